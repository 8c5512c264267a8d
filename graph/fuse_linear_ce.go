package graph

import "slices"

// FuseLinearCrossEntropy is a graph pass over a forward graph, before
// autodiff appends the step's backward pass (gradient ops a caller's
// lazy.Grad left in it are copied like any node): it rewrites
// a language model's head and loss, a cross_entropy of logits made by
//
//	linear(h, W) (no bias), matmul(h, W) with TransB, or matmul(h, permute(W, [1, 0])),
//
// with W [V, C] a value without a batch axis and h [.., C] (the logits
// [N, V], or [.., V] reshaped to [N, V]), into one linear_cross_entropy of
// h (reshaped to [N, C] where it has more axes), W and the labels, with the
// cross_entropy's reduction and classes (Attrs.End: a padded head's, as
// package precision pads it) and the default token chunk (the session
// sets the one a Session chooses, batchfit.Options.LossChunk). Preconditions, each
// checked (a graph that fails one is copied unchanged):
//
//   - the cross_entropy is the loss: one of outputs read by nothing else,
//     or read only by a mul with a float32 scalar without a batch axis
//     (models.CausalLMLoss's 1/count constant) that is one of outputs and
//     read by nothing else; the mul's scalar becomes the fused op's scale
//     input, so the fused op is the loss and the backward pass's seed its
//     upstream gradient, a constant: the forward pass then gives both
//     gradients (LinearCrossEntropyGradProducer);
//   - the logits (and the reshape of them) feed nothing but the loss: a
//     node read only by nodes that no output needs does not count.
//
// Nodes are copied in order, and the matched product and reshape (and the
// cross_entropy, when a mul was the loss) stay in the graph read by
// nothing (ids of them still name their values, as precision.Apply leaves
// a padded head's slice); the fused op takes the loss's place: ids[loss]
// is it. ids[i] is old node i's id in the new graph.
func FuseLinearCrossEntropy(g *Graph, outputs []int) (*Graph, []int, error) {
	n := g.Len()
	// live[i]: some output needs node i. users[i]: node i's live readers,
	// once per input naming it, −1 once per time outputs name it.
	live := make([]bool, n)
	isOut := make([]bool, n)
	for _, id := range outputs {
		if id >= 0 && id < n {
			live[id], isOut[id] = true, true
		}
	}
	for i := n - 1; i >= 0; i-- {
		if live[i] {
			for _, in := range g.Node(i).Inputs {
				live[in] = true
			}
		}
	}
	users := make([][]int, n)
	for i := range n {
		if !live[i] {
			continue
		}
		for _, in := range g.Node(i).Inputs {
			users[in] = append(users[in], i)
		}
	}
	for _, id := range outputs {
		if id >= 0 && id < n {
			users[id] = append(users[id], -1)
		}
	}
	type match struct {
		h, w, labels, scale int
		reshapeH            []int // h's [N, C] shape when h has more axes
		attrs               Attrs
		site, scope         string
	}
	fused := map[int]match{} // by the node whose place the fused op takes
	for c := range n {
		ce := g.Node(c)
		if ce.Op != OpCrossEntropy || !live[c] || len(ce.Inputs) != 2 {
			continue
		}
		target, scale := -1, -1
		switch u := users[c]; {
		case len(u) == 1 && u[0] == -1:
			target = c
		case len(u) == 1 && u[0] >= 0:
			m := g.Node(u[0])
			if m.Op != OpMul || len(m.Inputs) != 2 || !slices.Equal(users[u[0]], []int{-1}) || m.Type.DType != Float32 {
				continue
			}
			s := m.Inputs[1]
			if s == c {
				s = m.Inputs[0]
			}
			st := g.Node(s).Type
			if s == c || len(st.Shape) != 0 || st.Batched() || st.DType != Float32 {
				continue
			}
			target, scale = u[0], s
		default:
			continue
		}
		logits := ce.Inputs[0]
		prod := logits
		if r := g.Node(logits); r.Op == OpReshape {
			if !slices.Equal(users[logits], []int{c}) {
				continue
			}
			prod = r.Inputs[0]
			if !slices.Equal(users[prod], []int{logits}) {
				continue
			}
		} else if !slices.Equal(users[prod], []int{c}) {
			continue
		}
		h, w, ok := headOperands(g, prod)
		if !ok {
			continue
		}
		ht, wt, lt := g.Node(h).Type, g.Node(w).Type, g.Node(logits).Type
		if len(wt.Shape) != 2 || wt.Batched() || len(ht.Shape) < 2 || ht.Shape[len(ht.Shape)-1] != wt.Shape[1] ||
			ht.DType != wt.DType || len(lt.Shape) != 2 || lt.Shape[1] != wt.Shape[0] {
			continue
		}
		m := match{h: h, w: w, labels: ce.Inputs[1], scale: scale, site: ce.Site, scope: ce.Scope,
			attrs: Attrs{Reduction: ce.Attrs.Reduction, End: ce.Attrs.End}}
		if len(ht.Shape) > 2 {
			if Numel(ht.Shape[:len(ht.Shape)-1]) != lt.Shape[0] {
				continue
			}
			m.reshapeH = []int{lt.Shape[0], wt.Shape[1]}
		} else if ht.Shape[0] != lt.Shape[0] {
			continue
		}
		fused[target] = m
	}
	out := New()
	if g.Batch() != 0 {
		if err := out.SetBatch(g.Batch()); err != nil {
			return nil, nil, err
		}
	}
	ids := make([]int, n)
	for i := range n {
		nd := g.Node(i)
		if m, ok := fused[i]; ok {
			h := ids[m.h]
			if m.reshapeH != nil {
				r, err := out.Append(Node{Op: OpReshape, Inputs: []int{h}, Attrs: Attrs{Shape: m.reshapeH}, Scope: m.scope, Site: m.site})
				if err != nil {
					return nil, nil, &OpError{Op: "fuse linear_cross_entropy", Site: m.site, Err: err}
				}
				h = r
			}
			ins := []int{h, ids[m.w], ids[m.labels]}
			if m.scale >= 0 {
				ins = append(ins, ids[m.scale])
			}
			id, err := out.Append(Node{Op: OpLinearCrossEntropy, Inputs: ins, Attrs: m.attrs, Scope: nd.Scope, Site: m.site})
			if err != nil {
				return nil, nil, &OpError{Op: "fuse linear_cross_entropy", Site: m.site, Err: err}
			}
			ids[i] = id
			continue
		}
		c := Node{Op: nd.Op, Attrs: nd.Attrs.Clone(), Name: nd.Name, Scope: nd.Scope, Site: nd.Site, Value: nd.Value,
			Inputs: make([]int, len(nd.Inputs))}
		if nd.Op.Category() == CatSource {
			c.Type = nd.Type
		}
		for k, in := range nd.Inputs {
			c.Inputs[k] = ids[in]
		}
		id, err := out.Append(c)
		if err != nil {
			return nil, nil, &OpError{Op: "fuse " + c.Op.String(), Site: nd.Site, Err: err}
		}
		ids[i] = id
	}
	return out, ids, nil
}

