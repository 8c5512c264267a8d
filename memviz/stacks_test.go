package memviz_test

import (
	"bytes"
	"errors"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/google/pprof/profile"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/memviz"
	"github.com/batchfit/batchfit/planner"
)

// peakOfStep is the simulated peak of an MLP training step with Adam, and
// the names of its program.
func peakOfStep(t *testing.T) (memviz.Snapshot, *memviz.Names) {
	t.Helper()
	rng := rand.New(rand.NewPCG(31, 32))
	x, y := batch(rng, 64, nIn, nOut)
	s := compileStep(t, newMLP(9), x, y, 2)
	sim, err := memviz.Simulate(s.prog, planner.Chunks(64, 2), memviz.SimOptions{TraceEntries: traceEntries})
	require.NoError(t, err)
	return memviz.NewSnapshot(0, sim.Snapshot), memviz.NewNames(s.prog, memviz.Options{})
}

func total(stacks []memviz.StackBytes) int64 {
	var n int64
	for _, s := range stacks {
		n += s.Bytes
	}
	return n
}

func TestStacksFollowModulePaths(t *testing.T) {
	snap, names := peakOfStep(t)
	stacks := memviz.Stacks(snap, names)
	assert.Equal(t, snap.Allocated(), total(stacks))
	got := map[string]int64{}
	for _, s := range stacks {
		got[strings.Join(s.Stack, ";")] = s.Bytes
	}
	// Two of Adam's slots per parameter, each a 512-byte block or more.
	assert.Equal(t, roundUp(nHidden*nIn*4), got["fc1;weight;exp_avg_sq"])
	assert.Equal(t, roundUp(nHidden*nIn*4), got["fc1;weight;param"])
	assert.Positive(t, got["fc2;bias;grad"], "the gradient accumulator of a chunked step")
	// Without a program the stacks come from the tags alone, with the
	// same total.
	assert.Equal(t, snap.Allocated(), total(memviz.Stacks(snap, nil)))
}

func TestFoldedRoundTrip(t *testing.T) {
	snap, names := peakOfStep(t)
	var b bytes.Buffer
	require.NoError(t, memviz.WriteFolded(&b, snap, names))
	for _, line := range strings.Split(strings.TrimSpace(b.String()), "\n") {
		assert.Regexp(t, `^[^; ]+(;[^; ]+)* [0-9]+$`, line)
	}
	back, err := memviz.ReadFolded(&b)
	require.NoError(t, err)
	assert.Equal(t, memviz.Stacks(snap, names), back)
	assert.Equal(t, snap.Allocated(), total(back))
}

func TestReadFoldedErrors(t *testing.T) {
	for name, c := range map[string]struct {
		in   string
		line int64
	}{
		"no count":       {"a;b;c\n", 1},
		"bad count":      {"a;b 12x\n", 1},
		"negative count": {"a 1\na;b -5\n", 2},
		"empty stack":    {"a 1\n\n 7\n", 3},
		"empty frame":    {"a;;b 3\n", 1},
		"overflow":       {"a 9223372036854775807\nb 1\n", 2},
		"line too long":  {strings.Repeat("x", 2<<20) + " 1\n", 1},
	} {
		_, err := memviz.ReadFolded(strings.NewReader(c.in))
		var fe *memviz.FormatError
		if assert.True(t, errors.As(err, &fe), "%s: %v", name, err) {
			assert.True(t, errors.Is(err, memviz.ErrFormat), name)
			assert.Equal(t, c.line, fe.Offset, name)
		}
	}
	got, err := memviz.ReadFolded(strings.NewReader("a;b 1\r\n\na;b 2\nframe with spaces;x 3\n"))
	require.NoError(t, err)
	assert.Equal(t, []memviz.StackBytes{{Stack: []string{"a", "b"}, Bytes: 3}, {Stack: []string{"frame with spaces", "x"}, Bytes: 3}}, got)
}

func TestPprofTotalsMatchTheAllocator(t *testing.T) {
	snap, names := peakOfStep(t)
	var b bytes.Buffer
	require.NoError(t, memviz.WritePprof(&b, snap, names))
	back, err := memviz.ReadPprof(bytes.NewReader(b.Bytes()))
	require.NoError(t, err)
	assert.Equal(t, memviz.Stacks(snap, names), back)

	goBin, err := exec.LookPath("go")
	if err != nil {
		t.Skip("go command not found")
	}
	path := filepath.Join(t.TempDir(), "snapshot.pb.gz")
	require.NoError(t, os.WriteFile(path, b.Bytes(), 0o644))
	out, err := exec.Command(goBin, "tool", "pprof", "-top", "-unit=B", path).Output()
	require.NoError(t, err)
	m := regexp.MustCompile(`of (\d+)B total`).FindSubmatch(out)
	require.NotNil(t, m, "%s", out)
	n, err := strconv.ParseInt(string(m[1]), 10, 64)
	require.NoError(t, err)
	assert.Equal(t, snap.Allocated(), n)
	assert.Contains(t, string(out), "exp_avg_sq")
}

