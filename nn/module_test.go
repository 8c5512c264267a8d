package nn_test

import (
	"fmt"
	"math"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/internal/testutil"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/nn"
)

// block is a module written outside package nn: a residual MLP block.
type block struct{ nn.Children }

func newBlock(opt nn.Options, d int) *block {
	return &block{nn.NewChildren(
		nn.Child{Name: "ln", Module: nn.NewLayerNorm(opt, []int{d}, 1e-5)},
		nn.Child{Name: "fc", Module: nn.NewLinear(opt, d, d, true)},
	)}
}

func (b *block) Forward(x *lazy.Tensor) *lazy.Tensor { return x.Add(b.Call("fc", b.Call("ln", x))) }

// model is embed → layers (4 blocks) → head, as in a small transformer.
func model(opt nn.Options) *nn.Sequential {
	blocks := make([]nn.Module, 4)
	for i := range blocks {
		blocks[i] = newBlock(opt, 8)
	}
	return nn.NewSequentialNamed(
		nn.Child{Name: "embed", Module: nn.NewEmbedding(opt, 50, 8)},
		nn.Child{Name: "layers", Module: nn.NewSequential(blocks...)},
		nn.Child{Name: "head", Module: nn.NewLinear(opt, 8, 50, false)},
	)
}

func TestMLPParamNames(t *testing.T) {
	m := nn.MLP(nn.Seed(1), []int{784, 512, 512, 10}, nn.ReLU{})
	require.NoError(t, nn.Check(m))
	want := []string{"0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"}
	assert.Equal(t, want, testutil.ParamNames(m))
	assert.Equal(t, want, testutil.ParamNames(m), "a second call lists the same names")
	for _, p := range m.Params() {
		assert.Equal(t, p.Name(), p.Tensor().Name(), "the lazy leaf carries the full name")
	}
	assert.Equal(t, 784*512+512+512*512+512+512*10+10, nn.NumParams(m))
	shapes := [][]int{{512, 784}, {512}, {512, 512}, {512}, {10, 512}, {10}}
	for i, p := range m.Params() {
		assert.Equal(t, shapes[i], p.Shape(), p.Name())
	}
}

func TestNestedParamNames(t *testing.T) {
	m := model(nn.Seed(1))
	require.NoError(t, nn.Check(m))
	want := []string{"embed.weight"}
	for i := range 4 {
		for _, s := range []string{"ln.weight", "ln.bias", "fc.weight", "fc.bias"} {
			want = append(want, fmt.Sprintf("layers.%d.%s", i, s))
		}
	}
	want = append(want, "head.weight")
	assert.Equal(t, want, testutil.ParamNames(m))
	assert.Equal(t, testutil.ParamNames(m), testutil.ParamNames(model(nn.Seed(2))), "names do not depend on the seed")

	layers, ok := m.Get("layers").(*nn.Sequential)
	require.True(t, ok)
	assert.Equal(t, "layers.3.fc.bias", layers.Get("3").Params()[3].Name())
	assert.Len(t, layers.List(), 4)
}

func TestSharedParamListedOnce(t *testing.T) {
	opt := nn.Seed(3)
	emb := nn.NewEmbedding(opt, 10, 4)
	head := &nn.Linear{Weight: emb.Weight} // weight tying
	m := nn.NewSequentialNamed(nn.Child{Name: "embed", Module: emb}, nn.Child{Name: "head", Module: head})
	assert.Equal(t, []string{"embed.weight"}, testutil.ParamNames(m))

	// Past 16 parameters the list is deduplicated through a map: a tied
	// weight after them is listed once too, in first-seen order.
	mods := []nn.Module{emb}
	for range 10 {
		mods = append(mods, nn.NewLinear(opt, 4, 4, true))
	}
	mods = append(mods, head)
	long := nn.NewSequential(mods...)
	ps := long.Params()
	require.Len(t, ps, 21)
	assert.Same(t, emb.Weight, ps[0])
	for i, p := range ps {
		for _, q := range ps[:i] {
			assert.NotSame(t, q, p, "parameter %d listed twice", i)
		}
	}
}

