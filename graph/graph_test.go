package graph_test

import (
	"errors"
	"math"
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/graph"
)

// The op table is data; these checks keep every row well formed.
func TestOpTable(t *testing.T) {
	names := map[string]graph.Op{}
	for op := graph.Op(1); int(op) < graph.NumOps; op++ {
		info := op.Info()
		require.NotEmpty(t, info.Name, "op %d has no name", op)
		if prev, dup := names[info.Name]; dup {
			t.Errorf("ops %d and %d are both named %q", prev, op, info.Name)
		}
		names[info.Name] = op
		assert.Equal(t, info.Name, op.String())
		assert.NotContains(t, info.Category.String(), "Category(", "op %s", op)
		if info.Category.Leaf() {
			assert.Zero(t, info.MinArity, "leaf op %s", op)
			assert.NoError(t, op.CheckArity(0), "leaf op %s", op)
			continue
		}
		assert.Positive(t, info.MinArity, "op %s takes no inputs but is not a leaf", op)
		if info.Arity != graph.Variadic {
			assert.Equal(t, info.MinArity, info.Arity, "op %s: MinArity and Arity differ; optional inputs go in MaxArity", op)
			assert.True(t, info.MaxArity == 0 || info.MaxArity > info.Arity, "op %s: MaxArity %d", op, info.MaxArity)
		}
	}
	assert.Equal(t, "invalid", graph.OpInvalid.String())
	assert.Equal(t, "Op(65535)", graph.Op(65535).String())
}

func TestCheckArity(t *testing.T) {
	for _, c := range []struct {
		op     graph.Op
		ok, no []int
	}{
		{graph.OpRelu, []int{1}, []int{0, 2}},
		{graph.OpAdd, []int{2}, []int{1, 3}},
		{graph.OpLinear, []int{2, 3}, []int{1, 4}},
		{graph.OpLayerNorm, []int{1, 2, 3}, []int{0, 4}},
		{graph.OpBatchNorm, []int{1, 3, 5}, []int{0, 6}}, // the rule checks the count for the mode
		{graph.OpConv2d, []int{2, 3}, []int{1, 4}},
		{graph.OpConcat, []int{1, 2, 17}, []int{0}},
	} {
		for _, n := range c.ok {
			assert.NoError(t, c.op.CheckArity(n), "%s with %d inputs", c.op, n)
		}
		for _, n := range c.no {
			assert.ErrorIs(t, c.op.CheckArity(n), graph.ErrArity, "%s with %d inputs", c.op, n)
		}
	}
}

func TestDType(t *testing.T) {
	for _, c := range []struct {
		d     graph.DType
		size  int
		float bool
	}{
		{graph.Float32, 4, true}, {graph.Int64, 8, false}, {graph.Float16, 2, true}, {graph.BFloat16, 2, true},
		{graph.InvalidDType, 0, false}, {graph.DType(200), 0, false},
	} {
		assert.Equal(t, c.size, c.d.Size(), "%v", c.d)
		assert.Equal(t, c.float, c.d.IsFloat(), "%v", c.d)
	}
	for _, d := range []graph.DType{graph.Float32, graph.Int64, graph.Float16, graph.BFloat16} {
		got, err := graph.ParseDType(d.String())
		require.NoError(t, err)
		assert.Equal(t, d, got)
	}
	for _, name := range []string{"", "invalid", "float64", "DType(0)"} {
		_, err := graph.ParseDType(name)
		assert.ErrorIs(t, err, graph.ErrDType, "%q", name)
	}
}

