package lazy_test

import (
	"errors"
	"math"
	"math/bits"
	"math/rand/v2"
	"slices"
	"testing"

	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/shapeinfer"
)

// FuzzOpChain builds a random graph from the fuzz input: starting inputs of
// random shape and batch axis, then a chain of random lazy ops with random,
// often invalid, arguments. No call may panic; every tensor is either valid
// (consistent type, a node of its graph) or carries an *graph.OpError; and
// shapeinfer.Analyze accepts every graph built.
func FuzzOpChain(f *testing.F) {
	f.Add([]byte{})
	f.Add([]byte{2, 4, 3, 1, 0})                                 // one [4, 3] input, batch axis 0
	f.Add([]byte{2, 4, 3, 1, 0, 7, 0, 3, 0, 4, 14, 1, 0, 29, 1}) // …then a few ops
	f.Add([]byte{4, 2, 3, 5, 5, 1, 0, 39, 0, 3, 3, 1, 1, 1, 0, 40, 1, 2, 2})
	f.Add([]byte{3, 4, 2, 3, 2, 0, 31, 0, 3, 6, 255, 3, 32, 1, 2, 0, 1, 2})
	f.Add([]byte{1, 6, 1, 1, 0, 44, 0, 1, 45, 0, 0, 0, 46, 2, 1, 3})
	rng := rand.New(rand.NewPCG(1, 2))
	for range 16 {
		b := make([]byte, 24+rng.IntN(96))
		for k := range b {
			b[k] = byte(rng.UintN(256))
		}
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		fz := &fuzzer{src: src{b: data}, g: lazy.NewGraph()}
		defer func() {
			if r := recover(); r != nil {
				t.Fatalf("panic after %v: %v", fz.trace, r)
			}
		}()
		fz.run(t)
	})
}

// src hands out the fuzz bytes; past the end it returns zeros.
type src struct {
	b []byte
	i int
}

func (s *src) byte() byte {
	if s.i >= len(s.b) {
		return 0
	}
	c := s.b[s.i]
	s.i++
	return c
}

func (s *src) done() bool { return s.i >= len(s.b) }

// n is a number in [0, k).
func (s *src) n(k int) int { return int(s.byte()) % k }

// axis is mostly in range for small ranks, sometimes not.
func (s *src) axis() int { return s.n(11) - 5 }

// dim is a size 0–6, occasionally −1, a larger size or a huge one.
func (s *src) dim() int {
	switch c := s.n(32); {
	case c < 24:
		return c % 7
	case c < 27:
		return -1
	case c < 30:
		return 8 << (c - 27)
	case c == 30:
		return -2
	default:
		return 1 << 40
	}
}

func (s *src) shape() []int {
	r := s.n(5)
	out := make([]int, r)
	for k := range out {
		out[k] = s.dim()
	}
	return out
}

// smallShape has dims 0–6 only.
func (s *src) smallShape() []int {
	r := s.n(5)
	out := make([]int, r)
	for k := range out {
		out[k] = s.n(7)
	}
	return out
}

func (s *src) pair() [2]int { return [2]int{s.n(5) - 1, s.n(5) - 1} }

func (s *src) scalar() float64 {
	return [...]float64{0, 1, -1, 0.5, 2, 1e-5, -3, math.NaN()}[s.n(8)]
}

func (s *src) dtype() graph.DType {
	return [...]graph.DType{f32, f32, f32, i64, graph.InvalidDType, graph.Float16}[s.n(6)]
}

type fuzzer struct {
	src
	g     *lazy.Graph
	pool  []*lazy.Tensor
	trace []string
}