func bits(ps []*nn.Param) [][]uint32 {
	var out [][]uint32
	for _, p := range ps {
		data := p.Value().Data().([]float32)
		b := make([]uint32, len(data))
		for i, v := range data {
			b[i] = math.Float32bits(v)
		}
		out = append(out, b)
	}
	return out
}

func TestSeededInitReproducible(t *testing.T) {
	a := nn.MLP(nn.Seed(42), []int{20, 16, 3}, nn.ReLU{})
	b := nn.MLP(nn.Seed(42), []int{20, 16, 3}, nn.ReLU{})
	c := nn.MLP(nn.Seed(43), []int{20, 16, 3}, nn.ReLU{})
	assert.Equal(t, bits(a.Params()), bits(b.Params()), "same seed, bit-identical parameters")
	assert.NotEqual(t, bits(a.Params()), bits(c.Params()), "another seed, other parameters")

	r := rand.New(rand.NewPCG(5, 6))
	d := nn.MLP(nn.Options{Rand: r}, []int{20, 16, 3}, nn.ReLU{})
	e := nn.MLP(nn.Options{Rand: rand.New(rand.NewPCG(5, 6))}, []int{20, 16, 3}, nn.ReLU{})
	assert.Equal(t, bits(d.Params()), bits(e.Params()), "same *rand.Rand state, same parameters")
}

// checkUniform checks that data lies in [−bound, bound], is not constant,
// and fills the range: with n ≥ 1000 draws the extremes come within 5 % of
// the bound except with probability below 1e-20.
func checkUniform(t *testing.T, name string, data []float32, bound float64) {
	t.Helper()
	require.GreaterOrEqual(t, len(data), 1000, name)
	lo, hi := math.Inf(1), math.Inf(-1)
	for _, v := range data {
		lo, hi = math.Min(lo, float64(v)), math.Max(hi, float64(v))
	}
	assert.GreaterOrEqual(t, lo, -bound, name)
	assert.LessOrEqual(t, hi, bound, name)
	assert.Less(t, lo, -0.95*bound, name)
	assert.Greater(t, hi, 0.95*bound, name)
}

func TestInitBounds(t *testing.T) {
	opt := nn.Seed(7)
	l := nn.NewLinear(opt, 784, 512, true)
	checkUniform(t, "linear weight", l.Weight.Value().Data().([]float32), 1/math.Sqrt(784))
	c := nn.NewConv2d(opt, 1024, 2000, [2]int{3, 3}, true, lazy.ConvOptions{Groups: 4})
	assert.Equal(t, []int{2000, 256, 3, 3}, c.Weight.Shape())
	checkUniform(t, "conv bias", c.Bias.Value().Data().([]float32), 1/math.Sqrt(256*9))
	checkUniform(t, "conv weight", c.Weight.Value().Data().([]float32), 1/math.Sqrt(256*9))

	// Embedding: N(0, 1). With n = 40000 draws the sample mean's standard
	// error is 0.005 and the sample std's about 0.0035; tolerance 0.03.
	emb := nn.NewEmbedding(opt, 1000, 40)
	var sum, sq float64
	data := emb.Weight.Value().Data().([]float32)
	for _, v := range data {
		sum += float64(v)
		sq += float64(v) * float64(v)
	}
	n := float64(len(data))
	mean := sum / n
	assert.InDelta(t, 0, mean, 0.03)
	assert.InDelta(t, 1, math.Sqrt(sq/n-mean*mean), 0.03)

	ln := nn.NewLayerNorm(opt, []int{3, 4}, 1e-5)
	for i, v := range ln.Weight.Value().Data().([]float32) {
		require.Equal(t, float32(1), v, "weight[%d]", i)
	}
	for i, v := range ln.Bias.Value().Data().([]float32) {
		require.Equal(t, float32(0), v, "bias[%d]", i)
	}
}

func TestMLPShapes(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	data := make([]float32, 32*784)
	for i := range data {
		data[i] = float32(r.NormFloat64())
	}
	x := lazy.Wrap(tensor.New(tensor.WithShape(32, 784), tensor.WithBacking(data)), 0)
	m := nn.MLP(nn.Seed(1), []int{784, 512, 512, 10}, nn.ReLU{})
	y := m.Forward(x)
	require.NoError(t, y.Err())
	assert.Equal(t, []int{32, 10}, y.Shape())
	assert.Equal(t, 0, y.BatchAxis())
	assert.Equal(t, graph.Float32, y.DType())

	var ops []graph.Op
	for _, nd := range y.Graph().IR().Nodes() {
		if nd.Op != graph.OpParam {
			ops = append(ops, nd.Op)
		}
	}
	assert.Equal(t, []graph.Op{graph.OpInput, graph.OpLinear, graph.OpRelu, graph.OpLinear, graph.OpRelu, graph.OpLinear}, ops)
}

