package batchfit_test

import (
	"context"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/models"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/optim"
	"github.com/batchfit/batchfit/planner"
)

// llamaLogits evaluates m's logits on tok on the CPU in float32.
func llamaLogits(t *testing.T, m *models.Llama, tok *tensor.Dense) []float32 {
	t.Helper()
	sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU})
	require.NoError(t, sess.Err())
	defer sess.Close()
	out, err := sess.Eval(context.Background(), m.Forward(lazy.Wrap(tok, 0)))
	require.NoError(t, err)
	return slices.Clone(out[0].Float32s())
}

// A Llama adapted on every linear layer with fresh adapters (B = 0)
// computes its base's logits exactly, bit for bit: the packed q/k/v
// product's update is an exact zero.
func TestLlamaLoRAZeroInitIsBase(t *testing.T) {
	cfg := models.LlamaTiny()
	tok := llamaCorpus(rand.New(rand.NewPCG(1, 1)), cfg.Vocab, 2, 12)
	base := models.NewLlama(nn.Seed(4), cfg)
	adapted := models.NewLlama(nn.Seed(4), cfg)
	ls, err := nn.LoRA{Rank: 4, Alpha: 8, Targets: nn.DefaultLoRATargets, Base: graph.Float32}.Apply(nn.Seed(5), adapted)
	require.NoError(t, err)
	require.Len(t, ls, 7*cfg.Layers)
	require.Equal(t, llamaLogits(t, base, tok), llamaLogits(t, adapted, tok))
}

// A Llama with trained (random) adapters computes what its merged weights
// compute (MergeLoRA into a plain Llama): for the packed q/k/v product's
// update, adapting all three, a subset (q and v: zero blocks between), one
// alone (k), and with unequal scales (each adapter's down product apart).
//
// Tolerance: 1e-4 of the logits' magnitude (float32 sums in another
// order).
func TestLlamaLoRAMergeEqualsAdapted(t *testing.T) {
	cfg := models.LlamaTiny()
	tok := llamaCorpus(rand.New(rand.NewPCG(2, 2)), cfg.Vocab, 2, 10)
	for _, tc := range []struct {
		name    string
		targets []string
		alphaK  float64 // k_proj's alpha when set: scales differ
	}{
		{"all", nn.DefaultLoRATargets, 0},
		{"q,v", []string{"q_proj", "v_proj", "down_proj"}, 0},
		{"k", []string{"k_proj"}, 0},
		{"scales", []string{"q_proj", "k_proj", "v_proj", "o_proj"}, 3},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m := models.NewLlama(nn.Seed(6), cfg)
			ls, err := nn.LoRA{Rank: 3, Alpha: 6, Targets: tc.targets, Base: graph.Float32}.Apply(nn.Seed(7), m)
			require.NoError(t, err)
			rng := rand.New(rand.NewPCG(8, 9))
			for _, l := range ls {
				d := l.Layer.B.Value().Data().([]float32)
				for i := range d {
					d[i] = float32(rng.NormFloat64() * 0.1)
				}
				if tc.alphaK != 0 && strings.HasSuffix(l.Path, "k_proj") {
					l.Layer.Alpha = tc.alphaK
				}
			}
			merged, err := nn.MergeLoRA(m)
			require.NoError(t, err)
			plain := models.NewLlama(nn.Seed(100), cfg)
			require.Len(t, plain.Params(), len(merged))
			for i, p := range plain.Params() {
				require.Equal(t, p.Name(), merged[i].Name())
				copy(p.Value().Data().([]float32), merged[i].Value().Data().([]float32))
			}
			base := llamaLogits(t, models.NewLlama(nn.Seed(6), cfg), tok)
			want, got := llamaLogits(t, plain, tok), llamaLogits(t, m, tok)
			require.NotEqual(t, base, got, "the adapters change the logits")
			scale := 0.0
			for _, v := range want {
				scale = max(scale, math.Abs(float64(v)))
			}
			for i := range want {
				require.InDelta(t, want[i], got[i], 1e-4*scale, "logit %d", i)
			}
		})
	}
}

