package compile_test

import (
	"errors"
	"os"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/compile"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/models"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/precision"
)

// order is the pipeline's order, written out: a change to the table is a
// change to this test.
var order = []string{"offload-params", "fuse-attention-qkv", "autocast", "channels-last", "fuse-linear-cross-entropy", "loss-scale", "autodiff",
	"fold-casts", "fuse-gelu-grad", "fuse-layer-norm-grad-add", "fuse-embedding-grad-add", "fuse-pointwise", "recompute"}

func TestOrder(t *testing.T) {
	require.Equal(t, order, compile.Names())
	var stage compile.Stage
	for _, p := range compile.Passes() {
		assert.GreaterOrEqual(t, p.Stage, stage, "%s: stages run in order", p.Name)
		stage = p.Stage
		assert.NotEmpty(t, p.Doc, p.Name)
		assert.NotEmpty(t, p.When.Text, p.Name)
	}
}

// ran lists the passes a step of mode m with options o runs, by
// Pass.Applies.
func ran(m compile.Mode, o compile.Options) []string {
	var names []string
	for _, p := range compile.Passes() {
		if ok, _ := p.Applies(m, o); ok {
			names = append(names, p.Name)
		}
	}
	return names
}

// The preconditions: which passes each kind of step runs.
func TestPreconditions(t *testing.T) {
	train, eval := compile.TrainStep, compile.EvalStep
	bf16 := compile.Options{Policy: precision.BF16Mixed}
	for _, c := range []struct {
		name string
		mode compile.Mode
		o    compile.Options
		want []string
	}{
		{"eval fp32", eval, compile.Options{}, nil},
		{"eval bf16-mixed", eval, bf16, []string{"autocast"}},
		{"eval bf16-mixed channels last", eval, compile.Options{Policy: precision.BF16Mixed, ChannelsLast: true}, []string{"autocast"}},
		{"train fp32 plain", train, compile.Options{Plain: true}, []string{"fuse-linear-cross-entropy", "autodiff", "fuse-embedding-grad-add", "fuse-pointwise", "recompute"}},
		{"train tf32 plain", train, compile.Options{Policy: precision.TF32, Plain: true}, []string{"fuse-linear-cross-entropy", "autodiff", "fuse-embedding-grad-add", "fuse-pointwise", "recompute"}},
		{"train fp32", train, compile.Options{}, []string{"fuse-linear-cross-entropy", "autodiff", "fuse-layer-norm-grad-add", "fuse-embedding-grad-add", "fuse-pointwise", "recompute"}},
		{"train fp32 plain channels last", train, compile.Options{Plain: true, ChannelsLast: true},
			[]string{"channels-last", "fuse-linear-cross-entropy", "autodiff", "fuse-layer-norm-grad-add", "fuse-embedding-grad-add", "fuse-pointwise", "recompute"}},
		{"train bf16-mixed", train, compile.Options{Policy: precision.BF16Mixed, Plain: true},
			[]string{"fuse-attention-qkv", "autocast", "fuse-linear-cross-entropy", "autodiff", "fold-casts", "fuse-gelu-grad", "fuse-layer-norm-grad-add", "fuse-embedding-grad-add", "fuse-pointwise", "recompute"}},
		{"train bf16-mixed channels last", train, compile.Options{Policy: precision.BF16Mixed, ChannelsLast: true, Plain: true},
			[]string{"fuse-attention-qkv", "autocast", "channels-last", "fuse-linear-cross-entropy", "autodiff", "fold-casts", "fuse-gelu-grad", "fuse-layer-norm-grad-add", "fuse-embedding-grad-add", "fuse-pointwise", "recompute"}},
		{"train fp16-mixed loss-scaled", train, compile.Options{Policy: precision.FP16Mixed, LossScale: true, Plain: true},
			[]string{"fuse-attention-qkv", "autocast", "fuse-linear-cross-entropy", "loss-scale", "autodiff", "fold-casts", "fuse-gelu-grad", "fuse-layer-norm-grad-add", "fuse-embedding-grad-add", "fuse-pointwise", "recompute"}},
		{"train bf16-mixed offloaded", train, compile.Options{Policy: precision.BF16Mixed, Plain: true, OffloadParams: true},
			[]string{"offload-params", "fuse-attention-qkv", "autocast", "fuse-linear-cross-entropy", "autodiff", "fold-casts", "fuse-gelu-grad", "fuse-layer-norm-grad-add", "fuse-embedding-grad-add", "fuse-pointwise", "recompute"}},
		{"eval bf16-mixed offloaded", eval, compile.Options{Policy: precision.BF16Mixed, OffloadParams: true}, []string{"offload-params", "autocast"}},
		{"train bf16-mixed, two disabled", train, compile.Options{Policy: precision.BF16Mixed, Disable: []string{"fold-casts", "recompute"}},
			[]string{"fuse-attention-qkv", "autocast", "fuse-linear-cross-entropy", "autodiff", "fuse-gelu-grad", "fuse-layer-norm-grad-add", "fuse-embedding-grad-add", "fuse-pointwise"}},
	} {
		assert.Equal(t, c.want, ran(c.mode, c.o), c.name)
	}
	p := compile.Passes()[2] // autocast
	_, why := p.Applies(train, compile.Options{})
	assert.Equal(t, "needs a mixed policy (bf16-mixed, fp16-mixed); the policy is fp32", why)
	_, why = compile.Passes()[5].Applies(eval, bf16)
	assert.Equal(t, "train steps only", why)
	_, why = p.Applies(train, compile.Options{Policy: precision.BF16Mixed, Disable: []string{"autocast"}})
	assert.Equal(t, "disabled", why)
}

