package batchfit_test

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/compile"
	"github.com/batchfit/batchfit/exec/cpu"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/internal/testutil"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/models"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/optim"
	"github.com/batchfit/batchfit/precision"
)

// llamaCorpus draws batch sequences of seq tokens from a learnable
// language: each token is the previous one plus 1 or 2 (mod vocab), the
// first uniform. The labels are the tokens themselves (Hugging Face's
// labels=input_ids; CausalLMLoss shifts them).
func llamaCorpus(rng *rand.Rand, vocab, batch, seq int) *tensor.Dense {
	tok := make([]int64, batch*seq)
	for b := range batch {
		x := int64(rng.IntN(vocab))
		for i := range seq {
			tok[b*seq+i] = x
			x = (x + 1 + int64(rng.IntN(2))) % int64(vocab)
		}
	}
	return tensor.New(tensor.WithShape(batch, seq), tensor.WithBacking(tok))
}

// llamaLoss is m's causal LM loss on tokens, as a training loop builds it.
// wideLlamaTiny is llama-tiny made wide enough (vocabulary 2,048, width
// 256, SwiGLU 512) that its weights, optimizer state and activations fill
// many allocator segments: a step's reserved bytes then move with what it
// holds.
func wideLlamaTiny() models.LlamaConfig {
	cfg := models.LlamaTiny()
	cfg.Vocab, cfg.Hidden, cfg.Intermediate = 2048, 256, 512
	return cfg
}

func llamaLoss(m *models.Llama, tok *tensor.Dense) *lazy.Tensor {
	x := lazy.Wrap(tok, 0)
	return models.CausalLMLoss(m.Forward(x), x.Graph().Wrap(tok.Clone().(*tensor.Dense), 0))
}

// trainLlama trains llama-tiny for steps AdamW steps on the CPU under
// Options o and returns the losses.
func trainLlama(t *testing.T, o batchfit.Options, steps, batch, seq int) []float32 {
	t.Helper()
	cfg := models.LlamaTiny()
	m := models.NewLlama(nn.Seed(3), cfg)
	o.Device = batchfit.DeviceCPU
	sess := batchfit.NewSession(o)
	require.NoError(t, sess.Err())
	defer sess.Close()
	opt := optim.NewAdamW(3e-3)
	rng := rand.New(rand.NewPCG(5, 5))
	var losses []float32
	for step := range steps {
		l, err := sess.Step(context.Background(), llamaLoss(m, llamaCorpus(rng, cfg.Vocab, batch, seq)), nn.ParamTensors(m), opt)
		require.NoError(t, err, "step %d", step)
		losses = append(losses, l)
	}
	return losses
}

func meanTail(ls []float32, n int) float64 {
	s := 0.0
	for _, l := range ls[len(ls)-n:] {
		s += float64(l)
	}
	return s / float64(n)
}

// models.Llama learns on the CPU: the causal LM loss of a language whose
// next token is one of two falls from about log(64) (uniform) towards
// log(2) (the best any model can do): below 60% of log(64) within the
// steps, fp32 and bf16-mixed alike, bf16-mixed ending within 3% of fp32
// (16-bit GEMM inputs, float32 norms, loss and master weights, as
// autocast).
func TestLlamaTrainsOnCPU(t *testing.T) {
	steps := 60
	if !testing.Short() {
		steps = 150
	}
	fp32 := trainLlama(t, batchfit.Options{}, steps, 8, 16)
	bf16 := trainLlama(t, batchfit.Options{Precision: "bf16-mixed"}, steps, 8, 16)
	f, b := meanTail(fp32, 5), meanTail(bf16, 5)
	t.Logf("%d steps: loss %.4f → fp32 %.4f, bf16-mixed %.4f (log 64 = %.4f, log 2 = %.4f)", steps, fp32[0], f, b, math.Log(64), math.Log(2))
	assert.InDelta(t, math.Log(64), float64(fp32[0]), 0.3, "the first loss is about uniform's")
	require.Less(t, f, 0.6*math.Log(64), "fp32 did not learn")
	require.Less(t, b, 0.6*math.Log(64), "bf16-mixed did not learn")
	require.InEpsilon(t, f, b, 0.03)
}

