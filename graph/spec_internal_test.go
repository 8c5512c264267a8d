package graph

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Every op has one complete spec: a name, a rule (sources are typed by
// their data instead), chunk behaviour, and a VJP or the documented reason
// it has none. A new op without them fails here.
func TestOpTableComplete(t *testing.T) {
	seen := make([]int, NumOps)
	for _, fam := range opFamilies {
		for op, row := range fam {
			if row.Name != "" {
				seen[op]++
			}
		}
	}
	names := map[string]Op{}
	for i := 1; i < NumOps; i++ {
		op := Op(i)
		in := op.Info()
		assert.Equal(t, 1, seen[op], "op %d (%s) must be declared in exactly one family", i, in.Name)
		require.NotEmpty(t, in.Name, "op %d has no name", i)
		if prev, dup := names[in.Name]; dup {
			t.Errorf("ops %d and %d are both named %q", prev, op, in.Name)
		}
		names[in.Name] = op
		if in.Category == CatSource {
			assert.Nil(t, in.Rule, "%s: sources are typed by their data, not a rule", op)
		} else {
			assert.NotNil(t, in.Rule, "%s has no shape rule", op)
		}
		assert.NotNil(t, in.Chunk, "%s has no chunk behaviour", op)
		switch {
		case in.VJP != nil:
			assert.Empty(t, in.NoVJP, "%s has a VJP and a reason it has none", op)
		case in.NoVJP == noVJPLeaf:
			assert.True(t, in.Category.Leaf(), "%s is marked a leaf but takes inputs", op)
		case in.NoVJP == noVJPGrad:
			assert.Equal(t, CatGrad, in.Category, "%s is marked a gradient op", op)
		case in.NoVJP == noVJPFused:
			assert.Equal(t, CatFused, in.Category, "%s is marked a fused op", op)
		default:
			t.Errorf("%s has neither a VJP nor a documented reason (NoVJP) for lacking one", op)
		}
		if in.Saves != 0 {
			assert.NotNil(t, in.VJP, "%s saves values for a VJP it does not have", op)
		}
	}
	assert.Equal(t, OpInfo{Name: "invalid"}, OpInvalid.Info())
}

// Append stores its op's answer and nothing else: a node given another
// type is refused, and one given none gets the rule's.
func TestAppendStoresRuleType(t *testing.T) {
	g := New()
	x, err := g.Append(Node{Op: OpInput, Type: Type{Shape: []int{4, 3}, DType: Float32, BatchAxis: 0}})
	require.NoError(t, err)
	w, err := g.Append(Node{Op: OpParam, Type: Type{Shape: []int{5, 3}, DType: Float32, BatchAxis: 0}})
	require.NoError(t, err)
	assert.Equal(t, Type{Shape: []int{5, 3}, DType: Float32, BatchAxis: -1, PerSample: 1}, g.Node(w).Type,
		"a parameter has no batch axis, whatever it was given")

	want := Type{Shape: []int{4, 5}, DType: Float32, BatchAxis: 0, PerSample: 1}
	for _, wrong := range []Type{
		{Shape: []int{4, 4}, DType: Float32, BatchAxis: 0, PerSample: 1},
		{Shape: []int{4, 5}, DType: Float16, BatchAxis: 0, PerSample: 1},
		{Shape: []int{4, 5}, DType: Float32, BatchAxis: -1, PerSample: 1},
		{DType: Float32},
	} {
		_, err := g.Append(Node{Op: OpLinear, Inputs: []int{x, w}, Type: wrong})
		assert.ErrorIs(t, err, ErrShape, "%v", wrong)
	}
	require.Equal(t, 2, g.Len(), "refused nodes are not appended")

	y, err := g.Append(Node{Op: OpLinear, Inputs: []int{x, w}})
	require.NoError(t, err)
	assert.Equal(t, want, g.Node(y).Type)
	y2, err := g.Append(Node{Op: OpLinear, Inputs: []int{x, w}, Type: want})
	require.NoError(t, err)
	assert.Equal(t, want, g.Node(y2).Type)

	// The stored attributes are the rule's normalised ones.
	s, err := g.Append(Node{Op: OpMean, Inputs: []int{y}, Attrs: Attrs{Axes: []int{-1}}})
	require.NoError(t, err)
	assert.Equal(t, []int{1}, g.Node(s).Attrs.Axes)
	assert.Equal(t, 0.2, g.Node(s).Attrs.Scalar)

	// Every op of fixed arity: a rule error leaves the graph as it was.
	for i := 1; i < NumOps; i++ {
		if Op(i).Category().Leaf() || Op(i).Info().Arity == Variadic {
			continue
		}
		n := g.Len()
		_, err := g.Append(Node{Op: Op(i), Inputs: []int{x, x, x, x, x, x, x}})
		assert.Error(t, err, "%s with seven inputs", Op(i))
		assert.Equal(t, n, g.Len())
	}
	_, err = g.Append(Node{Op: Op(NumOps), Inputs: []int{x}})
	assert.Error(t, err, "an undeclared op has no rule")
}

// recorder is a VJPBuilder over a real graph that notes which forward
// values (inputs or output of the node being differentiated) the VJP's
// nodes read.
type recorder struct {
	t     *testing.T
	g     *Graph
	fwd   *Node
	reads Saved
	// frozen inputs want no gradient (attention's mask, which refuses one).
	frozen Saved
}

func (r *recorder) Emit(op Op, a Attrs, inputs ...int) int {
	for _, in := range inputs {
		if in == r.fwd.ID {
			r.reads |= SavesOutput
		}
		for i, x := range r.fwd.Inputs {
			if in == x {
				r.reads |= SavesInput(i)
			}
		}
	}
	id, err := r.g.Append(Node{Op: op, Inputs: inputs, Attrs: a})
	require.NoError(r.t, err, "%s's VJP emits %s", r.fwd.Op, op)
	return id
}

func (r *recorder) Accumulate(id, c int)     {}
func (r *recorder) AccumulateSlice(x, g int) {}
func (r *recorder) SumTo(g, id int) int      { return g }
func (r *recorder) Type(id int) Type         { return r.g.Node(id).Type }
func (r *recorder) Wants(i int) bool {
	return i < len(r.fwd.Inputs) && r.Type(r.fwd.Inputs[i]).DType.IsFloat() && r.frozen&SavesInput(i) == 0
}

// Each op's Saves is what its VJP reads, and its VJP builds well-typed
// nodes, on sample inputs of every differentiable op.
func TestSavesMatchVJP(t *testing.T) {
	f := func(s ...int) Type { return Type{Shape: s, DType: Float32, BatchAxis: -1} }
	i64 := func(s ...int) Type { return Type{Shape: s, DType: Int64, BatchAxis: -1} }
	type sample struct {
		in     []Type
		attrs  Attrs
		frozen Saved
	}
	x23 := []Type{f(2, 3)}
	samples := map[Op][]sample{
		OpNeg: {{in: x23}}, OpExp: {{in: x23}}, OpLog: {{in: x23}}, OpSqrt: {{in: x23}}, OpAbs: {{in: x23}},
		OpTanh: {{in: x23}}, OpSigmoid: {{in: x23}}, OpRelu: {{in: x23}}, OpGelu: {{in: x23}}, OpSign: {{in: x23}}, OpSilu: {{in: x23}},
		OpCausalMask: {{in: x23}}, OpDropout: {{in: x23, attrs: Attrs{Scalar: 0.5}}},
		OpAddScalar: {{in: x23}}, OpSubScalar: {{in: x23}}, OpRSubScalar: {{in: x23}}, OpMulScalar: {{in: x23}},
		OpDivScalar: {{in: x23}}, OpRDivScalar: {{in: x23}}, OpPowScalar: {{in: x23, attrs: Attrs{Scalar: 3}}},
		OpMaximumScalar: {{in: x23}}, OpCast: {{in: x23, attrs: Attrs{Target: Type{DType: BFloat16}}}},
		OpAdd: {{in: []Type{f(2, 3), f(2, 3)}}}, OpSub: {{in: []Type{f(2, 3), f(2, 3)}}},
		OpMul: {{in: []Type{f(2, 3), f(2, 3)}}}, OpDiv: {{in: []Type{f(2, 3), f(2, 3)}}},
		OpPow: {{in: []Type{f(2, 3), f(2, 3)}}}, OpMaximum: {{in: []Type{f(2, 3), f(2, 3)}}},
		OpMatMul: {{in: []Type{f(2, 3), f(3, 4)}}, {in: []Type{f(2, 2, 3), f(4, 3)}, attrs: Attrs{TransB: true}},
			{in: []Type{f(3, 2), f(3, 4)}, attrs: Attrs{TransA: true}}},
		OpLinear:  {{in: []Type{f(2, 3), f(4, 3), f(4)}}, {in: []Type{f(3), f(4, 3)}}, {in: []Type{f(2, 2, 3), f(4, 3)}}},
		OpSum:     {{in: x23, attrs: Attrs{Axes: []int{1}}}},
		OpMean:    {{in: x23, attrs: Attrs{Axes: []int{1}, KeepDim: true}}},
		OpMax:     {{in: x23, attrs: Attrs{Axes: []int{1}}}},
		OpSoftmax: {{in: x23, attrs: Attrs{Axis: 1}}}, OpLogSoftmax: {{in: x23, attrs: Attrs{Axis: -1}}},
		OpLayerNorm: {{in: []Type{f(2, 3), f(3), f(3)}, attrs: Attrs{NormDims: 1, Eps: 1e-5}}},
		OpBatchNorm: {{in: []Type{f(2, 3), f(3), f(3)}, attrs: Attrs{Training: true, Eps: 1e-5}},
			{in: []Type{f(2, 3, 2), f(3), f(3), f(3), f(3)}, attrs: Attrs{Eps: 1e-5}},
			{in: []Type{f(2, 3), f(3), f(3)}, attrs: Attrs{Training: true, PerChunk: true, Eps: 1e-5}}},
		OpBatchNormStats: {{in: []Type{f(2, 3, 2)}}},
		OpReshape:        {{in: x23, attrs: Attrs{Shape: []int{3, 2}}}},
		OpPermute:        {{in: x23, attrs: Attrs{Perm: []int{1, 0}}}},
		OpSlice:          {{in: x23, attrs: Attrs{Axis: 1, Start: 0, End: 2}}},
		OpConcat:         {{in: []Type{f(2, 3), f(2, 1)}, attrs: Attrs{Axis: 1}}},
		OpEmbedding:      {{in: []Type{i64(2), f(5, 3)}}},
		OpConv2d:         {{in: []Type{f(1, 2, 4, 4), f(3, 2, 3, 3), f(3)}}},
		OpMaxPool2d:      {{in: []Type{f(1, 2, 4, 4)}, attrs: Attrs{Kernel: [2]int{2, 2}}}},
		OpAvgPool2d:      {{in: []Type{f(1, 2, 4, 4)}, attrs: Attrs{Kernel: [2]int{2, 2}}}},
		OpCrossEntropy:   {{in: []Type{f(2, 3), i64(2)}}},
		OpMSE:            {{in: []Type{f(2, 3), f(2, 3)}}},
		OpLinearCrossEntropy: {{in: []Type{f(2, 3), f(5, 3), i64(2)}},
			{in: []Type{f(2, 3), f(5, 3), i64(2), f()}, attrs: Attrs{Reduction: ReduceSum, End: 4}}},
		OpAttention: {{in: []Type{f(2, 4, 3, 8), f(2, 2, 5, 8), f(2, 2, 5, 8)}, attrs: Attrs{Causal: true}},
			{in: []Type{f(2, 4, 3, 8), f(2, 4, 5, 8), f(2, 4, 5, 8), f(3, 5)}, frozen: SavesInput(3)}},
		OpAttentionQKV: {{in: []Type{f(2, 3, 24)}, attrs: Attrs{Groups: 2, Causal: true}},
			{in: []Type{f(2, 3, 32)}, attrs: Attrs{Groups: 4, KVHeads: 2}}},
		OpRMSNorm: {{in: []Type{f(2, 3), f(3)}, attrs: Attrs{NormDims: 1, Eps: 1e-6}},
			{in: []Type{f(2, 3, 4)}, attrs: Attrs{NormDims: 2, Eps: 1e-5}},
			{in: []Type{f(2, 3), f(3)}, attrs: Attrs{NormDims: 1, Eps: 1e-6, Target: Type{DType: BFloat16}}}},
		OpRotary: {{in: []Type{f(2, 3, 4, 8), f(3, 8)}, frozen: SavesInput(1)},
			{in: []Type{f(2, 3, 4, 8), f(3, 8)}, attrs: Attrs{End: 2}, frozen: SavesInput(1)}},
		OpSwiGLU: {{in: []Type{f(2, 3), f(2, 3)}}},
	}
	for i := 1; i < NumOps; i++ {
		op := Op(i)
		info := op.Info()
		if info.VJP == nil {
			continue
		}
		require.NotEmpty(t, samples[op], "%s has a VJP but no sample here to check it on", op)
		var reads Saved
		for _, s := range samples[op] {
			g := New()
			ids := make([]int, len(s.in))
			for k, typ := range s.in {
				id, err := g.Append(Node{Op: OpParam, Type: typ})
				require.NoError(t, err)
				ids[k] = id
			}
			y, err := g.Append(Node{Op: op, Inputs: ids, Attrs: s.attrs})
			require.NoError(t, err, "%s on %v", op, s.in)
			seed, err := g.Append(Node{Op: OpFill, Attrs: Attrs{Target: g.Node(y).Type}})
			require.NoError(t, err)
			r := &recorder{t: t, g: g, fwd: g.Node(y), frozen: s.frozen}
			info.VJP(r, r.fwd, seed)
			reads |= r.reads
		}
		assert.Equal(t, info.Saves, reads, "%s: Saves %08b, its VJP reads %08b", op, info.Saves, reads)
	}
}
