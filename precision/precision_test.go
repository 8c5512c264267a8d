package precision_test

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/compile"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/models"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/precision"
)

// model is a built forward graph: its loss and parameters.
type model struct {
	loss   *lazy.Tensor
	params []*lazy.Tensor
}

func mlp(t *testing.T, opt nn.Options) model {
	m := nn.NewSequential(nn.NewLinear(opt, 6, 8, true), nn.ReLU{}, nn.NewLinear(opt, 8, 8, true), nn.GELU{}, nn.NewLinear(opt, 8, 3, true))
	x := lazy.Placeholder([]int{4, 6}, graph.Float32, 0)
	y := x.Graph().Placeholder([]int{4}, graph.Int64, 0)
	loss := m.Forward(x).CrossEntropy(y, graph.ReduceMean)
	require.NoError(t, loss.Err())
	return model{loss, nn.ParamTensors(m)}
}

func gpt(t *testing.T, opt nn.Options) model { return gptOf(t, opt, false) }

// gptOf is the small GPT with fused attention, or written out.
func gptOf(t *testing.T, opt nn.Options, writtenOut bool) model {
	m := models.NewGPT(opt, models.GPTConfig{Vocab: 16, Context: 8, Layers: 2, Heads: 2, Dim: 8, WrittenOutAttention: writtenOut})
	tok := lazy.Placeholder([]int{2, 8}, graph.Int64, 0)
	tgt := tok.Graph().Placeholder([]int{2, 8}, graph.Int64, 0)
	loss := models.Loss(m.Forward(tok), tgt)
	require.NoError(t, loss.Err())
	return model{loss, nn.ParamTensors(m)}
}

func convnet(t *testing.T, opt nn.Options) model {
	m := models.NewConvNet(opt, models.ConvNetConfig{Channels: 3, Size: 8, Widths: []int{4, 8}, Classes: 5})
	x := lazy.Placeholder([]int{2, 3, 8, 8}, graph.Float32, 0)
	y := x.Graph().Placeholder([]int{2}, graph.Int64, 0)
	loss := m.Forward(x).CrossEntropy(y, graph.ReduceMean)
	require.NoError(t, loss.Err())
	return model{loss, nn.ParamTensors(m)}
}

func train(t *testing.T, m model, p precision.Policy) *precision.Step {
	t.Helper()
	wrt, err := lazy.ParamIDs(m.loss, m.params...)
	require.NoError(t, err)
	s, err := trainStep(m.loss.Graph().IR(), m.loss.ID(), wrt, compile.Options{Policy: p})
	require.NoError(t, err)
	return s
}

