package cpu_test

import (
	"fmt"
	"math"
	"testing"

	"github.com/batchfit/batchfit/lazy"
)

func TestUnary(t *testing.T) {
	shape := []int{4, 3, 5}
	cases := []struct {
		name   string
		lo, hi float64 // input range; log and sqrt get positive inputs only
		op     func(*lazy.Tensor) *lazy.Tensor
		ref    func(float64) float64
	}{
		{"neg", -3, 3, (*lazy.Tensor).Neg, func(x float64) float64 { return -x }},
		{"exp", -4, 4, (*lazy.Tensor).Exp, math.Exp},
		{"log", 0.05, 6, (*lazy.Tensor).Log, math.Log},
		{"sqrt", 0.01, 9, (*lazy.Tensor).Sqrt, math.Sqrt},
		{"abs", -3, 3, (*lazy.Tensor).Abs, math.Abs},
		{"tanh", -4, 4, (*lazy.Tensor).Tanh, math.Tanh},
		{"sigmoid", -8, 8, (*lazy.Tensor).Sigmoid, func(x float64) float64 { return 1 / (1 + math.Exp(-x)) }},
		{"relu", -3, 3, (*lazy.Tensor).Relu, func(x float64) float64 { return math.Max(x, 0) }},
		{"gelu", -4, 4, (*lazy.Tensor).Gelu, func(x float64) float64 {
			return x * 0.5 * math.Erfc(-x/math.Sqrt2) // Φ(x) = erfc(−x/√2)/2
		}},
		{"silu", -8, 8, (*lazy.Tensor).Silu, func(x float64) float64 { return x / (1 + math.Exp(-x)) }},
		{"gelu_tanh", -4, 4, (*lazy.Tensor).GeluTanh, func(x float64) float64 {
			u := math.Sqrt(2/math.Pi) * (x + 0.044715*x*x*x)
			return 0.5 * x * (1 + math.Tanh(u))
		}},
	}
	for i, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			d := uniform(newRNG(uint64(i)), numel(shape), c.lo, c.hi)
			got := run(t, c.op(input(shape, d)))
			requireClose(t, refMap(ref64(shape, d), c.ref), got)
		})
	}
}

func TestScalarOps(t *testing.T) {
	shape := []int{3, 7}
	cases := []struct {
		name string
		s    float64
		pos  bool // positive inputs (pow)
		op   func(*lazy.Tensor, float64) *lazy.Tensor
		ref  func(x, s float64) float64
	}{
		{"add", 1.25, false, (*lazy.Tensor).AddScalar, func(x, s float64) float64 { return x + s }},
		{"sub", 0.75, false, (*lazy.Tensor).SubScalar, func(x, s float64) float64 { return x - s }},
		{"rsub", 2.5, false, (*lazy.Tensor).RSubScalar, func(x, s float64) float64 { return s - x }},
		{"mul", -1.5, false, (*lazy.Tensor).MulScalar, func(x, s float64) float64 { return x * s }},
		{"div", 3, false, (*lazy.Tensor).DivScalar, func(x, s float64) float64 { return x / s }},
		{"rdiv", 2, false, (*lazy.Tensor).RDivScalar, func(x, s float64) float64 { return s / x }},
		{"pow", 1.7, true, (*lazy.Tensor).PowScalar, math.Pow},
		{"pow_negative_exponent", -0.5, true, (*lazy.Tensor).PowScalar, math.Pow},
		{"pow_integer", 3, true, (*lazy.Tensor).PowScalar, math.Pow},
		{"maximum", 0.3, false, (*lazy.Tensor).MaximumScalar, math.Max},
	}
	for i, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			r := newRNG(100 + uint64(i))
			d := signed(r, numel(shape), 0.2, 3) // away from 0 for rdiv
			if c.pos {
				d = uniform(r, numel(shape), 0.2, 3)
			}
			got := run(t, c.op(input(shape, d), c.s))
			requireClose(t, refMap(ref64(shape, d), func(x float64) float64 { return c.ref(x, c.s) }), got)
		})
	}
}

var binaryOps = []struct {
	name string
	op   func(a, b *lazy.Tensor) *lazy.Tensor
	ref  func(a, b float64) float64
}{
	{"add", (*lazy.Tensor).Add, func(a, b float64) float64 { return a + b }},
	{"sub", (*lazy.Tensor).Sub, func(a, b float64) float64 { return a - b }},
	{"mul", (*lazy.Tensor).Mul, func(a, b float64) float64 { return a * b }},
	{"div", (*lazy.Tensor).Div, func(a, b float64) float64 { return a / b }},
	{"pow", (*lazy.Tensor).Pow, math.Pow},
	{"maximum", (*lazy.Tensor).Maximum, math.Max},
}

func TestBinaryBroadcast(t *testing.T) {
	shapes := [][2][]int{
		{{4, 5}, {4, 5}},
		{{}, {3, 4}},
		{{3, 4}, {}},
		{{3, 1}, {1, 4}},
		{{5}, {2, 3, 5}},
		{{2, 3, 5}, {5}},
		{{6, 4}, {6, 1}},
		{{2, 1, 5}, {3, 1}},
		{{4, 1, 3, 1}, {2, 1, 5}},
		{{2, 3, 4}, {2, 3, 4}},
		{{1, 3, 1}, {2, 1, 4}},
		{{1}, {1}},
		{{2, 1, 1, 3}, {2, 4, 5, 3}},
	}
	for si, sh := range shapes {
		for oi, o := range binaryOps {
			t.Run(fmt.Sprintf("%s/%v_%v", o.name, sh[0], sh[1]), func(t *testing.T) {
				r := newRNG(uint64(1000 + 10*si + oi))
				a := signed(r, numel(sh[0]), 0.25, 2)
				b := signed(r, numel(sh[1]), 0.25, 2) // divisors away from 0
				if o.name == "pow" {
					a = uniform(r, numel(sh[0]), 0.25, 2) // positive bases only
				}
				// The batched input needs rank ≥ 1; a scalar operand is a parameter.
				var x, y *lazy.Tensor
				if len(sh[0]) > 0 {
					x, y = input(sh[0], a), param(sh[1], b)
				} else {
					x, y = param(sh[0], a), input(sh[1], b)
				}
				got := run(t, o.op(x, y))
				requireClose(t, refBroadcast(ref64(sh[0], a), ref64(sh[1], b), o.ref), got)
			})
		}
	}
}

// TestBinaryEmpty runs ops over size-0 intermediates (gorgonia cannot hold a
// size-0 tensor, so they come from empty slices) and concatenates the result
// with data so that the output is not empty.
func TestBinaryEmpty(t *testing.T) {
	shape := []int{3, 4}
	d := signed(newRNG(7), numel(shape), 0.5, 2)
	x := input(shape, d)
	empty := x.Slice(1, 2, 2)                // [3, 0]
	row := x.Slice(0, 0, 1).Slice(1, 3, 3)   // [1, 0]
	sum := empty.Add(row).MulScalar(2).Exp() // [3, 0] by broadcasting
	y := lazy.Concat(1, sum, x, empty.Neg()) // [3, 4]
	// The empty parts contribute nothing.
	requireClose(t, ref64(shape, d), run(t, y))

	s := run(t, empty.Sum(1)) // a sum over an empty axis is 0
	requireClose(t, arr{shape: []int{3}, v: []float64{0, 0, 0}}, s)
}
