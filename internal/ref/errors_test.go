package ref

import (
	"testing"

	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
)

func TestEvalErrors(t *testing.T) {
	d := newDSL(t)
	x := d.param(2, 3)
	s := d.op(graph.OpSum, graph.Attrs{}, x)
	good := map[int]Value{x: randValue(newRand(), -1, 1, 2, 3)}

	idx := d.src(graph.OpConst, graph.Int64, 2)
	w := d.param(3, 2)
	emb := d.op(graph.OpEmbedding, graph.Attrs{}, idx, w)
	logits := d.param(2, 3)
	ce := d.op(graph.OpCrossEntropy, graph.Attrs{}, logits, idx)

	with := func(m map[int]Value, id int, v Value) map[int]Value {
		out := map[int]Value{id: v}
		for k, v := range m {
			if k != id {
				out[k] = v
			}
		}
		return out
	}
	embIn := map[int]Value{w: randValue(newRand(), -1, 1, 3, 2), logits: randValue(newRand(), -1, 1, 2, 3)}

	cases := []struct {
		name     string
		override map[int]Value
		outputs  []int
		want     error
	}{
		{"no data", nil, []int{s}, graph.ErrNoData},
		{"override shape", map[int]Value{x: val([]int{3, 2}, 1, 2, 3, 4, 5, 6)}, []int{s}, graph.ErrShape},
		{"override length", map[int]Value{x: {Shape: []int{2, 3}, Data: []float64{1}}}, []int{s}, graph.ErrShape},
		{"override of a computed node", with(good, s, val(nil, 1)), []int{s}, graph.ErrAttr},
		{"override id", with(good, 99, val(nil, 1)), []int{s}, graph.ErrArity},
		{"output id", good, []int{-1}, graph.ErrArity},
		{"index too large", with(embIn, idx, val([]int{2}, 0, 3)), []int{emb}, graph.ErrShape},
		{"negative index", with(embIn, idx, val([]int{2}, -1, 0)), []int{emb}, graph.ErrShape},
		{"fractional index", with(embIn, idx, val([]int{2}, 0.5, 0)), []int{emb}, graph.ErrDType},
		{"label out of range", with(embIn, idx, val([]int{2}, 0, 3)), []int{ce}, graph.ErrShape},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := Eval(d.g, c.override, c.outputs...)
			require.ErrorIs(t, err, c.want)
		})
	}
	_, err := Eval(d.g, embIn, s)
	var oe *graph.OpError
	require.ErrorAs(t, err, &oe)
	require.Equal(t, "param", oe.Op)

	// Data of the wrong kind for its node.
	d.g.Node(idx).Value = tf([]int{2}, 0, 1)
	_, err = Eval(d.g, map[int]Value{w: Zeros(3, 2)}, emb)
	require.ErrorIs(t, err, graph.ErrDType)

	_, err = Eval(nil, nil)
	require.ErrorIs(t, err, graph.ErrNilTensor)

	// Sources the outputs do not need may lack data.
	v, err := Eval(d.g, good, s)
	require.NoError(t, err)
	require.Len(t, v, 1)
}

func TestEvalRejectsMistypedNode(t *testing.T) {
	// A node with a wrong type cannot be made: graph.Append types every
	// node and refuses a stored type its rule disagrees with, so Eval's
	// own check of stored types never sees one.
	d := newDSL(t)
	x := d.param(2, 3)
	_, err := d.g.Append(graph.Node{Op: graph.OpSum, Inputs: []int{x},
		Type: graph.Type{Shape: []int{5}, DType: graph.Float32, BatchAxis: -1}})
	require.ErrorIs(t, err, graph.ErrShape)

	// An un-normalised axis on a correctly typed hand-made node is read as
	// its rule would normalise it.
	sum, err := d.g.Append(graph.Node{Op: graph.OpSum, Inputs: []int{x}, Attrs: graph.Attrs{Axes: []int{-1}},
		Type: graph.Type{Shape: []int{2}, DType: graph.Float32, BatchAxis: -1}})
	require.NoError(t, err)
	v, err := Eval(d.g, map[int]Value{x: val([]int{2, 3}, 1, 2, 3, 4, 5, 6)}, sum)
	require.NoError(t, err)
	requireClose(t, val([]int{2}, 6, 15), v[0], 0)
}

func TestEvalReturnsCopies(t *testing.T) {
	d := newDSL(t)
	x := d.param(2)
	in := val([]int{2}, 1, 2)
	v, err := Eval(d.g, map[int]Value{x: in}, x)
	require.NoError(t, err)
	v[0].Data[0] = 99
	require.Equal(t, []float64{1, 2}, in.Data)
}

func TestFromTensor(t *testing.T) {
	v, err := FromTensor(tf([]int{2, 2}, 1.5, -2, 3, 4))
	require.NoError(t, err)
	requireClose(t, val([]int{2, 2}, 1.5, -2, 3, 4), v, 0)

	v, err = FromTensor(ti([]int{3}, 7, -1, 1<<40))
	require.NoError(t, err)
	requireClose(t, val([]int{3}, 7, -1, 1<<40), v, 0)

	v, err = FromTensor(tensor.New(tensor.FromScalar(float32(2.5))))
	require.NoError(t, err)
	requireClose(t, val(nil, 2.5), v, 0)

	v, err = FromTensor(tensor.New(tensor.WithShape(2), tensor.WithBacking([]float64{0.1, 0.2})))
	require.NoError(t, err)
	requireClose(t, val([]int{2}, 0.1, 0.2), v, 0)

	// A transposed view reads in its logical order.
	tr := tf([]int{2, 3}, 1, 2, 3, 4, 5, 6)
	require.NoError(t, tr.T())
	v, err = FromTensor(tr)
	require.NoError(t, err)
	requireClose(t, val([]int{3, 2}, 1, 4, 2, 5, 3, 6), v, 0)

	_, err = FromTensor(tensor.New(tensor.WithShape(2), tensor.WithBacking([]int32{1, 2})))
	require.ErrorIs(t, err, graph.ErrDType)
	_, err = FromTensor(nil)
	require.ErrorIs(t, err, graph.ErrNilTensor)
}

func TestEvalReadsSourceData(t *testing.T) {
	// Int64 data from a wrapped tensor and float32 params feed Eval directly;
	// an override replaces one source and leaves the others.
	idx := lazy.Wrap(ti([]int{2}, 1, 0), 0)
	w := lazy.Param(tf([]int{2, 2}, 1, 2, 3, 4), "w")
	e := idx.Embedding(w)
	got := eval(t, e)
	requireClose(t, val([]int{2, 2}, 3, 4, 1, 2), got[0], 0)
	ir := e.Graph().IR()
	v, err := Eval(ir, map[int]Value{paramID(t, ir, "w"): val([]int{2, 2}, 0, 0, 9, 9)}, e.ID())
	require.NoError(t, err)
	requireClose(t, val([]int{2, 2}, 9, 9, 0, 0), v[0], 0)
}