func (fz *fuzzer) run(t *testing.T) {
	// Starting inputs: one or two, of random rank 0–4 and dims 0–6.
	for k := range 1 + fz.n(2) {
		shape := fz.smallShape()
		if fz.n(3) == 0 { // an NCHW image batch, for convolutions and pooling
			shape = []int{1 + fz.n(4), 1 + fz.n(4), 2 + fz.n(5), 2 + fz.n(5)}
		}
		ax := fz.n(len(shape)+2) - 1 // −1 … rank: sometimes out of range
		if k == 0 && fz.n(2) == 0 {
			fz.push(fz.g.Wrap(denseOf(fz.byte(), shape...), ax))
		} else {
			fz.push(fz.g.Placeholder(shape, fz.dtype(), ax))
		}
		fz.trace = append(fz.trace, "input")
	}
	for steps := 0; steps < 48 && !fz.done(); steps++ {
		op := fuzzOps[fz.n(len(fuzzOps))]
		fz.trace = append(fz.trace, op.name)
		fz.push(op.f(fz, fz.pick())...)
	}
	fz.check(t)
}

func (fz *fuzzer) push(ts ...*lazy.Tensor) { fz.pool = append(fz.pool, ts...) }

// pick returns a tensor from the pool, or now and then a fresh operand.
func (fz *fuzzer) pick() *lazy.Tensor {
	c := fz.n(16)
	if c < 11 && len(fz.pool) > 0 {
		return fz.pool[len(fz.pool)-1-fz.n(len(fz.pool))]
	}
	return fz.fresh(c)
}

func (fz *fuzzer) fresh(c int) *lazy.Tensor {
	switch c % 8 {
	case 0, 1:
		return lazy.ParamSpec(fz.smallShape(), f32, "w")
	case 2:
		return lazy.ParamSpec(fz.smallShape(), i64, "idx")
	case 3:
		return lazy.Const(denseOf(fz.byte(), fz.smallShape()...))
	case 4: // an input of the same graph: a second batch size is an error
		s := fz.smallShape()
		return fz.g.Placeholder(s, f32, fz.n(len(s)+1))
	case 5: // another graph
		s := fz.smallShape()
		return lazy.Placeholder(s, f32, fz.n(len(s)+1))
	case 6:
		return nil
	}
	return &lazy.Tensor{}
}

// denseOf is float32 (or, when sel says so, int64) data of the given shape,
// or nil for shapes gorgonia cannot hold.
func denseOf(sel byte, shape ...int) tensor.Tensor {
	n := 1
	for _, d := range shape {
		if d < 0 || d > 64 {
			return nil
		}
		n *= d
	}
	if n == 0 {
		return nil // gorgonia does not make empty dense tensors
	}
	if len(shape) == 0 {
		return tensor.New(tensor.FromScalar(float32(1)))
	}
	if sel%4 == 0 {
		return tensor.New(tensor.WithShape(shape...), tensor.WithBacking(make([]int64, n)))
	}
	return tensor.New(tensor.WithShape(shape...), tensor.WithBacking(make([]float32, n)))
}

// like returns, half the time, an operand whose shape derive computes from
// x's (so the op often succeeds), sometimes nudged off by one; otherwise
// whatever pick gives.
func (fz *fuzzer) like(x *lazy.Tensor, dt graph.DType, derive func(s []int) []int) *lazy.Tensor {
	if fz.n(2) == 0 || x.Err() != nil {
		return fz.pick()
	}
	s := derive(x.Shape())
	if fz.n(8) == 0 && len(s) > 0 {
		s[fz.n(len(s))]++
	}
	if ax := x.BatchAxis(); fz.n(2) == 0 && ax >= 0 && ax < len(s) && x.Graph() != nil {
		return x.Graph().Placeholder(s, dt, ax) // batched like x when the shape kept its batch axis
	}
	return lazy.ParamSpec(s, dt, "w")
}

// bcast is a suffix of s with some dims set to 1.
func (fz *fuzzer) bcast(s []int) []int {
	out := slices.Clone(s[fz.n(len(s)+1):])
	for k := range out {
		if fz.n(3) == 0 {
			out[k] = 1
		}
	}
	return out
}

func last(s []int) int {
	if len(s) == 0 {
		return 1
	}
	return s[len(s)-1]
}

