package cuda

import (
	"slices"
	"sync/atomic"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/graph"
)

// Loss family (kernels/loss.cu): cross_entropy and mse, summed in double
// through the workspace, and their gradients. Predictions, targets, mse's
// g and loss, logits and the gradients share one float dtype;
// cross_entropy's loss and its gradient's g are float32 (a 16-bit
// cross_entropy computes in float32, graph's rule); labels are int64.
var lossKernels = family{
	graph.OpCrossEntropy: {run: func(k *kctx, in []operand, out operand) error {
		return k.crossEntropy(k.attrs(), in[0], in[1], out)
	}, ws: func(g *graph.Graph, nd *graph.Node, b int) int64 {
		if x := inputAt(g, nd, 0, b); len(x) == 2 {
			return ceBytes(int64(x[0]))
		}
		return 0
	}},
	graph.OpMSE: {run: func(k *kctx, in []operand, out operand) error {
		return k.mse(k.attrs(), in[0], in[1], out)
	}, ws: func(*graph.Graph, *graph.Node, int) int64 { return mseBytes }},

	graph.OpCrossEntropyGrad: {run: func(k *kctx, in []operand, out operand) error {
		return k.crossEntropyGrad(k.attrs(), in[0], in[1], in[2], out)
	}, ws: flagWorkspace},
	graph.OpMSEGrad: {run: typedGradOf(mseGrad)},
}

// MSE reduces through one partial per block of a grid of at most mseGrid
// blocks of mseBlock threads; its workspace holds the partials in double.
const (
	mseGrid  = 1024
	mseBlock = 256
	mseBytes = 8 * mseGrid
)

// ceBlock is the cross_entropy kernels' row block for rows of c classes:
// rowBlock's while a row fits the registers of a 1,024-thread block, and
// for longer rows (a GPT vocabulary) one block of ceLongBlock threads a
// row, so that several blocks share an SM and one's reductions overlap
// the others' loads.
func ceBlock(c int64) [3]uint32 {
	if c > 8*1024 {
		return [3]uint32{ceLongBlock, 1, 1}
	}
	return rowBlock(c)
}

const ceLongBlock = 256

// ceBytes is cross_entropy's workspace for n rows: the per-row losses in
// double, then the bad-label flag.
func ceBytes(n int64) int64 { return 8*n + flagBytes }

func mseGrad(k *kctx, dt graph.DType, g operand, in []operand, out operand) error {
	a, n := k.attrs(), out.n()
	if _, err := floatsOf(g, in[1], in[2], out); err != nil {
		return err
	}
	if err := sameN(k.nd.Op, out, in[1], in[2]); err != nil {
		return err
	}
	if g.n() != 1 {
		return graph.Errorf(graph.ErrShape, "mse_grad needs a scalar upstream gradient, got %v", g.shape)
	}
	return k.flat(typed(kMSEGrad, dt), n, g.p, in[1].p, in[2].p, out.p, n, a.Scalar)
}

// sumF64 sums n doubles at src, times scale, into out[0] of dtype dt with
// one block.
func (k *kctx) sumF64(dt graph.DType, src, out alloc.Ptr, n int64, scale float64) error {
	return k.launch(typed(kSumF64, dt), [3]uint32{1, 1, 1}, [3]uint32{1024, 1, 1}, src, out, n, scale)
}

// crossEntropy: per-row losses in double into the workspace, then their
// sum times a.Scalar; a bad label is an error, as on the CPU. The kernel
// reads rows ld apart and scores their first c columns (graph's
// Attrs.End), so padded logits need no slice first.
func (k *kctx) crossEntropy(a *graph.Attrs, logits, labels, out operand) error {
	dt, err := floatsOf(logits)
	if err != nil {
		return err
	}
	if out.dt != graph.Float32 {
		return graph.Errorf(graph.ErrDType, "cross_entropy of %s logits into a %s loss (float32)", dt, out.dt)
	}
	if len(logits.shape) != 2 || labels.dt != graph.Int64 || labels.n() != int64(logits.shape[0]) || out.n() != 1 {
		return graph.Errorf(graph.ErrShape, "cross_entropy needs logits [N, C], int64 labels [N] and a scalar output, got %v, %v, %v",
			logits.shape, labels.shape, out.shape)
	}
	n, ld := int64(logits.shape[0]), int64(logits.shape[1])
	c := int64(graph.CrossEntropyClasses(a, int(ld)))
	loss, err := k.workspace(ceBytes(n))
	if err != nil {
		return err
	}
	bad, err := k.badFlag(8 * n)
	if err != nil {
		return err
	}
	if n > 0 {
		block := ceBlock(c)
		if s, grad, ok := k.fusedCEGrad(logits); ok {
			// The gradient too (graph.CrossEntropyGradProducer); its own
			// run step is then skipped.
			if err := k.launch(typed(kCrossEntFused, dt), rowGrid(n, block, 1), block, logits.p, labels.p, loss, grad.p, n, c, ld, s, bad); err != nil {
				return err
			}
			k.coDone = true
			fusedCrossEntropies.Add(1)
		} else if err := k.launch(typed(kCrossEntropy, dt), rowGrid(n, block, 1), block, logits.p, labels.p, loss, n, c, ld, bad); err != nil {
			return err
		}
	}
	if err := k.sumF64(graph.Float32, loss, out.p, n, a.Scalar); err != nil || n == 0 {
		return err
	}
	return k.firstBad(bad, labels, "cross_entropy", "label", 1, c)
}

