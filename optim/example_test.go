package optim_test

import (
	"fmt"

	"github.com/batchfit/batchfit/optim"
)

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
