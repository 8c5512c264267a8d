package ref

import (
	"math"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/shapeinfer"
)

// tf is a float32 tensor of the given shape (nil shape: a scalar).
func tf(shape []int, data ...float32) *tensor.Dense {
	if len(shape) == 0 {
		return tensor.New(tensor.FromScalar(data[0]))
	}
	return tensor.New(tensor.WithShape(shape...), tensor.WithBacking(data))
}

// ti is an int64 tensor of the given shape.
func ti(shape []int, data ...int64) *tensor.Dense {
	return tensor.New(tensor.WithShape(shape...), tensor.WithBacking(data))
}

// eval evaluates lazy tensors of one graph from the data they hold.
func eval(t *testing.T, outs ...*lazy.Tensor) []Value {
	t.Helper()
	ids := make([]int, len(outs))
	for i, o := range outs {
		require.NoError(t, o.Err())
		ids[i] = o.ID()
	}
	vals, err := Eval(outs[0].Graph().IR(), nil, ids...)
	require.NoError(t, err)
	return vals
}

// requireClose checks shape and every element within tol (absolute).
func requireClose(t *testing.T, want Value, got Value, tol float64) {
	t.Helper()
	require.Equal(t, want.Shape, got.Shape, "shape")
	require.Len(t, got.Data, len(want.Data))
	for i := range want.Data {
		require.InDelta(t, want.Data[i], got.Data[i], tol, "element %d: want %v, got %v", i, want.Data, got.Data)
	}
}

// val builds a Value; a nil shape is a scalar.
func val(shape []int, data ...float64) Value {
	if shape == nil {
		shape = []int{}
	}
	return Value{Shape: shape, Data: data}
}

// randValue fills shape with uniform values in [lo, hi).
func randValue(rng *rand.Rand, lo, hi float64, shape ...int) Value {
	v := Zeros(shape...)
	for i := range v.Data {
		v.Data[i] = lo + (hi-lo)*rng.Float64()
	}
	return v
}

// dot is the inner product of two equally long arrays.
func dot(a, b Value) float64 {
	s := 0.0
	for i := range a.Data {
		s += a.Data[i] * b.Data[i]
	}
	return s
}

// dsl builds graphs node by node through shapeinfer, for ops and attributes
// the lazy API does not expose (gradient ops, matmul transposes).
type dsl struct {
	t *testing.T
	g *graph.Graph
}

func newDSL(t *testing.T) *dsl { return &dsl{t: t, g: graph.New()} }

// src appends a data-less source; Eval gets its value from an override.
func (d *dsl) src(op graph.Op, dt graph.DType, shape ...int) int {
	d.t.Helper()
	ba := -1
	if op == graph.OpInput {
		ba = 0
	}
	id, err := shapeinfer.AppendSource(d.g, graph.Node{Op: op, Type: graph.Type{Shape: shape, DType: dt, BatchAxis: ba}})
	require.NoError(d.t, err)
	return id
}

func (d *dsl) param(shape ...int) int { return d.src(graph.OpParam, graph.Float32, shape...) }

func (d *dsl) op(op graph.Op, a graph.Attrs, in ...int) int {
	d.t.Helper()
	id, err := shapeinfer.Append(d.g, graph.Node{Op: op, Attrs: a, Inputs: in})
	require.NoError(d.t, err)
	return id
}

func (d *dsl) shape(id int) []int { return d.g.Node(id).Type.Shape }

func (d *dsl) eval(override map[int]Value, outs ...int) []Value {
	d.t.Helper()
	vals, err := Eval(d.g, override, outs...)
	require.NoError(d.t, err)
	return vals
}

// paramID finds the node of the parameter named name.
func paramID(t *testing.T, g *graph.Graph, name string) int {
	t.Helper()
	for _, n := range g.Nodes() {
		if n.Op == graph.OpParam && n.Name == name {
			return n.ID
		}
	}
	t.Fatalf("no parameter %q", name)
	return -1
}

var ln = math.Log

// newRand is a fixed-seed source for tests that need a few random values.
func newRand() *rand.Rand { return rand.New(rand.NewPCG(42, 43)) }
