package batchfit_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"

	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/optim"
)

// A training loop: the graph is built again every step, as in eager
// frameworks; Step plans it (once per graph signature), runs it in the
// chunks the budget allows with the whole batch's gradients, and updates
// the parameters. Here a 64 → 256 → 4 MLP learns which quarter of its
// input holds the largest values, under a budget that forces chunks.
func ExampleSession_Step() {
	const n, in, classes = 4096, 64, 4
	rng := rand.New(rand.NewPCG(1, 2))
	images, labels := make([]float32, n*in), make([]int64, n)
	for i := range labels {
		labels[i] = int64(rng.IntN(classes))
		for j := range in {
			images[i*in+j] = float32(rng.NormFloat64())
			if j/(in/classes) == int(labels[i]) {
				images[i*in+j] += 2
			}
		}
	}

	model := nn.MLP(nn.Seed(1), []int{in, 256, classes}, nn.ReLU{})
	sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, Budget: 8 << 20})
	defer sess.Close()
	opt := optim.NewAdam(1e-2)
	var first, last float32
	for step := range 20 {
		x := lazy.Wrap(tensor.New(tensor.WithShape(n, in), tensor.WithBacking(images)), 0)
		y := x.Graph().Wrap(tensor.New(tensor.WithShape(n), tensor.WithBacking(labels)), 0)
		loss := model.Forward(x).CrossEntropy(y, lazy.Mean)
		l, err := sess.Step(context.Background(), loss, nn.ParamTensors(model), opt)
		if err != nil {
			fmt.Println(err)
			return
		}
		if step == 0 {
			first = l
		}
		last = l
	}
	pl := sess.LastPlan()
	fmt.Printf("%d samples in %d chunks of at most %d within the 8 MiB budget\n", pl.Batch, len(pl.Chunks), pl.Chunk)
	fmt.Printf("loss fell from %.1f: %v\n", first, last < first/2)
	// Output:
	// 4096 samples in 4 chunks of at most 1024 within the 8 MiB budget
	// loss fell from 1.4: true
}

// A fixed micro-batch: Options.MaxChunk runs every step as gradient
// accumulation over chunks of at most MaxChunk samples, whatever memory
// would hold, with the whole batch's gradients.
func ExampleOptions_maxChunk() {
	const n, in, classes = 1000, 16, 4
	rng := rand.New(rand.NewPCG(3, 4))
	data, labels := make([]float32, n*in), make([]int64, n)
	for i := range labels {
		labels[i] = int64(rng.IntN(classes))
		for j := range in {
			data[i*in+j] = float32(rng.NormFloat64())
		}
	}
	model := nn.MLP(nn.Seed(1), []int{in, 32, classes}, nn.ReLU{})
	sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, MaxChunk: 256})
	defer sess.Close()
	x := lazy.Wrap(tensor.New(tensor.WithShape(n, in), tensor.WithBacking(data)), 0)
	y := x.Graph().Wrap(tensor.New(tensor.WithShape(n), tensor.WithBacking(labels)), 0)
	loss := model.Forward(x).CrossEntropy(y, lazy.Mean)
	if _, err := sess.Step(context.Background(), loss, nn.ParamTensors(model), optim.NewSGD(0.1, 0)); err != nil {
		fmt.Println(err)
		return
	}
	var sizes []int
	for _, c := range sess.LastPlan().Chunks {
		sizes = append(sizes, c.Size)
	}
	fmt.Println("chunks:", sizes)
	// Output:
	// chunks: [250 250 250 250]
}

// Sizes as Options.Budget takes them: binary units (GiB) as GPU memory is
// sold, decimal ones (GB) as disks are, a space allowed.
func ExampleParseSize() {
	for _, s := range []string{"24GiB", "24 GB", "1.5GiB", "512"} {
		n, err := batchfit.ParseSize(s)
		if err != nil {
			fmt.Println(err)
			continue
		}
		fmt.Printf("%-7s = %d bytes = %s\n", s, n, batchfit.FormatSize(n))
	}
	_, err := batchfit.ParseSize("24XB")
	fmt.Println(errors.Is(err, alloc.ErrSize))
	// Output:
	// 24GiB   = 25769803776 bytes = 24.00 GiB
	// 24 GB   = 24000000000 bytes = 22.35 GiB
	// 1.5GiB  = 1610612736 bytes = 1.50 GiB
	// 512     = 512 bytes = 512 B
	// true
}
