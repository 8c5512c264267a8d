package cuda

import (
	"errors"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"unsafe"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/graph"
)

// cuBLASLt (libcublasLt), for GEMMs with fused epilogues: the bias, bias
// and GELU with the GELU input kept, and GELU's gradient. C signatures in the comments; handles and descriptors are
// opaque pointers.
type (
	ltHandle uintptr // cublasLtHandle_t
	ltDesc   uintptr // cublasLtMatmulDesc_t
	ltLayout uintptr // cublasLtMatrixLayout_t
	ltPref   uintptr // cublasLtMatmulPreference_t
)

// ltAlgo is cublasLtMatmulAlgo_t (uint64_t data[8]); ltHeuristic is
// cublasLtMatmulHeuristicResult_t: the algorithm, its workspace, its
// status, wavesCount and int reserved[4].
type (
	ltAlgo      [8]uint64
	ltHeuristic struct {
		algo      ltAlgo
		workspace uintptr
		state     int32
		_         float32 // wavesCount
		_         [4]int32
	}
)

// cublasLtMatmulDescAttributes_t, cublasLtMatmulPreferenceAttributes_t and
// cublasLtEpilogue_t values (cublasLt.h).
const (
	ltDescTransA    = 3
	ltDescTransB    = 4
	ltDescEpilogue  = 7
	ltDescBias      = 8
	ltDescAuxPtr    = 11
	ltDescAuxLD     = 12
	ltPrefWorkspace = 1
	ltPrefAlignA    = 5 // CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES; B, C, D follow

	ltEpilogueDefault     = 1
	ltEpilogueBias        = 4
	ltEpilogueGeluAux     = 32 | 128
	ltEpilogueGeluAuxBias = 32 | 128 | 4
	ltEpilogueDGelu       = 64 | 128

	cublasCompute32FFastTF32 = 77 // CUBLAS_COMPUTE_32F_FAST_TF32
)

type cublasLtLib struct {
	// cublasStatus_t cublasLtCreate(cublasLtHandle_t *handle)
	create func(h *ltHandle) cublasStatus
	// cublasStatus_t cublasLtDestroy(cublasLtHandle_t handle)
	destroy func(h ltHandle) cublasStatus
	// cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t *d, cublasComputeType_t compute, cudaDataType_t scale)
	descCreate func(d *ltDesc, compute, scale int32) cublasStatus
	// cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t d)
	descDestroy func(d ltDesc) cublasStatus
	// cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t attr, const void *buf, size_t size)
	descSet func(d ltDesc, attr int32, buf unsafe.Pointer, size uintptr) cublasStatus
	// cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t *l, cudaDataType type, uint64_t rows, uint64_t cols, int64_t ld)
	layoutCreate func(l *ltLayout, ty int32, rows, cols uint64, ld int64) cublasStatus
	// cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t l)
	layoutDestroy func(l ltLayout) cublasStatus
	// cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t *p)
	prefCreate func(p *ltPref) cublasStatus
	// cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t p)
	prefDestroy func(p ltPref) cublasStatus
	// cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t p, cublasLtMatmulPreferenceAttributes_t attr, const void *buf, size_t size)
	prefSet func(p ltPref, attr int32, buf unsafe.Pointer, size uintptr) cublasStatus
	// cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t h, cublasLtMatmulDesc_t d,
	//     cublasLtMatrixLayout_t A, cublasLtMatrixLayout_t B, cublasLtMatrixLayout_t C, cublasLtMatrixLayout_t D,
	//     cublasLtMatmulPreference_t p, int requested, cublasLtMatmulHeuristicResult_t results[], int *returned)
	heuristic func(h ltHandle, d ltDesc, a, b, c, dd ltLayout, p ltPref, requested int32, results *ltHeuristic, returned *int32) cublasStatus
	// cublasStatus_t cublasLtMatmul(cublasLtHandle_t h, cublasLtMatmulDesc_t d, const void *alpha,
	//     const void *A, cublasLtMatrixLayout_t Adesc, const void *B, cublasLtMatrixLayout_t Bdesc,
	//     const void *beta, const void *C, cublasLtMatrixLayout_t Cdesc, void *D, cublasLtMatrixLayout_t Ddesc,
	//     const cublasLtMatmulAlgo_t *algo, void *workspace, size_t workspaceSize, cudaStream_t stream)
	matmul func(h ltHandle, d ltDesc, alpha *float32, a CUdeviceptr, ad ltLayout, b CUdeviceptr, bd ltLayout,
		beta *float32, c CUdeviceptr, cd ltLayout, dd CUdeviceptr, ddd ltLayout, algo *ltAlgo,
		ws CUdeviceptr, wsSize uintptr, stream uintptr) cublasStatus
}

