package checkpoint_test

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"

	"github.com/batchfit/batchfit/checkpoint"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/optim"
)

// Save a model and its optimizer after 120 steps, then resume: a new
// process's model and optimizer (other values) load the latest
// checkpoint of the directory and continue from step 120.
func Example() {
	dir, err := os.MkdirTemp("", "checkpoints")
	if err != nil {
		fmt.Println(err)
		return
	}
	defer os.RemoveAll(dir)

	model := nn.MLP(nn.Seed(1), []int{4, 8, 2}, nn.ReLU{})
	opt := optim.NewAdamW(1e-3)
	ck := &checkpoint.Training{Model: model, Optimizer: opt, Step: 120}
	path, err := ck.Save(dir)
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println(filepath.Base(path))

	resumed := nn.MLP(nn.Seed(2), []int{4, 8, 2}, nn.ReLU{})
	ck2 := &checkpoint.Training{Model: resumed, Optimizer: optim.NewAdamW(1)}
	if err := ck2.Load(dir); err != nil {
		fmt.Println(err)
		return
	}
	w := func(m nn.Module) []float32 { return m.Params()[0].Value().Data().([]float32) }
	fmt.Println("resume at step", ck2.Step, "same weights:", slices.Equal(w(model), w(resumed)))

	err = (&checkpoint.Training{Model: resumed}).Load(filepath.Join(dir, "elsewhere"))
	fmt.Println(errors.Is(err, checkpoint.ErrNoCheckpoint))
	// Output:
	// ckpt-00000120
	// resume at step 120 same weights: true
	// true
}