// gpt is a small GPT's training step, shape-only, with attention written
// as q, k, v sliced from one projection (what fuse-attention-qkv fuses).
func gpt(t *testing.T) (*graph.Graph, int, []int) {
	t.Helper()
	m := models.NewGPT(nn.Options{ShapeOnly: true}, models.GPTConfig{Vocab: 16, Context: 8, Layers: 2, Heads: 2, Dim: 8, UnpackedAttention: true})
	tok := lazy.Placeholder([]int{2, 8}, graph.Int64, 0)
	tgt := tok.Graph().Placeholder([]int{2, 8}, graph.Int64, 0)
	loss := models.Loss(m.Forward(tok), tgt)
	require.NoError(t, loss.Err())
	wrt, err := lazy.ParamIDs(loss, nn.ParamTensors(m)...)
	require.NoError(t, err)
	return loss.Graph().IR(), loss.ID(), wrt
}

func count(g *graph.Graph, op graph.Op) int {
	n := 0
	for _, nd := range g.Nodes() {
		if nd.Op == op {
			n++
		}
	}
	return n
}

// Train reports every graph pass in table order, the recompute pass
// (the Session's) aside; the node counts chain, each pass starting from
// the graph the last one left, and the caller's graph stays as it was.
func TestTrainReports(t *testing.T) {
	g, loss, wrt := gpt(t)
	n := g.Len()
	st, err := compile.Train(g, loss, wrt, compile.Options{Policy: precision.BF16Mixed, Plain: true})
	require.NoError(t, err)
	require.Equal(t, n, g.Len(), "the caller's graph is not changed")
	var names []string
	nodes := n
	for _, r := range st.Passes {
		names = append(names, r.Name)
		assert.Equal(t, nodes, r.NodesBefore, r.Name)
		nodes = r.NodesAfter
		if !r.Ran {
			assert.NotEmpty(t, r.Why, r.Name)
			assert.Equal(t, r.NodesBefore, r.NodesAfter, r.Name)
			continue
		}
		assert.True(t, r.Measured, r.Name)
		assert.Positive(t, r.BytesBefore, r.Name)
		assert.Positive(t, r.PeakAfter, r.Name)
	}
	assert.Equal(t, order[:len(order)-1], names)
	assert.Equal(t, st.Graph.Len(), nodes)
	assert.Zero(t, count(st.Graph, graph.OpAttention), "fused into attention_qkv")
	assert.Equal(t, 2, count(st.Graph, graph.OpAttentionQKV))
}