// checkAutocast checks the dtypes autocast gives, on the forward part of
// a bf16-mixed or fp16-mixed step, and the cast cache.
func checkAutocast(t *testing.T, s *precision.Step, half graph.DType) (casts map[graph.Op]int) {
	t.Helper()
	g := s.Graph
	dt := func(id int) graph.DType { return g.Node(id).Type.DType }
	casts = map[graph.Op]int{}
	paramCasts := map[[2]int]int{}
	for i := range s.Loss + 1 {
		nd := g.Node(i)
		switch nd.Op {
		case graph.OpMatMul, graph.OpLinear, graph.OpConv2d:
			if nd.Op == graph.OpMatMul && nd.Attrs.Target.DType == graph.Float32 { // a folded widening cast
				assert.Equal(t, graph.Float32, nd.Type.DType, "node %d (%s) output", i, nd.Op)
			} else {
				assert.Equal(t, half, nd.Type.DType, "node %d (%s) output", i, nd.Op)
			}
			for _, in := range nd.Inputs {
				assert.Equal(t, half, dt(in), "node %d (%s) input %d", i, nd.Op, in)
			}
		case graph.OpCrossEntropy: // reads the 16-bit logits as they are, returns a float32 loss
			assert.Equal(t, graph.Float32, nd.Type.DType, "node %d (%s) output", i, nd.Op)
			assert.Equal(t, half, dt(nd.Inputs[0]), "node %d (%s) logits: no float32 copy", i, nd.Op)
			assert.NotEqual(t, graph.OpCast, g.Node(nd.Inputs[0]).Op, "node %d (%s) logits", i, nd.Op)
		case graph.OpBatchNorm: // x as it is, float32 weight and statistics, x's dtype out
			assert.Equal(t, dt(nd.Inputs[0]), nd.Type.DType, "node %d (%s) output", i, nd.Op)
			for _, in := range nd.Inputs[1:] {
				assert.Equal(t, graph.Float32, dt(in), "node %d (%s) input %d", i, nd.Op, in)
			}
		case graph.OpSoftmax, graph.OpLogSoftmax, graph.OpLayerNorm, graph.OpMSE, graph.OpSum, graph.OpMean:
			if nd.Op == graph.OpLayerNorm && nd.Attrs.Target.DType == half { // read by 16-bit GEMMs only
				assert.Equal(t, half, nd.Type.DType, "node %d (%s) output", i, nd.Op)
			} else {
				assert.Equal(t, graph.Float32, nd.Type.DType, "node %d (%s) output", i, nd.Op)
			}
			for _, in := range nd.Inputs {
				if dt(in) != graph.Int64 {
					assert.Equal(t, graph.Float32, dt(in), "node %d (%s) input %d", i, nd.Op, in)
				}
			}
		case graph.OpCast:
			in := g.Node(nd.Inputs[0])
			if in.Op == graph.OpParam {
				paramCasts[[2]int{in.ID, int(nd.Type.DType)}]++
			}
			for j := i + 1; j <= s.Loss; j++ {
				for _, in := range g.Node(j).Inputs {
					if in == i {
						casts[g.Node(j).Op]++
					}
				}
			}
		case graph.OpParam:
			assert.Equal(t, graph.Float32, nd.Type.DType, "parameter %q", nd.Name)
		}
	}
	for k, n := range paramCasts {
		assert.Equal(t, 1, n, "parameter node %d is cast to %s %d times in one step: the cast cache keeps one copy", k[0], graph.DType(k[1]), n)
	}
	assert.NotEmpty(t, paramCasts, "no parameter was cast")
	assert.Equal(t, graph.Float32, dt(s.Loss), "loss")
	for i, gr := range s.Grads {
		assert.Equal(t, graph.Float32, dt(gr), "gradient of parameter %d stays float32", i)
	}
	return casts
}

func TestAutocastMLP(t *testing.T) {
	for _, p := range []precision.Policy{precision.BF16Mixed, precision.FP16Mixed} {
		s := train(t, mlp(t, nn.Options{ShapeOnly: true}), p)
		checkAutocast(t, s, p.Half())
		// relu and gelu run in the 16-bit dtype of the linear before them.
		for _, nd := range s.Graph.Nodes()[:s.Loss] {
			if nd.Op == graph.OpRelu || nd.Op == graph.OpGelu {
				assert.Equal(t, p.Half(), nd.Type.DType, "%s", nd.Op)
			}
		}
	}
}

func TestAutocastGPT(t *testing.T) {
	for _, writtenOut := range []bool{false, true} {
		t.Run(map[bool]string{false: "fused attention", true: "attention written out"}[writtenOut], func(t *testing.T) {
			autocastGPT(t, writtenOut)
		})
	}
}

