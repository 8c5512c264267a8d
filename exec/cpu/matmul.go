package cpu

import (
	"slices"

	"gonum.org/v1/gonum/blas"
	"gonum.org/v1/gonum/blas/blas32"

	"github.com/batchfit/batchfit/exec"
	"github.com/batchfit/batchfit/graph"
)

// Contraction family: matmul and linear on gonum's BLAS.
var matmulKernels = family{
	graph.OpMatMul: {run: func(nd *graph.Node, in []*buf, out *buf, _ int) error {
		return matmulKernel(nd.Attrs.TransA, nd.Attrs.TransB, in[0], in[1], out)
	}},
	graph.OpLinear: {run: func(_ *graph.Node, in []*buf, out *buf, _ int) error {
		return linearKernel(in[0], in[1], optional(in, 2), out)
	}},
	// The product times GELU′(x), the product not rounded on the way (as
	// a GEMM epilogue multiplies it in float32).
	graph.OpMatMulGeluGrad: {run: func(nd *graph.Node, in []*buf, out *buf, _ int) error {
		if err := matmulKernel(nd.Attrs.TransA, nd.Attrs.TransB, in[0], in[1], out); err != nil {
			return err
		}
		for i, x := range in[2].f {
			out.f[i] *= float32(geluDeriv(float64(x), nd.Attrs.Approx))
		}
		return nil
	}},
}

// gemm computes c = op(a)·op(b) + beta·c for row-major operands, where op(a)
// is m×k and op(b) is k×n, ld* being the row strides as stored. It handles
// the empty cases itself because gonum's BLAS panics on them.
func gemm(tA, tB blas.Transpose, m, n, k int, a []float32, lda int, b []float32, ldb int, beta float32, c []float32, ldc int) {
	if m == 0 || n == 0 {
		return
	}
	if k == 0 {
		if beta != 1 {
			for i := range m {
				row := c[i*ldc : i*ldc+n]
				for j := range row {
					row[j] *= beta
				}
			}
		}
		return
	}
	ar, ac := m, k
	if tA != blas.NoTrans {
		ar, ac = k, m
	}
	br, bc := k, n
	if tB != blas.NoTrans {
		br, bc = n, k
	}
	// gonum's kernels skip a term whose factor from a is zero, so 0·NaN
	// and 0·Inf give 0 where IEEE 754, cuBLAS and PyTorch give NaN: a NaN
	// sample would poison only some of the values it reaches. A scan of
	// the operands (linear in them, a small part of the product's cost)
	// finds the rare non-finite ones, whose product entries are then
	// computed with every term.
	var fix []fixedEntry
	if !finite(a, ar, ac, lda) || !finite(b, br, bc, ldb) {
		fix = nonFiniteEntries(tA, tB, m, n, k, a, lda, b, ldb, beta, c, ldc)
	}
	blas32.Gemm(tA, tB, 1,
		blas32.General{Rows: ar, Cols: ac, Stride: lda, Data: a},
		blas32.General{Rows: br, Cols: bc, Stride: ldb, Data: b},
		beta,
		blas32.General{Rows: m, Cols: n, Stride: ldc, Data: c})
	for _, f := range fix {
		c[f.at] = f.v
	}
}

// finite reports whether the rows×cols matrix stored in d with row stride
// ld holds no NaN and no infinity: its dot product with zeros is 0 unless
// a value is not finite (x·0 is NaN for a NaN or an infinity), and gonum's
// vectorised Sdot makes the scan about 0.2 ns a value.
func finite(d []float32, rows, cols, ld int) bool {
	if ld == cols { // contiguous: one long row
		rows, cols = 1, rows*cols
	}
	for r := range rows {
		row := d[r*ld : r*ld+cols]
		for len(row) > 0 {
			n := min(len(row), len(zeros))
			if blas32.Dot(blas32.Vector{N: n, Inc: 1, Data: row[:n]}, blas32.Vector{N: n, Inc: 1, Data: zeros[:n]}) != 0 {
				return false
			}
			row = row[n:]
		}
	}
	return true
}

// zeros is finite's second operand; never written.
var zeros [4096]float32

// fixedEntry is a product entry gemm writes after the BLAS call: c[at] = v.
type fixedEntry struct {
	at int
	v  float32
}

// nonFiniteEntries computes, with every term, the entries of op(a)·op(b)
// + beta·c that a row of op(a) or a column of op(b) holding a NaN or an
// infinity reaches; every other entry has only finite terms, where
// skipping a zero one changes nothing. Each such entry is NaN or ±Inf
// whatever the order of its sum.
func nonFiniteEntries(tA, tB blas.Transpose, m, n, k int, a []float32, lda int, b []float32, ldb int, beta float32, c []float32, ldc int) []fixedEntry {
	opA := func(i, l int) float32 {
		if tA == blas.NoTrans {
			return a[i*lda+l]
		}
		return a[l*lda+i]
	}
	opB := func(l, j int) float32 {
		if tB == blas.NoTrans {
			return b[l*ldb+j]
		}
		return b[j*ldb+l]
	}
	badRow, badCol := make([]bool, m), make([]bool, n)
	for i := range m {
		for l := range k {
			if v := opA(i, l); v-v != 0 {
				badRow[i] = true
				break
			}
		}
	}
	for j := range n {
		for l := range k {
			if v := opB(l, j); v-v != 0 {
				badCol[j] = true
				break
			}
		}
	}
	var fix []fixedEntry
	for i := range m {
		for j := range n {
			if !badRow[i] && !badCol[j] {
				continue
			}
			var s float32
			for l := range k {
				s += opA(i, l) * opB(l, j)
			}
			if beta != 0 { // BLAS reads c only when beta is not 0
				s += beta * c[i*ldc+j]
			}
			fix = append(fix, fixedEntry{at: i*ldc + j, v: s})
		}
	}
	return fix
}

