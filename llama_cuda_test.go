package batchfit_test

import (
	"context"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/models"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/optim"
	"github.com/batchfit/batchfit/precision"
)

// llamaCUDAConfig is a Llama with Llama 3's head dim 64 (cuDNN's and the
// vector kernels' shapes), grouped-query heads and llama3 rope scaling,
// small enough for a quick test.
func llamaCUDAConfig() models.LlamaConfig {
	return models.LlamaConfig{Vocab: 512, Hidden: 256, Intermediate: 512, Layers: 2, Heads: 4, KVHeads: 2, HeadDim: 64,
		MaxPositions: 256, RMSNormEps: 1e-5, TieEmbeddings: true, Rope: models.Llama32_1B().Rope}
}

// stepAgainstCPU runs steps AdamW steps (learning rate lr) of Llama gm
// on the CUDA session gpu and of its twin cm on the CPU session cpu, over
// the same batches of n sequences of seq tokens drawn from rng: each
// step's losses agree within rtol relative, and gpu's planned peaks plus
// Overhead are the measured ones.
func stepAgainstCPU(t *testing.T, gpu, cpu *batchfit.Session, gm, cm *models.Llama, lr float64, rng *rand.Rand, steps, n, seq int, rtol float64) {
	t.Helper()
	ctx := context.Background()
	gopt, copt := optim.NewAdamW(lr), optim.NewAdamW(lr)
	for step := range steps {
		tok := llamaCorpus(rng, gm.Config().Vocab, n, seq)
		want, err := cpu.Step(ctx, llamaLoss(cm, tok), nn.ParamTensors(cm), copt)
		require.NoError(t, err)
		got, err := gpu.Step(ctx, llamaLoss(gm, tok), nn.ParamTensors(gm), gopt)
		require.NoError(t, err)
		pl, used := gpu.LastPlan(), gpu.LastUsage()
		t.Logf("step %d: loss cpu %.6f, cuda %.6f; reserved predicted %d + overhead %d, measured %d",
			step, want, got, pl.PeakReserved, gpu.Overhead(), used.PeakReserved)
		require.False(t, math.IsNaN(float64(got)))
		assert.InEpsilon(t, want, got, rtol, "step %d loss", step)
		assert.Equal(t, pl.PeakReserved+gpu.Overhead(), used.PeakReserved, "step %d: peak reserved", step)
		assert.Equal(t, pl.PeakAllocated+gpu.Overhead(), used.PeakAllocated, "step %d: peak allocated", step)
	}
}

// models.Llama on CUDA through the Session, in fp32 and bf16-mixed: the
// losses of five AdamW steps agree with the CPU session's (fp32 within
// 1e-4 relative; bf16-mixed within 1e-2, 16-bit GEMMs summing in other
// orders), the plan's peaks plus Overhead are the measured ones at every
// step (exec/cuda's TestAddRMSNormMatchesCPU, TestRMSNormGradFusedMatchesCPU
// and TestRotarySwiGLUMatchCPU check that the fused passes run).
func TestSessionCUDALlama(t *testing.T) {
	const steps, n, seq = 4, 4, 64
	for _, c := range []struct {
		prec precision.Policy
		rtol float64
	}{{precision.FP32, 1e-4}, {precision.BF16Mixed, 1e-2}} {
		t.Run(string(c.prec), func(t *testing.T) {
			gpu := cudaSession(t, batchfit.Options{Precision: string(c.prec)})
			cpu := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, Precision: string(c.prec)})
			defer cpu.Close()
			cfg := llamaCUDAConfig()
			gm, cm := models.NewLlama(nn.Seed(31), cfg), models.NewLlama(nn.Seed(31), cfg)
			stepAgainstCPU(t, gpu, cpu, gm, cm, 1e-3, rand.New(rand.NewPCG(33, 34)), steps, n, seq, c.rtol)
		})
	}
}
