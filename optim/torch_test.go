package optim_test

import (
	"encoding/json"
	"fmt"
	"math"
	"os"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/optim"
)

// testdata/torch_reference.json is made with PyTorch 2.11 and transformers
// 5.17 by scripts/make-reference-data.py: Adam, AdamW and SGD over 10
// steps with two parameter groups and a parameter whose first gradient
// comes at step 4 (its grad None before); every learning-rate schedule over
// 120 steps; clip_grad_norm_ cases. Non-finite numbers are the strings
// "nan", "inf" and "-inf".

// num is a JSON number or one of the strings "nan", "inf", "-inf".
type num float64

func (n *num) UnmarshalJSON(b []byte) error {
	var s string
	if json.Unmarshal(b, &s) == nil {
		switch s {
		case "nan":
			*n = num(math.NaN())
		case "inf":
			*n = num(math.Inf(1))
		case "-inf":
			*n = num(math.Inf(-1))
		default:
			return fmt.Errorf("number %q", s)
		}
		return nil
	}
	var f float64
	err := json.Unmarshal(b, &f)
	*n = num(f)
	return err
}

type torchGroup struct {
	LR          float64   `json:"lr"`
	WeightDecay float64   `json:"weight_decay"`
	Betas       []float64 `json:"betas"`
	Eps         float64   `json:"eps"`
	Momentum    float64   `json:"momentum"`
	Dampening   float64   `json:"dampening"`
	Nesterov    bool      `json:"nesterov"`
	Params      []int     `json:"params"`
}

type torchOptCase struct {
	Optimizer   string       `json:"optimizer"`
	Groups      []torchGroup `json:"groups"`
	Init        [][]num      `json:"init"`
	Grads       [][][]num    `json:"grads"` // step, parameter (null: no gradient), element
	ParamsAfter [][][]num    `json:"params_after"`
	Late        int          `json:"late_param"`
	LateFirst   int          `json:"late_first_step"`
}

type torchClipCase struct {
	Name      string  `json:"name"`
	MaxNorm   float64 `json:"max_norm"`
	NormType  num     `json:"norm_type"`
	Grads     [][]num `json:"grads"`
	TotalNorm num     `json:"total_norm"`
	Clipped   [][]num `json:"clipped"`
}

type torchReference struct {
	Adam      torchOptCase `json:"adam"`
	AdamW     torchOptCase `json:"adamw"`
	SGD       torchOptCase `json:"sgd"`
	Schedules struct {
		BaseLR  float64              `json:"base_lr"`
		FloorLR float64              `json:"floor"`
		Warmup  int                  `json:"warmup"`
		Total   int                  `json:"total"`
		Cases   map[string][]float64 `json:"cases"`
	} `json:"schedules"`
	Clip []torchClipCase `json:"clip_grad_norm"`
}

func loadTorchReference(t *testing.T) *torchReference {
	t.Helper()
	b, err := os.ReadFile("testdata/torch_reference.json")
	require.NoError(t, err)
	var ref torchReference
	require.NoError(t, json.Unmarshal(b, &ref))
	return &ref
}

func f32s(v []num) []float32 {
	out := make([]float32, len(v))
	for i, x := range v {
		out[i] = float32(x)
	}
	return out
}

// closeTo fails unless got is within atol + rtol·|want| of want, or both
// are NaN, or both the same infinity.
func closeTo(t *testing.T, want float64, got float64, rtol, atol float64, what string, args ...any) {
	t.Helper()
	switch {
	case math.IsNaN(want):
		require.True(t, math.IsNaN(got), "%s: got %g, want NaN", fmt.Sprintf(what, args...), got)
	case math.IsInf(want, 0):
		require.Equal(t, want, got, what, args)
	default:
		require.LessOrEqual(t, math.Abs(got-want), atol+rtol*math.Abs(want), "%s: got %.9g, want %.9g", fmt.Sprintf(what, args...), got, want)
	}
}

