package batchfit_test

import (
	"context"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/internal/testutil"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/models"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/optim"
)

// Under a mixed policy a GPT written with q, k and v sliced from one
// projection trains exactly as the zoo's packed one: the step's attention
// fusion (the pipeline's fuse-attention-qkv pass, graph.FuseAttentionQKV) leaves no slice or
// permute of the attention, and three steps give the same losses and
// parameters, bit for bit, on the CPU.
func TestSessionFusesUnpackedAttention(t *testing.T) {
	ctx := context.Background()
	for _, prec := range []string{"bf16-mixed", "fp16-mixed"} {
		t.Run(prec, func(t *testing.T) {
			train := func(unpacked bool) ([]float32, [][]float32, *batchfit.Session) {
				cfg := models.GPTConfig{Vocab: 32, Context: 8, Layers: 2, Heads: 2, Dim: 16, UnpackedAttention: unpacked}
				m := models.NewGPT(nn.Seed(5), cfg)
				sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, Precision: prec})
				require.NoError(t, sess.Err())
				opt := optim.NewAdamW(1e-2)
				rng := rand.New(rand.NewPCG(7, 8))
				var losses []float32
				for range 3 {
					tokens := lazy.Wrap(testutil.Classes(rng, 32, 4, 8), 0)
					targets := tokens.Graph().Wrap(testutil.Classes(rng, 32, 4, 8), 0)
					l, err := sess.Step(ctx, models.Loss(m.Forward(tokens), targets), nn.ParamTensors(m), opt)
					require.NoError(t, err)
					losses = append(losses, l)
				}
				require.NoError(t, sess.SyncParams())
				var params [][]float32
				for _, p := range nn.ParamTensors(m) {
					params = append(params, slicesClone(p.Value().(*tensor.Dense).Data().([]float32)))
				}
				return losses, params, sess
			}
			packedLoss, packedParams, _ := train(false)
			unpackedLoss, unpackedParams, sess := train(true)
			defer sess.Close()
			for _, nd := range sess.LastProgram().Graph.Nodes() {
				require.NotEqual(t, graph.OpPermute, nd.Op, "node %d: the attention's permutes were fused away", nd.ID)
				require.NotEqual(t, graph.OpAttention, nd.Op, "node %d", nd.ID)
			}
			require.Equal(t, packedLoss, unpackedLoss)
			require.Equal(t, packedParams, unpackedParams)
		})
	}
}

func slicesClone(s []float32) []float32 { return append([]float32(nil), s...) }