func TestReadPprofErrors(t *testing.T) {
	for name, in := range map[string][]byte{
		"not a profile": []byte("hello"),
		"gzip garbage":  {0x1f, 0x8b, 0x08, 0x00, 0x01},
	} {
		_, err := memviz.ReadPprof(bytes.NewReader(in))
		assert.True(t, errors.Is(err, memviz.ErrFormat), "%s: %v", name, err)
	}
	// A profile of something else: no inuse_space.
	var cpu bytes.Buffer
	require.NoError(t, (&profile.Profile{SampleType: []*profile.ValueType{{Type: "cpu", Unit: "nanoseconds"}}}).Write(&cpu))
	_, err := memviz.ReadPprof(&cpu)
	assert.True(t, errors.Is(err, memviz.ErrFormat), "cpu profile: %v", err)

	var b bytes.Buffer
	require.NoError(t, memviz.WritePprof(&b, memviz.Snapshot{}, nil))
	empty, err := memviz.ReadPprof(&b)
	require.NoError(t, err)
	assert.Empty(t, empty)
}

func TestCompareGrowingBatch(t *testing.T) {
	small, grown, a := grownRun(t)
	d := memviz.Compare(small, grown)
	assert.Empty(t, d.OnlyBefore, "a caching allocator keeps what it had")
	require.NotEmpty(t, d.OnlyAfter, "the larger batch needed new segments")
	var added int64
	large := 0
	for _, s := range d.OnlyAfter {
		added += s.Size
		if s.Pool == alloc.LargePool {
			large++
		}
	}
	assert.Positive(t, large, "2 MiB activations come from the large pool")
	assert.Equal(t, grown.Reserved()-small.Reserved(), added)
	assert.Equal(t, len(small.Devices[0].Segments), d.Common)

	// Releasing the cache takes the new segments back: they are now the
	// ones only before.
	require.NoError(t, a.EmptyCache())
	released := memviz.NewSnapshot(0, a.Snapshot())
	back := memviz.Compare(grown, released)
	assert.Empty(t, back.OnlyAfter)
	assert.ElementsMatch(t, d.OnlyAfter, back.OnlyBefore)

	// Snapshots read back from their pickles compare the same.
	load := func(s memviz.Snapshot) memviz.Snapshot {
		var b bytes.Buffer
		require.NoError(t, memviz.WritePickle(&b, s))
		r, err := memviz.ReadPickle(&b)
		require.NoError(t, err)
		return r
	}
	fromFiles := memviz.Compare(load(small), load(grown))
	assert.Equal(t, len(d.OnlyAfter), len(fromFiles.OnlyAfter))
	assert.Equal(t, d.ReservedAfter-d.ReservedBefore, fromFiles.ReservedAfter-fromFiles.ReservedBefore)

	var txt, folded bytes.Buffer
	require.NoError(t, d.WriteText(&txt))
	assert.Contains(t, txt.String(), "only after: "+strconv.Itoa(len(d.OnlyAfter))+" segments")
	require.NoError(t, d.WriteFolded(&folded, nil))
	stacks, err := memviz.ReadFolded(&folded)
	require.NoError(t, err)
	assert.Equal(t, added, total(stacks), "the differing segments' blocks, free ones included")
	for _, s := range stacks {
		assert.Equal(t, "only_after", s.Stack[0])
	}
}

func TestCompareStacks(t *testing.T) {
	small, grown, _ := grownRun(t)
	d := memviz.CompareStacks(memviz.Stacks(small, nil), memviz.Stacks(grown, nil))
	// After either step only parameters and Adam state stay allocated, so
	// the two snapshots hold the same stacks.
	assert.Empty(t, d)
	before := []memviz.StackBytes{{Stack: []string{"a"}, Bytes: 10}, {Stack: []string{"b"}, Bytes: 5}}
	after := []memviz.StackBytes{{Stack: []string{"a"}, Bytes: 10}, {Stack: []string{"b"}, Bytes: 1}, {Stack: []string{"c"}, Bytes: 7}}
	assert.Equal(t, []memviz.StackDelta{{Stack: []string{"c"}, After: 7}, {Stack: []string{"b"}, Before: 5, After: 1}},
		memviz.CompareStacks(before, after))
}