// A LoRA fine-tune of llama-tiny on the CPU, fp32 and bf16-mixed, with
// its base in bfloat16: the loss falls (by more than 0.15 nats from the
// first step to the mean of the last five, about log 64 to below 3.95 at
// 40 AdamW steps of 1e-2 over a frozen random base); only the adapters are trained
// (the program's trained parameters are exactly the lora_A and lora_B
// weights, every optimizer state buffer is one of theirs, two AdamW slots
// each), the base's weights are resident in 2 bytes an element and do not
// move; and every step's planned peaks are the measured ones to the byte.
func TestLlamaLoRAFineTuneOnCPU(t *testing.T) {
	for _, prec := range []string{"fp32", "bf16-mixed"} {
		t.Run(prec, func(t *testing.T) {
			cfg := models.LlamaTiny()
			m := models.NewLlama(nn.Seed(3), cfg)
			ls, err := nn.LoRA{Rank: 4, Alpha: 8, Targets: nn.DefaultLoRATargets}.Apply(nn.Seed(4), m)
			require.NoError(t, err)
			before := map[string][]float32{}
			for _, p := range m.Params() {
				before[p.Name()] = slices.Clone(p.Value().Data().([]float32))
			}
			sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, Precision: prec})
			require.NoError(t, sess.Err())
			defer sess.Close()
			opt := optim.NewAdamW(1e-2)
			rng := rand.New(rand.NewPCG(5, 5))
			var losses []float32
			for step := range 40 {
				l, err := sess.Step(context.Background(), llamaLoss(m, llamaCorpus(rng, cfg.Vocab, 8, 16)), nn.ParamTensors(m), opt)
				require.NoError(t, err, "step %d", step)
				losses = append(losses, l)
				pl, used := sess.LastPlan(), sess.LastUsage()
				require.Equal(t, pl.PeakReserved, used.PeakReserved, "step %d: reserved, predicted = measured", step)
				require.Equal(t, pl.PeakAllocated, used.PeakAllocated, "step %d: allocated, predicted = measured", step)
			}
			t.Logf("%s: loss %.4f → %.4f", prec, losses[0], meanTail(losses, 5))
			require.Less(t, meanTail(losses, 5), float64(losses[0])-0.15, "the loss falls")

			p := sess.LastProgram()
			adapters := map[string]bool{}
			var adapterBytes int64
			for _, a := range ls {
				adapters[a.Layer.A.Name()], adapters[a.Layer.B.Name()] = true, true
				adapterBytes += 4 * int64(graph.Numel(a.Layer.A.Shape())+graph.Numel(a.Layer.B.Shape()))
			}
			var trained []string
			for _, id := range p.Trained {
				trained = append(trained, p.Graph.Node(id).Name)
			}
			require.Len(t, trained, len(adapters))
			for _, n := range trained {
				require.True(t, adapters[n], "trained %s", n)
			}
			var state, half int64
			for _, b := range p.Buffers {
				nd := p.Graph.Node(b.Node)
				switch {
				case b.Kind == planner.BufState:
					require.True(t, adapters[nd.Name], "optimizer state of %s", nd.Name)
					state += b.Bytes(0)
				case b.Kind == planner.BufParam && nd.Op == graph.OpParam && !adapters[nd.Name] && strings.HasSuffix(nd.Name, "proj.weight"):
					require.Equal(t, graph.BFloat16, nd.Type.DType, nd.Name)
					half += b.Bytes(0)
				}
			}
			require.Equal(t, 2*adapterBytes, state, "two AdamW slots of the adapters, nothing else")
			require.Positive(t, half)

			require.NoError(t, sess.SyncParams())
			for _, p := range m.Params() {
				now := p.Value().Data().([]float32)
				if adapters[p.Name()] {
					if strings.Contains(p.Name(), "lora_B") {
						require.NotEqual(t, before[p.Name()], now, "%s trains", p.Name())
					}
					continue
				}
				require.Equal(t, before[p.Name()], now, "%s does not move", p.Name())
			}
		})
	}
}

