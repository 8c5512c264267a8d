package ref

import (
	"math"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
)

// Hand-computed cases, one small group per op family. The expected numbers
// are written out with their arithmetic; tolerance 1e-12 unless stated.
const handTol = 1e-12

func TestUnary(t *testing.T) {
	x := lazy.Wrap(tf([]int{4}, -2, -0.5, 0, 1), 0)
	got := eval(t, x.Neg(), x.Abs(), x.Relu(), x.Sigmoid(), x.Tanh(), x.Exp(), x.Gelu(), x.GeluTanh())
	requireClose(t, val([]int{4}, 2, 0.5, 0, -1), got[0], handTol)
	requireClose(t, val([]int{4}, 2, 0.5, 0, 1), got[1], handTol)
	requireClose(t, val([]int{4}, 0, 0, 0, 1), got[2], handTol)
	// σ(x) = 1/(1+e^−x): σ(0) = ½, σ(1) = e/(1+e).
	e := math.E
	requireClose(t, val([]int{4}, 1/(1+e*e), 1/(1+math.Sqrt(e)), 0.5, e/(1+e)), got[3], handTol)
	// tanh(1) = (e² − 1)/(e² + 1).
	requireClose(t, val([]int{4}, -(e*e*e*e-1)/(e*e*e*e+1), -(e-1)/(e+1), 0, (e*e-1)/(e*e+1)), got[4], handTol)
	requireClose(t, val([]int{4}, 1/(e*e), 1/math.Sqrt(e), 1, e), got[5], handTol)
	// gelu(x) = x·Φ(x); Φ(1) = 0.841344746068543 and Φ(−x) = 1 − Φ(x), so
	// gelu(1) = 0.841344746068543, gelu(−0.5) = −0.5·(1 − Φ(0.5)) with
	// Φ(0.5) = 0.691462461274013, gelu(−2) = −2·(1 − Φ(2)) with
	// Φ(2) = 0.977249868051821 (standard normal table, 15 digits).
	requireClose(t, val([]int{4}, -2*(1-0.977249868051821), -0.5*(1-0.691462461274013), 0, 0.841344746068543), got[6], 1e-14)
	// Tanh form at 1: ½(1 + tanh(√(2/π)·1.044715)) = ½(1 + tanh(0.8335619689))
	// = ½(1 + 0.6823839812) = 0.8411919906 (PyTorch: 0.8412).
	require.InDelta(t, 0.8411919906082768, got[7].Data[3], 1e-12)
	require.InDelta(t, 0.0, got[7].Data[2], handTol)

	// silu(x) = x·σ(x) = x/(1 + e^−x): silu(1) = e/(1+e), silu(−2) = −2/(1+e²).
	got = eval(t, x.Silu())
	requireClose(t, val([]int{4}, -2/(1+e*e), -0.5/(1+math.Sqrt(e)), 0, e/(1+e)), got[0], handTol)

	p := lazy.Wrap(tf([]int{3}, 0.25, 1, 4), 0)
	got = eval(t, p.Log(), p.Sqrt())
	requireClose(t, val([]int{3}, -2*ln(2), 0, 2*ln(2)), got[0], handTol)
	requireClose(t, val([]int{3}, 0.5, 1, 2), got[1], handTol)
}

func TestSign(t *testing.T) {
	d := newDSL(t)
	x := d.param(3)
	s := d.op(graph.OpSign, graph.Attrs{}, x)
	got := d.eval(map[int]Value{x: val([]int{3}, -3, 0, 0.5)}, s)
	requireClose(t, val([]int{3}, -1, 0, 1), got[0], 0)
}

