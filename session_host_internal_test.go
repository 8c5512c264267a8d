package batchfit

import (
	"context"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/exec"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/internal/testutil"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/models"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/optim"
	"github.com/batchfit/batchfit/precision"
)

// hostGPT is a GPT of GPT-2 small's depth with tiny tensors, and a step of
// it over fresh random tokens.
func hostGPT(t *testing.T) (*models.GPT, func() *lazy.Tensor) {
	t.Helper()
	m := models.NewGPT(nn.Seed(3), models.GPTConfig{Vocab: 32, Context: 8, Layers: 12, Heads: 2, Dim: 16})
	rng := rand.New(rand.NewPCG(1, 2))
	return m, func() *lazy.Tensor {
		tokens := lazy.Wrap(testutil.Classes(rng, 32, 2, 8), 0)
		targets := tokens.Graph().Wrap(testutil.Classes(rng, 32, 2, 8), 0)
		return models.Loss(m.Forward(tokens), targets)
	}
}

// A steady loop's step graph is the template's one instance, its data
// patched in: the next step reuses it once the last has released it, and
// a step that overlaps another gets its own copy.
func TestStepTemplateInstanceReused(t *testing.T) {
	ctx := context.Background()
	sess := NewSession(Options{Device: DeviceCPU, Precision: "bf16-mixed"})
	defer sess.Close()
	m, build := hostGPT(t)
	params := nn.ParamTensors(m)
	_, err := sess.Step(ctx, build(), params, optim.NewAdamW(1e-3))
	require.NoError(t, err)

	loss1 := build()
	st1, _, release1, err := sess.backward(loss1, params, nil)
	require.NoError(t, err)
	loss2 := build()
	st2, _, release2, err := sess.backward(loss2, params, nil)
	require.NoError(t, err)
	require.NotSame(t, st1.Graph, st2.Graph, "a step in flight keeps its graph")
	// Each holds its own step's data.
	holds := func(st *precision.Step, loss *lazy.Tensor) bool {
		for i, nd := range loss.Graph().IR().Nodes() {
			if nd.Op.Category() == graph.CatSource && st.Graph.Node(st.IDs[i]).Value != nd.Value {
				return false
			}
		}
		return true
	}
	require.True(t, holds(st1, loss1))
	require.True(t, holds(st2, loss2))
	release2()
	release1()
	loss3 := build()
	st3, _, release3, err := sess.backward(loss3, params, nil)
	require.NoError(t, err)
	defer release3()
	require.Same(t, st1.Graph, st3.Graph, "released, the instance is reused")
	require.True(t, holds(st3, loss3))
}

// PlanResidents matches a steady loop's residents to the program's
// persistent buffers pairwise; in any other order it looks them up by key,
// with the same answer.
func TestPlanResidentsInOrderAndNot(t *testing.T) {
	ctx := context.Background()
	sess := NewSession(Options{Device: DeviceCPU, Precision: "bf16-mixed"})
	defer sess.Close()
	m, build := hostGPT(t)
	opt := optim.NewAdamW(1e-3)
	for range 2 {
		_, err := sess.Step(ctx, build(), nn.ParamTensors(m), opt)
		require.NoError(t, err)
	}
	p, held := sess.LastProgram(), sess.be.Held()
	require.Len(t, held, len(p.Persistent), "a steady loop holds the persistent buffers")
	inOrder := exec.PlanResidents(p, held)
	for i, h := range inOrder {
		require.Equal(t, p.Persistent[i], h.Buffer, "resident %d", i)
	}
	reversed := slices.Clone(held)
	slices.Reverse(reversed)
	byKey := exec.PlanResidents(p, reversed)
	slices.Reverse(byKey)
	require.Equal(t, inOrder, byKey)
	// One resident fewer: looked up by key, the rest still found.
	fewer := exec.PlanResidents(p, held[1:])
	require.Equal(t, inOrder[1:], fewer)
}

// StepHostTime is the latest step's host time before its executor ran.
func TestStepHostTime(t *testing.T) {
	sess := NewSession(Options{Device: DeviceCPU})
	defer sess.Close()
	require.Zero(t, sess.StepHostTime())
	m, build := hostGPT(t)
	_, err := sess.Step(context.Background(), build(), nn.ParamTensors(m), optim.NewSGD(0.1, 0))
	require.NoError(t, err)
	require.Positive(t, sess.StepHostTime())
}
