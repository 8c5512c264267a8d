package cuda

import (
	"errors"
	"math"
	"os"
	"regexp"
	"slices"
	"strconv"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/optim"
	"github.com/batchfit/batchfit/planner"
	"github.com/batchfit/batchfit/recompute"
)

// These tests need no GPU: they check the pieces between Go and C.

func TestCUDAErrorUnwrap(t *testing.T) {
	oom := &CUDAError{Func: "cuMemAlloc_v2", Code: cudaErrorOOM, Name: "CUDA_ERROR_OUT_OF_MEMORY"}
	assert.ErrorIs(t, oom, alloc.ErrDeviceOOM)
	wrapped := errors.Join(errors.New("context"), oom)
	var ce *CUDAError
	require.True(t, errors.As(wrapped, &ce))
	assert.Equal(t, "CUDA_ERROR_OUT_OF_MEMORY", ce.Name)
	assert.NotErrorIs(t, &CUDAError{Code: cudaErrorInvalid}, alloc.ErrDeviceOOM)

	assert.ErrorIs(t, &CUBLASError{Code: cublasStatusAllocFailed}, alloc.ErrDeviceOOM)
	assert.Equal(t, "CUBLAS_STATUS_INVALID_VALUE", cublasStatusName(7))
	assert.Equal(t, "CUBLAS_STATUS_99", cublasStatusName(99))
}

func TestPackParams(t *testing.T) {
	blk := &alloc.Block{}
	p, err := packParams([]any{CUdeviceptr(0x1000), alloc.Ptr(0x2000), int32(-2), uint32(7),
		int64(-3), uint64(1 << 40), float32(1.5), math.Pi, blk})
	require.NoError(t, err)
	require.Len(t, p.ptrs, 9)
	for i := range p.ptrs {
		assert.Equal(t, unsafe.Pointer(&p.vals[i]), p.ptrs[i], "pointer %d addresses its slot", i)
	}
	assert.Equal(t, uint64(0x1000), *(*uint64)(p.ptrs[0]))
	assert.Equal(t, uint64(0x2000), *(*uint64)(p.ptrs[1]))
	assert.Equal(t, int32(-2), *(*int32)(p.ptrs[2]), "an int32 lies in the slot's first 4 bytes")
	assert.Equal(t, uint32(7), *(*uint32)(p.ptrs[3]))
	assert.Equal(t, int64(-3), *(*int64)(p.ptrs[4]))
	assert.Equal(t, uint64(1<<40), *(*uint64)(p.ptrs[5]))
	assert.Equal(t, float32(1.5), *(*float32)(p.ptrs[6]))
	assert.Equal(t, math.Pi, *(*float64)(p.ptrs[7]))
	assert.Equal(t, uint64(0), *(*uint64)(p.ptrs[8]))

	_, err = packParams([]any{int(3)})
	assert.ErrorIs(t, err, graph.ErrDType)
	_, err = packParams([]any{(*alloc.Block)(nil)})
	assert.ErrorIs(t, err, graph.ErrNilTensor)
	p, err = packParams(nil)
	require.NoError(t, err)
	assert.Empty(t, p.ptrs)
}

// TestKernelStructs: the Go mirrors have the C structs' sizes (all int64
// fields, no padding), and Launch passes a pointer to a copy of each.
func TestKernelStructs(t *testing.T) {
	assert.Equal(t, uintptr(136), unsafe.Sizeof(Strided{}))
	assert.Equal(t, uintptr(200), unsafe.Sizeof(Strided2{}))
	assert.Equal(t, uintptr(272), unsafe.Sizeof(ReduceGeom{}))
	assert.Equal(t, uintptr(112), unsafe.Sizeof(Window{}))
	assert.Equal(t, uintptr(136), unsafe.Offsetof(ReduceGeom{}.RedRank), "red_rank follows kept_stride")

	s := Strided{Rank: 2, Shape: [MaxDims]int64{3, 4, 1, 1, 1, 1, 1, 1}, Stride: [MaxDims]int64{1, 3}}
	g := ReduceGeom{KeptRank: 1, RedRank: 1, RedStride: [MaxDims]int64{7}}
	w := Window{N: 1, C: 2, HO: 13, WO: 14}
	p, err := packParams([]any{int64(5), s, g, w, Strided2{Rank: 1}})
	require.NoError(t, err)
	require.Len(t, p.ptrs, 5)
	assert.Equal(t, int64(5), *(*int64)(p.ptrs[0]))
	assert.Equal(t, s, *(*Strided)(p.ptrs[1]))
	assert.Equal(t, g, *(*ReduceGeom)(p.ptrs[2]))
	assert.Equal(t, int64(7), *(*int64)(unsafe.Add(p.ptrs[2], 136+8+8*8)), "red_stride[0] at byte 208")
	assert.Equal(t, w, *(*Window)(p.ptrs[3]))
	assert.Equal(t, int64(14), *(*int64)(unsafe.Add(p.ptrs[3], 13*8)), "wo is the 14th field")
	assert.Equal(t, int64(1), *(*int64)(p.ptrs[4]))
	s.Rank = 9
	assert.Equal(t, int64(2), (*Strided)(p.ptrs[1]).Rank, "the argument is a copy")
}