// The batch in chunks gives the whole batch's step: with MaxChunk 2 (3
// chunks of the batch of 6) three AdamW steps give the same losses within
// 1e-5 relative and the same parameters within 1e-4 of their magnitude
// (float sums in another order: the chunks' gradients accumulate).
func TestLlamaChunkedEqualsWhole(t *testing.T) {
	run := func(maxChunk int) ([]float32, [][]float32, int) {
		cfg := models.LlamaTiny()
		m := models.NewLlama(nn.Seed(7), cfg)
		sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, MaxChunk: maxChunk})
		require.NoError(t, sess.Err())
		defer sess.Close()
		opt := optim.NewAdamW(1e-2)
		rng := rand.New(rand.NewPCG(9, 9))
		var losses []float32
		for range 3 {
			l, err := sess.Step(context.Background(), llamaLoss(m, llamaCorpus(rng, cfg.Vocab, 6, 12)), nn.ParamTensors(m), opt)
			require.NoError(t, err)
			losses = append(losses, l)
		}
		chunks := len(sess.LastPlan().Chunks)
		require.NoError(t, sess.SyncParams())
		var ps [][]float32
		for _, p := range nn.ParamTensors(m) {
			ps = append(ps, slices.Clone(p.Value().(*tensor.Dense).Data().([]float32)))
		}
		return losses, ps, chunks
	}
	wl, wp, wc := run(0)
	cl, cp, cc := run(2)
	require.Equal(t, 1, wc)
	require.Equal(t, 3, cc)
	for i := range wl {
		require.InEpsilon(t, wl[i], cl[i], 1e-5, "step %d loss", i)
	}
	for k := range wp {
		scale := 0.0
		for _, v := range wp[k] {
			scale = max(scale, math.Abs(float64(v)))
		}
		for i, v := range wp[k] {
			require.InDelta(t, v, cp[k][i], 1e-4*scale, "parameter %d element %d", k, i)
		}
	}
}

// Predicted == measured, to the byte, for models.Llama on the CPU
// executor: fp32 and bf16-mixed, whole and in chunks (the fewest and the
// most the planner picks between 2 MiB budgets), over two AdamW steps
// (the first makes the parameters and optimizer state resident), the
// plan's peaks are the allocator's measured peaks and its Stats'.
func TestLlamaPlannedPeaksAreMeasured(t *testing.T) {
	cfg := models.LlamaConfig{Vocab: 1024, Hidden: 64, Intermediate: 160, Layers: 2, Heads: 4, KVHeads: 2, MaxPositions: 64,
		RMSNormEps: 1e-5, TieEmbeddings: true, Rope: models.Llama32_1B().Rope}
	const n, seq = 24, 32
	ctx := context.Background()
	for _, prec := range []precision.Policy{precision.FP32, precision.BF16Mixed} {
		t.Run(string(prec), func(t *testing.T) {
			build := func(m *models.Llama, rng *rand.Rand) (*lazy.Tensor, []*lazy.Tensor) {
				return llamaLoss(m, llamaCorpus(rng, cfg.Vocab, n, seq)), nn.ParamTensors(m)
			}
			loss, params := build(models.NewLlama(nn.Seed(1), cfg), rand.New(rand.NewPCG(1, 1)))
			prog := mixedProgram(t, prec, loss, params, 2)
			budgets := testutil.TightBudgets(t, prog)
			ks := testutil.Counts(budgets)
			require.Greater(t, len(ks), 1, "chunk counts %v", ks)
			seen := map[int]bool{}
			for _, k := range slices.Compact([]int{ks[0], ks[1], ks[len(ks)-1]}) {
				m := models.NewLlama(nn.Seed(1), cfg)
				rng := rand.New(rand.NewPCG(2, uint64(k)))
				sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, Budget: budgets[k], Precision: string(prec), NoFusedLoss: true})
				require.NoError(t, sess.Err())
				opt := optim.NewAdamW(1e-3)
				for step := range 2 {
					loss, params := build(m, rng)
					l, err := sess.Step(ctx, loss, params, opt)
					require.NoError(t, err)
					require.False(t, math.IsNaN(float64(l)), "loss %g", l)
					pl, used, st := sess.LastPlan(), sess.LastUsage(), sess.Allocator().Stats()
					at := fmt.Sprintf("budget %d (%d chunks) step %d", budgets[k], len(pl.Chunks), step)
					seen[len(pl.Chunks)] = true
					require.LessOrEqual(t, pl.PeakReserved, budgets[k], at)
					require.Equal(t, pl.PeakReserved, used.PeakReserved, "%s: reserved", at)
					require.Equal(t, pl.PeakAllocated, used.PeakAllocated, "%s: allocated", at)
					require.Equal(t, pl.PeakReserved, st.ReservedBytes[alloc.All].Peak, "%s: stats reserved", at)
					require.Zero(t, st.NumOOMs, at)
				}
				require.NoError(t, sess.Close())
			}
			require.True(t, seen[1], "no whole-batch run: %v", seen)
			require.Greater(t, len(seen), 1, "no chunked run: %v", seen)
		})
	}
}