type fuzzOp struct {
	name string
	f    func(fz *fuzzer, x *lazy.Tensor) []*lazy.Tensor
}

func one(t *lazy.Tensor) []*lazy.Tensor { return []*lazy.Tensor{t} }

func (fz *fuzzer) axes() []int {
	a := make([]int, fz.n(4))
	for k := range a {
		a[k] = fz.axis()
	}
	return a
}

// conv options are arbitrary half the time and plausible otherwise.
func (fz *fuzzer) conv() lazy.ConvOptions {
	if fz.n(2) == 0 {
		return lazy.ConvOptions{Stride: fz.pair(), Padding: fz.pair(), Dilation: fz.pair(), Groups: fz.n(5) - 1}
	}
	return lazy.ConvOptions{Stride: fz.small(3), Padding: fz.small(2), Dilation: fz.small(3), Groups: fz.n(3)}
}

func (fz *fuzzer) poolOpts() lazy.PoolOptions {
	if fz.n(2) == 0 {
		return lazy.PoolOptions{Kernel: fz.pair(), Stride: fz.pair(), Padding: fz.pair(), Dilation: fz.pair()}
	}
	k := 1 + fz.n(3)
	return lazy.PoolOptions{Kernel: [2]int{k, k}, Stride: fz.small(3), Padding: [2]int{fz.n(k/2 + 1), 0}}
}

// small is a pair of values in [0, k).
func (fz *fuzzer) small(k int) [2]int { return [2]int{fz.n(k), fz.n(k)} }

func (fz *fuzzer) reduction() graph.Reduction { return graph.Reduction(fz.n(2)) }

