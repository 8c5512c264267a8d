package batchfit_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/internal/testutil"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/optim"
	"github.com/batchfit/batchfit/planner"
)

// TestPerChunkBatchNormSession on CUDA: the per-chunk ConvNet's step in 1,
// 2 and 3 chunks, planned within budgets for the CUDA kernels' workspaces
// (plus the executor's Overhead), is gradient accumulation's over the
// plan's chunks (loss, SGD update and running statistics within 1e-4
// relative of the CPU reference's, with absolute floors of 1e-5 and 1e-6:
// GPU and CPU sum in different orders), the running
// statistics are updated once from the whole batch's moments, and
// predicted = measured to the byte.
func TestPerChunkBatchNormSessionCUDA(t *testing.T) {
	// 320 samples: with CUDA's workspaces a smaller batch fits whole in
	// the smallest budget that fits anything.
	const n, size, c, lr, momentum = 320, 32, bnChannels, 0.5, 0.5
	probe := cudaSession(t, batchfit.Options{})
	overhead := probe.Overhead()
	d := newBNData(rand.New(rand.NewPCG(75, 76)), n, size)
	ctx := context.Background()
	m := newBNConvNet(true)
	loss, _ := bnLoss(m, d, 0, n, "mean")
	// The session's own workspace rule: its convolutions declare what
	// cuDNN's timed search chose.
	budgets := testutil.TightBudgets(t, testutil.StepProgram(t, probe.Workspace(), loss, m.params(), 0, updateIDs(loss.Graph())...))
	for _, k := range []int{1, 2, 3} {
		budget, ok := budgets[k]
		if !ok {
			t.Fatalf("no budget gives %d chunks (%v)", k, budgets)
		}
		t.Run(fmt.Sprintf("chunks=%d", k), func(t *testing.T) {
			m := newBNConvNet(true)
			m.bn1.Momentum, m.bn2.Momentum = momentum, momentum
			sess := cudaSession(t, batchfit.Options{Budget: budget + overhead})
			loss, _ := bnLoss(m, d, 0, n, "mean")
			params := m.params()
			before := make([][]float32, len(params))
			for i, p := range params {
				before[i] = slices.Clone(f32sOf(p.Value()))
			}
			got, err := sess.Step(ctx, loss, params, optim.NewSGD(lr, 0))
			require.NoError(t, err)
			require.NoError(t, sess.SyncParams())
			pl, used := sess.LastPlan(), sess.LastUsage()
			require.Len(t, pl.Chunks, k)
			require.Equal(t, pl.PeakReserved+sess.Overhead(), used.PeakReserved, "reserved: predicted = measured")
			require.Equal(t, pl.PeakAllocated+sess.Overhead(), used.PeakAllocated, "allocated: predicted = measured")
			if k > 1 {
				require.Equal(t, planner.PerChunkStats, pl.BatchStats)
			}
			ref := accumulate(t, d, pl.Chunks, "mean")
			close32(t, []float32{ref.loss}, []float32{got}, 1e-4, 0, "loss")
			for i, p := range params {
				want := make([]float32, len(before[i]))
				for j := range want {
					want[j] = before[i][j] - lr*ref.grads[i][j]
				}
				close32(t, want, f32sOf(p.Value()), 1e-4, 1e-5, "parameter "+p.Name())
			}
			ones := slices.Repeat([]float32{1}, c)
			for b, bn := range []*nn.BatchNorm2d{m.bn1, m.bn2} {
				bm, bv := batchStats(ref.bnIn[b], c, size*size)
				wm, wv := runningAfter(momentum, make([]float32, c), ones, bm, bv)
				close32(t, wm, f32sOf(bn.RunningMean.Value()), 1e-4, 1e-6, fmt.Sprintf("bn%d running mean", b+1))
				close32(t, wv, f32sOf(bn.RunningVar.Value()), 1e-4, 1e-6, fmt.Sprintf("bn%d running variance", b+1))
			}
		})
	}
}
