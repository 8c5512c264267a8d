package cuda_test

import (
	"math/rand/v2"
	"os"
	"sync"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/exec/cuda"
	"github.com/batchfit/batchfit/internal/testutil"
)

// One device serves the whole test binary: creating a primary context
// takes long enough that each test should not pay for it.
var shared struct {
	once sync.Once
	d    *cuda.Device
	err  error
}

func TestMain(m *testing.M) {
	code := m.Run()
	if sharedExec.e != nil {
		if err := sharedExec.e.Close(); err != nil && code == 0 {
			os.Stderr.WriteString("closing the executor: " + err.Error() + "\n")
			code = 1
		}
	}
	if shared.d != nil {
		if err := shared.d.Close(); err != nil && code == 0 {
			os.Stderr.WriteString("closing the device: " + err.Error() + "\n")
			code = 1
		}
	}
	os.Exit(code)
}

// One executor serves the tests that need no allocator of their own.
var sharedExec struct {
	once sync.Once
	e    *cuda.Executor
	err  error
}

// executor returns the shared executor, or skips when there is no GPU.
func executor(tb testing.TB) *cuda.Executor {
	tb.Helper()
	d := device(tb)
	sharedExec.once.Do(func() { sharedExec.e, sharedExec.err = cuda.NewExecutor(d, cuda.ExecutorOptions{}) })
	require.NoError(tb, sharedExec.err)
	return sharedExec.e
}

// freshExecutor returns an executor of its own, closed when the test ends:
// its allocator holds nothing but the cuBLAS workspace.
func freshExecutor(tb testing.TB, o cuda.ExecutorOptions) *cuda.Executor {
	tb.Helper()
	e, err := cuda.NewExecutor(device(tb), o)
	require.NoError(tb, err)
	tb.Cleanup(func() { require.NoError(tb, e.Close()) })
	return e
}

// device returns the shared device, or skips when there is no GPU.
func device(tb testing.TB) *cuda.Device {
	tb.Helper()
	shared.once.Do(func() { shared.d, shared.err = cuda.Open(cuda.Options{}) })
	testutil.SkipWithoutGPU(tb, shared.err, cuda.ErrNoGPU)
	return shared.d
}

// newAllocator returns a caching allocator over the device that gives its
// cache back when the test ends.
func newAllocator(tb testing.TB, d *cuda.Device) *alloc.Allocator {
	a := alloc.New(d.Backend(), alloc.Options{})
	tb.Cleanup(func() { require.NoError(tb, a.EmptyCache()) })
	return a
}

// upload allocates a block holding data.
func upload[T cuda.Elem](tb testing.TB, d *cuda.Device, a *alloc.Allocator, data []T) *alloc.Block {
	tb.Helper()
	var zero T
	b, err := a.Malloc(int64(len(data))*int64(unsafe.Sizeof(zero)), alloc.Tag{Node: -1, Op: "test"})
	require.NoError(tb, err)
	require.NoError(tb, cuda.CopyHtoD(d, b.Ptr(), data))
	return b
}

func download(tb testing.TB, d *cuda.Device, b *alloc.Block, n int) []float32 {
	tb.Helper()
	out := make([]float32, n)
	require.NoError(tb, cuda.CopyDtoH(d, out, b.Ptr()))
	return out
}

func newRand(seed uint64) *rand.Rand { return rand.New(rand.NewPCG(seed, 0x9e3779b97f4a7c15)) }
