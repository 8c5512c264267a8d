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
// PerChunkStats is the opt-in to chunking through the layer in training
// mode: see its field. Without it nothing changes.
//
// The running statistics are buffers, not parameters: Params leaves them
// out, so optimizers never touch them. A graph has no side effects, so a
// training-mode Forward does not update them the way PyTorch's does; the
// update is an explicit step: evaluate BatchStats (the last training
// Forward's batch mean and unbiased variance) and hand the values to
// UpdateRunning. With PerChunkStats the training step does it itself.
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
	// PerChunkStats (training mode; false by default, or Options'
	// PerChunkStats at construction) normalises with per-chunk statistics
	// (lazy's BatchNorm2dPerChunk): when the planner runs the batch in
	// chunks, each chunk is normalised with its own mean and variance, as
	// each micro-batch is under PyTorch's gradient accumulation, so a
	// model with batch norm trains at any batch under a budget; its
	// gradients are those of the per-chunk forward, summed over chunks. In
	// one chunk it is the plain training mode. Plans say which statistics
	// are in force (planner.Plan.BatchStats). Both executors run it.
	//
	// Running statistics are then updated by the training step, once per
	// step: Forward registers the layer's update with the graph
	// (lazy.Graph.OnStep), and batchfit.Session.Step computes the mean and
	// unbiased variance of the layer's input over the whole batch, every
	// chunk's samples together, merged exactly from the chunks' own
	// statistics, in the same run, and applies
	// running = (1 − Momentum)·running + Momentum·batch once, as
	// UpdateRunning does. For the first batch norm of a model they are the
	// statistics an unchunked step computes; a later layer's input is what
	// the per-chunk normalisation before it made. Do not call
	// UpdateRunning for such a step as well: it would update twice. A
	// layer run twice in one graph updates twice, as PyTorch's does.
	PerChunkStats bool

	channels       int
	mean, variance []float32 // the running statistics' storage
	input          *lazy.Tensor
	scope          string
	stats          [2]*lazy.Tensor
	chunkStats     *lazy.Tensor // [2, C] of the last per-chunk Forward
	err            error
}

// NewBatchNorm2d makes the layer for channels channels; PyTorch's defaults
// are eps 1e-5 and momentum 0.1. It starts in training mode.
func NewBatchNorm2d(opt Options, channels int, eps, momentum float64) *BatchNorm2d {
	bn := &BatchNorm2d{Eps: eps, Momentum: momentum, Training: true, PerChunkStats: opt.PerChunkStats, channels: channels,
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
	if bn.PerChunkStats {
		return bn.forwardPerChunk(x)
	}
	y := x.BatchNorm2d(bn.Weight.Tensor(), bn.Bias.Tensor(), nil, nil, true, bn.Eps)
	if y.Err() == nil {
		bn.input, bn.stats, bn.chunkStats = x, [2]*lazy.Tensor{}, nil
		if g := x.Graph(); g != nil {
			bn.scope = g.IR().Scope()
		}
	}
	return y
}

// forwardPerChunk is Forward in training mode with PerChunkStats: the
// per-chunk op, and the running statistics' update registered with the
// graph, from batch_norm_stats of x made right here (so x need not live
// longer for it).
func (bn *BatchNorm2d) forwardPerChunk(x *lazy.Tensor) *lazy.Tensor {
	y := x.BatchNorm2dPerChunk(bn.Weight.Tensor(), bn.Bias.Tensor(), bn.Eps)
	if y.Err() != nil {
		return y
	}
	stats := x.BatchStats()
	if err := x.Graph().OnStep(stats, bn.updateFrom); err != nil {
		return lazy.ErrorTensor("nn.BatchNorm2d", err)
	}
	bn.input, bn.stats, bn.chunkStats = x, [2]*lazy.Tensor{}, stats
	bn.scope = x.Graph().IR().Scope()
	return y
}

// updateFrom is UpdateRunning with batch_norm_stats' [2, C] value.
func (bn *BatchNorm2d) updateFrom(stats *tensor.Dense) error {
	if stats == nil || !slices.Equal([]int(stats.Shape()), []int{2, bn.channels}) || stats.Dtype() != tensor.Float32 {
		return graph.Errorf(graph.ErrShape, "BatchNorm2d: batch statistics %v, want float32 [2 %d]", shapeOf(stats), bn.channels)
	}
	f := stats.Float32s()
	c := bn.channels
	row := func(i int) *tensor.Dense {
		return tensor.New(tensor.WithShape(c), tensor.WithBacking(f[i*c:(i+1)*c]))
	}
	return bn.UpdateRunning(row(0), row(1))
}

func shapeOf(d *tensor.Dense) []int {
	if d == nil {
		return nil
	}
	return d.Shape()
}

// BatchStats returns the batch mean and unbiased variance [C] of the input
// of the last training-mode Forward, as tensors of that Forward's graph
// (made on the first call, then reused): evaluate them, for instance with
// Session.Eval before the optimizer step changes the parameters they
// depend on, and pass the values to UpdateRunning. Before any
// training-mode Forward both carry an ErrNoData error. After a per-chunk
// Forward (PerChunkStats), whose step updates the running statistics
// itself, they are the two rows of the statistics it registered, which
// evaluate in one chunk only (slices of batch_norm_stats are not
// chunkable).
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
	if st := bn.chunkStats; st != nil {
		bn.stats = [2]*lazy.Tensor{st.Slice(0, 0, 1).Reshape(bn.channels), st.Slice(0, 1, 2).Reshape(bn.channels)}
		return bn.stats[0], bn.stats[1]
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