func autocastGPT(t *testing.T, writtenOut bool) {
	s := train(t, gptOf(t, nn.Options{ShapeOnly: true}, writtenOut), precision.BF16Mixed)
	casts := checkAutocast(t, s, graph.BFloat16)
	g := s.Graph
	attention := 0
	for _, nd := range g.Nodes()[:s.Loss] {
		switch nd.Op {
		case graph.OpEmbedding: // autocast leaves embedding alone: float32
			assert.Equal(t, graph.Float32, nd.Type.DType, "embedding")
		case graph.OpCausalMask, graph.OpGelu: // on the bf16 scores / projection
			assert.Equal(t, graph.BFloat16, nd.Type.DType, "%s", nd.Op)
		case graph.OpAttention, graph.OpAttentionQKV: // GEMM class: bf16 q, k, v (from the bf16 projection)
			assert.Equal(t, graph.BFloat16, nd.Type.DType, "%s", nd.Op)
			attention++
		case graph.OpAdd: // residual: float32 stream + bf16 branch promotes
			assert.Equal(t, graph.Float32, nd.Type.DType, "add at %s", nd.Scope)
		}
	}
	// Casts feed GEMMs (to bf16) and the float32 class (back to float32:
	// the written-out softmax's bf16 scores), never cross_entropy.
	assert.Positive(t, casts[graph.OpLinear]+casts[graph.OpMatMul])
	if writtenOut {
		assert.Positive(t, casts[graph.OpSoftmax])
		assert.Zero(t, attention)
	} else {
		assert.Equal(t, 2, attention, "one fused attention per layer")
	}
	assert.Zero(t, casts[graph.OpCrossEntropy])
	// The tied token embedding is read as float32 by the lookup and once
	// cast to bf16 for the head: one cast node.
	wte := -1
	for _, nd := range g.Nodes() {
		if nd.Op == graph.OpParam && nd.Name == "wte.weight" {
			wte = nd.ID
		}
	}
	require.GreaterOrEqual(t, wte, 0)
	n := 0
	for _, nd := range g.Nodes() {
		if nd.Op == graph.OpCast && nd.Inputs[0] == wte {
			n++
		}
	}
	assert.Equal(t, 1, n, "casts of the tied embedding")
}

func TestAutocastConvNet(t *testing.T) {
	s := train(t, convnet(t, nn.Options{ShapeOnly: true}), precision.BF16Mixed)
	checkAutocast(t, s, graph.BFloat16)
	for _, nd := range s.Graph.Nodes()[:s.Loss] {
		if nd.Op == graph.OpRelu || nd.Op == graph.OpMaxPool2d {
			assert.Equal(t, graph.BFloat16, nd.Type.DType, "%s runs in its input's dtype", nd.Op)
		}
	}
}

// A ResNet's batch norms read their convolution's 16-bit output as it is
// and give a 16-bit output, which the ReLU and the next convolution read
// as it is (PyTorch's autocast calls cuDNN's batch norm the same way): no
// activation is cast between the stem and the global pool.
func TestAutocastResNet(t *testing.T) {
	m := models.NewResNet(nn.Options{ShapeOnly: true}, models.ResNetConfig{Blocks: []int{1, 1, 1, 1}, Bottleneck: true,
		Width: 4, CIFARStem: true, ImageSize: 8, Classes: 5})
	x := lazy.Placeholder([]int{2, 3, 8, 8}, graph.Float32, 0)
	y := x.Graph().Placeholder([]int{2}, graph.Int64, 0)
	loss := m.Forward(x).CrossEntropy(y, graph.ReduceMean)
	require.NoError(t, loss.Err())
	s := train(t, model{loss, nn.ParamTensors(m)}, precision.BF16Mixed)
	checkAutocast(t, s, graph.BFloat16)
	g := s.Graph
	norms := 0
	for _, nd := range g.Nodes()[:s.Loss] {
		switch nd.Op {
		case graph.OpBatchNorm:
			norms++
			assert.Equal(t, graph.OpConv2d, g.Node(nd.Inputs[0]).Op, "batch norm %d reads its convolution's output, not a cast", nd.ID)
			assert.Equal(t, graph.BFloat16, nd.Type.DType, "batch norm %d", nd.ID)
		case graph.OpConv2d: // reads a 16-bit activation as it is (the stem's fp32 image is cast)
			if in := g.Node(nd.Inputs[0]); in.Op == graph.OpCast {
				assert.Equal(t, graph.OpInput, g.Node(in.Inputs[0]).Op, "convolution %d reads a cast activation", nd.ID)
			}
		}
	}
	assert.Positive(t, norms)
}

