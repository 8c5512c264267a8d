package batchfit_test

import (
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/models"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/precision"
)

// The written-out Llama (models.LlamaConfig.WrittenOut) on CUDA through
// the Session, with its fused_pointwise nodes run by generated kernels:
// the losses of four AdamW steps agree with the CPU session's (fp32 within
// 1e-4 relative, bf16-mixed within 1e-2), the plan's peaks plus Overhead
// are the measured ones at every step (exec/cuda's TestPointwiseFuzzGPU
// checks the kernels themselves). Rows of 256 make each norm's weight
// gradient a column sum of its backward kernel; in two chunks (MaxChunk 2)
// the chunks' sums add up to the CPU's whole-batch step.
func TestSessionCUDAWrittenLlama(t *testing.T) {
	const steps, n, seq = 4, 4, 64
	for _, c := range []struct {
		prec     precision.Policy
		rtol     float64
		maxChunk int
	}{{precision.FP32, 1e-4, 0}, {precision.BF16Mixed, 1e-2, 0}, {precision.FP32, 1e-4, 2}} {
		name := string(c.prec)
		if c.maxChunk > 0 {
			name += "/chunked"
		}
		t.Run(name, func(t *testing.T) {
			gpu := cudaSession(t, batchfit.Options{Precision: string(c.prec), MaxChunk: c.maxChunk})
			cpu := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, Precision: string(c.prec)})
			defer cpu.Close()
			cfg := llamaCUDAConfig()
			cfg.WrittenOut = true
			gm, cm := models.NewLlama(nn.Seed(31), cfg), models.NewLlama(nn.Seed(31), cfg)
			stepAgainstCPU(t, gpu, cpu, gm, cm, 1e-3, rand.New(rand.NewPCG(33, 34)), steps, n, seq, c.rtol)
			fused := 0
			for _, nd := range gpu.LastProgram().Graph.Nodes() {
				if nd.Op == graph.OpFusedPointwise {
					fused++
				}
			}
			require.Positive(t, fused)
			assert.Equal(t, 2*cfg.Layers+1, colSums(gpu.LastProgram().Graph), "a column sum for each norm's weight")
			if c.maxChunk > 0 {
				assert.Equal(t, n/c.maxChunk, gpu.LastPlan().Split.Len())
			}
		})
	}
}