// The optimizers against torch.optim, over 10 steps: two parameter
// groups (the second with its own lr, weight decay and betas or momentum,
// dampening and Nesterov) and parameter 1 first trained at step 4 (grad
// None before: no update, no decay, no state), so its Adam bias correction
// is its own first step's.
//
// Tolerance: rtol 1e-6, atol 1e-7. PyTorch updates in float32 tensor
// arithmetic (lerp, addcmul, addcdiv), batchfit in float64 per element
// rounded once to float32: they differ by a float32 rounding or two per
// step.
func TestOptimizersMatchTorch(t *testing.T) {
	ref := loadTorchReference(t)
	for _, c := range []torchOptCase{ref.Adam, ref.AdamW, ref.SGD} {
		t.Run(c.Optimizer, func(t *testing.T) {
			require.Len(t, c.Groups, 2)
			g0, g1 := c.Groups[0], c.Groups[1]
			keys := make([]any, len(c.Init))
			for i := range keys {
				keys[i] = fmt.Sprintf("p%d", i)
			}
			var opt optim.Optimizer
			var second *optim.Group
			switch c.Optimizer {
			case "SGD":
				o := optim.NewSGD(g0.LR, g0.Momentum)
				o.Dampening, o.Nesterov, o.WeightDecay = g0.Dampening, g0.Nesterov, g0.WeightDecay
				second = o.AddGroup("second")
				second.Momentum, second.Dampening, second.Nesterov = g1.Momentum, g1.Dampening, g1.Nesterov
				opt = o
			default:
				o := optim.NewAdam(g0.LR)
				o.Decoupled = c.Optimizer == "AdamW"
				o.WeightDecay, o.Beta1, o.Beta2, o.Eps = g0.WeightDecay, g0.Betas[0], g0.Betas[1], g0.Eps
				second = o.AddGroup("second")
				second.Beta1, second.Beta2, second.Eps = g1.Betas[0], g1.Betas[1], g1.Eps
				opt = o
			}
			second.LR, second.WeightDecay = g1.LR, g1.WeightDecay
			for _, i := range g1.Params {
				second.Keys = append(second.Keys, keys[i])
			}
			data := make([][]float32, len(c.Init))
			for i, v := range c.Init {
				data[i] = f32s(v)
			}
			for s, grads := range c.Grads {
				var ps []optim.Param
				for i, g := range grads {
					if g == nil {
						require.Equal(t, c.Late, i)
						require.Less(t, s+1, c.LateFirst)
						continue
					}
					ps = append(ps, optim.Param{Key: keys[i], Name: keys[i].(string), Data: data[i], Grad: f32s(g)})
				}
				require.NoError(t, opt.Step(ps))
				for i, want := range c.ParamsAfter[s] {
					for j, w := range want {
						closeTo(t, float64(w), float64(data[i][j]), 1e-6, 1e-7, "step %d parameter %d[%d]", s+1, i, j)
					}
				}
			}
			type stepper interface{ ParamStep(any) int }
			require.Equal(t, len(c.Grads)-c.LateFirst+1, opt.(stepper).ParamStep(keys[c.Late]))
		})
	}
}

// Every schedule against torch.optim.lr_scheduler and transformers over
// 120 steps (warmup 10, total 100, then 20 past the end), base 6e-4,
// floor 6e-5.
//
// Tolerance: rtol 1e-12, atol 1e-18. PyTorch's schedulers are recursive
// (each step's rate from the last), batchfit's closed forms; they agree to
// a few float64 roundings.
func TestSchedulesMatchTorch(t *testing.T) {
	ref := loadTorchReference(t)
	s := ref.Schedules
	base, floor, warm, total := s.BaseLR, s.FloorLR, s.Warmup, s.Total
	require.Equal(t, []int{10, 100}, []int{warm, total})
	for name, sched := range map[string]optim.Schedule{
		"constant":                optim.Constant{},
		"linear_warmup":           optim.Linear{Start: 0.01, End: 1, Steps: warm},
		"cosine":                  optim.Cosine{Total: total, MinLR: floor},
		"warmup_cosine":           optim.Cosine{Warmup: warm, Total: total, WarmupStart: 0.01, MinLR: floor},
		"linear_decay":            optim.Linear{Start: 1, End: 0, Steps: total},
		"step":                    optim.StepDecay{Every: 30, Gamma: 0.1},
		"hf_cosine_with_warmup":   optim.Cosine{Warmup: warm, Total: total},
		"hf_linear_with_warmup":   optim.WarmupLinear{Warmup: warm, Total: total},
		"hf_constant_with_warmup": optim.Constant{Warmup: warm},
		"hf_cosine_with_min_lr":   optim.Cosine{Warmup: warm, Total: total, MinRatio: 0.1},
	} {
		want, ok := s.Cases[name]
		require.True(t, ok, "reference case %s", name)
		require.Len(t, want, 120, name)
		for step, w := range want {
			closeTo(t, w, sched.LR(base, step), 1e-12, 1e-18, "%s step %d", name, step)
		}
	}
	require.Len(t, s.Cases, 10, "every reference case is checked")
}

