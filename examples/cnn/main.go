// Command cnn trains a small convolutional classifier (models.NewConvNet:
// two stages of conv 3×3 → ReLU → max-pool 2×2, then a linear layer) with
// Adam on generated RGB images and prints the loss as it falls.
//
// Each image shows stripes at one of four orientations (0°, 45°, 90°, 135°),
// which is its class, with a random frequency, phase and colour, under
// Gaussian noise. An untrained net guesses nearly uniformly, a loss of about
// ln 4 ≈ 1.39; telling the orientations apart needs the convolutions to
// learn oriented edge detectors.
//
//	go run ./examples/cnn -steps 60 -batch 16 -size 32 -seed 1 -lr 3e-3
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"os"

	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/models"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/optim"
	"github.com/batchfit/batchfit/shapeinfer"
)

const (
	channels = 3
	classes  = 4   // stripe orientations
	noise    = 0.5 // standard deviation of the pixel noise; stripes have amplitude ≤ 1
)

type options struct {
	steps int     // training steps
	batch int     // images per step
	size  int     // image height and width, a multiple of 4
	seed  uint64  // seeds the images and the initial weights
	lr    float64 // Adam learning rate
	every int     // print the loss every this many steps (0: ten lines)
}

func main() {
	var o options
	flag.IntVar(&o.steps, "steps", 60, "training steps")
	flag.IntVar(&o.batch, "batch", 16, "images per step")
	flag.IntVar(&o.size, "size", 32, "image height and width (a multiple of 4; CIFAR's is 32)")
	flag.Uint64Var(&o.seed, "seed", 1, "seed for the images and the initial weights")
	flag.Float64Var(&o.lr, "lr", 3e-3, "Adam learning rate")
	flag.IntVar(&o.every, "every", 0, "print the loss every this many steps (0: ten lines in all)")
	flag.Parse()
	if _, err := run(os.Stdout, o); err != nil {
		fmt.Fprintln(os.Stderr, "cnn:", err)
		os.Exit(1)
	}
}

func config(size int) models.ConvNetConfig {
	return models.ConvNetConfig{Channels: channels, Size: size, Widths: []int{8, 16}, Classes: classes}
}

// run trains for o.steps steps, printing as it goes, and returns the loss
// of every step.
func run(w io.Writer, o options) ([]float32, error) {
	switch {
	case o.steps < 0:
		return nil, fmt.Errorf("-steps must be at least 0, got %d", o.steps)
	case o.batch < 1:
		return nil, fmt.Errorf("-batch must be at least 1, got %d", o.batch)
	case o.size < 4 || o.size%4 != 0:
		return nil, fmt.Errorf("-size must be a positive multiple of 4, got %d", o.size)
	case !(o.lr > 0):
		return nil, fmt.Errorf("-lr must be positive, got %g", o.lr)
	}
	cfg := config(o.size)
	model := models.NewConvNet(nn.Seed(o.seed), cfg)
	if err := nn.Check(model); err != nil {
		return nil, err
	}
	sess := batchfit.NewSession(batchfit.Options{})
	defer sess.Close() // a failed Close of an example's GPU has nothing left to lose
	fmt.Fprintf(w, "device: %s\n", sess.Device())
	fmt.Fprintf(w, "model: ConvNet %d×%d×%d, widths %v, %d classes: %d parameters\n",
		cfg.Channels, cfg.Size, cfg.Size, cfg.Widths, cfg.Classes, nn.NumParams(model))
	if err := printBytes(w, model, o); err != nil {
		return nil, err
	}
	fmt.Fprintf(w, "data: stripes at %d orientations, noise σ %g; ln %d = %.3f (a uniform guess)\n",
		classes, noise, classes, math.Log(classes))
	fmt.Fprintf(w, "training: Adam lr %g, batch %d, %d steps\n", o.lr, o.batch, o.steps)

	opt := optim.NewAdam(o.lr)
	every := o.every
	if every <= 0 {
		every = max(o.steps/10, 1)
	}
	ctx := context.Background()
	params := nn.ParamTensors(model)
	losses := make([]float32, 0, o.steps)
	for step := range o.steps {
		images, labels := stripes(o.seed, uint64(step), o.batch, o.size)
		x := lazy.Wrap(images, 0)
		loss := model.Forward(x).CrossEntropy(x.Graph().Wrap(labels, 0), graph.ReduceMean)
		l, err := sess.Step(ctx, loss, params, opt)
		if err != nil {
			return losses, fmt.Errorf("step %d: %w", step+1, err)
		}
		losses = append(losses, l)
		if step == 0 || (step+1)%every == 0 || step+1 == o.steps {
			fmt.Fprintf(w, "step %4d  loss %.4f\n", step+1, l)
		}
	}
	return losses, nil
}

// printBytes analyses one training step (forward, loss, every gradient)
// without data and prints the sum of its tensors' sizes, split into the
// part that does not depend on the batch and the part per image. It is the
// sum over all nodes, not a peak: liveness frees most of them early.
func printBytes(w io.Writer, model nn.Module, o options) error {
	x := lazy.Placeholder([]int{o.batch, channels, o.size, o.size}, graph.Float32, 0)
	y := x.Graph().Placeholder([]int{o.batch}, graph.Int64, 0)
	loss := model.Forward(x).CrossEntropy(y, graph.ReduceMean)
	outs := []int{loss.ID()}
	for _, g := range lazy.Grad(loss, nn.ParamTensors(model)...) {
		if err := g.Err(); err != nil {
			return err
		}
		outs = append(outs, g.ID())
	}
	info, err := shapeinfer.Analyze(x.Graph().IR(), outs...)
	if err != nil {
		return err
	}
	fixed, perSample := info.Totals()
	fmt.Fprintf(w, "training graph: %d nodes; sum of tensor sizes (not a peak): %d B fixed + %d B per image = %d B at batch %d\n",
		len(info.Fixed), fixed, perSample, fixed+perSample*int64(o.batch), o.batch)
	return nil
}

// stripes draws n images [n, 3, size, size] and their classes [n] for
// training step step. Image k of class c is
//
//	colour[ch] · sin(2π·f·(x·cos θ_c + y·sin θ_c)/size + φ) + noise
//
// with θ_c = c·45°, f uniform in [1.5, 3.5] cycles per image width, φ
// uniform in [0, 2π) and each channel's colour uniform in [0.5, 1].
func stripes(seed, step uint64, n, size int) (images, labels *tensor.Dense) {
	r := rand.New(rand.NewPCG(seed^0x57819e5, step))
	x := make([]float32, n*channels*size*size)
	y := make([]int64, n)
	for k := range n {
		c := r.IntN(classes)
		y[k] = int64(c)
		theta := float64(c) * math.Pi / classes
		cos, sin := math.Cos(theta), math.Sin(theta)
		f := 1.5 + 2*r.Float64()
		phi := 2 * math.Pi * r.Float64()
		for ch := range channels {
			colour := 0.5 + 0.5*r.Float64()
			img := x[(k*channels+ch)*size*size:][:size*size]
			for i := range size {
				for j := range size {
					s := math.Sin(2*math.Pi*f*(float64(j)*cos+float64(i)*sin)/float64(size) + phi)
					img[i*size+j] = float32(colour*s + noise*r.NormFloat64())
				}
			}
		}
	}
	return tensor.New(tensor.WithShape(n, channels, size, size), tensor.WithBacking(x)),
		tensor.New(tensor.WithShape(n), tensor.WithBacking(y))
}