// The numbers of one pass on a small MLP, checked against the graph:
// under bf16-mixed fuse-gelu-grad removes the one matmul (a [4, 32]
// bfloat16 product, 256 bytes) that only the gelu_grad read, so the step
// has one node and 256 bytes fewer. The last report's bytes are the sum,
// counted here independently, of the step graph's values that its
// outputs need, sources aside.
func TestReportNumbers(t *testing.T) {
	x := lazy.Placeholder([]int{4, 16}, graph.Float32, 0)
	w1 := lazy.ParamSpec([]int{32, 16}, graph.Float32, "w1")
	w2 := lazy.ParamSpec([]int{8, 32}, graph.Float32, "w2")
	y := x.Graph().Placeholder([]int{4}, graph.Int64, 0)
	loss := x.Linear(w1, nil).Gelu().Linear(w2, nil).CrossEntropy(y, graph.ReduceMean)
	require.NoError(t, loss.Err())
	wrt, err := lazy.ParamIDs(loss, w1, w2)
	require.NoError(t, err)
	st, err := compile.Train(loss.Graph().IR(), loss.ID(), wrt, compile.Options{Policy: precision.BF16Mixed, Disable: []string{compile.FuseLinearCrossEntropy}}) // the head stays a matmul the GELU pass can read
	require.NoError(t, err)
	var gelu compile.Report
	for _, r := range st.Passes {
		if r.Name == "fuse-gelu-grad" {
			gelu = r
		}
	}
	require.True(t, gelu.Ran)
	assert.Equal(t, gelu.NodesBefore-1, gelu.NodesAfter)
	assert.Equal(t, int64(4*32*2), gelu.Saved(), "the [4, 32] bfloat16 product")
	assert.Equal(t, 1, count(st.Graph, graph.OpMatMulGeluGrad))

	last := st.Passes[len(st.Passes)-1]
	g := st.Graph
	need := make([]bool, g.Len())
	for _, id := range st.Outputs() {
		if id >= 0 {
			need[id] = true
		}
	}
	var sum int64
	for id := g.Len() - 1; id >= 0; id-- {
		if !need[id] {
			continue
		}
		nd := g.Node(id)
		for _, in := range nd.Inputs {
			need[in] = true
		}
		if nd.Op.Category() != graph.CatSource {
			sum += nd.Type.Bytes()
		}
	}
	assert.Equal(t, sum, last.BytesAfter)
	assert.GreaterOrEqual(t, last.PeakAfter, int64(0))
}

// A disabled pass does not run: the step is built without it, and its
// report says why.
func TestDisable(t *testing.T) {
	g, loss, wrt := gpt(t)
	on, err := compile.Train(g, loss, wrt, compile.Options{Policy: precision.BF16Mixed})
	require.NoError(t, err)
	off, err := compile.Train(g, loss, wrt, compile.Options{Policy: precision.BF16Mixed, Disable: []string{"fuse-attention-qkv", "fuse-layer-norm-grad-add"}})
	require.NoError(t, err)
	assert.Positive(t, count(on.Graph, graph.OpLayerNormGradXAdd))
	assert.Zero(t, count(off.Graph, graph.OpLayerNormGradXAdd))
	assert.Zero(t, count(off.Graph, graph.OpAttentionQKV))
	assert.Equal(t, 2, count(off.Graph, graph.OpAttention))
	for _, r := range off.Passes {
		if r.Name == "fuse-attention-qkv" || r.Name == "fuse-layer-norm-grad-add" {
			assert.False(t, r.Ran)
			assert.Equal(t, "disabled", r.Why)
		}
	}
}

// A name that is no pass, or names autodiff, is a typed error.
func TestUnknownPass(t *testing.T) {
	g, loss, wrt := gpt(t)
	_, err := compile.Train(g, loss, wrt, compile.Options{Disable: []string{"fuse-everything"}})
	require.ErrorIs(t, err, compile.ErrUnknownPass)
	var pe *compile.PassNameError
	require.True(t, errors.As(err, &pe))
	assert.Equal(t, "fuse-everything", pe.Name)
	assert.Contains(t, err.Error(), "fuse-gelu-grad", "the message lists the passes")
	_, err = compile.Eval(g, []int{loss}, compile.Options{Disable: []string{"fuse-linear-cross-entropy", "autodiff"}})
	require.ErrorIs(t, err, compile.ErrRequiredPass)
	require.NoError(t, compile.Check([]string{"recompute", "autocast"}))
	_, err = compile.Train(g, loss, wrt, compile.Options{Policy: "int8"})
	require.ErrorIs(t, err, precision.ErrUnknown)
	_, err = compile.Train(g, g.Len(), wrt, compile.Options{})
	require.ErrorIs(t, err, graph.ErrArity)
}

// Eval under fp32 runs nothing and hands back the caller's graph; under
// bf16-mixed autocast only.
func TestEval(t *testing.T) {
	g, loss, _ := gpt(t)
	ev, err := compile.Eval(g, []int{loss}, compile.Options{})
	require.NoError(t, err)
	assert.Same(t, g, ev.Graph)
	assert.Equal(t, []int{loss}, ev.Outputs)
	ev, err = compile.Eval(g, []int{loss}, compile.Options{Policy: precision.BF16Mixed, NoMeasure: true})
	require.NoError(t, err)
	assert.NotSame(t, g, ev.Graph)
	for _, r := range ev.Passes {
		assert.Equal(t, r.Name == "autocast", r.Ran, r.Name)
		assert.False(t, r.Measured)
	}
	assert.Equal(t, graph.Float32, ev.Graph.Node(ev.Outputs[0]).Type.DType)
}