func TestScalarOps(t *testing.T) {
	x := lazy.Wrap(tf([]int{3}, 1, 2, 4), 0)
	got := eval(t, x.AddScalar(1), x.SubScalar(1), x.RSubScalar(1), x.MulScalar(3),
		x.DivScalar(2), x.RDivScalar(8), x.PowScalar(0.5), x.MaximumScalar(2))
	want := [][]float64{
		{2, 3, 5},          // x + 1
		{0, 1, 3},          // x − 1
		{0, -1, -3},        // 1 − x
		{3, 6, 12},         // 3x
		{0.5, 1, 2},        // x/2
		{8, 4, 2},          // 8/x
		{1, math.Sqrt2, 2}, // x^½
		{2, 2, 4},          // max(x, 2)
	}
	for i, w := range want {
		requireClose(t, val([]int{3}, w...), got[i], handTol)
	}
}

func TestBinaryBroadcast(t *testing.T) {
	a := lazy.Wrap(tf([]int{2, 3}, 1, 2, 3, 4, 5, 6), 0)
	b := lazy.Const(tf([]int{3}, 10, 20, 30))
	c := lazy.Const(tf([]int{2, 1}, 2, 3))
	c2 := lazy.Const(tf([]int{2, 1}, 4, 6))
	got := eval(t, a.Add(b), a.Sub(b), a.Mul(c), a.Div(c), a.Pow(c), a.Maximum(c2))
	requireClose(t, val([]int{2, 3}, 11, 22, 33, 14, 25, 36), got[0], handTol)
	requireClose(t, val([]int{2, 3}, -9, -18, -27, -6, -15, -24), got[1], handTol)
	// c broadcasts along columns: row 0 by 2, row 1 by 3.
	requireClose(t, val([]int{2, 3}, 2, 4, 6, 12, 15, 18), got[2], handTol)
	requireClose(t, val([]int{2, 3}, 0.5, 1, 1.5, 4.0/3, 5.0/3, 2), got[3], handTol)
	requireClose(t, val([]int{2, 3}, 1, 4, 9, 64, 125, 216), got[4], 1e-10)
	// max with [4; 6] per row.
	requireClose(t, val([]int{2, 3}, 4, 4, 4, 6, 6, 6), got[5], handTol)
}

func TestMatMulAndLinear(t *testing.T) {
	// [1 2 3; 4 5 6]·[1 0; 0 1; 1 1] = [1+3 2+3; 4+6 5+6] = [4 5; 10 11].
	a := lazy.Wrap(tf([]int{2, 3}, 1, 2, 3, 4, 5, 6), 0)
	b := lazy.Const(tf([]int{3, 2}, 1, 0, 0, 1, 1, 1))
	// linear: x·Wᵀ + b with W = bᵀ [2, 3] and bias [100, 200].
	w := lazy.Const(tf([]int{2, 3}, 1, 0, 1, 0, 1, 1))
	bias := lazy.Const(tf([]int{2}, 100, 200))
	got := eval(t, a.MatMul(b), a.Linear(w, bias), a.Linear(w, nil))
	requireClose(t, val([]int{2, 2}, 4, 5, 10, 11), got[0], handTol)
	requireClose(t, val([]int{2, 2}, 104, 205, 110, 211), got[1], handTol)
	requireClose(t, val([]int{2, 2}, 4, 5, 10, 11), got[2], handTol)

	// Batched, broadcasting the leading axis of a [2,1,2] against [2,2]:
	// batch 0: [1 2]·I = [1 2]; batch 1: [3 4]·[0 1; 1 0] = [4 3] — with
	// the right operand [2, 2, 2] holding I then the swap.
	x := lazy.Wrap(tf([]int{2, 1, 2}, 1, 2, 3, 4), 0)
	m := lazy.Const(tf([]int{2, 2, 2}, 1, 0, 0, 1, 0, 1, 1, 0))
	requireClose(t, val([]int{2, 1, 2}, 1, 2, 4, 3), eval(t, x.MatMul(m))[0], handTol)
}

