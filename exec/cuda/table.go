package cuda

import (
	"github.com/batchfit/batchfit/exec/cuda/internal/opcode"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/internal/optable"
	"github.com/batchfit/batchfit/planner"
)

// opKernel is one op's entry in the kernel table: run launches its
// kernels; ws, when set, declares the scratch memory they take at chunk
// size b (see Workspace), beside the launch that carves it up.
type opKernel struct {
	run func(k *kctx, in []operand, out operand) error
	ws  func(g *graph.Graph, nd *graph.Node, b int) int64
}

// family is one file's table entries (elementwise.go, reduce.go, …).
type family map[graph.Op]opKernel

// kernelTable is every op's kernels, indexed by op; source ops have none
// (the host side fills their blocks). TestKernelTableComplete fails when an
// op has no entry or sits in two families.
var kernelTable = optable.Build(families...)

// OpcodeHeader is kernels/opcodes.cuh as the op codes declared in the
// family files make it: go generate (internal/gen) writes it, and a test
// fails when the committed header differs.
func OpcodeHeader() []byte {
	return opcode.Header(unaryCodes, scalarCodes, binaryCodes, reduceCodes)
}

// families is every family of the table.
var families = []family{elementwiseKernels, matmulKernels, reduceKernels, normKernels, rmsNormKernels,
	movementKernels, convKernels, attentionKernels, attentionQKVKernels, rotaryKernels, swigluKernels, lossKernels, linearCrossEntropyKernels, fusedKernels}

// eval runs node nd's kernels: the entry point of the host side (runner.Run),
// with in and out the node's operands at the chunk's size.
func (r *runner) eval(nd *graph.Node, in []operand, out operand, ws *wsView, c planner.Chunk, cos []coOut) (coDone coSet, err error) {
	if err := deviceDType(nd); err != nil {
		return 0, err
	}
	var run func(*kctx, []operand, operand) error
	if int(nd.Op) < graph.NumOps {
		run = kernelTable[nd.Op].run
	}
	if run == nil {
		return 0, graph.Errorf(graph.ErrAttr, "cuda executor has no kernel for op %s", nd.Op)
	}
	k := r.kernels()
	k.nd, k.c, k.ws = nd, c, ws
	if len(cos) > 0 {
		first := cos[0].v
		k.co, k.coNode, k.coIn = &first, cos[0].node, cos[0].in
		k.more = append([]coOut(nil), cos[1:]...)
	}
	if err = run(k, in, out); err != nil {
		return 0, err
	}
	if k.coDone {
		coDone |= 1
	}
	for i, m := range k.more {
		if m.done {
			coDone |= 1 << (i + 1)
		}
	}
	return coDone, nil
}

// Workspace declares the scratch memory of the CUDA kernels when b samples
// run at once, so that the planner allocates it like any buffer and every
// byte the executor uses comes from the planned allocator. Each family file
// states its ops' rules next to their launches:
//
//   - conv2d and its gradients: the unfolded patches of a tile of images,
//     one group at a time, at most 64 MiB, and conv2d_grad_weight's
//     float32 sums for a 16-bit gradient (conv.go);
//   - max_pool2d_grad: the int32 argmax of every window (conv.go);
//   - linear_cross_entropy, and its gradients where no producer computes
//     them: one logits chunk, the per-row losses in double and the
//     bad-label flag (graph.LossChunkWorkspace; linear_ce.go);
//   - cross_entropy: the per-row losses in double, and the bad-label flag;
//     cross_entropy_grad: the flag; mse: one double partial per block
//     (loss.go);
//   - embedding and embedding_grad: the flag, and embedding_grad's float32
//     sums for a 16-bit gradient (movement.go);
//   - layer_norm_grad_w: per-row mean and rstd in double, and the partial
//     sums of a split column reduction; layer_norm_grad_x with a companion
//     (its weight's or bias's gradient, computed in the same pass): the
//     float partials of both column sums; batch_norm and its gradients:
//     per-channel mean and rstd in double (norm.go);
//   - rms_norm_grad_w, and rms_norm_grad_x with an rms_norm_grad_w
//     companion: the float partials of the weight gradient of each row
//     group (rmsnorm.go);
//   - sum, mean and max with few outputs and long reductions: the partials
//     of a split reduction (reduce.go);
//   - attention_grad_kv on tensor cores (16-bit, head dim 64 or 128, no
//     mask): the float32 row term D = Σ g∘o of every query row
//     (attention.go);
//   - attention and attention_grad_q where cuDNN's fused attention takes
//     them (16-bit, head dim 64 or 128, no mask, grouped-query heads or
//     not): the log-sum-exp when no companion takes it, the backward
//     pass's dQ accumulator and softmax_sum, and a bound on cuDNN's plan
//     workspace (dnn_sdpa.go; with grouped heads it has room for float32
//     dk and dv of every query head);
//   - float32 attention, attention_lse and their gradients: one block of
//     queries' float32 scores for every head, [B·H, bq, ld], once for the
//     forward pass and twice for the gradients (attention32.go).
//
// The kernels compute in float32, so partials and sums count 4-byte floats
// (or 8-byte doubles) whatever the node's dtype; copies of values (conv2d's
// and conv2d_grad_weight's patches) take the node's element size.
func Workspace(g *graph.Graph, nd *graph.Node, b int) int64 {
	if int(nd.Op) >= graph.NumOps || kernelTable[nd.Op].ws == nil {
		return 0
	}
	return kernelTable[nd.Op].ws(g, nd, b)
}

// inputAt is input i of nd at chunk size b, nil when nd has no input i.
func inputAt(g *graph.Graph, nd *graph.Node, i, b int) []int {
	if i >= len(nd.Inputs) {
		return nil
	}
	return g.Node(nd.Inputs[i]).Type.AtBatch(b)
}
