package main

import (
	"context"
	"encoding/json"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/recompute"
)

// estimate's plan is the plan a Session's Step runs: for zoo models under
// several policies, a CPU session with estimate's budget, precision,
// micro-batch and recompute mode trains the same model with data, and its
// step's chunks and measured peaks are the ones estimate reported.
func TestEstimateIsSessionStep(t *testing.T) {
	for _, args := range []string{
		"--model mlp --batch 2000 --budget 32MiB --optimizer adam",
		"--model mlp --batch 300 --budget 64MiB --micro-batch 64 --optimizer sgd-momentum",
		"--model gpt-tiny --batch 96 --budget 12MiB --precision bf16-mixed",
		"--model gpt-tiny --batch 96 --budget 8MiB --recompute auto --profile h100",
		"--model convnet --batch 200 --budget 24MiB --precision fp16-mixed",
		"--model llama-tiny --batch 12 --seq 32 --budget 2MiB --precision bf16-mixed --lora 4 --lora-targets q_proj,v_proj,down_proj",
		"--model llama-tiny --batch 6 --seq 32 --budget 8MiB --lora 2",
	} {
		t.Run(args, func(t *testing.T) {
			fields := strings.Fields(args)
			code, stdout, stderr := runCLI(append([]string{"estimate", "--json"}, fields...)...)
			require.Equal(t, exitOK, code, stderr)
			var r report
			require.NoError(t, json.Unmarshal([]byte(stdout), &r))
			require.NotNil(t, r.Plan)

			c, err := parseEstimate(fields)
			require.NoError(t, err)
			b := c.model.build(nn.Options{Rand: rand.New(rand.NewPCG(1, 2)), PerChunkStats: c.perChunk}, c.batch, c.seq, true,
				rand.New(rand.NewPCG(3, 4)), c.adapt())
			require.NoError(t, nn.Check(b.module))
			sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, Budget: c.budget, Precision: string(c.policy),
				MaxChunk: c.microBatch, Recompute: c.recompute, Profile: c.profile})
			defer sess.Close()
			_, err = sess.Step(context.Background(), b.loss, nn.ParamTensors(b.module), makeOptimizer(c.optimizer))
			require.NoError(t, err)
			pl, u := sess.LastPlan(), sess.LastUsage()
			t.Logf("%s in %s, peak %d B", sess.LastRecompute().Strategy, pl.Split, pl.PeakReserved)
			assert.Equal(t, r.Plan.NumChunks, pl.Split.Len())
			assert.Equal(t, r.Plan.Chunk, pl.Chunk)
			assert.Equal(t, r.Plan.PeakReserved, u.PeakReserved, "estimate's peak is the step's measured one")
			assert.Equal(t, r.Plan.PeakAllocated, u.PeakAllocated)
			assert.Equal(t, r.Steps, len(sess.LastProgram().Steps))
			if c.recompute == recompute.Auto {
				require.NotNil(t, r.Recompute)
				assert.Equal(t, r.Recompute.Chosen, sess.LastRecompute().Strategy)
			}
		})
	}
}