func TestModulePathOnNodes(t *testing.T) {
	m := model(nn.Seed(1))
	idx := lazy.Placeholder([]int{4, 7}, graph.Int64, 0)
	y := m.Forward(idx)
	require.NoError(t, y.Err())
	assert.Equal(t, []int{4, 7, 50}, y.Shape())

	ir := y.Graph().IR()
	assert.Equal(t, "", ir.Scope(), "every scope pushed was popped")
	byName := map[string]graph.Node{}
	scopesOf := map[graph.Op][]string{}
	for _, nd := range ir.Nodes() {
		if nd.Name != "" {
			byName[nd.Name] = nd
		}
		scopesOf[nd.Op] = append(scopesOf[nd.Op], nd.Scope)
	}
	assert.Equal(t, []string{""}, scopesOf[graph.OpInput])
	assert.Equal(t, []string{"embed"}, scopesOf[graph.OpEmbedding])
	assert.Equal(t, []string{"layers.0.ln", "layers.1.ln", "layers.2.ln", "layers.3.ln"}, scopesOf[graph.OpLayerNorm])
	assert.Equal(t, []string{"layers.0.fc", "layers.1.fc", "layers.2.fc", "layers.3.fc", "head"}, scopesOf[graph.OpLinear])
	assert.Equal(t, []string{"layers.0", "layers.1", "layers.2", "layers.3"}, scopesOf[graph.OpAdd],
		"a custom module's own ops carry its path")

	for _, name := range testutil.ParamNames(m) {
		nd, ok := byName[name]
		require.True(t, ok, "parameter %s is a node", name)
		assert.Equal(t, graph.OpParam, nd.Op)
		assert.Equal(t, name[:strings.LastIndex(name, ".")], nd.Scope,
			"parameter %s is adopted in its module's scope", name)
	}
}

func TestShapeOnlyAllocatesNothing(t *testing.T) {
	// 100k × 100k float32 weights would take 40 GB each if allocated.
	opt := nn.Options{ShapeOnly: true}
	m := nn.MLP(opt, []int{100_000, 100_000, 100_000, 10}, nn.GELU{})
	require.NoError(t, nn.Check(m))
	for _, p := range m.Params() {
		assert.Nil(t, p.Value(), p.Name())
		assert.Equal(t, p.Name(), p.Tensor().Name())
	}
	assert.Equal(t, []int{100_000, 100_000}, m.Params()[2].Shape())

	x := lazy.Placeholder([]int{64, 100_000}, graph.Float32, 0)
	y := m.Forward(x)
	require.NoError(t, y.Err())
	assert.Equal(t, []int{64, 10}, y.Shape())
	for _, nd := range y.Graph().IR().Nodes() {
		assert.Nil(t, nd.Value, "node %d (%s)", nd.ID, nd.Op)
	}

	ln := nn.NewLayerNorm(opt, []int{8}, 1e-5)
	assert.Nil(t, ln.Weight.Value())
	assert.Equal(t, []int{8}, ln.Weight.Shape())
}

func TestShapeOnlyHalfPrecision(t *testing.T) {
	for _, dt := range []graph.DType{graph.Float16, graph.BFloat16} {
		m := nn.MLP(nn.Options{ShapeOnly: true, DType: dt}, []int{6, 5, 3}, nn.ReLU{})
		require.NoError(t, nn.Check(m))
		for _, p := range m.Params() {
			assert.Equal(t, dt, p.Tensor().DType(), p.Name())
		}
		x := lazy.Placeholder([]int{4, 6}, dt, 0)
		loss := m.Forward(x).CrossEntropy(x.Graph().Placeholder([]int{4}, graph.Int64, 0), graph.ReduceMean)
		require.NoError(t, loss.Err())
		for _, gr := range lazy.Grad(loss, nn.ParamTensors(m)...) {
			require.NoError(t, gr.Err())
			assert.Equal(t, dt, gr.DType(), "gradients take the parameters' dtype")
		}
		assert.Equal(t, int64(5*6*2), m.Params()[0].Tensor().Type().Bytes(), "two bytes an element")
	}
}