// checkLen guards a kernel against a missing buffer, an int64 one, or one
// whose data does not match its shape, so a BLAS call never panics.
func checkLen(what string, b *buf) error {
	switch {
	case b == nil:
		return graph.Errorf(graph.ErrArity, "%s is missing", what)
	case b.i != nil:
		return graph.Errorf(graph.ErrDType, "%s holds int64 data, want float", what)
	case len(b.f) != graph.Numel(b.shape):
		return graph.Errorf(graph.ErrShape, "%s has %d values for shape %v", what, len(b.f), b.shape)
	}
	return nil
}

// matmulKernel multiplies the last two axes of op(x) [..., m, k] and op(y)
// [..., k, n] into out [..., m, n], broadcasting the leading axes; op
// transposes the last two axes when ta (tb) is set, which BLAS does for free
// from the stored layout. Each matrix is a contiguous slice of its operand,
// so broadcasting needs offsets only, never copies.
func matmulKernel(ta, tb bool, x, y, out *buf) error {
	for _, c := range []struct {
		what string
		b    *buf
	}{{"matmul x", x}, {"matmul y", y}, {"matmul out", out}} {
		if err := checkLen(c.what, c.b); err != nil {
			return err
		}
	}
	rx, ry, ro := len(x.shape), len(y.shape), len(out.shape)
	if rx < 2 || ry < 2 || ro < 2 {
		return graph.Errorf(graph.ErrShape, "matmul needs rank ≥ 2 operands, got %v and %v", x.shape, y.shape)
	}
	lda, ldb := x.shape[rx-1], y.shape[ry-1] // row strides as stored
	m, k := x.shape[rx-2], lda
	if ta {
		m, k = k, m
	}
	k2, n := y.shape[ry-2], ldb
	if tb {
		k2, n = n, k2
	}
	opA, opB := blas.NoTrans, blas.NoTrans
	if ta {
		opA = blas.Trans
	}
	if tb {
		opB = blas.Trans
	}
	if k != k2 || out.shape[ro-2] != m || out.shape[ro-1] != n {
		return graph.Errorf(graph.ErrShape, "matmul of %v and %v cannot give %v", x.shape, y.shape, out.shape)
	}
	lead := out.shape[:ro-2]
	xs, err := exec.LeadStrides(x.shape[:rx-2], lead, m*k)
	if err != nil {
		return err
	}
	ys, err := exec.LeadStrides(y.shape[:ry-2], lead, k*n)
	if err != nil {
		return err
	}
	batches := graph.Numel(lead)
	if batches == 0 {
		return nil
	}
	if graph.Numel(y.shape[:ry-2]) == 1 && !ta {
		// y is one matrix: stack x's matrices into one tall [batches·m, k].
		gemm(opA, opB, batches*m, n, k, x.f, max(lda, 1), y.f, max(ldb, 1), 0, out.f, max(n, 1))
		return nil
	}
	idx := make([]int, len(lead))
	for bi := range batches {
		xo, yo := 0, 0
		for d, i := range idx {
			xo += i * xs[d]
			yo += i * ys[d]
		}
		gemm(opA, opB, m, n, k,
			x.f[xo:xo+m*k], max(lda, 1), y.f[yo:yo+k*n], max(ldb, 1), 0, out.f[bi*m*n:(bi+1)*m*n], max(n, 1))
		for d := len(idx) - 1; d >= 0; d-- { // odometer over the leading axes
			if idx[d]++; idx[d] < lead[d] {
				break
			}
			idx[d] = 0
		}
	}
	return nil
}

// linearKernel computes out = x·wᵀ + b with x [..., in], w [out, in] and an
// optional b [out]: one GEMM over x flattened to [rows, in].
func linearKernel(x, w, b *buf, out *buf) error {
	if err := checkLen("linear x", x); err != nil {
		return err
	}
	if err := checkLen("linear weight", w); err != nil {
		return err
	}
	if err := checkLen("linear out", out); err != nil {
		return err
	}
	if len(x.shape) < 1 || len(w.shape) != 2 || len(out.shape) != len(x.shape) {
		return graph.Errorf(graph.ErrShape, "linear of %v with weight %v cannot give %v", x.shape, w.shape, out.shape)
	}
	nOut, nIn := w.shape[0], w.shape[1]
	r := len(x.shape)
	if x.shape[r-1] != nIn || out.shape[r-1] != nOut || !slices.Equal(x.shape[:r-1], out.shape[:r-1]) {
		return graph.Errorf(graph.ErrShape, "linear of %v with weight %v cannot give %v", x.shape, w.shape, out.shape)
	}
	rows := graph.Numel(x.shape[:r-1])
	var beta float32
	if b != nil {
		if err := checkLen("linear bias", b); err != nil {
			return err
		}
		if !slices.Equal(b.shape, []int{nOut}) {
			return graph.Errorf(graph.ErrShape, "linear bias %v, want [%d]", b.shape, nOut)
		}
		for i := range rows {
			copy(out.f[i*nOut:(i+1)*nOut], b.f)
		}
		beta = 1
	}
	gemm(blas.NoTrans, blas.Trans, rows, nOut, nIn, x.f, max(nIn, 1), w.f, max(nIn, 1), beta, out.f, max(nOut, 1))
	return nil
}