func TestMatMulTranspose(t *testing.T) {
	// With A = [1 2 3; 4 5 6] and B = [1 0; 0 1; 1 1], A·B = [4 5; 10 11];
	// feeding Aᵀ with TransA and Bᵀ with TransB must give the same.
	d := newDSL(t)
	at, bt := d.param(3, 2), d.param(2, 3)
	a, b := d.param(2, 3), d.param(3, 2)
	ta := d.op(graph.OpMatMul, graph.Attrs{TransA: true}, at, b)
	tb := d.op(graph.OpMatMul, graph.Attrs{TransB: true}, a, bt)
	tab := d.op(graph.OpMatMul, graph.Attrs{TransA: true, TransB: true}, at, bt)
	got := d.eval(map[int]Value{
		a:  val([]int{2, 3}, 1, 2, 3, 4, 5, 6),
		at: val([]int{3, 2}, 1, 4, 2, 5, 3, 6),
		b:  val([]int{3, 2}, 1, 0, 0, 1, 1, 1),
		bt: val([]int{2, 3}, 1, 0, 1, 0, 1, 1),
	}, ta, tb, tab)
	for _, v := range got {
		requireClose(t, val([]int{2, 2}, 4, 5, 10, 11), v, handTol)
	}
}

func TestReduce(t *testing.T) {
	// x = [1 2 3; 4 5 6] (axis 0 is the batch of 2).
	x := lazy.Wrap(tf([]int{2, 3}, 1, 2, 3, 4, 5, 6), 0)
	got := eval(t, x.Sum(), x.Sum(0), x.SumKeepDim(1), x.Mean(), x.Mean(0), x.Max(1), x.MaxKeepDim(0))
	requireClose(t, val(nil, 21), got[0], handTol)
	requireClose(t, val([]int{3}, 5, 7, 9), got[1], handTol)
	requireClose(t, val([]int{2, 1}, 6, 15), got[2], handTol)
	requireClose(t, val(nil, 21.0/6), got[3], handTol)             // Scalar = 1/6
	requireClose(t, val([]int{3}, 2.5, 3.5, 4.5), got[4], handTol) // Scalar = 1/2
	requireClose(t, val([]int{2}, 3, 6), got[5], handTol)
	requireClose(t, val([]int{1, 3}, 4, 5, 6), got[6], handTol)
}

func TestMeanUsesScalar(t *testing.T) {
	// A mean node with a hand-set Scalar: the interpreter must use it rather
	// than recount (chunked runs rely on the full-batch 1/N).
	d := newDSL(t)
	x := d.param(4)
	m := d.op(graph.OpMean, graph.Attrs{}, x)
	d.g.Node(m).Attrs.Scalar = 0.1
	got := d.eval(map[int]Value{x: val([]int{4}, 1, 2, 3, 4)}, m)
	requireClose(t, val(nil, 1), got[0], handTol) // 0.1·(1+2+3+4)
}

func TestSoftmax(t *testing.T) {
	// softmax([0, ln 3]) = [1, 3]/4 = [0.25, 0.75]; row 2 is shifted by 5,
	// which softmax ignores. log_softmax = log of those.
	x := lazy.Wrap(tf([]int{2, 2}, 0, float32(math.Log(3)), 5, 5), 0)
	got := eval(t, x.Softmax(1), x.LogSoftmax(-1), x.Softmax(0))
	requireClose(t, val([]int{2, 2}, 0.25, 0.75, 0.5, 0.5), got[0], 1e-7) // ln 3 rounded to float32
	requireClose(t, val([]int{2, 2}, ln(0.25), ln(0.75), ln(0.5), ln(0.5)), got[1], 1e-7)
	// Along axis 0: column 0 is softmax([0, 5]) = [1, e⁵]/(1 + e⁵).
	e5 := math.Exp(5)
	require.InDelta(t, 1/(1+e5), got[2].Data[0], handTol)
	require.InDelta(t, e5/(1+e5), got[2].Data[2], handTol)
}

