package batchfit_test

import (
	"context"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/internal/testutil"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/optim"
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
	ctx := context.Background()
	const in, hidden, n = 32, 16, 8
	m := newTwoLayer(41, in, hidden)
	require.NoError(t, nn.FreezeAs(graph.BFloat16, m.Params()[0]))
	g := cudaSession(t, batchfit.Options{})
	rng := rand.New(rand.NewPCG(41, 42))
	opt := optim.NewAdamW(1e-2)
	for step := range 2 {
		_, err := g.Step(ctx, mlpStep(m, rng, n, in), nn.ParamTensors(m), opt)
		require.NoError(t, err, "step %d", step)
	}
	x := testutil.UniformF32(rng, n, in)
	eval := func(s *batchfit.Session) []float32 {
		out, err := s.Eval(ctx, m.Forward(lazy.Wrap(x, 0)))
		require.NoError(t, err)
		return testutil.Float32s(t, out[0])
	}
	cpu := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU})
	defer cpu.Close()
	for _, yielded := range []bool{false, true} {
		require.NoError(t, g.SyncParams())
		for _, p := range m.Params() { // what a checkpoint's load does
			f := p.Value().Data().([]float32)
			for i := range f {
				f[i] = float32(rng.NormFloat64()) / 4
			}
		}
		require.NoError(t, cpu.UploadParams()) // the frozen weight is held rounded on the CPU too
		want := eval(cpu)
		require.NotEqual(t, want, eval(g), "yielded %v: the device's copies are still the parameters", yielded)
		if yielded {
			require.NoError(t, g.Yield())
		}
		require.NoError(t, g.UploadParams())
		got := eval(g)
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
	ctx := context.Background()
	const in, hidden, n = 32, 16, 8
	for _, frozen := range []bool{false, true} {
		for _, restoreFirst := range []bool{false, true} {
			name := map[bool]string{false: "float32", true: "frozen-bf16"}[frozen] + map[bool]string{false: "/upload-then-restore", true: "/restore-then-upload"}[restoreFirst]
			t.Run(name, func(t *testing.T) {
				m := newTwoLayer(43, in, hidden)
				if frozen {
					require.NoError(t, nn.FreezeAs(graph.BFloat16, m.Params()[0]))
				}
				g := cudaSession(t, batchfit.Options{})
				rng := rand.New(rand.NewPCG(43, 44))
				opt := optim.NewAdamW(1e-2)
				for step := range 2 {
					_, err := g.Step(ctx, mlpStep(m, rng, n, in), nn.ParamTensors(m), opt)
					require.NoError(t, err, "step %d", step)
				}
				x := testutil.UniformF32(rng, n, in)
				eval := func(s *batchfit.Session) []float32 {
					out, err := s.Eval(ctx, m.Forward(lazy.Wrap(x, 0)))
					require.NoError(t, err)
					return testutil.Float32s(t, out[0])
				}
				require.NoError(t, g.SyncParams())
				require.NoError(t, g.Yield())
				for _, p := range m.Params() {
					f := p.Value().Data().([]float32)
					for i := range f {
						f[i] = float32(rng.NormFloat64()) / 4
					}
				}
				cpu := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU})
				defer cpu.Close()
				want := eval(cpu)
				if restoreFirst {
					require.NoError(t, g.Restore())
				}
				require.NoError(t, g.UploadParams())
				got := eval(g)
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
	ctx := context.Background()
	const in, hidden, n = 32, 16, 8
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
							m := newTwoLayer(47, in, hidden)
							if frozen {
								require.NoError(t, nn.FreezeAs(graph.BFloat16, m.Params()[0]))
							}
							g := cudaSession(t, batchfit.Options{NoCUDAGraphs: !graphs})
							rng := rand.New(rand.NewPCG(47, 48))
							opt := optim.NewAdamW(1e-2)
							x := testutil.UniformF32(rng, n, in)
							eval := func(s *batchfit.Session) []float32 {
								out, err := s.Eval(ctx, m.Forward(lazy.Wrap(x, 0)))
								require.NoError(t, err)
								return testutil.Float32s(t, out[0])
							}
							for step := range 2 {
								_, err := g.Step(ctx, mlpStep(m, rng, n, in), nn.ParamTensors(m), opt)
								require.NoError(t, err, "step %d", step)
							}
							for range 3 { // Eval's graphs: noted, captured, replayed
								eval(g)
							}
							cpu := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU})
							defer cpu.Close()
							for r, rd := range rounds {
								require.NoError(t, g.SyncParams())
								for _, p := range m.Params() {
									f := p.Value().Data().([]float32)
									for i := range f {
										f[i] = float32(rng.NormFloat64()) / 4
									}
								}
								require.NoError(t, cpu.UploadParams())
								want := eval(cpu)
								if rd.evalFirst {
									require.NotEqual(t, want, eval(g), "round %d: the device's copies are still the parameters", r)
								}
								if rd.yielded {
									require.NoError(t, g.Yield())
								}
								require.NoError(t, g.UploadParams())
								got := eval(g)
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
