package batchfit_test

import (
	"math"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/internal/testutil"
)

// Host tensors written after a CUDA session has stepped (a checkpoint
// loaded into it) are not seen until UploadParams copies them over the
// device's resident copies: float32 parameters and a frozen bfloat16 one
// (rounded as it is stored), the session running and yielded. Evaluated
// afterwards, the session gives the CPU's outputs for the new values.
//
// Tolerance: 1e-5·(1 + |want|) (float32 GEMMs of 32 and 16 terms in
// another order; both read the frozen weight rounded to bfloat16 alike).
func TestSessionCUDAUploadParams(t *testing.T) {
	g := cudaSession(t, batchfit.Options{})
	m, rng := trainedTwoLayer(t, g, 41, true)
	x := testutil.UniformF32(rng, uploadBatch, uploadIn)
	cpu := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU})
	defer cpu.Close()
	for _, yielded := range []bool{false, true} {
		require.NoError(t, g.SyncParams())
		writeParams(rng, m.Params()...)        // what a checkpoint's load does
		require.NoError(t, cpu.UploadParams()) // the frozen weight is held rounded on the CPU too
		want := evalTwoLayer(t, cpu, m, x)
		require.NotEqual(t, want, evalTwoLayer(t, g, m, x), "yielded %v: the device's copies are still the parameters", yielded)
		if yielded {
			require.NoError(t, g.Yield())
		}
		require.NoError(t, g.UploadParams())
		got := evalTwoLayer(t, g, m, x)
		for i := range want {
			require.InDelta(t, want[i], got[i], 1e-5*(1+math.Abs(float64(want[i]))), "yielded %v: output %d", yielded, i)
		}
	}
}

// UploadParams while yielded, parameter by parameter kind: float32 only
// and with a frozen bfloat16 weight, uploading before the Restore (into
// the host copies Restore loads) and after an explicit Restore (onto the
// device). Each way the next Eval gives the CPU's outputs for the values
// written into the host tensors.
//
// Tolerance: 1e-5·(1 + |want|), as above.
func TestSessionCUDAUploadParamsWhileYielded(t *testing.T) {
	for _, frozen := range []bool{false, true} {
		for _, restoreFirst := range []bool{false, true} {
			name := map[bool]string{false: "float32", true: "frozen-bf16"}[frozen] + map[bool]string{false: "/upload-then-restore", true: "/restore-then-upload"}[restoreFirst]
			t.Run(name, func(t *testing.T) {
				g := cudaSession(t, batchfit.Options{})
				m, rng := trainedTwoLayer(t, g, 43, frozen)
				x := testutil.UniformF32(rng, uploadBatch, uploadIn)
				require.NoError(t, g.SyncParams())
				require.NoError(t, g.Yield())
				writeParams(rng, m.Params()...)
				cpu := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU})
				defer cpu.Close()
				want := evalTwoLayer(t, cpu, m, x)
				if restoreFirst {
					require.NoError(t, g.Restore())
				}
				require.NoError(t, g.UploadParams())
				got := evalTwoLayer(t, g, m, x)
				for i := range want {
					require.InDelta(t, want[i], got[i], 1e-5*(1+math.Abs(float64(want[i]))), "output %d", i)
				}
			})
		}
	}
}

// UploadParams after an Eval of the old device values, yielded or not,
// with CUDA graphs on and off, with or without a frozen bfloat16 weight,
// and with an earlier write and UploadParams round (running or yielded)
// before the one checked: the Eval after each upload gives the CPU's
// outputs for the values written into the host tensors (the CPU session,
// used for every round, uploads too: it holds the frozen weight rounded).
// Each case is its own session, so a failure names the conditions it
// needs.
//
// Tolerance: 1e-5·(1 + |want|), as above.
func TestSessionCUDAUploadParamsAfterEval(t *testing.T) {
	type round struct{ evalFirst, yielded bool }
	for _, graphs := range []bool{true, false} {
		for _, frozen := range []bool{false, true} {
			for _, before := range []string{"", "running", "yielded"} {
				for _, evalFirst := range []bool{false, true} {
					for _, yielded := range []bool{false, true} {
						rounds := []round{{evalFirst, yielded}}
						if before != "" {
							rounds = append([]round{{true, before == "yielded"}}, rounds...)
						}
						name := map[bool]string{true: "graphs", false: "eager"}[graphs] +
							map[bool]string{false: "/float32", true: "/frozen-bf16"}[frozen] +
							map[string]string{"": "", "running": "/after-running-upload", "yielded": "/after-yielded-upload"}[before] +
							map[bool]string{false: "/no-eval", true: "/eval-first"}[evalFirst] +
							map[bool]string{false: "/running", true: "/yielded"}[yielded]
						t.Run(name, func(t *testing.T) {
							g := cudaSession(t, batchfit.Options{NoCUDAGraphs: !graphs})
							m, rng := trainedTwoLayer(t, g, 47, frozen)
							x := testutil.UniformF32(rng, uploadBatch, uploadIn)
							for range 3 { // Eval's graphs: noted, captured, replayed
								evalTwoLayer(t, g, m, x)
							}
							cpu := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU})
							defer cpu.Close()
							for r, rd := range rounds {
								require.NoError(t, g.SyncParams())
								writeParams(rng, m.Params()...)
								require.NoError(t, cpu.UploadParams())
								want := evalTwoLayer(t, cpu, m, x)
								if rd.evalFirst {
									require.NotEqual(t, want, evalTwoLayer(t, g, m, x), "round %d: the device's copies are still the parameters", r)
								}
								if rd.yielded {
									require.NoError(t, g.Yield())
								}
								require.NoError(t, g.UploadParams())
								got := evalTwoLayer(t, g, m, x)
								for i := range want {
									require.InDelta(t, want[i], got[i], 1e-5*(1+math.Abs(float64(want[i]))), "round %d: output %d", r, i)
								}
							}
						})
					}
				}
			}
		}
	}
}
