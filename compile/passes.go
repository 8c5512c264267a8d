package compile

import (
	"github.com/batchfit/batchfit/autodiff"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/layout"
	"github.com/batchfit/batchfit/precision"
)

// table is the pipeline: every graph pass, in the order it runs. A step
// runs each entry whose Modes hold the step's mode and whose When holds
// for its Options, unless Options.Disable names it. Adding a pass is one
// line here: a forward-graph rewrite g → (g′, ids) goes before
// "loss-scale" through forward(fn); a rewrite of the training graph that
// keeps given outputs, g, outputs → (g′, ids), goes after "autodiff"
// through backward(fn) (with Modes TrainStep | EvalStep it rewrites an
// evaluation's forward graph too, keeping its outputs).
var table = []Pass{
	{Name: "offload-params", Stage: Forward, Modes: TrainStep | EvalStep, When: offloaded, run: forward(halfParams),
		Doc: "float32 parameters held in bfloat16 on the device, their float32 masters on the host (batchfit.OffloadOptimizer)"},
	{Name: "fuse-attention-qkv", Stage: Forward, Modes: TrainStep, When: mixedPolicy, run: forward(graph.FuseAttentionQKV),
		Doc: "attention over q, k, v sliced from one projection, or from linears of one input (packed into one), q and k rotated by one table (rotary ops, or x·cos + rotate_half(x)·sin written out), is one attention_qkv reading them in place (graph.FuseAttentionQKV)"},
	{Name: "autocast", Stage: Forward, Modes: TrainStep | EvalStep, When: mixedPolicy, run: autocast,
		Doc: "the policy's dtypes, autocast's semantics: 16-bit GEMMs, float32 norms and losses (precision.Apply)"},
	{Name: "channels-last", Stage: Forward, Modes: TrainStep, When: channelsLast, run: forward(layout.ChannelsLast),
		Doc: "conv nets' 4-D activations stored NHWC from their bfloat16 convolutions on (layout.ChannelsLast)"},
	{Name: FuseLinearCrossEntropy, Stage: Forward, Modes: TrainStep, When: always, run: fuseLoss,
		Doc: "a linear (or a tied embedding's product) whose logits only the loss's cross_entropy reads is one linear_cross_entropy over token chunks: no [N, V] logits or gradient (graph.FuseLinearCrossEntropy)"},
	{Name: "loss-scale", Stage: Backward, Modes: TrainStep, When: lossScaled, run: lossScale,
		Doc: "the loss times the scale constant, where the backward pass starts (precision.Step.ScaleLoss)"},
	{Name: "autodiff", Stage: Backward, Modes: TrainStep, When: always, Required: true, run: differentiate,
		Doc: "the backward pass: the gradients of the parameters (autodiff.Backward)"},
	{Name: "fold-casts", Stage: Backward, Modes: TrainStep, When: mixedPolicy, run: foldCasts,
		Doc: "a 16-bit matmul read only by a widening cast writes float32 itself (precision.Step.FoldWideningCasts)"},
	{Name: "fuse-gelu-grad", Stage: Backward, Modes: TrainStep, When: mixedPolicy, run: backward(graph.FuseGeluGrad),
		Doc: "the product reaching a GELU and its derivative are one matmul_gelu_grad (graph.FuseGeluGrad)"},
	{Name: "fuse-layer-norm-grad-add", Stage: Backward, Modes: TrainStep, When: rewritten, run: backward(graph.FuseLayerNormGradAdd),
		Doc: "a layer norm's input gradient and the residual stream's add are one layer_norm_grad_x_add (graph.FuseLayerNormGradAdd)"},
	{Name: "fuse-embedding-grad-add", Stage: Backward, Modes: TrainStep, When: always, run: backward(graph.FuseEmbeddingGradAdd),
		Doc: "a tied embedding's gradient scatter-adds onto the head's, with no [V, D] value of its own (graph.FuseEmbeddingGradAdd)"},
	{Name: FusePointwise, Stage: Backward, Modes: TrainStep, When: always, run: backward(graph.FusePointwise),
		Doc: "connected chains of elementwise, broadcast, cast and row-reduction ops, forward and backward, are one fused_pointwise node each, its kernel generated (graph.FusePointwise); a sum over the rows of a chain's value (a weight's gradient) is one of its outputs"},
	{Name: Recompute, Stage: Program, Modes: TrainStep, When: recomputing,
		Doc: "forward values recomputed in backward, the set chosen within the budget (recompute.Apply; run by the Session)"},
}