func TestLayerNorm(t *testing.T) {
	// Row [1 2 3]: mean 2, biased variance (1+0+1)/3 = 2/3, so with eps
	// 1/3 the std is 1 and x̂ = [−1 0 1]; row [2 2 2]: x̂ = 0.
	// With w = [1 2 3], b = [0 1 0]: [−1 1 3] and [0 1 0].
	x := lazy.Wrap(tf([]int{2, 3}, 1, 2, 3, 2, 2, 2), 0)
	w := lazy.Const(tf([]int{3}, 1, 2, 3))
	b := lazy.Const(tf([]int{3}, 0, 1, 0))
	got := eval(t, x.LayerNorm(w, b, 1, 1.0/3), x.LayerNorm(nil, nil, 1, 1.0/3), x.LayerNorm(nil, nil, 2, 1e-300))
	requireClose(t, val([]int{2, 3}, -1, 1, 3, 0, 1, 0), got[0], handTol)
	requireClose(t, val([]int{2, 3}, -1, 0, 1, 0, 0, 0), got[1], handTol)
	// Over both axes: mean 2, variance (1+0+1+0+0+0)/6 = 1/3, std 1/√3:
	// x̂ = √3·[−1 0 1 0 0 0].
	s3 := math.Sqrt(3)
	requireClose(t, val([]int{2, 3}, -s3, 0, s3, 0, 0, 0), got[2], 1e-12)
}

func TestMovement(t *testing.T) {
	// x = [0 1 2 3; 4 5 6 7; 8 9 10 11] as [3, 4].
	x := lazy.Wrap(tf([]int{3, 4}, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11), 0)
	y := lazy.Const(tf([]int{3, 1}, -1, -2, -3))
	got := eval(t, x.Reshape(2, -1), x.Transpose(0, 1), x.SliceStep(1, 1, 4, 2), x.Slice(0, 1, 2), lazy.Concat(1, y, x, y))
	requireClose(t, val([]int{2, 6}, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11), got[0], 0)
	requireClose(t, val([]int{4, 3}, 0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11), got[1], 0)
	requireClose(t, val([]int{3, 2}, 1, 3, 5, 7, 9, 11), got[2], 0) // columns 1 and 3
	requireClose(t, val([]int{1, 4}, 4, 5, 6, 7), got[3], 0)
	requireClose(t, val([]int{3, 6}, -1, 0, 1, 2, 3, -1, -2, 4, 5, 6, 7, -2, -3, 8, 9, 10, 11, -3), got[4], 0)

	// A 3-axis permute: out[i,j,k] = in[j,k,i] for perm (2, 0, 1) of [2,1,3].
	z := lazy.Wrap(tf([]int{2, 1, 3}, 1, 2, 3, 4, 5, 6), 0)
	requireClose(t, val([]int{3, 2, 1}, 1, 4, 2, 5, 3, 6), eval(t, z.Permute(2, 0, 1))[0], 0)
}

func TestEmbedding(t *testing.T) {
	// Rows of w [3, 2] at indices [[2, 0], [2, 1]].
	idx := lazy.Wrap(ti([]int{2, 2}, 2, 0, 2, 1), 0)
	w := lazy.Const(tf([]int{3, 2}, 1, 2, 3, 4, 5, 6))
	got := eval(t, idx.Embedding(w))
	requireClose(t, val([]int{2, 2, 2}, 5, 6, 1, 2, 5, 6, 3, 4), got[0], 0)
}