// TestListStructs: the multi-tensor kernels' lists have the C structs'
// sizes and lengths (OPTIM_TENSORS, UNSCALE_TENSORS, OPTIM_SCALARS and the
// scalars' layout in optim.cu, the planner's constants for their bytes),
// stay under the 4 KiB kernel parameter limit with their other arguments,
// and Launch passes a copy. The cost model's UpdateTensors is
// OPTIM_TENSORS.
func TestListStructs(t *testing.T) {
	assert.Equal(t, uintptr(4*64*8+65*8+2*64*4), optimListBytes)
	assert.Equal(t, uintptr(4*64*8), unsafe.Offsetof(optimList{}.off), "off follows the four pointer arrays")
	assert.Equal(t, uintptr(4*64*8+65*8), unsafe.Offsetof(optimList{}.grp), "grp follows off")
	assert.Equal(t, uintptr(4*64*8+65*8+64*4), unsafe.Offsetof(optimList{}.idx), "idx follows grp")
	assert.Equal(t, uintptr(64*8+65*8), unsafe.Sizeof(unscaleList{}))
	assert.Equal(t, uintptr(480*8), unsafe.Sizeof(scalarList{}))
	assert.Less(t, optimListBytes+5*8, uintptr(4<<10), "adam_multi_f32's parameters")
	assert.Less(t, unsafe.Sizeof(scalarList{})+2*8, uintptr(4<<10), "optim_scalars_f64's parameters")
	src, err := Source("optim.cu")
	require.NoError(t, err)
	for name, n := range map[string]int{"OPTIM_TENSORS": optimTensors, "UNSCALE_TENSORS": unscaleTensors,
		"OPTIM_SCALARS": optimScalarWords, "OPTIM_NORM_BLOCKS": planner.OptimizerNormBlocks,
		"OPTIM_HEADER": scHeader, "OPTIM_GROUP_WORDS": groupWords} {
		m := regexp.MustCompile(`(?m)^#define ` + name + ` (\d+)$`).FindStringSubmatch(src)
		require.NotNil(t, m, name)
		assert.Equal(t, strconv.Itoa(n), m[1], name)
	}
	assert.Equal(t, optimTensors, recompute.UpdateTensors, "the cost model prices one update launch per list")
	var l optimList
	l.p[3], l.off[64], l.idx[63] = 7, 9, 11
	p, err := packParams([]any{l, int64(4)})
	require.NoError(t, err)
	l.p[3] = 8
	assert.Equal(t, alloc.Ptr(7), (*optimList)(p.ptrs[0]).p[3], "the argument is a copy")
	assert.Equal(t, int64(9), *(*int64)(unsafe.Add(p.ptrs[0], 4*64*8+64*8)), "off[64] ends off")
	assert.Equal(t, int32(11), *(*int32)(unsafe.Add(p.ptrs[0], optimListBytes-4)), "idx[63] is the last field")
	var sl scalarList
	sl.v[479] = 2.5
	p, err = packParams([]any{sl})
	require.NoError(t, err)
	assert.Equal(t, 2.5, *(*float64)(unsafe.Add(p.ptrs[0], 479*8)))
	// The scalars the kernels use fit the planner's count.
	for _, n := range []int{1, 63, 64, 65, 150, 1000} {
		lists := (n + optimTensors - 1) / optimTensors
		assert.Equal(t, planner.OptimizerScalarBytes(n), int64(8*(partialsAt(n)+planner.OptimizerNormBlocks*lists)), "%d parameters", n)
	}
}