func (c *cublasLtLib) symbols() []symbol {
	return []symbol{
		sym(&c.create, "cublasLtCreate"),
		sym(&c.destroy, "cublasLtDestroy"),
		sym(&c.descCreate, "cublasLtMatmulDescCreate"),
		sym(&c.descDestroy, "cublasLtMatmulDescDestroy"),
		sym(&c.descSet, "cublasLtMatmulDescSetAttribute"),
		sym(&c.layoutCreate, "cublasLtMatrixLayoutCreate"),
		sym(&c.layoutDestroy, "cublasLtMatrixLayoutDestroy"),
		sym(&c.prefCreate, "cublasLtMatmulPreferenceCreate"),
		sym(&c.prefDestroy, "cublasLtMatmulPreferenceDestroy"),
		sym(&c.prefSet, "cublasLtMatmulPreferenceSetAttribute"),
		sym(&c.heuristic, "cublasLtMatmulAlgoGetHeuristic"),
		sym(&c.matmul, "cublasLtMatmul"),
	}
}

var cublasLtOnce struct {
	sync.Once
	c   *cublasLtLib
	err error
}

// loadCUBLASLt dlopens libcublasLt, newest first, and binds its functions.
func loadCUBLASLt() (*cublasLtLib, error) {
	cublasLtOnce.Do(func() {
		lib, err := dlopen("libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so.11", "libcublasLt.so")
		if err != nil {
			cublasLtOnce.err = fmt.Errorf("%w: cannot load libcublasLt: %v", ErrNoLibrary, err)
			return
		}
		c := new(cublasLtLib)
		if err := bind(lib, c.symbols()); err != nil {
			cublasLtOnce.err = fmt.Errorf("%w: libcublasLt: %v", ErrNoLibrary, err)
			return
		}
		cublasLtOnce.c = c
	})
	return cublasLtOnce.c, cublasLtOnce.err
}

// EpilogueKind is what a GEMM does to its product on the way out
// (BLAS.GemmEpilogue), in cuBLASLt's fused epilogues.
type EpilogueKind uint8

const (
	// EpiNone stores the product.
	EpiNone EpilogueKind = iota
	// EpiBias adds Epilogue.Bias[j] to column j of the row-major C.
	EpiBias
	// EpiGeluAux stores GELU (the tanh form) of the product plus the bias
	// when Epilogue.Bias is set, and the GELU input in Epilogue.Aux.
	EpiGeluAux
	// EpiGeluGrad stores the product times GELU′(Epilogue.Aux).
	EpiGeluGrad
)

// Epilogue is a GEMM's fused epilogue: its kind and the vector and
// matrix it reads or writes. Bias (EpiBias, EpiGeluAux) has C's dtype and
// n elements; Aux is row-major m×n of C's dtype with C's row stride.
type Epilogue struct {
	Kind EpilogueKind
	Bias alloc.Ptr
	Aux  alloc.Ptr
}

// ltCode is the cublasLtEpilogue_t of e.
func (e Epilogue) ltCode() int32 {
	switch e.Kind {
	case EpiBias:
		return ltEpilogueBias
	case EpiGeluAux:
		if e.Bias != 0 {
			return ltEpilogueGeluAuxBias
		}
		return ltEpilogueGeluAux
	case EpiGeluGrad:
		return ltEpilogueDGelu
	}
	return ltEpilogueDefault
}

// epilogueGEMMs counts the GEMMs cuBLASLt ran with an epilogue (tests
// read it).
var epilogueGEMMs atomic.Int64

// ErrNoEpilogue is returned by GemmEpilogue when cuBLASLt has no algorithm
// for the GEMM and its epilogue (or no cuBLASLt): the caller runs the
// unfused kernels instead.
var ErrNoEpilogue = errors.New("cuda: cuBLASLt has no algorithm for this GEMM epilogue")

// ltKey is what fixes a cuBLASLt GEMM's descriptors and algorithm: the
// dtypes, transposes, sizes, strides, epilogue, math and each pointer's
// alignment (which the heuristic assumes).
type ltKey struct {
	dev           int // the device's ordinal: algorithms are per device
	ab, c         graph.DType
	ta, tb, tf32  bool
	m, n, k       int
	lda, ldb, ldc int
	epi           int32
	align         [6]uint16 // A, B, C (= D), bias, aux, workspace
}