// fusedCrossEntropies counts cross_entropy launches that wrote their
// gradient too (tests read it).
var fusedCrossEntropies atomic.Int64

// fusedCEGrad is the companion cross_entropy_grad output the forward pass
// over logits writes too, with its scale Scalar·seed, when the program has
// one of logits' dtype and shape. The program pairs them only through
// graph.CrossEntropyGradProducer, so the seed is a fill.
func (k *kctx) fusedCEGrad(logits operand) (s float64, grad operand, ok bool) {
	if k.co == nil || k.co.dt != logits.dt || !slices.Equal(k.co.shape, logits.shape) {
		return 0, operand{}, false
	}
	gr := k.g.Node(k.coNode)
	if gr.Op != graph.OpCrossEntropyGrad {
		return 0, operand{}, false
	}
	seed := k.g.Node(gr.Inputs[0])
	return gr.Attrs.Scalar * seed.Attrs.Scalar, *k.co, true
}

// crossEntropyGrad: g·Scalar·(softmax(logits) − onehot(label)), g float32,
// the gradient in the logits' dtype; the columns past Attrs.End get 0.
func (k *kctx) crossEntropyGrad(a *graph.Attrs, g, logits, labels, out operand) error {
	dt, err := floatsOf(logits, out)
	if err != nil {
		return err
	}
	if g.dt != graph.Float32 {
		return graph.Errorf(graph.ErrDType, "cross_entropy_grad of %s logits with a %s upstream gradient (float32)", dt, g.dt)
	}
	if len(logits.shape) != 2 || labels.dt != graph.Int64 || labels.n() != int64(logits.shape[0]) || out.n() != logits.n() || g.n() != 1 {
		return graph.Errorf(graph.ErrShape, "cross_entropy_grad needs a scalar g, logits [N, C] and int64 labels [N], got %v, %v, %v",
			g.shape, logits.shape, labels.shape)
	}
	n, ld := int64(logits.shape[0]), int64(logits.shape[1])
	c := int64(graph.CrossEntropyClasses(a, int(ld)))
	if out.n() == 0 {
		return nil
	}
	bad, err := k.badFlag(0)
	if err != nil {
		return err
	}
	block := ceBlock(c)
	if err := k.launch(typed(kCrossEntGrad, dt), rowGrid(n, block, 1), block, g.p, logits.p, labels.p, out.p, n, c, ld, a.Scalar, bad); err != nil {
		return err
	}
	return k.firstBad(bad, labels, "cross_entropy", "label", 2, c)
}

// mse: a double partial per block into the workspace, then their sum times
// a.Scalar.
func (k *kctx) mse(a *graph.Attrs, pred, target, out operand) error {
	dt, err := floatsOf(pred, target, out)
	if err != nil {
		return err
	}
	if pred.n() != target.n() || out.n() != 1 {
		return graph.Errorf(graph.ErrShape, "mse of %v and %v into %v", pred.shape, target.shape, out.shape)
	}
	partial, err := k.workspace(mseBytes)
	if err != nil {
		return err
	}
	n := pred.n()
	grid := min(max(ceilDiv(n, mseBlock), 1), mseGrid)
	if err := k.launch(typed(kMSEPartial, dt), [3]uint32{uint32(grid), 1, 1}, [3]uint32{mseBlock, 1, 1}, pred.p, target.p, partial, n); err != nil {
		return err
	}
	return k.sumF64(dt, partial, out.p, grid, a.Scalar)
}