// TestOptimLists: the device optimizer lists its parameters in order,
// optimTensors a launch, each list's offsets the running sum of its
// parameters' sizes, each entry with its group and its index among the
// step's parameters; parameters without elements are left out, a shared
// gradient stays in one list, and a parameter listed twice starts a new
// list.
func TestOptimLists(t *testing.T) {
	type launch struct {
		p, g, s0, s1 []alloc.Ptr
		off          []int64
		grp, idx     []int32
	}
	lists := func(ps []trained, pl *optim.DevicePlan) []launch {
		var got []launch
		for _, l := range optimLists(ps, pl) {
			count := l.count
			require.Positive(t, count)
			require.LessOrEqual(t, count, optimTensors)
			for i := count; i < optimTensors; i++ {
				require.Zero(t, l.p[i], "unused entries are zero")
				require.Zero(t, l.off[i+1])
			}
			got = append(got, launch{slices.Clone(l.p[:count]), slices.Clone(l.g[:count]), slices.Clone(l.s0[:count]),
				slices.Clone(l.s1[:count]), slices.Clone(l.off[:count+1]), slices.Clone(l.grp[:count]), slices.Clone(l.idx[:count])})
		}
		return got
	}
	planOf := func(n int) *optim.DevicePlan {
		pl := &optim.DevicePlan{Params: make([]optim.ParamUpdate, n)}
		for i := range pl.Params {
			pl.Params[i].Group = i % 3
		}
		return pl
	}
	var ps []trained
	for i := range 150 {
		ps = append(ps, trained{param: alloc.Ptr(0x1000 * (i + 1)), grad: alloc.Ptr(0x1000*(i+1) + 1),
			state: []alloc.Ptr{alloc.Ptr(0x1000*(i+1) + 2), alloc.Ptr(0x1000*(i+1) + 3)}, n: int64(i%7 + 1)})
	}
	ps[10].n = 0
	ps[11].grad = ps[12].grad // a shared gradient
	got := lists(ps, planOf(150))
	require.Len(t, got, 3)
	assert.Len(t, got[0].p, 64)
	assert.Len(t, got[1].p, 64)
	assert.Len(t, got[2].p, 149-128)
	var j int
	for _, l := range got {
		assert.Zero(t, l.off[0])
		for i, p := range l.p {
			if j == 10 {
				j++ // left out
			}
			assert.Equal(t, ps[j].param, p)
			assert.Equal(t, ps[j].grad, l.g[i])
			assert.Equal(t, ps[j].state, []alloc.Ptr{l.s0[i], l.s1[i]})
			assert.Equal(t, ps[j].n, l.off[i+1]-l.off[i])
			assert.Equal(t, int32(j), l.idx[i], "the step's parameter index, gaps and all")
			assert.Equal(t, int32(j%3), l.grp[i])
			j++
		}
	}
	assert.Equal(t, 150, j)
	assert.Equal(t, got[0].g[10], got[0].g[11], "both read the shared gradient")

	sgd := []trained{{param: 1, grad: 2, state: []alloc.Ptr{3}, n: 5}, {param: 4, grad: 2, n: 3}, {param: 1, grad: 6, state: []alloc.Ptr{3}, n: 5}}
	got = lists(sgd, planOf(3))
	require.Len(t, got, 2, "the parameter listed twice starts a second list")
	assert.Equal(t, launch{[]alloc.Ptr{1, 4}, []alloc.Ptr{2, 2}, []alloc.Ptr{3, 0}, []alloc.Ptr{0, 0}, []int64{0, 5, 8}, []int32{0, 1}, []int32{0, 1}}, got[0])
	assert.Equal(t, launch{[]alloc.Ptr{1}, []alloc.Ptr{6}, []alloc.Ptr{3}, []alloc.Ptr{0}, []int64{0, 5}, []int32{2}, []int32{2}}, got[1])
	assert.Empty(t, lists([]trained{{param: 1, n: 0}}, planOf(1)), "no elements, no launch")
	assert.Empty(t, lists(nil, planOf(0)))
}

