package models_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/compile"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/models"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/precision"
	"github.com/batchfit/batchfit/shapeinfer"
)

// gpt2TrainingGraph builds one shape-only GPT-2 small training step: the
// forward pass over tokens [8, 1024], the mean next-token loss, the backward
// pass over every parameter, and the analysis of loss and gradients.
func gpt2TrainingGraph(tb testing.TB) (*lazy.Tensor, []*lazy.Tensor, *shapeinfer.Result) {
	model := models.NewGPT(nn.Options{ShapeOnly: true}, gpt2Written())
	tokens := lazy.Placeholder([]int{8, 1024}, graph.Int64, 0)
	targets := tokens.Graph().Placeholder([]int{8, 1024}, graph.Int64, 0)
	loss := models.Loss(model.Forward(tokens), targets)
	grads := lazy.Grad(loss, nn.ParamTensors(model)...)
	outs := []int{loss.ID()}
	for _, gr := range grads {
		if err := gr.Err(); err != nil {
			tb.Fatal(err)
		}
		outs = append(outs, gr.ID())
	}
	res, err := shapeinfer.Analyze(loss.Graph().IR(), outs...)
	if err != nil {
		tb.Fatal(err)
	}
	return loss, grads, res
}

func TestGPT2SmallTrainingGraphIsShapeOnlyAndChunkable(t *testing.T) {
	loss, grads, res := gpt2TrainingGraph(t)
	g := loss.Graph().IR()
	sources := 0
	for _, n := range g.Nodes() {
		if n.Op.Category() == graph.CatSource {
			sources++
			require.Nil(t, n.Value, "source node %d (%s %q) holds data", n.ID, n.Op, n.Name)
		}
	}
	// 2 inputs, and 148 parameters: wpe, wte, ln_f (2) and 12 blocks of 12.
	require.Equal(t, 2+148, sources)
	require.Len(t, grads, 148)
	require.True(t, res.Chunkable(), "%v", res.NotChunkable)
	require.Equal(t, 8, res.Batch)
}

// BenchmarkGPT2SmallTrainingGraph times building and analysing one GPT-2
// small training step, shapes only.
func BenchmarkGPT2SmallTrainingGraph(b *testing.B) {
	nodes := 0
	for b.Loop() {
		loss, _, _ := gpt2TrainingGraph(b)
		nodes = loss.Graph().IR().Len()
	}
	b.ReportMetric(float64(nodes), "nodes")
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(nodes), "ns/node")
}

// BenchmarkGPT2SmallTrainingGraphBF16Mixed times building one GPT-2 small
// training step under bf16-mixed as Session.Step does (the forward graph,
// compile.Train's autocast pass and backward, then the analysis), shapes
// only: the host work a training loop pays before the plan cache.
func BenchmarkGPT2SmallTrainingGraphBF16Mixed(b *testing.B) {
	nodes := 0
	for b.Loop() {
		model := models.NewGPT(nn.Options{ShapeOnly: true}, gpt2Written())
		tokens := lazy.Placeholder([]int{8, 1024}, graph.Int64, 0)
		targets := tokens.Graph().Placeholder([]int{8, 1024}, graph.Int64, 0)
		loss := models.Loss(model.Forward(tokens), targets)
		wrt, err := lazy.ParamIDs(loss, nn.ParamTensors(model)...)
		if err != nil {
			b.Fatal(err)
		}
		st, err := compile.Train(loss.Graph().IR(), loss.ID(), wrt, compile.Options{Policy: precision.BF16Mixed})
		if err != nil {
			b.Fatal(err)
		}
		if _, err := shapeinfer.Analyze(st.Graph, append([]int{st.Loss}, st.Grads...)...); err != nil {
			b.Fatal(err)
		}
		nodes = st.Graph.Len()
	}
	b.ReportMetric(float64(nodes), "nodes")
}

// gpt2Written is GPT-2 small with attention written out: the graph whose
// figures the README's performance table quotes (1,012 nodes).
func gpt2Written() models.GPTConfig {
	cfg := models.GPT2Small()
	cfg.WrittenOutAttention = true
	return cfg
}

// BenchmarkGPT2SmallGraphBuild times what a training loop does every step
// before Session.Step: building GPT-2 small's forward graph and loss
// (batch 8 × 1024, shape-only). Ops inside nn's and models' modules take
// their module's recorded call site instead of walking the stack each
// (lazy.Graph.PushInternalScope): about 800 → 430 µs a build on the
// 2-core dev machine.
func BenchmarkGPT2SmallGraphBuild(b *testing.B) {
	m := models.NewGPT(nn.Options{ShapeOnly: true}, models.GPT2Small())
	for b.Loop() {
		tok := lazy.Placeholder([]int{8, 1024}, graph.Int64, 0)
		tgt := tok.Graph().Placeholder([]int{8, 1024}, graph.Int64, 0)
		if err := models.Loss(m.Forward(tok), tgt).Err(); err != nil {
			b.Fatal(err)
		}
	}
}