// ltPlan is a key's descriptors and its algorithm (ltPick).
type ltPlan struct {
	desc    ltDesc
	a, b, d ltLayout
	algo    ltAlgo
	ok      bool // false: the heuristic found none (ErrNoEpilogue)
}

// ltState is a BLAS's cuBLASLt handle and plans, made on first use.
type ltState struct {
	lib   *cublasLtLib
	h     ltHandle
	plans map[ltKey]*ltPlan
	err   error // why cuBLASLt is unusable, sticky
}

// maxLtPlans bounds the plan cache; past it, plans are destroyed and
// made again (a training step uses a few dozen shapes).
const maxLtPlans = 1024

// alignOf is p's alignment in bytes, at most 256 (what cuBLASLt asks for
// by default); a null pointer counts as aligned.
func alignOf(p alloc.Ptr) uint16 {
	if p == 0 {
		return 256
	}
	a := uint64(p) & -uint64(p)
	return uint16(min(a, 256))
}

// GemmEpilogue computes C = op(A)·op(B) then e, for row-major matrices as
// Gemm (alpha 1, beta 0), with A and B of dtype ab and C of dtype c, on
// cuBLASLt with the handle's workspace and stream. ErrNoEpilogue when
// cuBLASLt cannot (no library, no algorithm, an aux stride it refuses).
func (b *BLAS) GemmEpilogue(ab, c graph.DType, transA, transB bool, m, n, k int, A alloc.Ptr, lda int,
	B alloc.Ptr, ldb int, C alloc.Ptr, ldc int, e Epilogue) error {
	ty, cty, err := b.checkCall(ab, c, transA, transB, m, n, k, lda, ldb, ldc)
	if err != nil {
		return err
	}
	if m == 0 || n == 0 || k == 0 {
		return ErrNoEpilogue // empty products: the unfused path handles them
	}
	if (e.Kind == EpiGeluAux || e.Kind == EpiGeluGrad) && (e.Aux == 0 || ldc%8 != 0) {
		return ErrNoEpilogue // cuBLASLt's GELU input stride must divide by 8
	}
	var wsPtr alloc.Ptr
	var wsSize int64
	if b.ws != nil {
		wsPtr, wsSize = b.ws.Ptr(), b.ws.Requested()
	}
	key := ltKey{dev: b.d.opts.Ordinal, ab: ab, c: c, ta: transA, tb: transB, tf32: b.tf32 && ab == graph.Float32 && c == graph.Float32,
		m: m, n: n, k: k, lda: lda, ldb: ldb, ldc: ldc, epi: e.ltCode(),
		align: [6]uint16{alignOf(A), alignOf(B), alignOf(C), alignOf(e.Bias), alignOf(e.Aux), alignOf(wsPtr)}}
	return b.d.do(func() error {
		// run launches the GEMM with algo: beta is 0 and no operand is
		// an output, so running it again (to time algorithms) is harmless.
		run := func(pl *ltPlan, algo *ltAlgo) error {
			var alpha, beta float32 = 1, 0
			return checkBLAS("cublasLtMatmul", b.lt.lib.matmul(b.lt.h, pl.desc, &alpha,
				CUdeviceptr(B), pl.a, CUdeviceptr(A), pl.b, &beta, CUdeviceptr(C), pl.d, CUdeviceptr(C), pl.d,
				algo, CUdeviceptr(wsPtr), uintptr(wsSize), b.stream))
		}
		pl, err := b.ltPlan(key, ty, cty, e, wsSize, run)
		if err != nil {
			return err
		}
		if !pl.ok {
			return ErrNoEpilogue
		}
		if err := b.ltPointers(pl.desc, e); err != nil {
			return err
		}
		if err := run(pl, &pl.algo); err != nil {
			return err
		}
		epilogueGEMMs.Add(1)
		return nil
	})
}

// ltPointers sets the epilogue's bias and aux pointers on desc.
func (b *BLAS) ltPointers(desc ltDesc, e Epilogue) error {
	lib := b.lt.lib
	if e.Bias != 0 {
		p := CUdeviceptr(e.Bias)
		if err := checkBLAS("cublasLtMatmulDescSetAttribute", lib.descSet(desc, ltDescBias, unsafe.Pointer(&p), unsafe.Sizeof(p))); err != nil {
			return err
		}
	}
	if e.Aux != 0 {
		p := CUdeviceptr(e.Aux)
		if err := checkBLAS("cublasLtMatmulDescSetAttribute", lib.descSet(desc, ltDescAuxPtr, unsafe.Pointer(&p), unsafe.Sizeof(p))); err != nil {
			return err
		}
	}
	return nil
}