var fuzzOps = []fuzzOp{
	{"neg", func(_ *fuzzer, x *lazy.Tensor) []*lazy.Tensor { return one(x.Neg()) }},
	{"exp", func(_ *fuzzer, x *lazy.Tensor) []*lazy.Tensor { return one(x.Exp()) }},
	{"log", func(_ *fuzzer, x *lazy.Tensor) []*lazy.Tensor { return one(x.Log()) }},
	{"sqrt", func(_ *fuzzer, x *lazy.Tensor) []*lazy.Tensor { return one(x.Sqrt()) }},
	{"abs", func(_ *fuzzer, x *lazy.Tensor) []*lazy.Tensor { return one(x.Abs()) }},
	{"tanh", func(_ *fuzzer, x *lazy.Tensor) []*lazy.Tensor { return one(x.Tanh()) }},
	{"sigmoid", func(_ *fuzzer, x *lazy.Tensor) []*lazy.Tensor { return one(x.Sigmoid()) }},
	{"relu", func(_ *fuzzer, x *lazy.Tensor) []*lazy.Tensor { return one(x.Relu()) }},
	{"gelu", func(_ *fuzzer, x *lazy.Tensor) []*lazy.Tensor { return one(x.Gelu()) }},
	{"gelu_tanh", func(_ *fuzzer, x *lazy.Tensor) []*lazy.Tensor { return one(x.GeluTanh()) }},
	{"causal_mask", func(_ *fuzzer, x *lazy.Tensor) []*lazy.Tensor { return one(x.CausalMask()) }},
	{"add", func(fz *fuzzer, x *lazy.Tensor) []*lazy.Tensor { return one(x.Add(fz.like(x, f32, fz.bcast))) }},
	{"sub", func(fz *fuzzer, x *lazy.Tensor) []*lazy.Tensor { return one(x.Sub(fz.like(x, f32, fz.bcast))) }},
	{"mul", func(fz *fuzzer, x *lazy.Tensor) []*lazy.Tensor { return one(x.Mul(fz.like(x, f32, fz.bcast))) }},
	{"div", func(fz *fuzzer, x *lazy.Tensor) []*lazy.Tensor { return one(x.Div(fz.like(x, f32, fz.bcast))) }},
	{"pow", func(fz *fuzzer, x *lazy.Tensor) []*lazy.Tensor { return one(x.Pow(fz.like(x, f32, fz.bcast))) }},
	{"maximum", func(fz *fuzzer, x *lazy.Tensor) []*lazy.Tensor { return one(x.Maximum(fz.like(x, f32, fz.bcast))) }},
	{"add_scalar", func(fz *fuzzer, x *lazy.Tensor) []*lazy.Tensor { return one(x.AddScalar(fz.scalar())) }},
	{"sub_scalar", func(fz *fuzzer, x *lazy.Tensor) []*lazy.Tensor { return one(x.SubScalar(fz.scalar())) }},
	{"rsub_scalar", func(fz *fuzzer, x *lazy.Tensor) []*lazy.Tensor { return one(x.RSubScalar(fz.scalar())) }},
	{"mul_scalar", func(fz *fuzzer, x *lazy.Tensor) []*lazy.Tensor { return one(x.MulScalar(fz.scalar())) }},
	{"div_scalar", func(fz *fuzzer, x *lazy.Tensor) []*lazy.Tensor { return one(x.DivScalar(fz.scalar())) }},
	{"rdiv_scalar", func(fz *fuzzer, x *lazy.Tensor) []*lazy.Tensor { return one(x.RDivScalar(fz.scalar())) }},
	{"pow_scalar", func(fz *fuzzer, x *lazy.Tensor) []*lazy.Tensor { return one(x.PowScalar(fz.scalar())) }},
	{"maximum_scalar", func(fz *fuzzer, x *lazy.Tensor) []*lazy.Tensor { return one(x.MaximumScalar(fz.scalar())) }},
	{"matmul", func(fz *fuzzer, x *lazy.Tensor) []*lazy.Tensor {
		return one(x.MatMul(fz.like(x, f32, func(s []int) []int {
			if len(s) >= 3 && fz.n(2) == 0 {
				return []int{s[0], last(s), 1 + fz.n(4)} // batched leading axis
			}
			return []int{last(s), 1 + fz.n(4)}
		})))
	}},
	{"matmul_t", func(fz *fuzzer, x *lazy.Tensor) []*lazy.Tensor {
		ta, tb := fz.n(2) == 0, fz.n(2) == 0
		return one(x.MatMulT(fz.like(x, f32, func(s []int) []int {
			k := last(s)
			if ta && len(s) >= 2 {
				k = s[len(s)-2]
			}
			if tb {
				return []int{1 + fz.n(4), k}
			}
			return []int{k, 1 + fz.n(4)}
		}), ta, tb))
	}},
	{"linear", func(fz *fuzzer, x *lazy.Tensor) []*lazy.Tensor {
		n := 1 + fz.n(4)
		w := fz.like(x, f32, func(s []int) []int { return []int{n, last(s)} })
		b := fz.like(x, f32, func([]int) []int { return []int{n} })
		if fz.n(2) == 0 {
			b = nil
		}
		return one(x.Linear(w, b))
	}},
	{"sum", func(fz *fuzzer, x *lazy.Tensor) []*lazy.Tensor { return one(x.Sum(fz.axes()...)) }},
	{"mean", func(fz *fuzzer, x *lazy.Tensor) []*lazy.Tensor { return one(x.Mean(fz.axes()...)) }},
	{"max", func(fz *fuzzer, x *lazy.Tensor) []*lazy.Tensor { return one(x.Max(fz.axes()...)) }},
	{"sum_keepdim", func(fz *fuzzer, x *lazy.Tensor) []*lazy.Tensor { return one(x.SumKeepDim(fz.axes()...)) }},
	{"mean_keepdim", func(fz *fuzzer, x *lazy.Tensor) []*lazy.Tensor { return one(x.MeanKeepDim(fz.axes()...)) }},
	{"max_keepdim", func(fz *fuzzer, x *lazy.Tensor) []*lazy.Tensor { return one(x.MaxKeepDim(fz.axes()...)) }},
	{"softmax", func(fz *fuzzer, x *lazy.Tensor) []*lazy.Tensor { return one(x.Softmax(fz.axis())) }},
	{"log_softmax", func(fz *fuzzer, x *lazy.Tensor) []*lazy.Tensor { return one(x.LogSoftmax(fz.axis())) }},
	{"layer_norm", func(fz *fuzzer, x *lazy.Tensor) []*lazy.Tensor {
		nd := fz.n(6) - 1
		trail := func(s []int) []int { return slices.Clone(s[len(s)-min(max(nd, 0), len(s)):]) }
		var w, b *lazy.Tensor
		switch fz.n(4) {
		case 1:
			w = fz.like(x, f32, trail)
		case 2:
			w, b = fz.like(x, f32, trail), fz.like(x, f32, trail)
		case 3:
			b = fz.pick()
		}
		return one(x.LayerNorm(w, b, nd, fz.scalar()))
	}},
	{"reshape", func(fz *fuzzer, x *lazy.Tensor) []*lazy.Tensor { return one(x.Reshape(fz.shape()...)) }},
	{"reshape_numel", func(fz *fuzzer, x *lazy.Tensor) []*lazy.Tensor {
		// Split the element count into two factors, so reshapes often succeed.
		n := graph.Numel(x.Shape())
		k := 1 + fz.n(6)
		if n > 0 && n%k == 0 {
			return one(x.Reshape(k, n/k))
		}
		return one(x.Reshape(-1))
	}},
	{"permute", func(fz *fuzzer, x *lazy.Tensor) []*lazy.Tensor {
		p := make([]int, len(x.Shape()))
		for k := range p {
			p[k] = k
		}
		rand.New(rand.NewPCG(uint64(fz.byte()), 0)).Shuffle(len(p), func(i, j int) { p[i], p[j] = p[j], p[i] })
		if fz.n(3) == 0 && len(p) > 0 { // often a valid permutation, sometimes not
			p[fz.n(len(p))] = fz.axis()
		}
		return one(x.Permute(p...))
	}},
	{"transpose", func(fz *fuzzer, x *lazy.Tensor) []*lazy.Tensor { return one(x.Transpose(fz.axis(), fz.axis())) }},
	{"slice", func(fz *fuzzer, x *lazy.Tensor) []*lazy.Tensor {
		return one(x.SliceStep(fz.axis(), fz.n(5)-1, fz.n(8)-1, fz.n(4)-1))
	}},
	{"concat", func(fz *fuzzer, x *lazy.Tensor) []*lazy.Tensor {
		ts := []*lazy.Tensor{x}
		for range fz.n(3) {
			ts = append(ts, fz.pick())
		}
		return one(lazy.Concat(fz.axis(), ts...))
	}},
	{"embedding", func(fz *fuzzer, x *lazy.Tensor) []*lazy.Tensor {
		if fz.n(2) == 0 && x.Err() == nil && x.DType() != i64 { // indices shaped like x
			x = fz.like(x, i64, func(s []int) []int { return s })
		}
		return one(x.Embedding(fz.like(x, f32, func([]int) []int { return []int{1 + fz.n(6), fz.n(5)} })))
	}},
	{"conv2d", func(fz *fuzzer, x *lazy.Tensor) []*lazy.Tensor {
		o := fz.conv()
		groups := max(o.Groups, 1)
		out := groups * (1 + fz.n(3))
		w := fz.like(x, f32, func(s []int) []int {
			c := 1
			if len(s) > 1 {
				c = s[1]
			}
			return []int{out, c / groups, 1 + fz.n(3), 1 + fz.n(3)}
		})
		b := fz.like(x, f32, func([]int) []int { return []int{out} })
		if fz.n(2) == 0 {
			b = nil
		}
		return one(x.Conv2d(w, b, o))
	}},
	{"max_pool2d", func(fz *fuzzer, x *lazy.Tensor) []*lazy.Tensor { return one(x.MaxPool2d(fz.poolOpts())) }},
	{"avg_pool2d", func(fz *fuzzer, x *lazy.Tensor) []*lazy.Tensor { return one(x.AvgPool2d(fz.poolOpts())) }},
	{"cross_entropy", func(fz *fuzzer, x *lazy.Tensor) []*lazy.Tensor {
		labels := fz.like(x, i64, func(s []int) []int { return s[:min(len(s), 1)] })
		return one(x.CrossEntropy(labels, fz.reduction()))
	}},
	{"mse", func(fz *fuzzer, x *lazy.Tensor) []*lazy.Tensor {
		return one(x.MSE(fz.like(x, f32, slices.Clone[[]int]), fz.reduction()))
	}},
	{"grad", func(fz *fuzzer, x *lazy.Tensor) []*lazy.Tensor {
		loss := x
		if fz.n(4) != 0 && x.Err() == nil && len(x.Shape()) > 0 {
			loss = x.Sum() // a scalar, so Backward has a seed
		}
		ps := make([]*lazy.Tensor, fz.n(4))
		for k := range ps {
			ps[k] = fz.pick()
		}
		return append(lazy.Grad(loss, ps...), loss)
	}},
	{"scope", func(fz *fuzzer, x *lazy.Tensor) []*lazy.Tensor {
		if fz.n(2) == 0 {
			fz.g.PushScope("m")
		} else {
			fz.g.PopScope()
		}
		return nil
	}},
	{"wrap", func(fz *fuzzer, _ *lazy.Tensor) []*lazy.Tensor {
		s := fz.smallShape()
		return one(fz.g.Wrap(denseOf(fz.byte(), s...), fz.n(len(s)+2)-1))
	}},
	{"batch_norm", func(fz *fuzzer, x *lazy.Tensor) []*lazy.Tensor {
		ch := func(s []int) []int { return s[min(1, len(s)):min(2, len(s))] } // [C] when the rank allows
		per := func() *lazy.Tensor {
			if fz.n(4) == 0 {
				return nil
			}
			return fz.like(x, f32, ch)
		}
		w, b, mean, variance := per(), per(), per(), per()
		if fz.n(2) == 0 {
			return one(x.BatchNorm2d(w, b, mean, variance, fz.n(2) == 0, fz.scalar()))
		}
		return one(x.BatchNorm(w, b, mean, variance, fz.n(2) == 0, fz.scalar()))
	}},
}

