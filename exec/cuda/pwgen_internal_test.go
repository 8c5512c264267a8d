package cuda

import (
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/internal/ref"
)

// Inputs are classed by how a kernel reads them at element i of row r,
// column j of the iteration shape.
func TestPointwiseKinds(t *testing.T) {
	s := []int{4, 6, 16}
	for _, c := range []struct {
		sh   []int
		want pwKind
	}{
		{[]int{4, 6, 16}, pwFull}, {[]int{1, 4, 6, 16}, pwFull}, {[]int{4, 6, 1}, pwRow}, {[]int{16}, pwCol},
		{[]int{1, 1, 16}, pwCol}, {[]int{}, pwScalar}, {[]int{1, 1}, pwScalar}, {[]int{6, 16}, pwStrided},
		{[]int{4, 1, 16}, pwStrided}, {[]int{6, 1}, pwStrided},
	} {
		assert.Equal(t, c.want, pwKindOf(c.sh, s), "%v", c.sh)
	}
}

// pwFuzzSources generates the kernel of every case of the fused_pointwise
// fuzz test (seed 1, as exec/cpu's TestPointwiseFuzz and the GPU's
// TestPointwiseFuzzGPU draw them) over its inputs' layout.
func pwFuzzSources(t *testing.T, n int) []*pwSource {
	rng := rand.New(rand.NewPCG(1, 34))
	var out []*pwSource
	for range n {
		c, err := ref.RandomPointwise(rng)
		require.NoError(t, err)
		nd := c.Graph.Node(c.Outs[0])
		var shapes [][]int
		var dts []graph.DType
		for _, in := range nd.Inputs {
			it := c.Graph.Node(in).Type
			shapes, dts = append(shapes, it.Shape), append(dts, it.DType)
		}
		l, _, err := layoutOf(shapes, dts)
		require.NoError(t, err)
		src, err := generatePointwise(c.Expr, l)
		require.NoError(t, err, "%v", c)
		out = append(out, src)
	}
	return out
}

// The generated sources of the first 120 fuzz cases pass scripts/cuda-syntax-check
// (clang-14 standing in for NVRTC) — skipped where clang++-14 is not
// installed (apt-get install clang-14). BATCHFIT_PW_SOURCES=dir keeps the
// files there. Each kernel's name is a hash of its expression and layout,
// and its two entry points are there.
func TestPointwiseSourcesSyntax(t *testing.T) {
	srcs := pwFuzzSources(t, 120)
	dir := os.Getenv("BATCHFIT_PW_SOURCES")
	if dir == "" {
		dir = t.TempDir()
	}
	require.NoError(t, os.MkdirAll(dir, 0o755))
	seen := map[string]bool{}
	var files []string
	for _, s := range srcs {
		assert.Contains(t, s.Source, `extern "C" __global__ void `+s.Name+"_i32(")
		assert.Contains(t, s.Source, `extern "C" __global__ void `+s.Name+"_i64(")
		if seen[s.Name] {
			continue
		}
		seen[s.Name] = true
		f := filepath.Join(dir, s.Name+".cu")
		require.NoError(t, os.WriteFile(f, []byte(s.Source), 0o644))
		files = append(files, f)
	}
	if _, err := exec.LookPath("clang++-14"); err != nil {
		t.Skip("clang++-14 is not installed: the sources are generated but not checked")
	}
	root, err := filepath.Abs("../..")
	require.NoError(t, err)
	cmd := exec.Command(filepath.Join(root, "scripts", "cuda-syntax-check"), files...)
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "%s", strings.TrimSpace(string(out)))
}
