package cuda

import (
	"errors"
	"slices"

	"github.com/batchfit/batchfit/exec"
	"github.com/batchfit/batchfit/graph"
)

// Contraction family (cuBLAS, with bias_fill from kernels/elementwise.cu):
// matmul as strided-batched GEMMs, linear as one GEMM after the bias.
var matmulKernels = family{
	graph.OpMatMul: {run: func(k *kctx, in []operand, out operand) error {
		a := k.attrs()
		return k.matmul(a.TransA, a.TransB, in[0], in[1], out)
	}},
	graph.OpLinear: {run: func(k *kctx, in []operand, out operand) error {
		return k.linear(in[0], in[1], optional(in, 2), out)
	}},
	graph.OpMatMulGeluGrad: {run: func(k *kctx, in []operand, out operand) error {
		return k.matmulGeluGrad(in[0], in[1], in[2], out)
	}},
}

// gemmCall is one strided-batched GEMM of a matmul: count products whose
// operands start at element offsets x, y, out and step by sx, sy, so
// (stride 0 where an operand is broadcast).
type gemmCall struct {
	x, y, out  int
	sx, sy, so int
	count      int
}

// matmulPlan is how a matmul runs on cuBLAS: op(x) is m×k, op(y) is k×n,
// lda and ldb are the stored row strides. tall means one GEMM of
// [rows·m, k] by op(y) (y is one matrix and x is not transposed);
// otherwise calls lists the strided-batched GEMMs.
type matmulPlan struct {
	m, n, k, lda, ldb int
	tall              bool
	rows              int
	calls             []gemmCall
}

// planMatmul lays out the product of the last two axes of op(x) [..., m, k]
// and op(y) [..., k, n] into out [..., m, n], broadcasting the leading
// axes. The leading axes are merged; the innermost merged axis runs as one
// strided-batched GEMM and the others loop, so any broadcast pattern works
// without copies. An empty product (out or k zero) has no calls.
func planMatmul(ta, tb bool, xs, ys, os []int) (matmulPlan, error) {
	rx, ry, ro := len(xs), len(ys), len(os)
	if rx < 2 || ry < 2 || ro < 2 {
		return matmulPlan{}, graph.Errorf(graph.ErrShape, "matmul needs rank ≥ 2 operands, got %v and %v", xs, ys)
	}
	pl := matmulPlan{lda: xs[rx-1], ldb: ys[ry-1]}
	pl.m, pl.k = xs[rx-2], pl.lda
	if ta {
		pl.m, pl.k = pl.k, pl.m
	}
	k2 := ys[ry-2]
	pl.n = pl.ldb
	if tb {
		k2, pl.n = pl.n, k2
	}
	if pl.k != k2 || os[ro-2] != pl.m || os[ro-1] != pl.n {
		return matmulPlan{}, graph.Errorf(graph.ErrShape, "matmul of %v and %v cannot give %v", xs, ys, os)
	}
	lead := os[:ro-2]
	xst, err := exec.LeadStrides(xs[:rx-2], lead, pl.m*pl.k)
	if err != nil {
		return matmulPlan{}, err
	}
	yst, err := exec.LeadStrides(ys[:ry-2], lead, pl.k*pl.n)
	if err != nil {
		return matmulPlan{}, err
	}
	if graph.Numel(os) == 0 || pl.k == 0 {
		return pl, nil
	}
	if graph.Numel(ys[:ry-2]) == 1 && !ta {
		// y is one matrix: x's matrices stack into one tall [batches·m, k].
		pl.tall, pl.rows = true, graph.Numel(lead)*pl.m
		return pl, nil
	}
	dims, st := mergeAxes(lead, xst, yst, contiguousMul(lead, pl.m*pl.n))
	inner := gemmCall{count: 1}
	if last := len(dims) - 1; last >= 0 {
		inner = gemmCall{count: dims[last], sx: st[0][last], sy: st[1][last], so: st[2][last]}
		dims = dims[:last]
	}
	idx := make([]int, len(dims))
	for range graph.Numel(dims) {
		c := inner
		for d, i := range idx {
			c.x += i * st[0][d]
			c.y += i * st[1][d]
			c.out += i * st[2][d]
		}
		pl.calls = append(pl.calls, c)
		for d := len(idx) - 1; d >= 0; d-- { // odometer over the outer axes
			if idx[d]++; idx[d] < dims[d] {
				break
			}
			idx[d] = 0
		}
	}
	return pl, nil
}