func TestType(t *testing.T) {
	// [N·T, C] with N = 4, T = 2, C = 3, batch axis 0.
	ty := graph.Type{Shape: []int{8, 3}, DType: graph.Float32, BatchAxis: 0, PerSample: 2}
	assert.Equal(t, 24, ty.Numel())
	assert.Equal(t, int64(96), ty.Bytes())
	assert.True(t, ty.Batched())
	assert.Equal(t, []int{6, 3}, ty.AtBatch(3)) // 3 samples · 2 rows
	assert.Equal(t, []int{8, 3}, ty.Shape, "AtBatch must not modify the type")

	u := graph.Type{Shape: []int{5}, DType: graph.Int64, BatchAxis: -1, PerSample: 1}
	assert.Equal(t, []int{5}, u.AtBatch(3))
	assert.False(t, u.Batched())

	assert.Equal(t, 1, graph.Numel([]int{}))
	assert.Equal(t, 1, graph.Numel(nil))
	assert.Equal(t, 0, graph.Numel([]int{3, 0, 2}))
	assert.Equal(t, "[]", graph.FormatShape([]int{}))
	assert.Equal(t, "[2 3]", graph.FormatShape([]int{2, 3}))
}

func TestGraphAppend(t *testing.T) {
	g := graph.New()
	f := graph.Type{Shape: []int{2}, DType: graph.Float32, BatchAxis: -1, PerSample: 1}
	a, err := g.Append(graph.Node{Op: graph.OpParam, Type: f})
	require.NoError(t, err)
	g.PushScope("layers")
	g.PushScope("0")
	b, err := g.Append(graph.Node{Op: graph.OpRelu, Inputs: []int{a}, Type: f})
	require.NoError(t, err)
	g.PopScope()
	g.PopScope()
	g.PopScope() // one too many is harmless
	assert.Equal(t, []int{0, 1}, []int{a, b})
	assert.Equal(t, "layers.0", g.Node(b).Scope)
	assert.Equal(t, "", g.Node(a).Scope)
	assert.Equal(t, 2, g.Len())
	assert.Len(t, g.Nodes(), 2)

	for _, n := range []graph.Node{
		{Op: graph.OpRelu, Inputs: []int{2}},     // not an earlier node
		{Op: graph.OpRelu, Inputs: []int{-1}},    // not a node
		{Op: graph.OpRelu, Inputs: []int{0, 1}},  // wrong arity
		{Op: graph.OpAdd, Inputs: []int{0}},      // wrong arity
		{Op: graph.OpConcat, Inputs: []int(nil)}, // no inputs
	} {
		_, err := g.Append(n)
		assert.ErrorIs(t, err, graph.ErrArity, "%s %v", n.Op, n.Inputs)
	}
	assert.Equal(t, 2, g.Len())
	// A rejected node leaves nothing behind: the next one takes its id.
	g.PushScope("head")
	c, err := g.Append(graph.Node{Op: graph.OpRelu, Inputs: []int{b}})
	require.NoError(t, err)
	assert.Equal(t, 2, c)
	assert.Equal(t, "head", g.Node(c).Scope)
	assert.Equal(t, f, g.Node(c).Type)
	assert.Len(t, g.Nodes(), 3)
}

func TestSetBatch(t *testing.T) {
	g := graph.New()
	assert.Zero(t, g.Batch())
	require.NoError(t, g.SetBatch(16))
	require.NoError(t, g.SetBatch(16))
	assert.ErrorIs(t, g.SetBatch(8), graph.ErrShape)
	assert.Equal(t, 16, g.Batch())
}

func TestOpError(t *testing.T) {
	err := error(&graph.OpError{Op: "matmul", Shapes: [][]int{{2, 3}, {4, 5}}, Site: "model.go:12",
		Err: graph.Errorf(graph.ErrShape, "inner dimensions differ")})
	var oe *graph.OpError
	require.True(t, errors.As(err, &oe))
	assert.Equal(t, "matmul", oe.Op)
	assert.True(t, errors.Is(err, graph.ErrShape))
	assert.False(t, errors.Is(err, graph.ErrDType))
	assert.NotEmpty(t, err.Error())
}

