package models

import (
	"slices"

	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/nn"
)

// ConvNetConfig sizes a ConvNet over square images.
type ConvNetConfig struct {
	Channels int   // input channels (3 for RGB)
	Size     int   // image height and width; a multiple of 2^len(Widths)
	Widths   []int // output channels of each conv stage
	Classes  int
}

// CIFAR10 is a three-stage net over 32×32 RGB images.
func CIFAR10() ConvNetConfig {
	return ConvNetConfig{Channels: 3, Size: 32, Widths: []int{32, 64, 128}, Classes: 10}
}

// NewConvNet builds, per stage, conv 3×3 (padding 1) → ReLU → max-pool 2×2,
// then flattens into a linear classifier.
func NewConvNet(opt nn.Options, cfg ConvNetConfig) *nn.Sequential {
	size := cfg.Size
	for range cfg.Widths {
		size /= 2
	}
	if cfg.Channels < 1 || cfg.Classes < 1 || len(cfg.Widths) == 0 || size < 1 || size<<len(cfg.Widths) != cfg.Size ||
		slices.ContainsFunc(cfg.Widths, func(w int) bool { return w < 1 }) {
		return nn.NewSequentialNamed(nn.Child{Name: "invalid", Module: invalid{graph.Errorf(graph.ErrAttr,
			"ConvNet config %+v: sizes must be positive, with Size a multiple of 2^%d", cfg, len(cfg.Widths))}})
	}
	var mods []nn.Module
	in := cfg.Channels
	for _, w := range cfg.Widths {
		mods = append(mods,
			nn.NewConv2d(opt, in, w, [2]int{3, 3}, true, lazy.ConvOptions{Padding: [2]int{1, 1}}),
			nn.ReLU{},
			nn.MaxPool2d{Kernel: [2]int{2, 2}})
		in = w
	}
	mods = append(mods, nn.Flatten{}, nn.NewLinear(opt, in*size*size, cfg.Classes, true))
	return nn.NewSequential(mods...)
}

// invalid is a module that reports a configuration error from Forward.
type invalid struct{ err error }

func (m invalid) Forward(x *lazy.Tensor) *lazy.Tensor {
	if err := firstErr(x); err != nil { // the input's error first, as in nn
		return lazy.ErrorTensor("models", err)
	}
	return lazy.ErrorTensor("models", m.err, x.Shape())
}
func (invalid) Params() []*nn.Param { return nil }
func (m invalid) Err() error        { return m.err }