// check asserts the invariants of every tensor made and analyses every
// graph they belong to.
func (fz *fuzzer) check(t *testing.T) {
	outputs := map[*lazy.Graph][]int{fz.g: nil}
	for k, x := range fz.pool {
		if x == nil {
			continue
		}
		err := x.Err()
		_ = x.String()
		if err != nil {
			var oe *graph.OpError
			if !errors.As(err, &oe) {
				t.Fatalf("tensor %d: error %T %v is not a *graph.OpError", k, err, err)
			}
			if x.Shape() != nil || x.ID() != -1 || x.Graph() != nil {
				t.Fatalf("tensor %d: errored tensor has shape %v, id %d", k, x.Shape(), x.ID())
			}
			continue
		}
		if x.Graph() == nil && x.ID() == -1 && x.Type().DType == graph.InvalidDType {
			continue // a zero lazy.Tensor handed in as an operand
		}
		ty := x.Type()
		if !slices.Equal(ty.Shape, x.Shape()) {
			t.Fatalf("tensor %d: Type().Shape %v, Shape() %v", k, ty.Shape, x.Shape())
		}
		n, ok := numel(ty.Shape)
		if !ok || n != graph.Numel(ty.Shape) || ty.Bytes() != int64(n)*int64(ty.DType.Size()) || ty.DType.Size() == 0 {
			t.Fatalf("tensor %d: %s%v: numel %d (overflow %v), %d bytes", k, ty.DType, ty.Shape, graph.Numel(ty.Shape), !ok, ty.Bytes())
		}
		if ty.BatchAxis < -1 || ty.BatchAxis >= len(ty.Shape) || ty.PerSample < 1 {
			t.Fatalf("tensor %d: %v: batch axis %d, PerSample %d", k, ty.Shape, ty.BatchAxis, ty.PerSample)
		}
		g := x.Graph()
		if g == nil { // a free leaf
			if x.ID() != -1 || ty.Batched() {
				t.Fatalf("tensor %d: free leaf with id %d, batch axis %d", k, x.ID(), ty.BatchAxis)
			}
			continue
		}
		ir := g.IR()
		id := x.ID()
		if id < 0 || id >= ir.Len() {
			t.Fatalf("tensor %d: id %d outside its graph of %d nodes", k, id, ir.Len())
		}
		nd := ir.Node(id)
		if !slices.Equal(nd.Type.Shape, ty.Shape) || nd.Type.DType != ty.DType || nd.Type.BatchAxis != ty.BatchAxis || nd.Type.PerSample != ty.PerSample {
			t.Fatalf("tensor %d: type %+v, its node has %+v", k, ty, nd.Type)
		}
		if ty.Batched() && (ir.Batch() < 1 || ty.Shape[ty.BatchAxis] != ir.Batch()*ty.PerSample) {
			t.Fatalf("tensor %d (%s): %v batch axis %d PerSample %d, graph batch %d", k, nd.Op, ty.Shape, ty.BatchAxis, ty.PerSample, ir.Batch())
		}
		outputs[g] = append(outputs[g], id)
	}
	for g, outs := range outputs {
		checkAnalysis(t, g.IR(), outs)
	}
}

