package batchfit

import (
	"context"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/exec"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/internal/lru"
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
	require.True(t, exec.HoldsExactly(p, held), "a steady loop's device, which plans as a fresh one")
	inOrder := exec.PlanResidents(p, held)
	for i, h := range inOrder {
		require.Equal(t, p.Persistent[i], h.Buffer, "resident %d", i)
	}
	reversed := slices.Clone(held)
	slices.Reverse(reversed)
	require.False(t, exec.HoldsExactly(p, reversed))
	require.False(t, exec.HoldsExactly(p, held[1:]))
	byKey := exec.PlanResidents(p, reversed)
	slices.Reverse(byKey)
	require.Equal(t, inOrder, byKey)
	// One resident fewer: looked up by key, the rest still found.
	fewer := exec.PlanResidents(p, held[1:])
	require.Equal(t, inOrder[1:], fewer)
}

// StepHostTime is the latest step's host time before its executor ran;
// LastStepTimes splits the whole step into that, the executor's run and
// what follows it. A step refused before its run has no run.
func TestStepHostTime(t *testing.T) {
	sess := NewSession(Options{Device: DeviceCPU})
	defer sess.Close()
	require.Zero(t, sess.StepHostTime())
	require.Zero(t, sess.LastStepTimes())
	m, build := hostGPT(t)
	params := nn.ParamTensors(m)
	_, err := sess.Step(context.Background(), build(), params, optim.NewSGD(0.1, 0))
	require.NoError(t, err)
	require.Positive(t, sess.StepHostTime())
	st := sess.LastStepTimes()
	require.Equal(t, sess.StepHostTime(), st.Host)
	require.Positive(t, st.Execute)
	require.GreaterOrEqual(t, st.Total, st.Host+st.Execute)

	_, err = sess.Step(context.Background(), build(), params, nil)
	require.Error(t, err)
	st = sess.LastStepTimes()
	require.Zero(t, st.Host)
	require.Zero(t, st.Execute)
	require.Positive(t, st.Total)
}

// The session's caches find a step's template, program and plan by
// signature, or the latest step's by comparing graphs; a hit is used only
// on a graph equal to the one cached. Forged signature collisions (another
// graph's entry stored under this graph's key) are misses: the step is
// differentiated, compiled and planned anew, and trains as a session
// without the forged entries does.
func TestStepCachesVerifySignatureHits(t *testing.T) {
	ctx := context.Background()
	for _, prec := range []string{"fp32", "bf16-mixed"} {
		t.Run(prec, func(t *testing.T) {
			sess, fresh := NewSession(Options{Device: DeviceCPU, Precision: prec}), NewSession(Options{Device: DeviceCPU, Precision: prec})
			defer sess.Close()
			defer fresh.Close()
			a, b := testutil.MLPModel(16, 8, false), testutil.MLPModel(16, 4, false)
			fb := testutil.MLPModel(16, 4, false)
			rng := rand.New(rand.NewPCG(1, 2))
			loss, params := a.Build(rng, 8)
			_, err := sess.Step(ctx, loss, params, optim.NewSGD(0.1, 0))
			require.NoError(t, err)

			// b's step key now names a's template.
			brng, frng := rand.New(rand.NewPCG(3, 4)), rand.New(rand.NewPCG(3, 4))
			bloss, bparams := b.Build(brng, 8)
			wrt, err := lazy.ParamIDs(bloss, bparams...)
			require.NoError(t, err)
			fwd := bloss.Graph().IR()
			sess.mu.Lock()
			ta := sess.latest
			sess.steps.Put(stepKey{sig: fwd.Signature(), loss: bloss.ID(), wrt: lru.Ints(wrt)}, ta)
			sess.latest = nil
			// and b's step graph's program key names a's program.
			var ea programEntry
			for k, e := range sess.programs.All() {
				_, ea = k, e
			}
			sess.mu.Unlock()
			hits, stepHits := sess.CacheHits(), sess.StepGraphHits()
			bopt, fopt := optim.NewSGD(0.1, 0), optim.NewSGD(0.1, 0)
			got, err := sess.Step(ctx, bloss, bparams, bopt)
			require.NoError(t, err)
			floss, fparams := fb.Build(frng, 8)
			want, err := fresh.Step(ctx, floss, fparams, fopt)
			require.NoError(t, err)
			require.Equal(t, want, got)
			require.Equal(t, stepHits, sess.StepGraphHits(), "a's template is not b's")
			require.Equal(t, hits, sess.CacheHits())
			require.NotSame(t, ta, sess.latest)

			// The same for the program: b's next step finds b's template,
			// whose program is forgotten, and b's program key names a's.
			tb := sess.latest
			sess.mu.Lock()
			tb.prog = nil
			var kb programKey
			for k, e := range sess.programs.All() {
				if e.g == tb.st.Graph {
					kb = k
				}
			}
			sess.programs.Put(kb, ea)
			sess.mu.Unlock()
			bloss, bparams = b.Build(brng, 8)
			got, err = sess.Step(ctx, bloss, bparams, bopt)
			require.NoError(t, err)
			floss, fparams = fb.Build(frng, 8)
			want, err = fresh.Step(ctx, floss, fparams, fopt)
			require.NoError(t, err)
			require.Equal(t, want, got)
			require.Equal(t, stepHits+1, sess.StepGraphHits(), "b's template")
			require.Equal(t, hits, sess.CacheHits(), "a's program is not b's")
			for i := range bparams {
				require.Equal(t, testutil.Float32s(t, fparams[i].Value().(*tensor.Dense)),
					testutil.Float32s(t, bparams[i].Value().(*tensor.Dense)), bparams[i].Name())
			}
		})
	}
}

// A loop alternating between two graphs (two batch sizes) finds each
// step's template and program after the first of each: the latest step's
// does not match, the one found by signature does.
func TestStepTemplatesAlternate(t *testing.T) {
	ctx := context.Background()
	sess := NewSession(Options{Device: DeviceCPU, Precision: "bf16-mixed"})
	defer sess.Close()
	m := testutil.MLPModel(16, 8, false)
	rng := rand.New(rand.NewPCG(1, 2))
	opt := optim.NewAdam(1e-3)
	for step := range 6 {
		loss, params := m.Build(rng, 8-2*(step%2))
		_, err := sess.Step(ctx, loss, params, opt)
		require.NoError(t, err)
	}
	require.Equal(t, 4, sess.StepGraphHits())
	require.Equal(t, 4, sess.CacheHits())
	require.Equal(t, 2, CachedPrograms(sess))
}
