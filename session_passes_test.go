package batchfit_test

import (
	"context"
	"errors"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/compile"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/internal/testutil"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/models"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/optim"
	"github.com/batchfit/batchfit/precision"
	"github.com/batchfit/batchfit/recompute"
)

var tinyGPTConfig = models.GPTConfig{Vocab: 32, Context: 8, Layers: 2, Heads: 2, Dim: 16}

// tinyGPT is a small GPT's loss over batch 4 × 8 tokens, shape-only, and
// its parameters.
func tinyGPT() (*lazy.Tensor, []*lazy.Tensor) {
	m := models.NewGPT(nn.Options{ShapeOnly: true}, tinyGPTConfig)
	tok := lazy.Placeholder([]int{4, 8}, graph.Int64, 0)
	return models.Loss(m.Forward(tok), tok.Graph().Placeholder([]int{4, 8}, graph.Int64, 0)), nn.ParamTensors(m)
}

func opCount(g *graph.Graph, op graph.Op) int {
	n := 0
	for _, nd := range g.Nodes() {
		if nd.Op == op {
			n++
		}
	}
	return n
}

// A name in Options.DisablePasses that is no pass, or names autodiff, is
// the session's error.
func TestSessionDisablePassesUnknown(t *testing.T) {
	s := batchfit.NewSession(batchfit.Options{DryRun: &batchfit.DryRun{}, DisablePasses: []string{"fuse-all"}})
	require.ErrorIs(t, s.Err(), compile.ErrUnknownPass)
	var pe *compile.PassNameError
	require.True(t, errors.As(s.Err(), &pe))
	assert.Equal(t, "fuse-all", pe.Name)
	s = batchfit.NewSession(batchfit.Options{DryRun: &batchfit.DryRun{}, DisablePasses: []string{"autodiff"}})
	require.ErrorIs(t, s.Err(), compile.ErrRequiredPass)
}

// Plan's StepPlan.Passes: every pass of the pipeline in order, the
// recompute pass last; the step planned is the graph compile.Train builds
// with the Session's options, and a disabled pass leaves its rewrite out.
func TestSessionPlanPasses(t *testing.T) {
	loss, params := tinyGPT()
	plan := func(o batchfit.Options) *batchfit.StepPlan {
		o.Precision, o.DryRun = "bf16-mixed", &batchfit.DryRun{}
		o.LossChunk = graph.DefaultLossChunk // compile.Train's, which the planner would otherwise choose anew
		s := batchfit.NewSession(o)
		require.NoError(t, s.Err())
		defer s.Close()
		sp, err := s.Plan(loss, params, optim.NewAdamW(1e-3))
		require.NoError(t, err)
		return sp
	}
	sp := plan(batchfit.Options{})
	var names []string
	for _, r := range sp.Passes {
		names = append(names, r.Name)
	}
	require.Equal(t, compile.Names(), names)
	last := sp.Passes[len(sp.Passes)-1]
	assert.Equal(t, "Options.Recompute is off", last.Why)
	wrt, err := lazy.ParamIDs(loss, params...)
	require.NoError(t, err)
	st, err := compile.Train(loss.Graph().IR(), loss.ID(), wrt, compile.Options{Policy: precision.BF16Mixed, ChannelsLast: true, Plain: true})
	require.NoError(t, err)
	assert.True(t, st.Graph.SameSignature(sp.Program.Graph), "the Session plans compile.Train's step")
	assert.Equal(t, st.Passes, sp.Passes[:len(sp.Passes)-1])
	assert.Positive(t, opCount(sp.Program.Graph, graph.OpLayerNormGradXAdd))

	off := plan(batchfit.Options{DisablePasses: []string{"fuse-layer-norm-grad-add"}})
	assert.Zero(t, opCount(off.Program.Graph, graph.OpLayerNormGradXAdd))
	assert.Equal(t, "disabled", off.Passes[len(off.Passes)-4].Why)

	full := plan(batchfit.Options{Recompute: recompute.FullCheckpoint})
	r := full.Passes[len(full.Passes)-1]
	require.True(t, r.Ran, r.Why)
	assert.True(t, r.Measured)
	assert.Equal(t, full.Program.Graph.Len(), r.NodesAfter)
	assert.Greater(t, r.NodesAfter, r.NodesBefore)
	none := plan(batchfit.Options{Recompute: recompute.FullCheckpoint, DisablePasses: []string{"recompute"}})
	assert.Equal(t, "none", none.Recompute.Strategy)
	assert.Equal(t, "disabled", none.Passes[len(none.Passes)-1].Why)
}

// PlanEval's passes: under bf16-mixed autocast only, measured.
func TestSessionPlanEvalPasses(t *testing.T) {
	loss, _ := tinyGPT()
	s := batchfit.NewSession(batchfit.Options{Precision: "bf16-mixed", DryRun: &batchfit.DryRun{}})
	require.NoError(t, s.Err())
	defer s.Close()
	sp, err := s.PlanEval(loss)
	require.NoError(t, err)
	require.Len(t, sp.Passes, len(compile.Names())-1, "the recompute pass is the training step's")
	for _, r := range sp.Passes {
		assert.Equal(t, r.Name == "autocast", r.Ran, r.Name)
		assert.Equal(t, r.Name == "autocast", r.Measured, r.Name)
	}
}

// Steps run with a pass disabled: the layer-norm gradient fusion is bit
// for bit the unfused step on the CPU, so three bf16-mixed steps with and
// without it give the same losses, bit for bit.
func TestSessionStepDisabledPass(t *testing.T) {
	train := func(disable []string) []float32 {
		s := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, Precision: "bf16-mixed", DisablePasses: disable})
		require.NoError(t, s.Err())
		defer s.Close()
		rng := rand.New(rand.NewPCG(1, 2))
		m := models.NewGPT(nn.Seed(3), tinyGPTConfig)
		opt := optim.NewAdamW(1e-2)
		var losses []float32
		for range 3 {
			tok := lazy.Wrap(testutil.Classes(rng, 32, 4, 8), 0)
			loss := models.Loss(m.Forward(tok), tok.Graph().Wrap(testutil.Classes(rng, 32, 4, 8), 0))
			l, err := s.Step(context.Background(), loss, nn.ParamTensors(m), opt)
			require.NoError(t, err)
			losses = append(losses, l)
		}
		if disable != nil {
			assert.Zero(t, opCount(s.LastProgram().Graph, graph.OpLayerNormGradXAdd))
		}
		return losses
	}
	assert.Equal(t, train(nil), train([]string{"fuse-layer-norm-grad-add"}))
}
