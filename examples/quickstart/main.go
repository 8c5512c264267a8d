package main

import (
	"context"
	"fmt"
	"math/rand/v2"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/optim"
	"gorgonia.org/tensor"
)

func main() {
	const n, in, classes = 16384, 64, 4
	rng := rand.New(rand.NewPCG(1, 2))
	x, y := make([]float32, n*in), make([]int64, n) // class c: feature c raised by 2
	for i := range n {
		y[i] = int64(rng.IntN(classes))
		for j := range in {
			x[i*in+j] = float32(rng.NormFloat64())
		}
		x[i*in+int(y[i])] += 2
	}
	model, opt := nn.MLP(nn.Seed(1), []int{in, 256, classes}, nn.ReLU{}), optim.NewAdam(1e-2)
	sess := batchfit.NewSession(batchfit.Options{Budget: 64 << 20}) // CUDA when a GPU is usable
	defer sess.Close()
	for step := range 10 {
		xs := lazy.Wrap(tensor.New(tensor.WithShape(n, in), tensor.WithBacking(x)), 0) // axis 0: the batch
		ys := xs.Graph().Wrap(tensor.New(tensor.WithShape(n), tensor.WithBacking(y)), 0)
		l, err := sess.Step(context.Background(), model.Forward(xs).CrossEntropy(ys, lazy.Mean), nn.ParamTensors(model), opt)
		if err != nil {
			panic(err)
		}
		fmt.Printf("step %2d  loss %.4f\n", step+1, l)
	}
	fmt.Printf("%s\nbatch %d as %s chunks, peak %s predicted, %s measured\n", sess.Device(), n, sess.LastPlan().Split,
		batchfit.FormatSize(sess.LastPlan().PeakReserved+sess.Overhead()), batchfit.FormatSize(sess.LastUsage().PeakReserved))
}