// GPT takes adapters by its own layer names (c_attn, both c_proj, c_fc):
// fresh ones give the base's logits exactly, trained ones what the merged
// weights give (within 1e-4 of the logits' magnitude), and a bf16-mixed
// LoRA step over its bfloat16 base plans its peaks to the byte.
func TestGPTLoRA(t *testing.T) {
	cfg := models.GPTConfig{Vocab: 32, Context: 32, Layers: 2, Heads: 2, Dim: 32}
	tok := llamaCorpus(rand.New(rand.NewPCG(1, 2)), cfg.Vocab, 2, 16)
	logits := func(m *models.GPT) []float32 {
		sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU})
		defer sess.Close()
		out, err := sess.Eval(context.Background(), m.Forward(lazy.Wrap(tok, 0)))
		require.NoError(t, err)
		return slices.Clone(out[0].Float32s())
	}
	targets := []string{"c_attn", "c_proj", "c_fc"}
	base, m := models.NewGPT(nn.Seed(3), cfg), models.NewGPT(nn.Seed(3), cfg)
	ls, err := nn.LoRA{Rank: 4, Alpha: 8, Targets: targets, Base: graph.Float32}.Apply(nn.Seed(4), m)
	require.NoError(t, err)
	require.Len(t, ls, 4*cfg.Layers)
	want := logits(base)
	require.Equal(t, want, logits(m))
	rng := rand.New(rand.NewPCG(5, 6))
	for _, l := range ls {
		d := l.Layer.B.Value().Data().([]float32)
		for i := range d {
			d[i] = float32(0.1 * rng.NormFloat64())
		}
	}
	merged, err := nn.MergeLoRA(m)
	require.NoError(t, err)
	plain := models.NewGPT(nn.Seed(100), cfg)
	for i, p := range plain.Params() {
		require.Equal(t, p.Name(), merged[i].Name())
		copy(p.Value().Data().([]float32), merged[i].Value().Data().([]float32))
	}
	tuned, folded := logits(m), logits(plain)
	require.NotEqual(t, want, tuned)
	scale := 0.0
	for _, v := range folded {
		scale = max(scale, math.Abs(float64(v)))
	}
	for i := range folded {
		require.InDelta(t, folded[i], tuned[i], 1e-4*scale, "logit %d", i)
	}

	g := models.NewGPT(nn.Seed(7), cfg)
	_, err = nn.LoRA{Rank: 4, Targets: targets}.Apply(nn.Seed(8), g)
	require.NoError(t, err)
	sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, Precision: "bf16-mixed"})
	defer sess.Close()
	opt := optim.NewAdamW(1e-2)
	for step := range 3 {
		x := lazy.Wrap(tok, 0)
		l, err := sess.Step(context.Background(), models.Loss(g.Forward(x), x.Graph().Wrap(tok.Clone().(*tensor.Dense), 0)), nn.ParamTensors(g), opt)
		require.NoError(t, err)
		require.False(t, math.IsNaN(float64(l)))
		pl, used := sess.LastPlan(), sess.LastUsage()
		require.Equal(t, pl.PeakReserved, used.PeakReserved, "step %d", step)
		require.Equal(t, pl.PeakAllocated, used.PeakAllocated, "step %d", step)
	}
}

// With lora_dropout in training mode, each adapter of the packed q/k/v
// product drops its own input (its own module, its own seed): the step
// runs, every adapter's counter advances once a step, and the planned
// peaks are the measured ones.
func TestLlamaLoRADropoutTrains(t *testing.T) {
	cfg := models.LlamaTiny()
	m := models.NewLlama(nn.Seed(3), cfg)
	ls, err := nn.LoRA{Rank: 4, Dropout: 0.1, Targets: []string{"q_proj", "k_proj", "v_proj"}}.Apply(nn.Seed(4), m)
	require.NoError(t, err)
	nn.SetTraining(m, true)
	seeds := map[uint64]bool{}
	for _, l := range ls {
		seeds[l.Layer.Dropout.Seed] = true
	}
	require.Len(t, seeds, len(ls), "one seed per adapter")
	sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, Precision: "bf16-mixed"})
	defer sess.Close()
	opt := optim.NewAdamW(1e-2)
	rng := rand.New(rand.NewPCG(5, 5))
	for step := range 3 {
		l, err := sess.Step(context.Background(), llamaLoss(m, llamaCorpus(rng, cfg.Vocab, 4, 16)), nn.ParamTensors(m), opt)
		require.NoError(t, err)
		require.False(t, math.IsNaN(float64(l)))
		pl, used := sess.LastPlan(), sess.LastUsage()
		require.Equal(t, pl.PeakReserved, used.PeakReserved, "step %d", step)
		require.Equal(t, pl.PeakAllocated, used.PeakAllocated, "step %d", step)
	}
	for _, l := range ls {
		require.Equal(t, uint64(3), l.Layer.Dropout.Step(), l.Path)
	}
}
