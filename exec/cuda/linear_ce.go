package cuda

import (
	"slices"
	"sync/atomic"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/exec"
	"github.com/batchfit/batchfit/graph"
)

// Fused head and loss (kernels/loss.cu's linear_ce_rows_*, cuBLAS):
// linear_cross_entropy and its gradients over chunks of
// graph.LossChunkRows tokens. For each chunk: one GEMM of the chunk's
// logits [T, V] = h·Wᵀ into the workspace (in h's dtype, float32 sums,
// rows graph.LossChunkPitch apart), one row pass (the rows' losses in
// double, and with gradients the rows overwritten in place by
// s·(softmax − onehot)), then the GEMMs dh = dl·W and dW += dlᵀ·h (beta
// 1 after the first chunk: W's dtype accumulates, as Liger's
// torch.addmm does). The forward node computes its gradients too when the
// program hands them over (graph.LinearCrossEntropyGradProducer: the
// seed is a fill, whose value scales them), and _grad_h computes _grad_w;
// a node whose companion is computed so declares no workspace.
var linearCrossEntropyKernels = family{
	graph.OpLinearCrossEntropy: {run: func(k *kctx, in []operand, out operand) error {
		return k.linearCEForward(in, out)
	}, ws: exec.LossChunkWorkspace},
	graph.OpLinearCrossEntropyGradH: {run: func(k *kctx, in []operand, out operand) error {
		var dw *operand
		cw := k.companionWith(graph.OpLinearCrossEntropyGradW)
		if cw.v != nil && sameOperand(*cw.v, in[2]) {
			dw = cw.v
		}
		if err := k.linearCE(in[1], in[2], in[3], optional(in, 4), in[0].p, 1, nil, &out, dw, 3); err != nil {
			return err
		}
		if dw != nil {
			*cw.done = true
		}
		return nil
	}, ws: exec.LossChunkWorkspace},
	graph.OpLinearCrossEntropyGradW: {run: func(k *kctx, in []operand, out operand) error {
		return k.linearCE(in[1], in[2], in[3], optional(in, 4), in[0].p, 1, nil, nil, &out, 3)
	}, ws: exec.LossChunkWorkspace},
}

// fusedLinearCEs counts linear_cross_entropy launches that computed their
// gradients too (tests read it).
var fusedLinearCEs atomic.Int64

// sameOperand reports whether a gradient's output o has x's dtype and
// shape.
func sameOperand(o, x operand) bool { return o.dt == x.dt && slices.Equal(o.shape, x.shape) }

// linearCEForward runs linear_cross_entropy, with the companion
// gradients the program hands over: their seed is a fill
// (graph.LinearCrossEntropyGradProducer), whose value scales them.
func (k *kctx) linearCEForward(in []operand, out operand) error {
	h, w := in[0], in[1]
	ch := k.companionWith(graph.OpLinearCrossEntropyGradH)
	cw := k.companionWith(graph.OpLinearCrossEntropyGradW)
	var dh, dw *operand
	seed := 0.0
	if ch.v != nil && sameOperand(*ch.v, h) {
		dh, seed = ch.v, k.g.Node(ch.nd.Inputs[0]).Attrs.Scalar
	}
	if cw.v != nil && sameOperand(*cw.v, w) {
		dw, seed = cw.v, k.g.Node(cw.nd.Inputs[0]).Attrs.Scalar
	}
	if err := k.linearCE(h, w, in[2], optional(in, 3), 0, seed, &out, dh, dw, 2); err != nil {
		return err
	}
	if dh != nil {
		*ch.done = true
	}
	if dw != nil {
		*cw.done = true
	}
	if dh != nil || dw != nil {
		fusedLinearCEs.Add(1)
	}
	return nil
}

