package cuda

import "github.com/batchfit/batchfit/graph"

// Splitting long reductions (kernels/README.md): a reduction with few
// outputs runs as up to maxSplits partial reductions per output, combined
// by a second pass. Whether a node may split is decided from its full-batch
// types, so that its workspace is affine in the chunk size as the planner
// requires; how many splits a chunk uses depends on the chunk.
const (
	maxSplits       = 32
	splitMaxOutputs = 1 << 14 // reductions with more outputs have blocks enough
	splitLen        = 1 << 8  // elements each split reduces, at least
	lnSplitRows     = 1 << 7  // rows each split of layer_norm_grad_w covers, at least
)

// MSE reduces through one partial per block of a grid of at most mseGrid
// blocks of mseBlock threads.
const (
	mseGrid  = 1024
	mseBlock = 256
)

// Workspace declares the scratch memory of the CUDA kernels when b samples
// run at once, so that the planner allocates it like any buffer and every
// byte the executor uses comes from the planned allocator:
//
//   - conv2d and its gradients: the unfolded patches of one image,
//     [C/groups·kh·kw, Ho·Wo] floats, reused across images and groups (as
//     exec/cpu's Workspace); none for a 1×1 kernel with unit stride and no
//     padding, whose patches are the input itself;
//   - max_pool2d_grad: the int32 argmax of every window;
//   - cross_entropy: the per-row losses in double, and the bad-label flag;
//     cross_entropy_grad, embedding and embedding_grad: the flag (8 bytes);
//   - mse: one double partial per block (mseGrid);
//   - layer_norm_grad_w: per-row mean and rstd in double, and the partial
//     sums of a split column reduction;
//   - batch_norm and its gradients: per-channel mean and rstd in double;
//   - sum, mean and max with few outputs and long reductions: the partials
//     of a split reduction.
//
// The kernels compute in float32, so sizes count 4-byte floats whatever the
// node's dtype.
func Workspace(g *graph.Graph, nd *graph.Node, b int) int64 {
	in := func(i int) []int {
		if i >= len(nd.Inputs) {
			return nil
		}
		return g.Node(nd.Inputs[i]).Type.AtBatch(b)
	}
	switch nd.Op {
	case graph.OpConv2d:
		return convColBytes(in(1), nd.Type.AtBatch(b), &nd.Attrs)
	case graph.OpConv2dGradInput:
		return convColBytes(in(1), in(0), &nd.Attrs)
	case graph.OpConv2dGradWeight:
		return convColBytes(nd.Type.AtBatch(b), in(0), &nd.Attrs)
	case graph.OpMaxPool2dGrad:
		return 4 * int64(graph.Numel(in(0)))
	case graph.OpEmbedding, graph.OpEmbeddingGrad, graph.OpCrossEntropyGrad:
		return 8
	case graph.OpCrossEntropy:
		if x := in(0); len(x) == 2 {
			return 8*int64(x[0]) + 8
		}
	case graph.OpMSE:
		return 8 * mseGrid
	case graph.OpLayerNormGradW:
		rows, d := normRows(in(1), nd.Attrs.NormDims)
		ws := 16 * rows
		if lnSplittable(g, nd) {
			ws += 4 * maxSplits * d
		}
		return ws
	case graph.OpBatchNorm, graph.OpBatchNormGradX, graph.OpBatchNormGradW:
		x := in(0)
		if nd.Op != graph.OpBatchNorm {
			x = in(1)
		}
		if len(x) >= 2 {
			return 16 * int64(x[1])
		}
	case graph.OpSum, graph.OpMean, graph.OpMax:
		if reduceSplittable(g, nd) {
			return 4 * maxSplits * int64(graph.Numel(nd.Type.AtBatch(b)))
		}
	}
	return 0
}

// convColBytes is the patch matrix of one image for weight w [O, C/g, kh,
// kw] and forward output y [N, O, Ho, Wo]; 0 when the input is used as it
// is.
func convColBytes(w, y []int, a *graph.Attrs) int64 {
	if len(w) != 4 || len(y) != 4 {
		return 0
	}
	if w[2] == 1 && w[3] == 1 && a.Stride == [2]int{1, 1} && a.Padding == [2]int{} {
		return 0
	}
	return 4 * int64(w[1]*w[2]*w[3]) * int64(y[2]*y[3])
}

// normRows views x as [rows, d] with d the product of its trailing k dims.
func normRows(x []int, k int) (rows, d int64) {
	if k < 1 || k > len(x) {
		return 0, 0
	}
	d = int64(graph.Numel(x[len(x)-k:]))
	if d > 0 {
		rows = int64(graph.Numel(x)) / d
	}
	return rows, d
}

// reduceSplittable reports whether a sum, mean or max node may split its
// reductions: few outputs, long reductions, at the full batch.
func reduceSplittable(g *graph.Graph, nd *graph.Node) bool {
	nout := int64(nd.Type.Numel())
	nin := int64(g.Node(nd.Inputs[0]).Type.Numel())
	return nout > 0 && nout <= splitMaxOutputs && nin/nout >= 2*splitLen
}

// lnSplittable reports whether layer_norm_grad_w may split its column
// reduction: many rows at the full batch.
func lnSplittable(g *graph.Graph, nd *graph.Node) bool {
	rows, _ := normRows(g.Node(nd.Inputs[1]).Type.Shape, nd.Attrs.NormDims)
	return rows >= 2*lnSplitRows
}

// splitsFor is how many splits a reduction of n elements uses, with at
// least per elements each.
func splitsFor(n, per int64) int64 { return min(max(n/per, 1), maxSplits) }