// matmul runs planMatmul's GEMMs on cuBLAS, which reads the transposes from
// the stored layout.
//
// A float32 out from 16-bit x and y (graph.OpMatMul's Attrs.Target) is
// one cublasGemmEx of 16-bit A and B into a float32 C with float32
// accumulation, a combination cuBLAS supports (CUDA_R_16BF or CUDA_R_16F
// A/B, CUDA_R_32F C, CUBLAS_COMPUTE_32F): the sums are rounded once, to
// float32, with no 16-bit result and no cast kernel.
func (k *kctx) matmul(ta, tb bool, x, y, out operand) error {
	dt, err := floatsOf(x, y)
	if err != nil {
		return err
	}
	if out.dt != dt && (out.dt != graph.Float32 || !dt.IsHalf()) {
		return graph.Errorf(graph.ErrDType, "matmul of %s operands into %s (their dtype or float32)", dt, out.dt)
	}
	pl, err := planMatmul(ta, tb, x.shape, y.shape, out.shape)
	if err != nil {
		return err
	}
	gemm, batched := k.blas.GemmOf, k.blas.GemmStridedBatchedOf
	if out.dt != dt {
		gemm, batched = k.blas.GemmToF32, k.blas.GemmStridedBatchedToF32
	}
	switch {
	case out.n() == 0:
		return nil
	case pl.k == 0: // empty sums
		return k.d.Memzero(out.p, int64(out.dt.Size())*out.n())
	case pl.tall:
		return gemm(dt, false, tb, pl.rows, pl.n, pl.k, 1, x.p, pl.lda, y.p, pl.ldb, 0, out.p, pl.n)
	}
	for _, c := range pl.calls {
		if err := batched(dt, ta, tb, pl.m, pl.n, pl.k, 1, x.at(int64(c.x)), pl.lda, int64(c.sx),
			y.at(int64(c.y)), pl.ldb, int64(c.sy), 0, out.at(int64(c.out)), pl.n, int64(c.so), c.count); err != nil {
			return err
		}
	}
	return nil
}

// contiguousMul is the row-major strides of shape scaled by inner.
func contiguousMul(shape []int, inner int) []int {
	s := graph.ContiguousStrides(shape)
	for i := range s {
		s[i] *= inner
	}
	return s
}