// linearCE runs the chunks of the node's linear_cross_entropy over h
// [n, C], W [V, C], labels [n] (input labelsIn of the node) and an
// optional float32 scale: the loss into loss (float32), and dh, dW where
// set, scaled by Scalar·g·scale with g the float32 device scalar at gp,
// or seed when gp is 0.
func (k *kctx) linearCE(h, w, labels operand, scale *operand, gp alloc.Ptr, seed float64, loss, dh, dw *operand, labelsIn int) error {
	a := k.attrs()
	dt, err := floatsOf(h, w)
	if err != nil {
		return err
	}
	if len(h.shape) != 2 || len(w.shape) != 2 || h.shape[1] != w.shape[1] || labels.dt != graph.Int64 || labels.n() != int64(h.shape[0]) {
		return graph.Errorf(graph.ErrShape, "linear_cross_entropy needs h [N, C], W [V, C] and int64 labels [N], got %v, %v and %v", h.shape, w.shape, labels.shape)
	}
	if scale != nil && (scale.dt != graph.Float32 || scale.n() != 1) {
		return graph.Errorf(graph.ErrShape, "linear_cross_entropy's scale must be a float32 scalar, got %s%v", scale.dt, scale.shape)
	}
	if loss != nil && (loss.dt != graph.Float32 || loss.n() != 1) {
		return graph.Errorf(graph.ErrDType, "linear_cross_entropy into a %s%v loss (a float32 scalar)", loss.dt, loss.shape)
	}
	for _, d := range []*operand{dh, dw} {
		if d != nil && d.dt != dt {
			return graph.Errorf(graph.ErrDType, "linear_cross_entropy gradient %s%v of %s operands", d.dt, d.shape, dt)
		}
	}
	n, c, v := h.shape[0], h.shape[1], w.shape[0]
	classes := graph.CrossEntropyClasses(a, v)
	ld := graph.LossChunkPitch(v)
	off := graph.LossRowsOffset(a, n, v)
	t := graph.LossChunkRows(a, n)
	base, err := k.workspace(graph.LossChunkWorkspace(a, n, v))
	if err != nil {
		return err
	}
	rowLoss, acc := base+alloc.Ptr(off), base+alloc.Ptr(off+8*int64(t))
	bad, err := k.badFlag(off + 8*int64(t) + 8)
	if err != nil {
		return err
	}
	var sp alloc.Ptr
	if scale != nil {
		sp = scale.p
	}
	grads := dh != nil || dw != nil
	s0 := a.Scalar
	if gp == 0 {
		s0 *= seed
	}
	block := ceBlock(int64(classes))
	for t0 := 0; t0 < n; t0 += t {
		rows := min(t, n-t0)
		hc := h.at(int64(t0 * c))
		if err := k.blas.GemmOf(dt, false, true, rows, v, c, 1, hc, c, w.p, c, 0, base, ld); err != nil {
			return err
		}
		if err := k.launch(typed(kLinearCERows, dt), rowGrid(int64(rows), block, 1), block, base, labels.p, rowLoss, gp, sp,
			int64(t0), int64(rows), int64(classes), int64(ld), s0, boolInt(grads), bad); err != nil {
			return err
		}
		if err := k.launch(kLinearCEAcc, [3]uint32{1, 1, 1}, [3]uint32{1024, 1, 1}, rowLoss, acc, int64(rows), boolInt(t0 == 0)); err != nil {
			return err
		}
		if dh != nil {
			if err := k.blas.GemmOf(dt, false, false, rows, c, v, 1, base, ld, w.p, c, 0, dh.at(int64(t0*c)), c); err != nil {
				return err
			}
		}
		if dw != nil {
			beta := float32(1)
			if t0 == 0 {
				beta = 0
			}
			if err := k.blas.GemmOf(dt, true, false, v, c, rows, 1, base, ld, hc, c, beta, dw.p, c); err != nil {
				return err
			}
		}
	}
	if loss != nil {
		if err := k.sumF64(graph.Float32, acc, loss.p, 1, a.Scalar); err != nil {
			return err
		}
	}
	return k.firstBad(bad, labels, "linear_cross_entropy", "label", labelsIn, int64(classes))
}
