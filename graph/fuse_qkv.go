package graph

import "slices"

// FuseAttentionQKV is a graph pass: it rewrites attention written over q,
// k and v sliced from one packed projection, as PyTorch code writes a
// transformer block,
//
//	for i in q, k, v: x.Slice(2, i·C, (i+1)·C).Reshape(B, T, H, d).Permute(0, 2, 1, 3)
//	attention(q, k, v) (no mask) .Permute(0, 2, 1, 3).Reshape(B, T, C)
//
// with x [B, T, 3C], into one attention_qkv of x (H heads, the attention's
// scale and causality), which reads q, k, v in place: none of the slices,
// permutes or their gradients' copies remain. Everything else is copied
// as it is; a graph without the pattern comes back as a copy of itself
// (the same ops, wiring, attributes and types). ids[i] is old node i's id
// in the new graph, −1 for a node of a matched pattern that nothing else
// reads (the pattern's nodes another node reads are kept for it). Run it
// on the forward graph, before autodiff: a graph holding gradient ops is
// refused (ErrAttr), as precision.Apply refuses one.
func FuseAttentionQKV(g *Graph) (*Graph, []int, error) {
	users := make([][]int, g.Len())
	for i := range g.Len() {
		for _, in := range g.Node(i).Inputs {
			users[in] = append(users[in], i)
		}
	}
	// fused[r] is the packed input of the pattern that reshape r ends;
	// drop marks pattern nodes that only the pattern reads.
	type match struct {
		x     int
		attrs Attrs
	}
	fused := map[int]match{}
	drop := make([]bool, g.Len())
	for i := range g.Len() {
		if g.Node(i).Op.Category() == CatGrad {
			return nil, nil, &OpError{Op: "fuse attention_qkv", Site: g.Node(i).Site,
				Err: Errorf(ErrAttr, "node %d is a gradient op (%s): fuse the forward graph, before autodiff", i, g.Node(i).Op)}
		}
		x, heads, chain, ok := qkvPattern(g, users, i)
		if !ok {
			continue
		}
		a := g.Node(g.Node(g.Node(i).Inputs[0]).Inputs[0]).Attrs
		fused[i] = match{x: x, attrs: Attrs{Groups: heads, Scalar: a.Scalar, Causal: a.Causal}}
		// Backwards from the attention: a node goes when all its readers do.
		for _, id := range chain {
			gone := true
			for _, u := range users[id] {
				gone = gone && (u == i || drop[u])
			}
			drop[id] = gone
		}
	}
	return Rebuild(g, "", func(i int, n *Node, ids []int) (int, bool) {
		if drop[i] {
			return -1, false
		}
		if m, ok := fused[i]; ok {
			n.Op, n.Attrs, n.Inputs = OpAttentionQKV, m.attrs, []int{ids[m.x]}
		}
		return 0, true
	})
}

// qkvPattern reports whether node r ends attention over a packed
// projection (FuseAttentionQKV): r reshapes to [B, T, C] a [0, 2, 1, 3]
// permute, read by nothing else, of an unmasked attention, read by nothing
// else, whose q, k and v are the [0, 2, 1, 3] permutes of [B, T, H, d]
// reshapes of slices 0, 1 and 2 (of width C, step 1, on axis 2) of one x
// [B, T, 3C], q, k and v of one shape. It returns x, H and the pattern's
// nodes from the attention back to the slices.
func qkvPattern(g *Graph, users [][]int, r int) (x, heads int, chain []int, ok bool) {
	swap := []int{0, 2, 1, 3}
	rn := g.Node(r)
	if rn.Op != OpReshape || len(rn.Type.Shape) != 3 {
		return 0, 0, nil, false
	}
	p := rn.Inputs[0]
	pn := g.Node(p)
	if pn.Op != OpPermute || !slices.Equal(pn.Attrs.Perm, swap) || len(users[p]) != 1 {
		return 0, 0, nil, false
	}
	a := pn.Inputs[0]
	an := g.Node(a)
	if an.Op != OpAttention || len(an.Inputs) != 3 || len(users[a]) != 1 {
		return 0, 0, nil, false
	}
	chain = []int{p, a}
	x = -1
	var sliced []int
	for i, h := range an.Inputs {
		hn := g.Node(h)
		if hn.Op != OpPermute || !slices.Equal(hn.Attrs.Perm, swap) {
			return 0, 0, nil, false
		}
		rs := g.Node(hn.Inputs[0])
		if rs.Op != OpReshape {
			return 0, 0, nil, false
		}
		sl := g.Node(rs.Inputs[0])
		if sl.Op != OpSlice || sl.Attrs.Axis != 2 || sl.Attrs.Step != 1 {
			return 0, 0, nil, false
		}
		src := g.Node(sl.Inputs[0]).Type
		c := sl.Attrs.End - sl.Attrs.Start
		s := rs.Type.Shape // [B, T, H, d]
		if len(src.Shape) != 3 || src.Shape[2] != 3*c || sl.Attrs.Start != i*c || len(s) != 4 ||
			s[0] != src.Shape[0] || s[1] != src.Shape[1] || s[2]*s[3] != c || (x >= 0 && sl.Inputs[0] != x) ||
			(i > 0 && !slices.Equal(s, g.Node(g.Node(an.Inputs[0]).Inputs[0]).Type.Shape)) {
			return 0, 0, nil, false
		}
		if src.Batched() && src.BatchAxis != 0 {
			return 0, 0, nil, false
		}
		x, heads = sl.Inputs[0], s[2]
		chain = append(chain, h)
		sliced = append(sliced, hn.Inputs[0], rs.Inputs[0])
	}
	out := g.Node(x).Type.Shape
	if !slices.Equal(rn.Type.Shape, []int{out[0], out[1], out[2] / 3}) {
		return 0, 0, nil, false
	}
	return x, heads, append(chain, sliced...), true
}