// The recompute pass: the chosen forward nodes copied into backward.
func TestRunRecompute(t *testing.T) {
	g, loss, wrt := gpt(t)
	st, err := compile.Train(g, loss, wrt, compile.Options{Plain: true})
	require.NoError(t, err)
	outs := append([]int{st.Loss}, st.Grads...)
	var set []int
	for id := range st.Scaled {
		if st.Graph.Node(id).Op == graph.OpGelu {
			set = append(set, id)
		}
	}
	require.NotEmpty(t, set)
	ng, remap, copies, r, err := compile.RunRecompute(st.Graph, st.Scaled+1, set, "gelus", outs, compile.Options{})
	require.NoError(t, err)
	assert.True(t, r.Ran)
	assert.Equal(t, ng.Len(), r.NodesAfter)
	assert.Equal(t, st.Graph.Len()+copies, ng.Len())
	assert.Len(t, remap, st.Graph.Len())
	assert.Contains(t, r.Detail, "gelus")
	_, _, _, r, err = compile.RunRecompute(st.Graph, st.Scaled+1, set, "gelus", outs, compile.Options{Disable: []string{"recompute"}})
	require.NoError(t, err)
	assert.False(t, r.Ran)
	_, _, _, _, err = compile.RunRecompute(st.Graph, st.Scaled+1, []int{st.Graph.Len() - 1}, "bad", outs, compile.Options{})
	require.ErrorIs(t, err, graph.ErrArity)
}

// docs/ARCHITECTURE.md's pipeline table and this package's documentation
// list the passes as the table does, in order.
func TestDocsListThePipeline(t *testing.T) {
	doc, err := os.ReadFile("../docs/ARCHITECTURE.md")
	require.NoError(t, err)
	const begin, end = "<!-- pipeline: begin (compile.Markdown; TestDocsListThePipeline) -->\n", "<!-- pipeline: end -->"
	_, after, ok := strings.Cut(string(doc), begin)
	require.True(t, ok, "docs/ARCHITECTURE.md has no %q", begin)
	block, _, ok := strings.Cut(after, end)
	require.True(t, ok)
	require.Equal(t, compile.Markdown(), block, "docs/ARCHITECTURE.md's pipeline table; paste compile.Markdown()'s:\n%s", compile.Markdown())

	src, err := os.ReadFile("doc.go")
	require.NoError(t, err)
	at := 0
	for _, name := range compile.Names() {
		i := strings.Index(string(src[at:]), "//   - "+name+" (")
		require.GreaterOrEqual(t, i, 0, "doc.go lists %s after the passes before it", name)
		at += i
	}
}

// offload-params holds every float32 parameter in bfloat16 (an offloaded
// optimizer's device copies), in training steps and evaluations: the
// trained parameters and their gradients are bfloat16.
func TestOffloadParams(t *testing.T) {
	g, loss, wrt := gpt(t)
	st, err := compile.Train(g, loss, wrt, compile.Options{Policy: precision.BF16Mixed, Plain: true, OffloadParams: true})
	require.NoError(t, err)
	for i, id := range st.Params {
		assert.Equal(t, graph.BFloat16, st.Graph.Node(id).Type.DType, "parameter %d", i)
		assert.Equal(t, graph.BFloat16, st.Graph.Node(st.Grads[i]).Type.DType, "gradient %d", i)
	}
	r := st.Passes[0]
	require.Equal(t, "offload-params", r.Name)
	require.True(t, r.Ran)
	assert.Equal(t, graph.Float32, g.Node(wrt[0]).Type.DType, "the caller's graph is not changed")

	ev, err := compile.Eval(g, []int{loss}, compile.Options{Policy: precision.BF16Mixed, OffloadParams: true})
	require.NoError(t, err)
	params := 0
	for _, nd := range ev.Graph.Nodes() {
		if nd.Op == graph.OpParam {
			params++
			assert.Equal(t, graph.BFloat16, nd.Type.DType, nd.Name)
		}
	}
	assert.Equal(t, len(wrt), params)
}