// batch_norm's mode changes the graph's meaning (and its chunkability), so
// it must change the signature that plans are cached under.
func TestSignatureSeesTraining(t *testing.T) {
	typ := graph.Type{Shape: []int{4, 3}, DType: graph.Float32, BatchAxis: 0, PerSample: 1}
	build := func(training bool) *graph.Graph {
		g := graph.New()
		x, err := g.Append(graph.Node{Op: graph.OpInput, Type: typ})
		require.NoError(t, err)
		// Three inputs of one type in both modes (weight and bias, or the
		// running statistics), so only the mode tells the graphs apart.
		c := graph.Type{Shape: []int{3}, DType: graph.Float32, BatchAxis: -1}
		p, err := g.Append(graph.Node{Op: graph.OpParam, Type: c})
		require.NoError(t, err)
		q, err := g.Append(graph.Node{Op: graph.OpParam, Type: c})
		require.NoError(t, err)
		_, err = g.Append(graph.Node{Op: graph.OpBatchNorm, Inputs: []int{x, p, q}, Attrs: graph.Attrs{Training: training, Eps: 1e-5}, Type: typ})
		require.NoError(t, err)
		return g
	}
	assert.Equal(t, build(true).Signature(), build(true).Signature())
	assert.NotEqual(t, build(true).Signature(), build(false).Signature())
}

// Signature streams words through its hash: graphs that differ in one
// field anywhere (an attribute, a name, a shape, the wiring) differ, and
// the data (Value) is not part of it.
func TestSignatureSeesEachField(t *testing.T) {
	typ := graph.Type{Shape: []int{2, 3, 8, 8}, DType: graph.Float32, BatchAxis: 0, PerSample: 3 * 8 * 8}
	build := func(name string, kernel, pad int, perm []int, val tensor.Tensor) *graph.Graph {
		g := graph.New()
		x, err := g.Append(graph.Node{Op: graph.OpInput, Type: typ})
		require.NoError(t, err)
		w, err := g.Append(graph.Node{Op: graph.OpParam, Name: name, Value: val,
			Type: graph.Type{Shape: []int{4, 3, kernel, kernel}, DType: graph.Float32, BatchAxis: -1}})
		require.NoError(t, err)
		y, err := g.Append(graph.Node{Op: graph.OpConv2d, Inputs: []int{x, w},
			Attrs: graph.Attrs{Stride: [2]int{1, 1}, Padding: [2]int{pad, pad}, Dilation: [2]int{1, 1}, Groups: 1}})
		require.NoError(t, err)
		_, err = g.Append(graph.Node{Op: graph.OpPermute, Inputs: []int{y}, Attrs: graph.Attrs{Perm: perm}})
		require.NoError(t, err)
		return g
	}
	base := build("w", 3, 1, []int{0, 2, 3, 1}, nil)
	data := tensor.New(tensor.WithShape(4, 3, 3, 3), tensor.Of(tensor.Float32))
	assert.Equal(t, base.Signature(), build("w", 3, 1, []int{0, 2, 3, 1}, data).Signature(), "data is not part of it")
	seen := map[uint64]string{base.Signature(): "base"}
	for what, g := range map[string]*graph.Graph{
		"name":    build("v", 3, 1, []int{0, 2, 3, 1}, nil),
		"kernel":  build("w", 1, 0, []int{0, 2, 3, 1}, nil),
		"padding": build("w", 3, 0, []int{0, 2, 3, 1}, nil),
		"perm":    build("w", 3, 1, []int{0, 3, 2, 1}, nil),
	} {
		sig := g.Signature()
		_, dup := seen[sig]
		assert.False(t, dup, "%s: same signature as %s", what, seen[sig])
		seen[sig] = what
	}
}

func TestBatchNormAffine(t *testing.T) {
	assert.Equal(t, 1, graph.BatchNormAffine(true))  // x, weight, bias
	assert.Equal(t, 3, graph.BatchNormAffine(false)) // x, running_mean, running_var, weight, bias
}