// TestScalarWords: the device scalars of a plan in optim.cu's layout:
// the max norm, each group's hyperparameters (Adam's and SGD's orders),
// each parameter's bias corrections or fresh flag.
func TestScalarWords(t *testing.T) {
	pl := &optim.DevicePlan{
		Groups: []optim.Hyper{{LR: 1, Beta1: 2, Beta2: 3, Eps: 4, WeightDecay: 5, Decay: 6}, {LR: 7, Momentum: 8, Dampening: 9, WeightDecay: 10, Nesterov: true}},
		Params: []optim.ParamUpdate{{Group: 1, C1: 0.1, C2: 0.01}, {Group: 0, C1: 0.2, C2: 0.02, Fresh: true}},
		Clip:   optim.Clip{MaxNorm: 1.5, NormType: 2},
	}
	w := scalarWords(true, pl)
	require.Len(t, w, partialsAt(2))
	assert.Equal(t, []float64{1.5, 0, 0, 0}, w[:scHeader])
	assert.Equal(t, []float64{1, 2, 3, 4, 5, 6, 0, 0}, w[scHeader:scHeader+groupWords])
	assert.Equal(t, []float64{0.1, 0.01, 0.2, 0.02}, w[paramsAt(2):])
	w = scalarWords(false, pl)
	assert.Equal(t, []float64{7, 8, 9, 10, 1, 0, 0, 0}, w[scHeader+groupWords:scHeader+2*groupWords])
	assert.Equal(t, []float64{0, 0, 1, 0}, w[paramsAt(2):])
	pl.Clip.MaxNorm = 0
	assert.Zero(t, scalarWords(true, pl)[scMaxNorm], "no clipping")
}

func TestCheckGemm(t *testing.T) {
	ok := []struct {
		tA, tB              bool
		m, n, k, la, lb, lc int
	}{
		{false, false, 4, 5, 6, 6, 5, 5},
		{true, false, 4, 5, 6, 4, 5, 5},
		{false, true, 4, 5, 6, 6, 6, 5},
		{true, true, 4, 5, 6, 4, 6, 7},
		{false, false, 0, 0, 0, 1, 1, 1},
	}
	for _, c := range ok {
		assert.NoError(t, checkGemm(c.tA, c.tB, c.m, c.n, c.k, c.la, c.lb, c.lc, 1), "%+v", c)
	}
	bad := []struct {
		tA, tB                     bool
		m, n, k, la, lb, lc, batch int
	}{
		{false, false, 4, 5, 6, 5, 5, 5, 1}, // lda < k
		{true, false, 4, 5, 6, 6, 4, 5, 1},  // ldb < n
		{false, true, 4, 5, 6, 6, 5, 5, 1},  // ldb < k
		{false, false, 4, 5, 6, 6, 5, 4, 1}, // ldc < n
		{false, false, 0, 0, 0, 0, 1, 1, 1}, // lda < 1
		{false, false, -1, 5, 6, 6, 5, 5, 1},
		{false, false, 4, 5, 6, 6, 5, 5, -1},
		{false, false, 1 << 31, 5, 6, 6, 5, 5, 1},
	}
	for _, c := range bad {
		assert.ErrorIs(t, checkGemm(c.tA, c.tB, c.m, c.n, c.k, c.la, c.lb, c.lc, c.batch), graph.ErrShape, "%+v", c)
	}
}

func TestCubinKey(t *testing.T) {
	opts := compileOptions("sm_90")
	k := cubinKey("a.cu", "src", "13.0", opts)
	assert.Len(t, k, 64)
	assert.Equal(t, k, cubinKey("a.cu", "src", "13.0", opts))
	assert.NotEqual(t, k, cubinKey("a.cu", "src", "12.8", opts))
	assert.NotEqual(t, k, cubinKey("a.cu", "src ", "13.0", opts))
	assert.NotEqual(t, k, cubinKey("a.cu", "src", "13.0", compileOptions("sm_80")))
	// The separator keeps "ab"+"c" and "a"+"bc" apart.
	assert.NotEqual(t, cubinKey("ab", "c", "v", nil), cubinKey("a", "bc", "v", nil))
}

func TestWriteFileAtomic(t *testing.T) {
	path := t.TempDir() + "/sub/x.cubin"
	require.NoError(t, writeFileAtomic(path, []byte("cubin")))
	b, err := os.ReadFile(path)
	require.NoError(t, err)
	assert.Equal(t, "cubin", string(b))
}

func TestFormatVersion(t *testing.T) {
	assert.Equal(t, "13.0", formatVersion(13000))
	assert.Equal(t, "12.8", formatVersion(12080))
	assert.Equal(t, "11.8", formatVersion(11080))
}

func TestCString(t *testing.T) {
	b := cString("sm_90")
	assert.Equal(t, "sm_90", goString(&b[0]))
	assert.Equal(t, "", goString(nil))
}

// openInternal opens a device for the benchmarks below, which need the
// package's internals.
func openInternal(b *testing.B) *Device {
	d, err := Open(Options{})
	if errors.Is(err, ErrNoGPU) {
		if os.Getenv("BATCHFIT_REQUIRE_GPU") != "" {
			b.Fatalf("BATCHFIT_REQUIRE_GPU is set: %v", err)
		}
		b.Skipf("no GPU: %v", err)
	}
	require.NoError(b, err)
	b.Cleanup(func() { d.Close() })
	return d
}