// The schedule drives the optimizer: the rate step i runs with is the
// reference's lrs[i], seen through SGD's update p ← p − lr·1 on a
// parameter with gradient 1.
//
// Tolerance: rtol 1e-6 (the update is stored in float32).
func TestScheduleInOptimizerMatchesTorch(t *testing.T) {
	ref := loadTorchReference(t)
	want := ref.Schedules.Cases["warmup_cosine"]
	o := optim.NewSGD(ref.Schedules.BaseLR, 0)
	o.Schedule = optim.Cosine{Warmup: 10, Total: 100, WarmupStart: 0.01, MinLR: ref.Schedules.FloorLR}
	for step, lr := range want {
		p := optim.Param{Key: "w", Data: []float32{1}, Grad: []float32{1}}
		require.NoError(t, o.Step([]optim.Param{p}))
		closeTo(t, 1-lr, float64(p.Data[0]), 1e-6, 0, "step %d", step)
	}
}

// Clipping against torch.nn.utils.clip_grad_norm_ (foreach=False): the
// 2-norm clipped and below max_norm, the ∞-norm, tiny gradients, a NaN
// (norm NaN, every gradient NaN) and an inf (norm inf, finite gradients
// scaled by 0, the inf one NaN).
//
// Tolerance: rtol 1e-6, atol 1e-12 on the norm and the clipped gradients.
// PyTorch sums the squares per tensor in float32, batchfit in float64 over
// all, so the norms differ by about one float32 rounding; coef and the
// products are float32 in both.
func TestClipMatchesTorch(t *testing.T) {
	ref := loadTorchReference(t)
	require.Len(t, ref.Clip, 6)
	for _, c := range ref.Clip {
		grads := make([][]float32, len(c.Grads))
		for i, g := range c.Grads {
			grads[i] = f32s(g)
		}
		inf := math.IsInf(float64(c.NormType), 1)
		norm := optim.GradNorm(grads, inf)
		closeTo(t, float64(c.TotalNorm), norm, 1e-6, 1e-12, "%s norm", c.Name)
		coef := optim.ClipCoef(norm, c.MaxNorm)
		for i, g := range grads {
			for j, x := range g {
				closeTo(t, float64(c.Clipped[i][j]), float64(x*coef), 1e-6, 1e-12, "%s clipped %d[%d]", c.Name, i, j)
			}
		}
		// The same through an optimizer: SGD with lr 1 and no momentum
		// steps each parameter from 0 by −g·coef; LastGradNorm is the norm.
		o := optim.NewSGD(1, 0)
		o.Clip = optim.Clip{MaxNorm: c.MaxNorm, NormType: float64(c.NormType)}
		ps := make([]optim.Param, len(grads))
		for i, g := range grads {
			ps[i] = optim.Param{Key: i, Data: make([]float32, len(g)), Grad: g}
		}
		require.NoError(t, o.Step(ps))
		for i, p := range ps {
			for j, x := range p.Data {
				closeTo(t, -float64(c.Clipped[i][j]), float64(x), 1e-6, 1e-12, "%s step %d[%d]", c.Name, i, j)
			}
		}
		got, err := o.LastGradNorm()
		require.NoError(t, err)
		closeTo(t, float64(c.TotalNorm), got, 1e-6, 1e-12, "%s LastGradNorm", c.Name)
	}
}