// headOperands returns h and W [V, C] of a classifier head node p: a
// linear without bias, a matmul with TransB, or a matmul of a [1, 0]
// permute of a 2-D W (a tied embedding read transposed).
func headOperands(g *Graph, p int) (h, w int, ok bool) {
	nd := g.Node(p)
	switch {
	case nd.Op == OpLinear && len(nd.Inputs) == 2:
		return nd.Inputs[0], nd.Inputs[1], true
	case nd.Op == OpMatMul && len(nd.Inputs) == 2 && !nd.Attrs.TransA && nd.Attrs.TransB:
		return nd.Inputs[0], nd.Inputs[1], true
	case nd.Op == OpMatMul && len(nd.Inputs) == 2 && !nd.Attrs.TransA && !nd.Attrs.TransB:
		t := g.Node(nd.Inputs[1])
		if t.Op == OpPermute && slices.Equal(t.Attrs.Perm, []int{1, 0}) {
			return nd.Inputs[0], t.Inputs[0], true
		}
	}
	return 0, 0, false
}

// WithLossChunk is a copy of g whose linear_cross_entropy nodes and their
// gradients run over chunks of t tokens (Attrs.LossChunk), for the planner's
// choice (batchfit.Options.LossChunk); g itself when it has none, or when
// every one has t already.
func WithLossChunk(g *Graph, t int) (*Graph, error) {
	need := false
	for i := range g.Len() {
		if nd := g.Node(i); IsLinearCrossEntropy(nd.Op) && nd.Attrs.LossChunk != t {
			need = true
		}
	}
	if !need {
		return g, nil
	}
	out, _, err := Rebuild(g, "loss chunk ", func(_ int, n *Node, _ []int) (int, bool) {
		if IsLinearCrossEntropy(n.Op) {
			n.Attrs.LossChunk = t
		}
		return 0, true
	})
	return out, err
}

// LossChunkOf is the token chunk of g's first linear_cross_entropy node
// (Attrs.LossChunk) and its rows, hidden size and classes' rows of W; ok
// false when g has none.
func LossChunkOf(g *Graph) (chunk, rows, hidden, vocab int, ok bool) {
	for i := range g.Len() {
		if nd := g.Node(i); nd.Op == OpLinearCrossEntropy && len(nd.Inputs) >= 3 {
			h, w := g.Node(nd.Inputs[0]).Type, g.Node(nd.Inputs[1]).Type
			return nd.Attrs.LossChunk, h.Shape[0], h.Shape[1], w.Shape[0], true
		}
	}
	return 0, 0, 0, 0, false
}