func TestConvPoolStackShapes(t *testing.T) {
	for _, opt := range []nn.Options{nn.Seed(1), {ShapeOnly: true}} {
		m := nn.NewSequential(
			nn.NewConv2d(opt, 3, 16, [2]int{3, 3}, true, lazy.ConvOptions{Padding: [2]int{1, 1}}), // 32×32
			nn.ReLU{},
			nn.MaxPool2d{Kernel: [2]int{2, 2}}, // 16×16
			nn.NewConv2d(opt, 16, 32, [2]int{5, 5}, false, lazy.ConvOptions{Stride: [2]int{2, 2}, Padding: [2]int{2, 2}}), // 8×8
			nn.GELU{Approx: true},
			nn.NewConv2d(opt, 32, 64, [2]int{3, 3}, true, lazy.ConvOptions{Groups: 8, Dilation: [2]int{2, 2}}), // 8−4 = 4×4
			nn.AvgPool2d{Kernel: [2]int{2, 2}}, // 2×2
			nn.Flatten{},                       // 64·2·2 = 256
			nn.NewDropout(0.1),
			nn.NewLinear(opt, 256, 10, true),
		)
		require.NoError(t, nn.Check(m))
		assert.Equal(t, []string{"0.weight", "0.bias", "3.weight", "5.weight", "5.bias", "9.weight", "9.bias"}, testutil.ParamNames(m))
		assert.Equal(t, []int{64, 4, 3, 3}, m.Params()[3].Shape())

		x := lazy.Placeholder([]int{8, 3, 32, 32}, graph.Float32, 0)
		want := map[string][]int{"0": {8, 16, 32, 32}, "2": {8, 16, 16, 16}, "3": {8, 32, 8, 8},
			"5": {8, 64, 4, 4}, "6": {8, 64, 2, 2}, "7": {8, 256}, "9": {8, 10}}
		y := m.Forward(x)
		require.NoError(t, y.Err())
		assert.Equal(t, []int{8, 10}, y.Shape())
		assert.Equal(t, 0, y.BatchAxis())
		for _, nd := range y.Graph().IR().Nodes() {
			if w, ok := want[nd.Scope]; ok && nd.Op != graph.OpParam {
				assert.Equal(t, w, nd.Type.Shape, "%s in %s", nd.Op, nd.Scope)
				assert.Equal(t, 0, nd.Type.BatchAxis, "%s in %s", nd.Op, nd.Scope)
			}
			if nd.Op == graph.OpGelu {
				assert.True(t, nd.Attrs.Approx)
			}
		}
	}
}

func TestLayerNormEmbeddingForward(t *testing.T) {
	opt := nn.Seed(9)
	m := nn.NewSequential(nn.NewEmbedding(opt, 100, 16), nn.NewLayerNorm(opt, []int{16}, 1e-5), nn.GELU{})
	y := m.Forward(lazy.Placeholder([]int{2, 5}, graph.Int64, 0))
	require.NoError(t, y.Err())
	assert.Equal(t, []int{2, 5, 16}, y.Shape())
	var lnNode *graph.Node
	for _, nd := range y.Graph().IR().Nodes() {
		if nd.Op == graph.OpLayerNorm {
			lnNode = &nd
		}
		if nd.Op == graph.OpGelu {
			assert.False(t, nd.Attrs.Approx)
		}
	}
	require.NotNil(t, lnNode)
	assert.Equal(t, 1, lnNode.Attrs.NormDims)
	assert.Equal(t, 1e-5, lnNode.Attrs.Eps)
	assert.Len(t, lnNode.Inputs, 3)
}

func TestDropoutEvalIsIdentity(t *testing.T) {
	d := nn.NewDropout(0.5)
	require.NoError(t, nn.Check(d))
	x := lazy.Placeholder([]int{4, 3}, graph.Float32, 0)
	assert.Same(t, x, d.Forward(x))
	assert.Equal(t, 1, x.Graph().IR().Len(), "no node added")
}