// linear computes out = x·wᵀ + b with x [..., in], w [out, in] and an
// optional b [out], x flattened to [rows, in]: one cuBLASLt GEMM with the
// bias in its epilogue, or, where cuBLASLt has no algorithm, the bias
// broadcast into out and one GEMM adding the product (beta = 1), as on the
// CPU.
//
// When the program pairs a tanh-form gelu of out with it
// (graph.GeluProducer) and hands over its output, the epilogue also
// applies GELU: out gets the GELU input (cuBLASLt's aux matrix) and the
// companion GELU's result, in the same pass.
func (k *kctx) linear(x, w operand, b *operand, out operand) error {
	dt, err := floatsOf(x, w, out)
	if err != nil {
		return err
	}
	rk := len(x.shape)
	if rk < 1 || len(w.shape) != 2 || len(out.shape) != rk {
		return graph.Errorf(graph.ErrShape, "linear of %v with weight %v cannot give %v", x.shape, w.shape, out.shape)
	}
	nOut, nIn := w.shape[0], w.shape[1]
	if x.shape[rk-1] != nIn || out.shape[rk-1] != nOut || !slices.Equal(x.shape[:rk-1], out.shape[:rk-1]) {
		return graph.Errorf(graph.ErrShape, "linear of %v with weight %v cannot give %v", x.shape, w.shape, out.shape)
	}
	rows := graph.Numel(x.shape[:rk-1])
	if b != nil {
		if _, err := floatsOf(*b, out); err != nil {
			return err
		}
		if !slices.Equal(b.shape, []int{nOut}) {
			return graph.Errorf(graph.ErrShape, "linear bias %v, want [%d]", b.shape, nOut)
		}
	}
	if rows == 0 || nOut == 0 {
		return nil
	}
	if nIn > 0 {
		if gelu, done, ok := k.geluCompanion(out); ok {
			err := k.blas.GemmEpilogue(dt, dt, false, true, rows, nOut, nIn, x.p, nIn, w.p, nIn, gelu.p, nOut,
				Epilogue{Kind: EpiGeluAux, Bias: ptrOf(b), Aux: out.p})
			if err == nil {
				*done = true
				return nil
			}
			if !errors.Is(err, ErrNoEpilogue) {
				return err
			}
		}
		if b != nil {
			err := k.blas.GemmEpilogue(dt, dt, false, true, rows, nOut, nIn, x.p, nIn, w.p, nIn, out.p, nOut,
				Epilogue{Kind: EpiBias, Bias: b.p})
			if !errors.Is(err, ErrNoEpilogue) {
				return err
			}
		}
	}
	var beta float32
	if b != nil {
		if err := k.packs(typed(kBiasFill, dt), out.n(), perPack(dt), out.p, b.p, int64(rows), int64(nOut), int64(1)); err != nil {
			return err
		}
		beta = 1
	}
	if nIn == 0 {
		if b == nil {
			return k.d.Memzero(out.p, int64(dt.Size())*out.n())
		}
		return nil
	}
	return k.blas.GemmOf(dt, false, true, rows, nOut, nIn, 1, x.p, nIn, w.p, nIn, beta, out.p, nOut)
}

// geluCompanion is the companion output of a linear when it is a
// tanh-form gelu of the linear's output, of its dtype and shape
// (graph.GeluProducer pairs them).
func (k *kctx) geluCompanion(out operand) (operand, *bool, bool) {
	co, done := k.companionOf(graph.OpGelu)
	if co == nil || co.dt != out.dt || !slices.Equal(co.shape, out.shape) {
		return operand{}, nil, false
	}
	return *co, done, true
}

// matmulGeluGrad computes out = (op(a)·op(b))·GELU′(x): one cuBLASLt GEMM
// with the DGELU epilogue where the product is one GEMM (b one matrix,
// a not transposed) and cuBLASLt has an algorithm, otherwise the product
// into out and gelu_grad over it in place. The bias gradient stays a sum
// node: cuBLASLt's DGELU_BGRAD, which would give it in the same pass, ran
// at a third of DGELU's rate on the H100 (246 against 94 µs for GPT-2
// small's [8192, 768]·[768, 3072] at batch 8).
func (k *kctx) matmulGeluGrad(a, b, x, out operand) error {
	dt, err := floatsOf(a, b, x, out)
	if err != nil {
		return err
	}
	if x.dt != dt || out.dt != dt || !slices.Equal(x.shape, out.shape) {
		return graph.Errorf(graph.ErrShape, "matmul_gelu_grad: GELU input %s%v for a product %s%v", x.dt, x.shape, out.dt, out.shape)
	}
	at := k.attrs()
	pl, err := planMatmul(at.TransA, at.TransB, a.shape, b.shape, out.shape)
	if err != nil {
		return err
	}
	if pl.tall && out.n() > 0 && pl.k > 0 {
		err := k.blas.GemmEpilogue(dt, dt, false, at.TransB, pl.rows, pl.n, pl.k, a.p, pl.lda, b.p, pl.ldb, out.p, pl.n,
			Epilogue{Kind: EpiGeluGrad, Aux: x.p})
		if !errors.Is(err, ErrNoEpilogue) {
			return err
		}
	}
	if err := k.matmul(at.TransA, at.TransB, a, b, out); err != nil {
		return err
	}
	return k.map2(kGeluGrad, dt, out, x, out, boolInt(at.Approx))
}
