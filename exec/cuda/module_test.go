package cuda_test

import (
	"errors"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/exec/cuda"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/internal/testutil"
)

func smokeModule(tb testing.TB, d *cuda.Device) *cuda.Module {
	tb.Helper()
	src, err := cuda.Source("smoke.cu")
	require.NoError(tb, err)
	m, err := d.Compile("smoke.cu", src)
	require.NoError(tb, err)
	tb.Cleanup(func() { require.NoError(tb, m.Close()) })
	return m
}

// TestCompileCacheAndAxpy compiles smoke.cu into an empty cache, takes it
// from the cache the second time, and checks axpy against a float64
// reference.
func TestCompileCacheAndAxpy(t *testing.T) {
	device(t)
	dir := t.TempDir()
	d, err := cuda.Open(cuda.Options{CacheDir: dir})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, d.Close()) }) // runs after the module cleanups
	src, err := cuda.Source("smoke.cu")
	require.NoError(t, err)

	start := time.Now()
	m1, err := d.Compile("smoke.cu", src)
	require.NoError(t, err)
	cold := time.Since(start)
	require.NoError(t, m1.Close())
	assert.False(t, m1.Cached())
	files, err := filepath.Glob(filepath.Join(dir, "*.cubin"))
	require.NoError(t, err)
	require.Len(t, files, 1)

	start = time.Now()
	m, err := d.Compile("smoke.cu", src)
	require.NoError(t, err)
	warm := time.Since(start)
	t.Cleanup(func() { require.NoError(t, m.Close()) })
	assert.True(t, m.Cached())
	t.Logf("NVRTC compile %v, from the cubin cache %v", cold, warm)

	axpy, err := m.Function("axpy")
	require.NoError(t, err)
	params, err := m.ParamCount(axpy)
	require.NoError(t, err)
	assert.Equal(t, 4, params, "axpy(alpha, x, y, n); the executor checks every launch against this count")
	a := newAllocator(t, d)
	r := newRand(4)
	const n = 1<<20 + 3
	const alpha = float32(1.75)
	x, y := testutil.RandFloats(r, n), testutil.RandFloats(r, n)
	xb, yb := upload(t, d, a, x), upload(t, d, a, y)
	require.NoError(t, m.Launch(axpy, [3]uint32{1024, 1, 1}, [3]uint32{256, 1, 1}, 0,
		alpha, xb, yb.Ptr(), int64(n)))
	require.NoError(t, d.Synchronize())
	got := download(t, d, yb, n)
	// One or two float32 roundings: within 1e-6 of the terms' magnitude.
	for i := range got {
		ref := float64(alpha)*float64(x[i]) + float64(y[i])
		scale := math.Abs(float64(alpha)*float64(x[i])) + math.Abs(float64(y[i]))
		require.LessOrEqual(t, math.Abs(float64(got[i])-ref), 1e-6*scale, "element %d", i)
	}
	require.NoError(t, a.Free(xb))
	require.NoError(t, a.Free(yb))
}

func TestCompileError(t *testing.T) {
	d := device(t)
	_, err := d.Compile("bad.cu", "extern \"C\" __global__ void f() { undeclared_thing(); }")
	var ne *cuda.NVRTCError
	require.True(t, errors.As(err, &ne), "got %v", err)
	assert.Equal(t, "nvrtcCompileProgram", ne.Func)
	assert.Equal(t, "NVRTC_ERROR_COMPILATION", ne.Name)
	assert.NotEmpty(t, ne.Log)
	t.Log(err)
}

func TestModuleErrors(t *testing.T) {
	d := device(t)
	m := smokeModule(t, d)
	_, err := m.Function("no_such_kernel")
	var ce *cuda.CUDAError
	require.True(t, errors.As(err, &ce), "got %v", err)
	assert.Equal(t, "CUDA_ERROR_NOT_FOUND", ce.Name)

	fn, err := m.Function("noop")
	require.NoError(t, err)
	one := [3]uint32{1, 1, 1}
	assert.ErrorIs(t, m.Launch(fn, one, one, 0, "a string"), graph.ErrDType)
	assert.ErrorIs(t, m.Launch(fn, one, one, 0, (*alloc.Block)(nil)), graph.ErrNilTensor)
	// A zero grid is the driver's to reject.
	err = m.Launch(fn, [3]uint32{0, 1, 1}, one, 0)
	require.True(t, errors.As(err, &ce), "got %v", err)
	assert.Equal(t, "cuLaunchKernel", ce.Func)
	require.NoError(t, m.Launch(fn, one, one, 0))
	require.NoError(t, d.Synchronize())

	_, err = d.LoadModule("empty", nil)
	assert.ErrorIs(t, err, graph.ErrAttr)
}

func TestModuleClosed(t *testing.T) {
	d := device(t)
	src, err := cuda.Source("smoke.cu")
	require.NoError(t, err)
	m, err := d.Compile("smoke.cu", src)
	require.NoError(t, err)
	require.NoError(t, m.Close())
	require.NoError(t, m.Close())
	_, err = m.Function("noop")
	assert.ErrorIs(t, err, cuda.ErrClosed)
}

func TestSourceMissing(t *testing.T) {
	_, err := cuda.Source("no_such_file.cu")
	assert.Error(t, err)
}

// Every kernel file reaches NVRTC self-contained (NVRTC has no include
// path here) and is documented in kernels/README.md.
func TestSourcesAreSelfContainedAndDocumented(t *testing.T) {
	readme, err := os.ReadFile("kernels/README.md") // documentation, not embedded
	require.NoError(t, err)
	names := cuda.Names()
	require.NotEmpty(t, names)
	for _, n := range names {
		src, err := cuda.Source(n)
		require.NoError(t, err, n)
		for _, line := range strings.Split(src, "\n") {
			assert.False(t, strings.HasPrefix(strings.TrimSpace(line), "#include"), "%s still includes a file: %s", n, line)
		}
		if n != "smoke.cu" {
			assert.Contains(t, string(readme), n, "kernels/README.md does not mention %s", n)
		}
	}
}
