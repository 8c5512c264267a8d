package optim_test

import (
	"fmt"

	"github.com/batchfit/batchfit/optim"
)

// A warmup-cosine schedule: the rate each step runs with, from a base of
// 1e-3, 2 warmup steps, 10 in all, a floor of a tenth of the base.
func ExampleCosine() {
	s := optim.Cosine{Warmup: 2, Total: 10, MinRatio: 0.1}
	for _, step := range []int{0, 1, 2, 6, 10} {
		fmt.Printf("step %2d: %.6f\n", step, s.LR(1e-3, step))
	}
	// Output:
	// step  0: 0.000000
	// step  1: 0.000500
	// step  2: 0.001000
	// step  6: 0.000550
	// step 10: 0.000100
}

// AdamW with weight decay off biases and norms (the usual recipe),
// gradients clipped to a global norm of 1, and a parameter first trained
// at the optimizer's third step: its first update is a first step's (its
// own bias correction), lr·g/(|g| + ε).
func ExampleAdam() {
	opt := optim.NewAdamW(0.1)
	opt.WeightDecay = 0.1
	opt.AddGroup("no_decay", "bias").WeightDecay = 0
	opt.Clip = optim.Clip{MaxNorm: 1}
	w := optim.Param{Key: "weight", Name: "weight", Data: []float32{1, 1}, Grad: []float32{3, 4}}
	b := optim.Param{Key: "bias", Name: "bias", Data: []float32{0}, Grad: []float32{0.5}}
	for range 2 {
		_ = opt.Step([]optim.Param{w})
	}
	_ = opt.Step([]optim.Param{w, b})
	norm, _ := opt.LastGradNorm()
	fmt.Printf("steps %d, weight's %d, bias's %d\n", opt.Steps(), opt.ParamStep("weight"), opt.ParamStep("bias"))
	fmt.Printf("bias %.4f, last norm %.4f\n", b.Data[0], norm)
	// Output:
	// steps 3, weight's 3, bias's 1
	// bias -0.1000, last norm 5.0249
}

// NoDecay is the rule SplitDecay applies.
func ExampleNoDecay() {
	for _, p := range []struct {
		name  string
		shape []int
	}{{"h.0.attn.c_attn.weight", []int{768, 2304}}, {"h.0.attn.c_attn.bias", []int{2304}}, {"h.0.ln_1.weight", []int{768}}} {
		fmt.Println(p.name, optim.NoDecay(p.name, p.shape))
	}
	// Output:
	// h.0.attn.c_attn.weight false
	// h.0.attn.c_attn.bias true
	// h.0.ln_1.weight true
}

// A training loop hands its optimizer to batchfit.Session.Step, which
// builds the Param views itself. By hand: minimise (w − 3)² for two
// parameters from 0, each gradient 2(w − 3) written into Grad, with
// AdamW's update rule (PyTorch's torch.optim.AdamW, weight decay 0.01,
// which holds w a little below 3).
// The state, two moment tensors per parameter, is kept under each Key.
func ExampleNewAdamW() {
	opt := optim.NewAdamW(0.1)
	w := []float32{0, 0}
	grad := make([]float32, len(w))
	for range 200 {
		for i := range w {
			grad[i] = 2 * (w[i] - 3)
		}
		if err := opt.Step([]optim.Param{{Key: "w", Name: "w", Data: w, Grad: grad}}); err != nil {
			fmt.Println(err)
			return
		}
	}
	fmt.Printf("%s after %d steps: w = %.2f, %d state tensors per parameter\n", opt.Name(), opt.Steps(), w, opt.StateSlots())
	// Output:
	// adamw after 200 steps: w = [2.98 2.98], 2 state tensors per parameter
}

// A gradient whose length differs from its parameter's is refused before
// anything changes.
func ExampleSGD_Step() {
	opt := optim.NewSGD(0.5, 0.9)
	w := []float32{1, 2}
	err := opt.Step([]optim.Param{{Key: 0, Name: "w", Data: w, Grad: []float32{1}}})
	fmt.Println(err, w)
	_ = opt.Step([]optim.Param{{Key: 0, Name: "w", Data: w, Grad: []float32{1, -1}}})
	fmt.Println(w)
	// Output:
	// optimizer: parameter "w" has 2 elements but its gradient 1 [1 2]
	// [0.5 2.5]
}