func TestConv2d(t *testing.T) {
	// x = [1 2 3; 4 5 6; 7 8 9], w = [1 2; 3 4]:
	// out[0,0] = 1·1 + 2·2 + 3·4 + 4·5 = 37, out[0,1] = 1·2 + 2·3 + 3·5 + 4·6 = 47,
	// out[1,0] = 1·4 + 2·5 + 3·7 + 4·8 = 67, out[1,1] = 1·5 + 2·6 + 3·8 + 4·9 = 77.
	x := lazy.Wrap(tf([]int{1, 1, 3, 3}, 1, 2, 3, 4, 5, 6, 7, 8, 9), 0)
	w := lazy.Const(tf([]int{1, 1, 2, 2}, 1, 2, 3, 4))
	b := lazy.Const(tf([]int{1}, 0.5))
	// Padding 1, stride 2 gives 2×2 outputs whose windows start at −1 and 1:
	// [0,0] sees only x[0,0]·w[1,1] = 4; [0,1] sees x[0,1]·w[1,0] + x[0,2]·w[1,1] = 6 + 12 = 18;
	// [1,0] sees x[1,0]·w[0,1] + x[2,0]·w[1,1] = 8 + 28 = 36; [1,1] sees 5 + 12 + 24 + 36 = 77.
	// Dilation 2 makes the one 2×2 window read the corners: 1 + 2·3 + 3·7 + 4·9 = 64.
	got := eval(t, x.Conv2d(w, nil, lazy.ConvOptions{}), x.Conv2d(w, b, lazy.ConvOptions{Stride: [2]int{2, 2}, Padding: [2]int{1, 1}}),
		x.Conv2d(w, nil, lazy.ConvOptions{Dilation: [2]int{2, 2}}))
	requireClose(t, val([]int{1, 1, 2, 2}, 37, 47, 67, 77), got[0], handTol)
	requireClose(t, val([]int{1, 1, 2, 2}, 4.5, 18.5, 36.5, 77.5), got[1], handTol)
	requireClose(t, val([]int{1, 1, 1, 1}, 64), got[2], handTol)

	// Groups 2: two channels, each convolved with its own 1×1 kernel (2 and 10).
	x2 := lazy.Wrap(tf([]int{1, 2, 1, 2}, 1, 2, 3, 4), 0)
	w2 := lazy.Const(tf([]int{2, 1, 1, 1}, 2, 10))
	requireClose(t, val([]int{1, 2, 1, 2}, 2, 4, 30, 40), eval(t, x2.Conv2d(w2, nil, lazy.ConvOptions{Groups: 2}))[0], handTol)
}

func TestPooling(t *testing.T) {
	// x = 4×4 of 1..16; 2×2 windows with stride 2: max = [6 8; 14 16],
	// mean = [(1+2+5+6)/4 …] = [3.5 5.5; 11.5 13.5].
	data := make([]float32, 16)
	for i := range data {
		data[i] = float32(i + 1)
	}
	x := lazy.Wrap(tf([]int{1, 1, 4, 4}, data...), 0)
	k2 := lazy.PoolOptions{Kernel: [2]int{2, 2}}
	got := eval(t, x.MaxPool2d(k2), x.AvgPool2d(k2))
	requireClose(t, val([]int{1, 1, 2, 2}, 6, 8, 14, 16), got[0], handTol)
	requireClose(t, val([]int{1, 1, 2, 2}, 3.5, 5.5, 11.5, 13.5), got[1], handTol)

	// Padding 1 on a 2×2 input of negatives [−1 −2; −3 −4] with 2×2
	// windows, stride 2: each window holds one input element and three
	// padding cells. Max ignores the padding (no zeros win); the average
	// still divides by 4.
	neg := lazy.Wrap(tf([]int{1, 1, 2, 2}, -1, -2, -3, -4), 0)
	pad := lazy.PoolOptions{Kernel: [2]int{2, 2}, Padding: [2]int{1, 1}}
	got = eval(t, neg.MaxPool2d(pad), neg.AvgPool2d(pad))
	requireClose(t, val([]int{1, 1, 2, 2}, -1, -2, -3, -4), got[0], handTol)
	requireClose(t, val([]int{1, 1, 2, 2}, -0.25, -0.5, -0.75, -1), got[1], handTol)

	// Dilated max pool: kernel 2, dilation 2 on 3×3 reads the corners 1, 3, 7, 9.
	sq := lazy.Wrap(tf([]int{1, 1, 3, 3}, 1, 9, 3, 4, 5, 6, 7, 8, 2), 0)
	got = eval(t, sq.MaxPool2d(lazy.PoolOptions{Kernel: [2]int{2, 2}, Dilation: [2]int{2, 2}}))
	requireClose(t, val([]int{1, 1, 1, 1}, 7), got[0], handTol)
}