// The preconditions the table's entries name.
var (
	always      = Condition{Text: "always", holds: func(*Options) bool { return true }}
	mixedPolicy = Condition{Text: "a mixed policy (bf16-mixed, fp16-mixed)",
		holds: func(o *Options) bool { return o.policy().Mixed() }}
	channelsLast = Condition{Text: "Options.ChannelsLast", holds: func(o *Options) bool { return o.ChannelsLast }}
	lossScaled   = Condition{Text: "Options.LossScale (fp16-mixed's dynamic loss scaling)",
		holds: func(o *Options) bool { return o.LossScale }}
	rewritten = Condition{Text: "a rewritten step: a mixed policy, Options.ChannelsLast, or not Options.Plain",
		holds: func(o *Options) bool { return !o.Plain || o.policy().Mixed() || o.ChannelsLast }}
	offloaded = Condition{Text: "Options.OffloadParams (an offloaded optimizer)",
		holds: func(o *Options) bool { return o.OffloadParams }}
	recomputing = Condition{Text: "a recompute set chosen when the step is planned (the Session's Options.Recompute)",
		holds: func(*Options) bool { return true }}
)

// halfParams makes every float32 parameter node of g bfloat16: the device
// copies of an offloaded optimizer's parameters, whose float32 masters
// are on the host. Trained or frozen, steps and evaluations alike, so
// that both find the same resident copies. Node ids stay.
func halfParams(g *graph.Graph) (*graph.Graph, []int, error) {
	c := g.Clone()
	ids := make([]int, c.Len())
	for i := range ids {
		ids[i] = i
		if nd := c.Node(i); nd.Op == graph.OpParam && nd.Type.DType == graph.Float32 {
			nd.Type.DType = graph.BFloat16
		}
	}
	return c, ids, nil
}

// forward makes a forward-graph rewrite an entry's run: fn returns the
// new graph and, for each node of the old one, its id there (−1 for one
// it removed).
func forward(fn func(*graph.Graph) (*graph.Graph, []int, error)) func(*state) error {
	return func(s *state) error {
		ng, ids, err := fn(s.g)
		if err != nil {
			return err
		}
		s.rebind(ng, ids)
		return nil
	}
}

// backward makes a rewrite of the training graph an entry's run: fn keeps
// the step's outputs (precision.Step.Rewrite). In an evaluation (an entry
// whose Modes hold EvalStep) it rewrites the forward graph, keeping the
// evaluation's outputs.
func backward(fn func(*graph.Graph, []int) (*graph.Graph, []int, error)) func(*state) error {
	return func(s *state) error {
		if s.st != nil {
			return s.st.Rewrite(fn)
		}
		ng, ids, err := fn(s.g, s.outs())
		if err != nil {
			return err
		}
		s.rebind(ng, ids)
		return nil
	}
}

func autocast(s *state) error {
	ng, ids, err := precision.Apply(s.g, s.o.policy())
	if err != nil {
		return err
	}
	s.rebind(ng, ids)
	return nil
}

// fuseLoss fuses the step's head and loss (graph.FuseLinearCrossEntropy),
// with Options.LossChunk tokens a chunk when it is set.
func fuseLoss(s *state) error {
	loss := s.ids[s.loss]
	if loss < 0 {
		return nil // fused into another node already: no cross_entropy to rewrite
	}
	ng, ids, err := graph.FuseLinearCrossEntropy(s.g, []int{loss})
	if err != nil {
		return err
	}
	if s.o.LossChunk > 0 {
		if ng, err = graph.WithLossChunk(ng, s.o.LossChunk); err != nil {
			return err
		}
	}
	s.rebind(ng, ids)
	return nil
}

func lossScale(s *state) error { return s.st.ScaleLoss(s.o.Scale) }

func differentiate(s *state) error {
	grads, err := autodiff.Backward(s.st.Graph, s.st.Scaled, s.st.Params)
	if err != nil {
		return err
	}
	s.st.Grads = grads
	return nil
}

func foldCasts(s *state) error { return s.st.FoldWideningCasts() }