// ltPlan finds or makes key's plan; on the device thread. cuBLAS is
// column-major, so as in gemm the row-major C = op(A)·op(B) runs as the
// column-major Cᵀ = op(B)ᵀ·op(A)ᵀ: cuBLASLt's A is our B and its B our A,
// and C's columns (our bias's elements) are cuBLASLt's rows.
func (b *BLAS) ltPlan(key ltKey, ty, cty int32, e Epilogue, wsSize int64, run func(*ltPlan, *ltAlgo) error) (*ltPlan, error) {
	if b.lt == nil {
		b.lt = &ltState{plans: map[ltKey]*ltPlan{}}
		if b.lt.lib, b.lt.err = loadCUBLASLt(); b.lt.err == nil {
			b.lt.err = checkBLAS("cublasLtCreate", b.lt.lib.create(&b.lt.h))
		}
	}
	if b.lt.err != nil {
		return &ltPlan{}, nil
	}
	if pl, ok := b.lt.plans[key]; ok {
		return pl, nil
	}
	if len(b.lt.plans) >= maxLtPlans {
		b.ltDestroyPlans()
	}
	lib := b.lt.lib
	pl := &ltPlan{}
	compute := int32(cublasCompute32F)
	if key.tf32 {
		compute = cublasCompute32FFastTF32
	}
	err := checkBLAS("cublasLtMatmulDescCreate", lib.descCreate(&pl.desc, compute, 0 /* CUDA_R_32F scale */))
	set := func(attr int32, v int32) {
		if err == nil {
			err = checkBLAS("cublasLtMatmulDescSetAttribute", lib.descSet(pl.desc, attr, unsafe.Pointer(&v), unsafe.Sizeof(v)))
		}
	}
	set(ltDescTransA, op(key.tb))
	set(ltDescTransB, op(key.ta))
	set(ltDescEpilogue, key.epi)
	if err == nil && e.Aux != 0 {
		ld := int64(key.ldc)
		err = checkBLAS("cublasLtMatmulDescSetAttribute", lib.descSet(pl.desc, ltDescAuxLD, unsafe.Pointer(&ld), unsafe.Sizeof(ld)))
	}
	if err == nil {
		err = b.ltPointers(pl.desc, e)
	}
	layout := func(l *ltLayout, t int32, rows, cols, ld int) {
		if err == nil {
			err = checkBLAS("cublasLtMatrixLayoutCreate", lib.layoutCreate(l, t, uint64(rows), uint64(cols), int64(ld)))
		}
	}
	if key.tb { // cuBLASLt's A: our B, stored n×k row-major when transposed
		layout(&pl.a, ty, key.k, key.n, key.ldb)
	} else {
		layout(&pl.a, ty, key.n, key.k, key.ldb)
	}
	if key.ta {
		layout(&pl.b, ty, key.m, key.k, key.lda)
	} else {
		layout(&pl.b, ty, key.k, key.m, key.lda)
	}
	layout(&pl.d, cty, key.n, key.m, key.ldc)
	var pref ltPref
	if err == nil {
		err = checkBLAS("cublasLtMatmulPreferenceCreate", lib.prefCreate(&pref))
	}
	if err == nil {
		ws := uint64(wsSize)
		err = checkBLAS("cublasLtMatmulPreferenceSetAttribute", lib.prefSet(pref, ltPrefWorkspace, unsafe.Pointer(&ws), unsafe.Sizeof(ws)))
		// Alignments of cuBLASLt's A (our B), B (our A), C and D.
		for i, a := range []uint16{key.align[1], key.align[0], key.align[2], key.align[2]} {
			v := uint32(a)
			if err == nil {
				err = checkBLAS("cublasLtMatmulPreferenceSetAttribute", lib.prefSet(pref, ltPrefAlignA+int32(i), unsafe.Pointer(&v), unsafe.Sizeof(v)))
			}
		}
	}
	if err == nil {
		var res [ltCandidates]ltHeuristic
		var got int32
		s := lib.heuristic(b.lt.h, pl.desc, pl.a, pl.b, pl.d, pl.d, pref, ltCandidates, &res[0], &got)
		// NOT_SUPPORTED or no result: no algorithm, the caller falls back.
		var algos []ltAlgo
		for _, r := range res[:max(got, 0)] {
			if s == 0 && r.state == 0 && int64(r.workspace) <= wsSize {
				algos = append(algos, r.algo)
			}
		}
		if pl.ok = len(algos) > 0; pl.ok {
			pl.algo, err = b.ltPick(key, pl, algos, run)
		}
	}
	if pref != 0 {
		lib.prefDestroy(pref)
	}
	if err != nil {
		b.ltDestroy(pl)
		return nil, err
	}
	b.lt.plans[key] = pl
	return pl, nil
}

