package batchfit_test

import (
	"context"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/internal/testutil"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/optim"
)

// TestSessionCUDAGraphsBitEqual: training with the CUDA executor's graphs
// on (BATCHFIT_CUDA_GRAPHS=1) computes exactly what eager launching
// (BATCHFIT_CUDA_GRAPHS=0) does: for an MLP, a GPT with dropout (its
// counter advances every step, so the graphs must follow it), a fused-
// attention GPT and a ConvNet with dropout, in fp32, bf16-mixed and
// fp16-mixed (loss scaling), whole and in chunks of a quarter batch, with
// Adam, every step's loss and every parameter after the last step are
// bit-equal (tolerance zero: the same kernels with the same arguments on
// the same data), graphs were replayed, no capture failed, and every
// step's measured peaks are the planned ones plus the overhead, to the
// byte.
func TestSessionCUDAGraphsBitEqual(t *testing.T) {
	const steps = 5
	ctx := context.Background()
	for _, prec := range []string{"fp32", "bf16-mixed", "fp16-mixed"} {
		for _, mc := range []struct {
			newModel func() testutil.TrainModel
			n        int
		}{
			{func() testutil.TrainModel { return testutil.MLPModel(784, 64, true) }, 256},
			{func() testutil.TrainModel { return testutil.GPTModel(64, true) }, 128},
			{func() testutil.TrainModel { return testutil.FusedGPTModel(64, false) }, 128},
			{func() testutil.TrainModel { return testutil.ConvModel(12, true) }, 256},
		} {
			for _, chunked := range []bool{false, true} {
				name := prec + "/" + mc.newModel().Name
				if chunked {
					name += "/chunked"
				}
				t.Run(name, func(t *testing.T) {
					o := batchfit.Options{Precision: prec}
					if chunked {
						o.MaxChunk = mc.n / 4
					}
					run := func(graphs string) ([]float32, [][]float32, *batchfit.Session) {
						t.Setenv("BATCHFIT_CUDA_GRAPHS", graphs)
						s := cudaSession(t, o)
						m := mc.newModel()
						rng := rand.New(rand.NewPCG(71, 72))
						opt := optim.NewAdam(1e-3)
						var losses []float32
						var params []*lazy.Tensor
						for step := range steps {
							var loss *lazy.Tensor
							loss, params = m.Build(rng, mc.n)
							l, err := s.Step(ctx, loss, params, opt)
							require.NoError(t, err, "graphs=%s step %d", graphs, step)
							losses = append(losses, l)
							pl, used := s.LastPlan(), s.LastUsage()
							if chunked {
								require.Greater(t, len(pl.Chunks), 1)
							}
							assert.Equal(t, pl.PeakReserved+s.Overhead(), used.PeakReserved, "graphs=%s step %d: peak reserved", graphs, step)
							assert.Equal(t, pl.PeakAllocated+s.Overhead(), used.PeakAllocated, "graphs=%s step %d: peak allocated", graphs, step)
						}
						require.NoError(t, s.SyncParams())
						var vals [][]float32
						for _, p := range params {
							vals = append(vals, append([]float32(nil), p.Value().Data().([]float32)...))
						}
						return losses, vals, s
					}
					wantLoss, wantParams, _ := run("0")
					gotLoss, gotParams, s := run("1")
					st, ok := batchfit.CUDAGraphStats(s)
					require.True(t, ok)
					t.Logf("graphs: %+v", st)
					require.NoError(t, st.LastFailure)
					assert.Zero(t, st.Failed)
					assert.Positive(t, st.Replays, "no segment was replayed")
					require.Len(t, gotLoss, len(wantLoss))
					for i := range wantLoss {
						assert.Equal(t, math.Float32bits(wantLoss[i]), math.Float32bits(gotLoss[i]), "step %d loss: eager %v, graphs %v", i, wantLoss[i], gotLoss[i])
					}
					require.Len(t, gotParams, len(wantParams))
					nonzero := false
					for i := range wantParams {
						require.Len(t, gotParams[i], len(wantParams[i]))
						for j := range wantParams[i] {
							nonzero = nonzero || wantParams[i][j] != 0
							if math.Float32bits(wantParams[i][j]) != math.Float32bits(gotParams[i][j]) {
								t.Fatalf("param %d [%d]: eager %v, graphs %v", i, j, wantParams[i][j], gotParams[i][j])
							}
						}
					}
					require.True(t, nonzero, "the parameters are not all zero")
				})
			}
		}
	}
}