// BenchmarkDo is one round trip to the device goroutine with nothing to
// do: the price of running every call on one locked thread.
func BenchmarkDo(b *testing.B) {
	d := openInternal(b)
	for b.Loop() {
		if err := d.do(func() error { return nil }); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkLaunchOnDeviceThread queues empty kernels from inside one do,
// the launch cost without the hop to the device goroutine.
func BenchmarkLaunchOnDeviceThread(b *testing.B) {
	d := openInternal(b)
	src, err := Source("smoke.cu")
	require.NoError(b, err)
	m, err := d.Compile("smoke.cu", src)
	require.NoError(b, err)
	b.Cleanup(func() { m.Close() })
	fn, err := m.Function("noop")
	require.NoError(b, err)
	p, err := packParams(nil)
	require.NoError(b, err)
	one := [3]uint32{1, 1, 1}
	b.ResetTimer()
	err = d.do(func() error {
		for i := 0; i < b.N; i++ {
			if err := d.launch(fn, one, one, 0, p); err != nil {
				return err
			}
		}
		return d.drv.check("cuCtxSynchronize", d.drv.cuCtxSynchronize())
	})
	require.NoError(b, err)
}

// TestNVRTCCompile needs NVRTC but no GPU: smoke.cu compiles to an ELF
// cubin for sm_90, and a syntax error comes back with its log.
func TestNVRTCCompile(t *testing.T) {
	nv, err := loadNVRTC()
	if errors.Is(err, ErrNoLibrary) {
		t.Skipf("no NVRTC: %v", err)
	}
	require.NoError(t, err)
	t.Logf("NVRTC %s", nv.version)
	src, err := Source("smoke.cu")
	require.NoError(t, err)
	cubin, err := nv.compile("smoke.cu", src, compileOptions("sm_90"))
	require.NoError(t, err)
	require.Greater(t, len(cubin), 4)
	assert.Equal(t, "\x7fELF", string(cubin[:4]))

	_, err = nv.compile("bad.cu", "extern \"C\" __global__ void f() { undeclared_thing(); }", compileOptions("sm_90"))
	var ne *NVRTCError
	require.True(t, errors.As(err, &ne), "got %v", err)
	assert.Equal(t, "NVRTC_ERROR_COMPILATION", ne.Name)
	assert.NotEmpty(t, ne.Log)

	_, err = nv.compile("smoke.cu", src, []string{"--no-such-option"})
	require.True(t, errors.As(err, &ne), "got %v", err)
	assert.Equal(t, "NVRTC_ERROR_INVALID_OPTION", ne.Name)
}

// TestCUBLASSymbols needs libcublas but no GPU: every bound symbol exists.
func TestCUBLASSymbols(t *testing.T) {
	_, err := loadCUBLAS()
	if errors.Is(err, ErrNoLibrary) {
		t.Skipf("no cuBLAS: %v", err)
	}
	require.NoError(t, err)
}

// TestNewExecutorOptions: a device is required, and a cuBLAS workspace
// that would share its segment with program buffers is refused before the
// device is touched.
func TestNewExecutorOptions(t *testing.T) {
	_, err := NewExecutor(nil, ExecutorOptions{})
	assert.ErrorIs(t, err, graph.ErrAttr)
	for _, ws := range []int64{4 << 20, 11 << 20, -2} {
		_, err := NewExecutor(&Device{}, ExecutorOptions{BLASWorkspace: ws})
		assert.ErrorIs(t, err, graph.ErrAttr, "workspace %d", ws)
	}
}

// TestLaunchChecksTheArgumentCount: a launch with more or fewer arguments
// than the kernel's parameters is refused on the host (the driver would
// read past the argument array); a kernel whose count the driver cannot
// give (−1) is not checked here.
func TestLaunchChecksTheArgumentCount(t *testing.T) {
	k := &kctx{ks: &kernelSet{fns: map[string]kernel{"im2col_f32": {params: 6}}}}
	err := k.launch("im2col_f32", [3]uint32{1, 1, 1}, [3]uint32{1, 1, 1}, int64(1), int64(2))
	require.ErrorIs(t, err, ErrKernelArgs)
	require.ErrorContains(t, err, "im2col_f32 takes 6, launched with 2")
	err = k.launch("im2col_f32", [3]uint32{1, 1, 1}, [3]uint32{1, 1, 1}, 1, 2, 3, 4, 5, 6, 7)
	require.ErrorIs(t, err, ErrKernelArgs)
}
