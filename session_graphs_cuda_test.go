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
// on (BATCHFIT_CUDA_GRAPHS=1) computes what eager launching
// (BATCHFIT_CUDA_GRAPHS=0) does, for an MLP, a GPT with dropout (its
// counter advances every step, so the graphs must follow it), a fused-
// attention GPT and a ConvNet with dropout, in fp32, bf16-mixed and
// fp16-mixed (loss scaling), whole and in chunks of a quarter batch, five
// Adam steps each (a segment is captured on the third step, when its
// fingerprint comes the second time, and replayed on the fourth and fifth). The GPTs' token embedding is not trained:
// embedding_grad adds with float atomicAdd, so eager runs that train it
// differ from each other in the last bits, and Adam makes that visible.
// Eager training runs twice: where those two runs are bit-equal, the
// graphs' run must be too, every step's loss and every parameter after the
// last step (tolerance zero: the same kernels with the same arguments on
// the same data). Where they are not (a library's nondeterministic
// kernel), the graphs' run may differ from the first eager run by at most
// ten times as much as the second does (losses relative, parameters
// relative to each tensor's largest magnitude); both are logged. In every
// case no capture failed and every step's measured peaks are the planned
// ones plus the overhead, to the byte; where segments repeat, graphs were
// replayed.
func TestSessionCUDAGraphsBitEqual(t *testing.T) {
	const steps = 5
	ctx := context.Background()
	for _, prec := range []string{"fp32", "bf16-mixed", "fp16-mixed"} {
		for _, mc := range []struct {
			newModel func() testutil.TrainModel
			n        int
			frozen   int // the parameter not trained (the GPTs' token embedding), −1 for none
			// replays: some segment repeats from step to step, so graphs
			// are replayed. The MLP's and the GPT's dropout is in every
			// segment with a new counter each step: no graph is worth
			// capturing there (a fingerprint is captured on its second
			// sighting).
			replays bool
		}{
			{func() testutil.TrainModel { return testutil.MLPModel(784, 64, true) }, 256, -1, false},
			{func() testutil.TrainModel { return testutil.GPTModel(64, true) }, 128, 1, false},
			{func() testutil.TrainModel { return testutil.FusedGPTModel(64, false) }, 128, 1, true},
			{func() testutil.TrainModel { return testutil.ConvModel(12, true) }, 256, -1, true},
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
							if mc.frozen >= 0 { // models.GPT's Params: wpe, then wte's [vocab, dim] weight
								require.Equal(t, []int{64, 16}, []int(params[mc.frozen].Shape()))
								params = append(params[:mc.frozen:mc.frozen], params[mc.frozen+1:]...)
							}
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
					againLoss, againParams, _ := run("0")
					gotLoss, gotParams, s := run("1")
					eagerDiff := maxDiff(wantLoss, againLoss, wantParams, againParams)
					graphDiff := maxDiff(wantLoss, gotLoss, wantParams, gotParams)
					t.Logf("largest relative difference from the first eager run: eager again %g, graphs %g", eagerDiff, graphDiff)
					st, ok := batchfit.CUDAGraphStats(s)
					require.True(t, ok)
					t.Logf("graphs: %+v", st)
					require.NoError(t, st.LastFailure)
					assert.Zero(t, st.Failed)
					if mc.replays {
						assert.Positive(t, st.Replays, "no segment was replayed")
					}
					nonzero := false
					for _, w := range wantParams {
						for _, v := range w {
							nonzero = nonzero || v != 0
						}
					}
					require.True(t, nonzero, "the parameters are not all zero")
					if eagerDiff == 0 {
						assert.Zero(t, graphDiff, "eager training is reproducible here, so the graphs' must be bit-equal")
					} else {
						assert.LessOrEqual(t, graphDiff, 10*eagerDiff, "eager runs differ from each other; graphs may differ 10 times as much")
					}
				})
			}
		}
	}
}

// maxDiff is the largest difference between two runs: each step's loss
// relative to its magnitude, each parameter relative to its tensor's
// largest magnitude; 0 only when both are bit-equal. Mismatched lengths
// count as 1.
func maxDiff(la, lb []float32, pa, pb [][]float32) float64 {
	if len(la) != len(lb) || len(pa) != len(pb) {
		return 1
	}
	d := 0.0
	for i := range la {
		if math.Float32bits(la[i]) != math.Float32bits(lb[i]) {
			d = math.Max(d, math.Max(math.Abs(float64(la[i]-lb[i]))/math.Abs(float64(la[i])), 1e-30))
		}
	}
	for i := range pa {
		if len(pa[i]) != len(pb[i]) {
			return 1
		}
		scale := 0.0
		for _, v := range pa[i] {
			scale = math.Max(scale, math.Abs(float64(v)))
		}
		for j := range pa[i] {
			if math.Float32bits(pa[i][j]) != math.Float32bits(pb[i][j]) {
				d = math.Max(d, math.Max(math.Abs(float64(pa[i][j]-pb[i][j]))/scale, 1e-30))
			}
		}
	}
	return d
}
