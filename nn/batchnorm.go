package nn

import (
	"slices"

	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
)

// BatchNorm2d normalises NCHW input per channel, as PyTorch's
// nn.BatchNorm2d: y = (x − mean)/√(var + Eps)·Weight + Bias.
//
// In training mode (the default, as in PyTorch) mean and var are the
// batch's, var biased, over N, H and W: every output depends on the whole
// batch, so a graph using the layer runs its batch in one piece (the
// analysis reports it not chunkable and the planner needs the whole batch
// to fit). In evaluation mode they are the running statistics, and the
// layer is per-sample.
//
// The running statistics are buffers, not parameters: Params leaves them
// out, so optimizers never touch them. A graph has no side effects, so a
// training-mode Forward does not update them the way PyTorch's does; the
// update is an explicit step: evaluate BatchStats (the last training
// Forward's batch mean and unbiased variance) and hand the values to
// UpdateRunning.
type BatchNorm2d struct {
	Weight *Param // ones
	Bias   *Param // zeros
	// RunningMean and RunningVar are float32 constants [C], zeros and ones
	// at construction, which UpdateRunning changes in place: graphs built
	// later, and executors holding them resident, read the new values.
	RunningMean, RunningVar *lazy.Tensor
	Eps                     float64
	// Momentum weighs the batch in UpdateRunning (PyTorch's default 0.1).
	Momentum float64
	// Training selects batch statistics (true) or running statistics.
	Training bool

	channels       int
	mean, variance []float32 // the running statistics' storage
	input          *lazy.Tensor
	scope          string
	stats          [2]*lazy.Tensor
	err            error
}

// NewBatchNorm2d makes the layer for channels channels; PyTorch's defaults
// are eps 1e-5 and momentum 0.1. It starts in training mode.
func NewBatchNorm2d(opt Options, channels int, eps, momentum float64) *BatchNorm2d {
	bn := &BatchNorm2d{Eps: eps, Momentum: momentum, Training: true, channels: channels,
		Weight: opt.Full("weight", []int{channels}, 1), Bias: opt.Full("bias", []int{channels}, 0)}
	switch {
	case channels < 1:
		bn.err = graph.Errorf(graph.ErrShape, "BatchNorm2d needs at least one channel, got %d", channels)
		bn.RunningMean = lazy.ErrorTensor("nn.BatchNorm2d", bn.err)
		bn.RunningVar = bn.RunningMean
		return bn
	case !(eps > 0):
		bn.err = graph.Errorf(graph.ErrAttr, "BatchNorm2d eps must be positive, got %g", eps)
	case !(momentum >= 0 && momentum <= 1):
		bn.err = graph.Errorf(graph.ErrAttr, "BatchNorm2d momentum %g is outside [0, 1]", momentum)
	}
	bn.mean, bn.variance = make([]float32, channels), make([]float32, channels)
	for i := range bn.variance {
		bn.variance[i] = 1
	}
	// The statistics are C floats: real data even for shape-only models.
	bn.RunningMean = lazy.Const(tensor.New(tensor.WithShape(channels), tensor.WithBacking(bn.mean)))
	bn.RunningVar = lazy.Const(tensor.New(tensor.WithShape(channels), tensor.WithBacking(bn.variance)))
	return bn
}

// Forward normalises x [N, C, H, W].
func (bn *BatchNorm2d) Forward(x *lazy.Tensor) *lazy.Tensor {
	if bn.err != nil {
		return fail("nn.BatchNorm2d", bn.err, x)
	}
	if !bn.Training {
		return x.BatchNorm2d(bn.Weight.Tensor(), bn.Bias.Tensor(), bn.RunningMean, bn.RunningVar, false, bn.Eps)
	}
	y := x.BatchNorm2d(bn.Weight.Tensor(), bn.Bias.Tensor(), nil, nil, true, bn.Eps)
	if y.Err() == nil {
		bn.input, bn.stats = x, [2]*lazy.Tensor{}
		if g := x.Graph(); g != nil {
			bn.scope = g.IR().Scope()
		}
	}
	return y
}

// BatchStats returns the batch mean and unbiased variance [C] of the input
// of the last training-mode Forward, as tensors of that Forward's graph
// (made on the first call, then reused): evaluate them, for instance with
// Session.Eval before the optimizer step changes the parameters they
// depend on, and pass the values to UpdateRunning. Before any
// training-mode Forward both carry an ErrNoData error.
func (bn *BatchNorm2d) BatchStats() (mean, variance *lazy.Tensor) {
	if bn.input == nil {
		err := graph.Errorf(graph.ErrNoData, "BatchNorm2d.BatchStats before any training-mode Forward")
		e := lazy.ErrorTensor("nn.BatchNorm2d", err)
		return e, e
	}
	if bn.stats[0] != nil {
		return bn.stats[0], bn.stats[1]
	}
	x := bn.input
	if g := x.Graph(); g != nil && bn.scope != "" {
		g.PushScope(bn.scope)
		defer g.PopScope()
	}
	s := x.Shape()
	m := s[0] * s[2] * s[3] // > 1: the training-mode op accepted x
	mean = x.Mean(0, 2, 3)
	d := x.Sub(mean.Reshape(1, s[1], 1, 1))
	variance = d.Mul(d).Sum(0, 2, 3).MulScalar(1 / float64(m-1))
	bn.stats = [2]*lazy.Tensor{mean, variance}
	return mean, variance
}

// UpdateRunning folds a batch's statistics into the running ones, as
// PyTorch does in a training-mode forward:
// running = (1 − Momentum)·running + Momentum·batch, with the unbiased
// batch variance. mean and variance are float32 [C], as BatchStats gives.
func (bn *BatchNorm2d) UpdateRunning(mean, variance tensor.Tensor) error {
	if bn.err != nil {
		return bn.err
	}
	var vals [2][]float32
	for i, t := range []tensor.Tensor{mean, variance} {
		what := []string{"mean", "variance"}[i]
		d, ok := t.(*tensor.Dense)
		if !ok || d == nil {
			return graph.Errorf(graph.ErrNilTensor, "BatchNorm2d.UpdateRunning: %s is not a *tensor.Dense", what)
		}
		if !slices.Equal([]int(d.Shape()), []int{bn.channels}) {
			return graph.Errorf(graph.ErrShape, "BatchNorm2d.UpdateRunning: %s shape %v, want [%d]", what, d.Shape(), bn.channels)
		}
		if d.Dtype() != tensor.Float32 {
			return graph.Errorf(graph.ErrDType, "BatchNorm2d.UpdateRunning: %s is %v, want float32", what, d.Dtype())
		}
		if d.RequiresIterator() { // a strided view: its backing slice is not in order
			c, ok := d.Materialize().(*tensor.Dense)
			if !ok {
				return graph.Errorf(graph.ErrShape, "BatchNorm2d.UpdateRunning: %s cannot be materialised", what)
			}
			d = c
		}
		vals[i] = d.Float32s()
	}
	mom := float32(bn.Momentum)
	for k := range bn.channels {
		bn.mean[k] = (1-mom)*bn.mean[k] + mom*vals[0][k]
		bn.variance[k] = (1-mom)*bn.variance[k] + mom*vals[1][k]
	}
	return nil
}

// Params returns weight, then bias; the running statistics are buffers.
func (bn *BatchNorm2d) Params() []*Param { return params(bn.Weight, bn.Bias) }

// Err is the construction error, if any.
func (bn *BatchNorm2d) Err() error { return bn.err }