func checkAnalysis(t *testing.T, ir *graph.Graph, outs []int) {
	res, err := shapeinfer.Analyze(ir, outs...)
	if err != nil {
		t.Fatalf("Analyze: %v", err)
	}
	if res.NotChunkable != nil {
		if !errors.Is(res.NotChunkable, graph.ErrNotChunkable) || res.NotChunkable.Node < 0 || res.NotChunkable.Node >= ir.Len() {
			t.Fatalf("NotChunkable %v", res.NotChunkable)
		}
	}
	for _, nd := range ir.Nodes() {
		id := nd.ID
		for _, in := range nd.Inputs {
			if in < 0 || in >= id {
				t.Fatalf("node %d (%s) reads node %d", id, nd.Op, in)
			}
		}
		if res.Fixed[id] < 0 || res.PerSample[id] < 0 || res.Bytes(id, res.Batch) != nd.Type.Bytes() {
			t.Fatalf("node %d (%s %v): Fixed %d, PerSample %d, %d bytes at batch %d", id, nd.Op, nd.Type.Shape, res.Fixed[id], res.PerSample[id], nd.Type.Bytes(), res.Batch)
		}
		if lu := res.LastUse[id]; lu != -1 && lu != shapeinfer.End && lu <= id {
			t.Fatalf("node %d: last use %d", id, lu)
		}
		if (res.Class[id] == shapeinfer.PerSample) != nd.Type.Batched() {
			t.Fatalf("node %d (%s): class %v, batch axis %d", id, nd.Op, res.Class[id], nd.Type.BatchAxis)
		}
		if res.Class[id] == shapeinfer.CrossBatch && res.Combine[id] == shapeinfer.CombineNone && res.Chunkable() {
			t.Fatalf("node %d (%s): chunkable graph, cross-batch value with no combine rule", id, nd.Op)
		}
	}
}

// numel multiplies out a shape, reporting overflow of int64 byte counts.
func numel(shape []int) (int, bool) {
	n, nz := 1, uint64(1)
	for _, d := range shape {
		if d < 0 {
			return 0, false
		}
		n *= d
		if d > 0 { // zero dims hide an overflow of the others until reduced away
			hi, lo := bits.Mul64(nz, uint64(d))
			if hi != 0 || lo > math.MaxInt64/8 {
				return 0, false
			}
			nz = lo
		}
	}
	return n, true
}