// SameSignature compares exactly what Signature hashes: every field of a
// node, its type and its attributes changes both, except those Signature
// leaves out on purpose (the data, the random seeds, where and in which
// module the node was made). A field added to Node, Type or Attrs fails
// here until it is in both or listed as left out.
func TestSameSignatureSeesWhatSignatureHashes(t *testing.T) {
	leftOut := map[string]bool{"Node.ID": true, "Node.Scope": true, "Node.Site": true, "Node.Value": true,
		"Attrs.Seed": true, "Attrs.Counter": true}
	typ := graph.Type{Shape: []int{2, 3, 8, 8}, DType: graph.Float32, BatchAxis: 0, PerSample: 3 * 8 * 8}
	base := graph.New()
	x, err := base.Append(graph.Node{Op: graph.OpInput, Type: typ})
	require.NoError(t, err)
	w, err := base.Append(graph.Node{Op: graph.OpParam, Name: "w", Type: graph.Type{Shape: []int{4, 3, 3, 3}, DType: graph.Float32, BatchAxis: -1}})
	require.NoError(t, err)
	_, err = base.Append(graph.Node{Op: graph.OpConv2d, Inputs: []int{x, w},
		Attrs: graph.Attrs{Stride: [2]int{1, 1}, Padding: [2]int{1, 1}, Dilation: [2]int{1, 1}, Groups: 1}})
	require.NoError(t, err)
	require.True(t, base.SameSignature(base.Clone()))

	// change sets v to another value of its type; slices get new backing
	// arrays, since clones share them.
	var change func(v reflect.Value)
	change = func(v reflect.Value) {
		switch v.Kind() {
		case reflect.Int, reflect.Int64, reflect.Int32, reflect.Int16, reflect.Int8:
			v.SetInt(v.Int() + 1)
		case reflect.Uint, reflect.Uint64, reflect.Uint32, reflect.Uint16, reflect.Uint8:
			v.SetUint(v.Uint() + 1)
		case reflect.Bool:
			v.SetBool(!v.Bool())
		case reflect.Float64:
			v.SetFloat(v.Float() + 1.5)
		case reflect.String:
			v.SetString(v.String() + "x")
		case reflect.Slice:
			n := reflect.AppendSlice(reflect.MakeSlice(v.Type(), 0, v.Len()+1), v)
			v.Set(reflect.Append(n, reflect.ValueOf(0).Convert(v.Type().Elem())))
		case reflect.Array:
			change(v.Index(0))
		case reflect.Interface:
			v.Set(reflect.ValueOf(tensor.New(tensor.WithShape(1), tensor.Of(tensor.Float32))))
		case reflect.Pointer: // Attrs.Pointwise
			p, err := graph.NewPointwise([]graph.PWNode{{Op: graph.PWInput}, {Op: graph.PWNeg}}, []graph.PWOut{{Node: 1, DType: graph.Float32}})
			require.NoError(t, err)
			v.Set(reflect.ValueOf(p))
		default:
			t.Fatalf("no change for kind %s", v.Kind())
		}
	}
	var fields func(prefix string, typ reflect.Type, path []int)
	checked := 0
	fields = func(prefix string, rt reflect.Type, path []int) {
		for i := range rt.NumField() {
			f := rt.Field(i)
			name := prefix + "." + f.Name
			p := append(slices.Clone(path), i)
			if f.Type.Kind() == reflect.Struct {
				fields(f.Type.Name(), f.Type, p)
				continue
			}
			name = strings.TrimPrefix(name, ".")
			g := base.Clone()
			v := reflect.ValueOf(g.Node(2)).Elem().FieldByIndex(p)
			change(v)
			checked++
			if leftOut[name] {
				assert.True(t, base.SameSignature(g), name)
				assert.Equal(t, base.Signature(), g.Signature(), name)
			} else {
				assert.False(t, base.SameSignature(g), name)
				assert.NotEqual(t, base.Signature(), g.Signature(), name)
			}
		}
	}
	fields("Node", reflect.TypeFor[graph.Node](), nil)
	assert.Greater(t, checked, 30)
	// −0 and +0 differ in both; a NaN equals itself in both.
	for _, pair := range [][2]float64{{0, math.Copysign(0, -1)}, {math.NaN(), math.NaN()}} {
		a, b := base.Clone(), base.Clone()
		a.Node(2).Attrs.Scalar, b.Node(2).Attrs.Scalar = pair[0], pair[1]
		assert.Equal(t, a.Signature() == b.Signature(), a.SameSignature(b), "%v", pair)
	}
	// The node count.
	longer := base.Clone()
	_, err = longer.Append(graph.Node{Op: graph.OpRelu, Inputs: []int{2}})
	require.NoError(t, err)
	assert.False(t, base.SameSignature(longer))
	assert.False(t, longer.SameSignature(base))
}