// fp32 and tf32 leave the graph as it is: the same signature.
func TestFloat32PoliciesCopy(t *testing.T) {
	m := gpt(t, nn.Options{ShapeOnly: true})
	for _, p := range []precision.Policy{precision.FP32, precision.TF32} {
		g, ids, err := precision.Apply(m.loss.Graph().IR(), p)
		require.NoError(t, err)
		assert.Equal(t, m.loss.Graph().IR().Signature(), g.Signature(), "%s", p)
		assert.Len(t, ids, g.Len())
	}
}

func TestParse(t *testing.T) {
	for _, p := range precision.Policies {
		got, err := precision.Parse(string(p))
		require.NoError(t, err)
		assert.Equal(t, p, got)
	}
	p, err := precision.Parse("")
	require.NoError(t, err)
	assert.Equal(t, precision.FP32, p)
	for _, bad := range []string{"bf16", "FP32", "mixed", "float16"} {
		_, err := precision.Parse(bad)
		require.ErrorIs(t, err, precision.ErrUnknown, "%q", bad)
		assert.Contains(t, err.Error(), "bf16-mixed")
	}
	_, _, err = precision.Apply(graph.New(), "int8")
	assert.ErrorIs(t, err, precision.ErrUnknown)
	assert.True(t, precision.TF32.TF32())
	assert.False(t, precision.BF16Mixed.TF32())
	assert.False(t, precision.TF32.Mixed())
}

// The pass runs before autodiff: a graph with gradient ops is refused.
func TestApplyRefusesBackwardGraph(t *testing.T) {
	m := mlp(t, nn.Options{ShapeOnly: true})
	lazy.Grad(m.loss, m.params...)
	_, _, err := precision.Apply(m.loss.Graph().IR(), precision.BF16Mixed)
	require.ErrorIs(t, err, graph.ErrAttr)
	var oe *graph.OpError
	require.True(t, errors.As(err, &oe))
}

// Mixing dtypes where no promotion rule applies is a typed error naming
// the op and both dtypes.
func TestMixedDTypeMisuse(t *testing.T) {
	a := lazy.Placeholder([]int{2, 3}, graph.BFloat16, 0)
	w := lazy.ParamSpec([]int{3, 4}, graph.Float32, "w")
	y := a.MatMul(w)
	require.ErrorIs(t, y.Err(), graph.ErrDType)
	assert.Contains(t, y.Err().Error(), "matmul of bfloat16 and float32")
	l := a.Linear(lazy.ParamSpec([]int{4, 3}, graph.Float16, "w2"), nil)
	require.ErrorIs(t, l.Err(), graph.ErrDType)
	assert.Contains(t, l.Err().Error(), "linear of bfloat16 with float16")
	// Elementwise ops of two float dtypes promote instead.
	s := a.Add(lazy.ParamSpec([]int{3}, graph.Float32, "b"))
	require.NoError(t, s.Err())
	assert.Equal(t, graph.Float32, s.DType())
	// 16-bit inputs take float32 data.
	ints := tensor.New(tensor.WithShape(2), tensor.WithBacking([]int64{1, 2}))
	require.ErrorIs(t, lazy.WrapAs(ints, graph.BFloat16, 0).Err(), graph.ErrDType)
	f := tensor.New(tensor.WithShape(2), tensor.WithBacking([]float32{1, 2}))
	require.ErrorIs(t, lazy.WrapAs(f, graph.Int64, 0).Err(), graph.ErrDType)
	require.Equal(t, graph.Float16, lazy.WrapAs(f, graph.Float16, 0).DType())
	// A cast to an integer dtype is refused.
	c := a.Cast(graph.Int64)
	require.ErrorIs(t, c.Err(), graph.ErrDType)
	assert.Contains(t, c.Err().Error(), "cast")
}
