package main

import (
	"bytes"
	"errors"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/pprof/profile"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/memviz"
)

// Times past a time.Duration print as seconds, never as a wrapped
// negative duration (-2562047h47m16.85s); ordinary ones as before.
func TestRoundNeverWraps(t *testing.T) {
	for _, s := range []float64{1e10, 1e300, math.Inf(1), math.MaxFloat64} {
		got := round(s)
		assert.False(t, strings.HasPrefix(got, "-"), "round(%g) = %s", s, got)
		assert.NotContains(t, got, "2562047h", "round(%g)", s)
	}
	assert.Equal(t, "1.2s", round(1.2345))
	assert.Equal(t, "1e+10s", round(1e10))
	assert.Equal(t, "+Inf s", round(math.Inf(1)))
}

// Byte totals past int64 are refused when the file is read (ErrTooLarge),
// so compare never prints a wrapped total ("8388608.00 TiB in 3 stacks"
// for 3 × 8 EiB): folded stacks of 3 × 4 EiB, and a pprof profile of
// three samples of 8 EiB.
func TestCompareRefusesTotalsPastInt64(t *testing.T) {
	dir := t.TempDir()
	folded := filepath.Join(dir, "big.folded")
	require.NoError(t, os.WriteFile(folded, []byte("a 4611686018427387904\nb 4611686018427387904\nc 4611686018427387904\n"), 0o644))
	var pb bytes.Buffer
	fa, fb, fc := &profile.Function{ID: 1, Name: "a"}, &profile.Function{ID: 2, Name: "b"}, &profile.Function{ID: 3, Name: "c"}
	p := &profile.Profile{SampleType: []*profile.ValueType{{Type: memviz.SampleInuse, Unit: "bytes"}}, Function: []*profile.Function{fa, fb, fc}}
	for i, f := range p.Function {
		loc := &profile.Location{ID: uint64(i + 1), Line: []profile.Line{{Function: f}}}
		p.Location = append(p.Location, loc)
		p.Sample = append(p.Sample, &profile.Sample{Location: []*profile.Location{loc}, Value: []int64{math.MaxInt64}})
	}
	require.NoError(t, p.Write(&pb))
	pprof := filepath.Join(dir, "big.pb.gz")
	require.NoError(t, os.WriteFile(pprof, pb.Bytes(), 0o644))
	small := filepath.Join(dir, "small.folded")
	require.NoError(t, os.WriteFile(small, []byte("a 512\n"), 0o644))
	for _, f := range []string{folded, pprof} {
		_, err := readSnapshotFile(f, nil, "", "")
		require.True(t, errors.Is(err, memviz.ErrTooLarge), "%s: %v", f, err)
		code, out, errOut := runCLI("compare", "--stacks", small, f)
		assert.NotEqual(t, exitOK, code, f)
		assert.NotContains(t, out, "TiB in", f)
		assert.Contains(t, errOut, "int64", f)
	}
}