// ltCandidates is how many of the heuristic's algorithms are timed.
const ltCandidates = 8

// ltTuned is the algorithm timed fastest for each key, shared by every
// handle of the process: two executors (or a Session's re-plan) run the
// same algorithm for the same GEMM, so they round the same way.
var ltTuned struct {
	sync.Mutex
	algo map[ltKey]ltAlgo
}

// ltPick returns the fastest of algos for key: the one already timed in
// this process, or each timed now on the call's own operands (one warm-up
// and ltRuns runs, CUDA events on the default stream). The heuristic's
// first choice is taken as it is when there is one candidate, when the
// stream is capturing a CUDA graph (no timing there), or when
// BATCHFIT_LT_AUTOTUNE=0. The heuristic alone picked GELU-gradient
// epilogue kernels at a third of the plain GEMM's rate on the H100.
func (b *BLAS) ltPick(key ltKey, pl *ltPlan, algos []ltAlgo, run func(*ltPlan, *ltAlgo) error) (ltAlgo, error) {
	ltTuned.Lock()
	defer ltTuned.Unlock()
	if a, ok := ltTuned.algo[key]; ok {
		return a, nil
	}
	if len(algos) == 1 || b.stream != 0 || b.d.capture != 0 || os.Getenv("BATCHFIT_LT_AUTOTUNE") == "0" {
		return algos[0], nil
	}
	drv := b.d.drv
	var start, end CUevent
	if err := drv.check("cuEventCreate", drv.cuEventCreate(&start, 0)); err != nil {
		return algos[0], err
	}
	defer drv.cuEventDestroy(start)
	if err := drv.check("cuEventCreate", drv.cuEventCreate(&end, 0)); err != nil {
		return algos[0], err
	}
	defer drv.cuEventDestroy(end)
	best, bestMS := -1, float32(0)
	for i := range algos {
		if err := run(pl, &algos[i]); err != nil {
			continue // an algorithm that fails on these operands is skipped
		}
		if err := drv.check("cuEventRecord", drv.cuEventRecord(start, 0)); err != nil {
			return algos[0], err
		}
		for range ltRuns {
			if err := run(pl, &algos[i]); err != nil {
				return algos[0], err
			}
		}
		if err := drv.check("cuEventRecord", drv.cuEventRecord(end, 0)); err != nil {
			return algos[0], err
		}
		if err := drv.check("cuEventSynchronize", drv.cuEventSynchronize(end)); err != nil {
			return algos[0], err
		}
		var ms float32
		if err := drv.check("cuEventElapsedTime", drv.cuEventElapsedTime(&ms, start, end)); err != nil {
			return algos[0], err
		}
		if best < 0 || ms < bestMS {
			best, bestMS = i, ms
		}
	}
	if best < 0 {
		return algos[0], nil
	}
	if ltTuned.algo == nil {
		ltTuned.algo = map[ltKey]ltAlgo{}
	}
	ltTuned.algo[key] = algos[best]
	return algos[best], nil
}

// ltRuns is the timed runs of each candidate algorithm.
const ltRuns = 3

// ltDestroy destroys a plan's descriptors.
func (b *BLAS) ltDestroy(pl *ltPlan) {
	lib := b.lt.lib
	for _, l := range []ltLayout{pl.a, pl.b, pl.d} {
		if l != 0 {
			lib.layoutDestroy(l)
		}
	}
	if pl.desc != 0 {
		lib.descDestroy(pl.desc)
	}
}

// ltDestroyPlans destroys every plan; on the device thread.
func (b *BLAS) ltDestroyPlans() {
	for k, pl := range b.lt.plans {
		b.ltDestroy(pl)
		delete(b.lt.plans, k)
	}
}

// ltClose destroys the plans and the handle; on the device thread.
func (b *BLAS) ltClose() error {
	if b.lt == nil || b.lt.err != nil {
		return nil
	}
	b.ltDestroyPlans()
	return checkBLAS("cublasLtDestroy", b.lt.lib.destroy(b.lt.h))
}