// A bf16-mixed Llama step computes the fp32 step's gradients within 5%
// (‖got − want‖/‖want‖ per parameter): every GEMM input rounds to 8
// significant bits, norms, softmax, the loss and the gradients' sums stay
// float32. And the mixed step holds what a Llama under autocast holds:
// 16-bit RMS norms for the GEMMs (no float32 copy cast), each residual
// add paired with the norm after it, the layers' RMS norm backward fused
// with the residual stream's gradient.
func TestLlamaMixedGradientsNearFloat32(t *testing.T) {
	cfg := models.LlamaTiny()
	tok := llamaCorpus(rand.New(rand.NewPCG(11, 11)), cfg.Vocab, 4, 16)
	grads := func(p precision.Policy) ([][]float32, *graph.Graph) {
		m := models.NewLlama(nn.Seed(13), cfg)
		loss := llamaLoss(m, tok)
		params := nn.ParamTensors(m)
		wrt, err := lazy.ParamIDs(loss, params...)
		require.NoError(t, err)
		st, err := compile.Train(loss.Graph().IR(), loss.ID(), wrt, compile.Options{Policy: p})
		require.NoError(t, err)
		out, err := cpu.New().Run(context.Background(), st.Graph, st.Grads...)
		require.NoError(t, err)
		vals := make([][]float32, len(out))
		for i, d := range out {
			vals[i] = testutil.Float32s(t, d)
		}
		return vals, st.Graph
	}
	want, _ := grads(precision.FP32)
	got, g := grads(precision.BF16Mixed)
	worst := 0.0
	for i := range want {
		e := relErr(got[i], want[i])
		worst = max(worst, e)
		assert.LessOrEqual(t, e, 0.05, "gradient %d", i)
		assert.Positive(t, e, "gradient %d equals fp32's: nothing rounded", i)
	}
	t.Logf("worst relative gradient error bf16-mixed against fp32: %.3g (tolerance 0.05)", worst)
	counts := map[graph.Op]int{}
	paired := 0
	for id, nd := range g.Nodes() {
		counts[nd.Op]++
		if nd.Op == graph.OpRMSNorm && graph.AddRMSNormProducer(g, id) >= 0 {
			paired++
		}
		if nd.Op == graph.OpCast && g.Node(nd.Inputs[0]).Op == graph.OpRMSNorm {
			t.Errorf("node %d casts an RMS norm: the norm should write 16 bits itself", id)
		}
	}
	// Per layer: the post-attention norm after its add; layer 1's input
	// norm after layer 0's MLP add; the final norm after the last add.
	assert.GreaterOrEqual(t, paired, 2*cfg.Layers, "rms_norm paired with the add before it")
	// Each layer's two norms read the residual stream (the first layer's
	// input norm the embedding, which the stream carries on), so their
	// backward meets the stream's gradient; the final norm ends the stream.
	assert.Equal(t, 2*cfg.Layers, counts[graph.OpRMSNormGradXAdd], "rms_norm_grad_x fused with the residual stream's gradient")
	assert.Equal(t, 1, counts[graph.OpRMSNormGradX], "the final norm's")
	assert.Equal(t, cfg.Layers, counts[graph.OpAttentionQKV])
	assert.Equal(t, cfg.Layers, counts[graph.OpRotary])
	assert.Equal(t, cfg.Layers, counts[graph.OpSwiGLU])
}