func TestLosses(t *testing.T) {
	// Row 0: logits [0, ln 3], label 1: −log softmax = −ln 0.75.
	// Row 1: logits [0, 0], label 0: −ln 0.5 = ln 2.
	logits := lazy.Wrap(tf([]int{2, 2}, 0, float32(math.Log(3)), 0, 0), 0)
	labels := logits.Graph().Wrap(ti([]int{2}, 1, 0), 0)
	p := logits.Graph().Wrap(tf([]int{2, 2}, 1, 2, 3, 4), 0)
	q := lazy.Const(tf([]int{2, 2}, 1, 0, 5, 4))
	got := eval(t, logits.CrossEntropy(labels, graph.ReduceMean), logits.CrossEntropy(labels, graph.ReduceSum),
		p.MSE(q, graph.ReduceMean), p.MSE(q, graph.ReduceSum))
	sum := -ln(0.75) + ln(2)
	require.InDelta(t, sum/2, got[0].Data[0], 1e-7) // ln 3 rounded to float32
	require.InDelta(t, sum, got[1].Data[0], 1e-7)
	// (p − q)² = [0 4 4 0]: sum 8, mean 2.
	requireClose(t, val(nil, 2), got[2], handTol)
	requireClose(t, val(nil, 8), got[3], handTol)
}

// Gradient ops appended straight through shapeinfer, on hand-picked data.
func TestGradOpsByHand(t *testing.T) {
	d := newDSL(t)
	g3 := d.param(3)
	x3 := d.param(3)
	y3 := d.param(3)
	relu := d.op(graph.OpReluGrad, graph.Attrs{}, g3, y3)
	gelu := d.op(graph.OpGeluGrad, graph.Attrs{}, g3, x3)
	geluT := d.op(graph.OpGeluGrad, graph.Attrs{Approx: true}, g3, x3)
	ms := d.op(graph.OpMaximumScalarGrad, graph.Attrs{Scalar: 1}, g3, x3)
	mA := d.op(graph.OpMaximumGrad, graph.Attrs{Axis: 0}, g3, x3, y3)
	mB := d.op(graph.OpMaximumGrad, graph.Attrs{Axis: 1}, g3, x3, y3)
	sm := d.op(graph.OpSoftmaxGrad, graph.Attrs{Axis: 0}, g3, y3)
	lsm := d.op(graph.OpLogSoftmaxGrad, graph.Attrs{Axis: 0}, g3, y3)
	gs := d.param()
	xm := d.param(3)
	mx := d.op(graph.OpMax, graph.Attrs{}, xm)
	mg := d.op(graph.OpMaxGrad, graph.Attrs{}, gs, xm, mx)
	fill := d.op(graph.OpFill, graph.Attrs{Scalar: 2.5, Target: graph.Type{Shape: []int{2}, DType: graph.Float32}})
	got := d.eval(map[int]Value{
		g3: val([]int{3}, 2, 4, 6),
		x3: val([]int{3}, 0, 1, 2),
		y3: val([]int{3}, 0.5, 1, -1),
		gs: val(nil, 3),
		xm: val([]int{3}, 5, 1, 5),
	}, relu, gelu, geluT, ms, mA, mB, sm, lsm, mg, fill)
	requireClose(t, val([]int{3}, 2, 4, 0), got[0], 0) // g where y > 0
	// gelu'(0) = Φ(0) + 0 = ½ in both forms; the exact form's gelu'(1) =
	// Φ(1) + φ(1) = 0.841344746068543 + 0.241970724519143.
	require.InDelta(t, 1.0, got[1].Data[0], handTol)
	require.InDelta(t, 4*(0.841344746068543+0.241970724519143), got[1].Data[1], 1e-13)
	require.InDelta(t, 1.0, got[2].Data[0], handTol)
	// max(x, 1) with x = [0 1 2]: none, half (tie), all.
	requireClose(t, val([]int{3}, 0, 2, 6), got[3], 0)
	// maximum(x, y), x = [0 1 2], y = [0.5 1 −1]: a gets [0, ½, 1]·g, b the rest.
	requireClose(t, val([]int{3}, 0, 2, 6), got[4], 0)
	requireClose(t, val([]int{3}, 2, 2, 0), got[5], 0)
	// softmax_grad: y·(g − Σg·y) with Σg·y = 1 + 4 − 6 = −1: y·(g + 1) = [1.5 5 −7].
	requireClose(t, val([]int{3}, 1.5, 5, -7), got[6], handTol)
	// log_softmax_grad: g − exp(y)·Σg with Σg = 12.
	e := math.E
	requireClose(t, val([]int{3}, 2-12*math.Sqrt(e), 4-12*e, 6-12/e), got[7], 1e-12)
	// max of [5 1 5] ties at 0 and 2: each gets g/2.
	requireClose(t, val([]int{3}, 1.5, 0, 1.5), got[8], 0)
	requireClose(t, val([]int{2}, 2.5, 2.5), got[9], 0)
}

func TestPoolGradsByHand(t *testing.T) {
	// A 2×2 window holding [1 1; 0 1]: the whole gradient goes to the first
	// maximum, position (0, 0). Avg spreads g/4.
	d := newDSL(t)
	x := d.param(1, 1, 2, 2)
	g := d.param(1, 1, 1, 1)
	pool := graph.Attrs{Kernel: [2]int{2, 2}}
	mp := d.op(graph.OpMaxPool2dGrad, pool, g, x)
	ap := pool
	ap.Target = graph.Type{Shape: []int{1, 1, 2, 2}, DType: graph.Float32}
	av := d.op(graph.OpAvgPool2dGrad, ap, g)
	got := d.eval(map[int]Value{x: val([]int{1, 1, 2, 2}, 1, 1, 0, 1), g: val([]int{1, 1, 1, 1}, 8)}, mp, av)
	requireClose(t, val([]int{1, 1, 2, 2}, 8, 0, 0, 0), got[0], 0)
	requireClose(t, val([]int{1, 1, 2, 2}, 2, 2, 2, 2), got[1], 0)
}

func TestLossGradsByHand(t *testing.T) {
	// cross_entropy_grad = g·Scalar·(softmax − onehot): logits [0, ln 3],
	// label 1, g = 2, Scalar = ½ (mean over 2 rows, the second row [0 0]
	// with label 0): row 0 = [0.25, −0.25], row 1 = ½·[−0.5, 0.5].
	d := newDSL(t)
	logits := d.param(2, 2)
	labels := d.src(graph.OpConst, graph.Int64, 2)
	ce := d.op(graph.OpCrossEntropy, graph.Attrs{}, logits, labels)
	g := d.param()
	ceg := d.op(graph.OpCrossEntropyGrad, graph.Attrs{Scalar: d.g.Node(ce).Attrs.Scalar}, g, logits, labels)
	p, q := d.param(2), d.param(2)
	mse := d.op(graph.OpMSE, graph.Attrs{}, p, q)
	mseg := d.op(graph.OpMSEGrad, graph.Attrs{Scalar: d.g.Node(mse).Attrs.Scalar}, g, p, q)
	got := d.eval(map[int]Value{
		logits: val([]int{2, 2}, 0, ln(3), 0, 0),
		labels: val([]int{2}, 1, 0),
		g:      val(nil, 2),
		p:      val([]int{2}, 1, 5),
		q:      val([]int{2}, 2, 2),
	}, ceg, mseg)
	requireClose(t, val([]int{2, 2}, 0.25, -0.25, -0.5, 0.5), got[0], handTol)
	// mse_grad = g·Scalar·2(p − q) = 2·½·2·[−1 3] = [−2 6].
	requireClose(t, val([]int{2}, -2, 6), got[1], handTol)
}
