package graph

import "slices"

// FuseAttentionQKV is a graph pass: it rewrites attention written over q,
// k and v as PyTorch code writes a transformer block,
//
//	for i in q, k, v: p_i.Reshape(B, T, H_i, d) [.rotate()] .Permute(0, 2, 1, 3)
//	attention(q, k, v) (no mask) .Permute(0, 2, 1, 3).Reshape(B, T, H·d)
//
// into one attention_qkv of a packed projection [B, T, (H + 2·Hkv)·d]
// (H query heads, Hkv = H_k = H_v key/value heads dividing H, the
// attention's scale and causality), which reads q, k, v in place: none of
// the slices, permutes or their gradients' copies remain. The p_i are
// either
//
//   - slices 0, 1 and 2 of one x [B, T, (H + 2·Hkv)·d] along axis 2 (a
//     GPT block's c_attn), which attention_qkv reads as they are, or
//   - linears of one x by their own weights [H_i·d, in] (a Llama block's
//     q_proj, k_proj, v_proj; biases on all three or none), which become
//     one linear by the weights concatenated along axis 0 (and the biases
//     so), whose gradient the autodiff slices back to each weight.
//
// q and k may be rotated (v never), both by one table: by rotary ops of
// every head with one table cs, or by rotary written out as Hugging
// Face's apply_rotary_pos_emb writes it, x·cos + rotate_half(x)·sin with
// rotate_half(x) = concat(−x[..., d/2:], x[..., :d/2]) and cos, sin of
// shape [T, 1, d] (leading 1s allowed). The rotation then runs once on the
// packed projection's first H + Hkv heads (rotary with End = H + Hkv):
// with cs as it is, or with the written form's tables side by side,
// concat(cos, sin) [T, 2d], rotary's full form, which equals the written
// expression for any values of cos and sin, so the rewrite does not read
// them.
//
// Everything else is copied as it is; a graph without the pattern comes
// back as a copy of itself (the same ops, wiring, attributes and types).
// ids[i] is old node i's id in the new graph, −1 for a node of a matched
// pattern that nothing else reads (the pattern's nodes another node reads
// are kept for it). Run it on the forward graph, before autodiff: a graph
// holding gradient ops is refused (ErrAttr), as precision.Apply refuses
// one.
func FuseAttentionQKV(g *Graph) (*Graph, []int, error) {
	users := make([][]int, g.Len())
	for i := range g.Len() {
		for _, in := range g.Node(i).Inputs {
			users[in] = append(users[in], i)
		}
	}
	fused := map[int]*qkvMatch{}
	drop := make([]bool, g.Len())
	for i := range g.Len() {
		if g.Node(i).Op.Category() == CatGrad {
			return nil, nil, &OpError{Op: "fuse attention_qkv", Site: g.Node(i).Site,
				Err: Errorf(ErrAttr, "node %d is a gradient op (%s): fuse the forward graph, before autodiff", i, g.Node(i).Op)}
		}
		m, ok := qkvPattern(g, users, i)
		if !ok {
			continue
		}
		fused[i] = m
		// Backwards from the attention (readers before what they read): a
		// node goes when all its readers do.
		chain := slices.Clone(m.chain)
		slices.Sort(chain)
		chain = slices.Compact(chain)
		for k := len(chain) - 1; k >= 0; k-- {
			id := chain[k]
			gone := true
			for _, u := range users[id] {
				gone = gone && (u == i || drop[u])
			}
			drop[id] = gone
		}
	}
	tables := map[[2]int]int{} // the full tables made, by their cos and sin
	return RebuildEmit(g, "fuse attention_qkv: ", func(i int, n *Node, ids []int, emit Emit) (int, bool) {
		if drop[i] {
			return -1, false
		}
		m, ok := fused[i]
		if !ok {
			return 0, true
		}
		at := func(op Op, attrs Attrs, in ...int) int {
			return emit(Node{Op: op, Attrs: attrs, Inputs: in, Scope: n.Scope, Site: n.Site})
		}
		p := ids[m.x]
		if m.weights != nil {
			w := at(OpConcat, Attrs{Axis: 0}, ids[m.weights[0]], ids[m.weights[1]], ids[m.weights[2]])
			in := []int{p, w}
			if m.biases != nil {
				in = append(in, at(OpConcat, Attrs{Axis: 0}, ids[m.biases[0]], ids[m.biases[1]], ids[m.biases[2]]))
			}
			p = at(OpLinear, Attrs{}, in...)
		}
		if m.rot.kind != rotNone {
			tab := fullTable(g, m, ids, at, tables)
			n4 := at(OpReshape, Attrs{Shape: []int{m.b, m.t, m.heads + 2*m.kv, m.d}}, p)
			p = at(OpReshape, Attrs{Shape: []int{m.b, m.t, (m.heads + 2*m.kv) * m.d}}, at(OpRotary, Attrs{End: m.heads + m.kv}, n4, tab))
		}
		n.Op, n.Attrs, n.Inputs = OpAttentionQKV, m.attrs, []int{p}
		return 0, true
	})
}

// fullTable is the rotary table of m's rotation in the new graph: a
// rotary op's table as it is, or the written form's cos and sin [T, d]
// side by side in float32 (their dtype is one), made once for each pair
// (tables) with at.
func fullTable(g *Graph, m *qkvMatch, ids []int, at func(Op, Attrs, ...int) int, tables map[[2]int]int) int {
	if m.rot.kind == rotTable {
		return ids[m.rot.cs]
	}
	key := [2]int{ids[m.rot.cos], ids[m.rot.sin]}
	if t, ok := tables[key]; ok {
		return t
	}
	td := []int{m.t, m.d}
	tab := at(OpConcat, Attrs{Axis: 1}, at(OpReshape, Attrs{Shape: td}, key[0]), at(OpReshape, Attrs{Shape: td}, key[1]))
	if g.Node(m.rot.cos).Type.DType != Float32 {
		tab = at(OpCast, Attrs{Target: Type{DType: Float32}}, tab)
	}
	tables[key] = tab
	return tab
}

// qkvMatch is one attention FuseAttentionQKV rewrites: the packed
// projection x (or the linears' common input, with their weights and
// biases, old ids, in q, k, v order), the rotation of q and k, the sizes
// (batch b, positions t, heads, kv heads, head dim d), attention_qkv's
// attributes, and the pattern's nodes, which go when only the pattern
// reads them.
type qkvMatch struct {
	x                  int
	weights, biases    []int
	rot                qkvRotation
	b, t, heads, kv, d int
	attrs              Attrs
	chain              []int
}

// qkvRotation is how q or k is rotated: not (rotNone), by a rotary op of
// every head with table cs (rotTable), or written out with cos and sin
// (rotWritten).
type qkvRotation struct {
	kind         uint8
	cs, cos, sin int
}

const (
	rotNone uint8 = iota
	rotTable
	rotWritten
)

// qkvHead is one of attention's q, k, v traced back to its projection:
// from the slice of x at start (linear false) or from the linear of x by
// w (and b, −1 for none); [B, T, n, d]; its rotation; its nodes.
type qkvHead struct {
	linear            bool
	x, start, w, bias int
	shape             []int
	rot               qkvRotation
	nodes             []int
}

// qkvPattern reports whether node r ends attention over q, k and v of one
// input (FuseAttentionQKV): r reshapes to [B, T, H·d] a [0, 2, 1, 3]
// permute, read by nothing else, of an unmasked attention, read by nothing
// else, whose q, k and v are traced by qkvHeadOf to slices of one x or
// linears of one x, consistently.
func qkvPattern(g *Graph, users [][]int, r int) (*qkvMatch, bool) {
	swap := []int{0, 2, 1, 3}
	rn := g.Node(r)
	if rn.Op != OpReshape || len(rn.Type.Shape) != 3 {
		return nil, false
	}
	p := rn.Inputs[0]
	pn := g.Node(p)
	if pn.Op != OpPermute || !slices.Equal(pn.Attrs.Perm, swap) || len(users[p]) != 1 {
		return nil, false
	}
	a := pn.Inputs[0]
	an := g.Node(a)
	if an.Op != OpAttention || len(an.Inputs) != 3 || len(users[a]) != 1 {
		return nil, false
	}
	var hs [3]qkvHead
	for i, h := range an.Inputs {
		var ok bool
		if hs[i], ok = qkvHeadOf(g, h); !ok {
			return nil, false
		}
	}
	q, k, v := hs[0], hs[1], hs[2]
	s := q.shape
	b, t, d := s[0], s[1], s[3]
	heads, kv := s[2], k.shape[2]
	if !slices.Equal(k.shape, v.shape) || k.shape[0] != b || k.shape[1] != t || k.shape[3] != d || heads%kv != 0 ||
		q.linear != k.linear || q.linear != v.linear || q.x != k.x || q.x != v.x ||
		q.rot != k.rot || v.rot.kind != rotNone || !slices.Equal(rn.Type.Shape, []int{b, t, heads * d}) {
		return nil, false
	}
	if xt := g.Node(q.x).Type; xt.Batched() && xt.BatchAxis != 0 {
		return nil, false
	}
	m := &qkvMatch{x: q.x, rot: q.rot, b: b, t: t, heads: heads, kv: kv, d: d,
		attrs: Attrs{Groups: heads, Scalar: an.Attrs.Scalar, Causal: an.Attrs.Causal}, chain: []int{p, a}}
	if kv != heads {
		m.attrs.KVHeads = kv
	}
	if q.linear {
		if !linearsPack(g, q, k, v) {
			return nil, false
		}
		m.weights = []int{q.w, k.w, v.w}
		if q.bias >= 0 {
			m.biases = []int{q.bias, k.bias, v.bias}
		}
	} else {
		xs := g.Node(q.x).Type.Shape
		if len(xs) != 3 || xs[0] != b || xs[1] != t || xs[2] != (heads+2*kv)*d ||
			q.start != 0 || k.start != heads*d || v.start != (heads+kv)*d {
			return nil, false
		}
	}
	for _, h := range hs {
		m.chain = append(m.chain, h.nodes...)
	}
	return m, true
}

// linearsPack reports whether the linears of q, k and v pack into one:
// weights [n_i·d, in] of one dtype, biases [n_i·d] of one dtype on all
// three or none.
func linearsPack(g *Graph, hs ...qkvHead) bool {
	w0 := g.Node(hs[0].w).Type
	for _, h := range hs {
		wt := g.Node(h.w).Type
		if len(wt.Shape) != 2 || wt.Shape[0] != h.shape[2]*h.shape[3] || wt.Shape[1] != w0.Shape[1] || wt.DType != w0.DType || wt.Batched() {
			return false
		}
		if (h.bias >= 0) != (hs[0].bias >= 0) {
			return false
		}
		if h.bias >= 0 {
			bt := g.Node(h.bias).Type
			if !slices.Equal(bt.Shape, []int{wt.Shape[0]}) || bt.DType != g.Node(hs[0].bias).Type.DType || bt.Batched() {
				return false
			}
		}
	}
	return true
}

// qkvHeadOf traces attention input h back: a [0, 2, 1, 3] permute of y
// [B, T, n, d], y being (or rotating, qkvRotationOf) a reshape of a
// projection [B, T, n·d] that is a slice of some x along axis 2 (step 1)
// or a linear of some x.
func qkvHeadOf(g *Graph, h int) (qkvHead, bool) {
	hn := g.Node(h)
	if hn.Op != OpPermute || !slices.Equal(hn.Attrs.Perm, []int{0, 2, 1, 3}) {
		return qkvHead{}, false
	}
	y := hn.Inputs[0]
	hd := qkvHead{nodes: []int{h}}
	rs, rot, rotNodes := qkvRotationOf(g, y)
	hd.rot, hd.nodes = rot, append(hd.nodes, rotNodes...)
	rn := g.Node(rs)
	if rn.Op != OpReshape || len(rn.Type.Shape) != 4 {
		return qkvHead{}, false
	}
	hd.shape = rn.Type.Shape
	src := rn.Inputs[0]
	sn := g.Node(src)
	st := sn.Type.Shape
	if len(st) != 3 || st[0] != hd.shape[0] || st[1] != hd.shape[1] || st[2] != hd.shape[2]*hd.shape[3] {
		return qkvHead{}, false
	}
	hd.nodes = append(hd.nodes, rs, src)
	switch sn.Op {
	case OpSlice:
		if sn.Attrs.Axis != 2 || sn.Attrs.Step != 1 {
			return qkvHead{}, false
		}
		hd.x, hd.start = sn.Inputs[0], sn.Attrs.Start
	case OpLinear:
		hd.linear, hd.x, hd.w, hd.bias = true, sn.Inputs[0], sn.Inputs[1], -1
		if len(sn.Inputs) == 3 {
			hd.bias = sn.Inputs[2]
		}
	default:
		return qkvHead{}, false
	}
	return hd, true
}

// qkvRotationOf reports how y [B, T, n, d] rotates the reshape it reads:
// a rotary op of every head (its table), x·cos + rotate_half(x)·sin
// written out (cos and sin [T, 1, d] of one dtype, leading 1s allowed,
// not batched: the pass concatenates them),
// or not at all. It returns the reshape's id (y itself when there is no
// rotation), the rotation and the rotation's nodes.
func qkvRotationOf(g *Graph, y int) (int, qkvRotation, []int) {
	yn := g.Node(y)
	if yn.Op == OpRotary && len(yn.Inputs) == 2 {
		x := yn.Inputs[0]
		if xs := g.Node(x).Type.Shape; len(xs) == 4 && yn.Attrs.End == xs[2] {
			return x, qkvRotation{kind: rotTable, cs: yn.Inputs[1]}, []int{y}
		}
		return y, qkvRotation{}, nil
	}
	if yn.Op != OpAdd || len(yn.Inputs) != 2 || len(yn.Type.Shape) != 4 {
		return y, qkvRotation{}, nil
	}
	for _, order := range [2][2]int{{0, 1}, {1, 0}} {
		m1, m2 := yn.Inputs[order[0]], yn.Inputs[order[1]]
		x, sin, rest, ok := rotateHalfTimes(g, m2)
		if !ok {
			continue
		}
		cos, ok := otherFactor(g, m1, x)
		if !ok || !ropeTableShape(g.Node(cos).Type, yn.Type) || !ropeTableShape(g.Node(sin).Type, yn.Type) ||
			g.Node(cos).Type.DType != g.Node(sin).Type.DType || g.Node(x).Type.DType != yn.Type.DType {
			continue
		}
		return x, qkvRotation{kind: rotWritten, cos: cos, sin: sin}, append([]int{y, m1, m2}, rest...)
	}
	return y, qkvRotation{}, nil
}

// rotateHalfTimes reports whether m is rotate_half(x)·sin in either order,
// rotate_half(x) = concat(−x[..., h:], x[..., :h]) along the last axis (h
// = d/2), and returns x, sin and the nodes of rotate_half.
func rotateHalfTimes(g *Graph, m int) (x, sin int, nodes []int, ok bool) {
	mn := g.Node(m)
	if mn.Op != OpMul || len(mn.Inputs) != 2 {
		return 0, 0, nil, false
	}
	for _, order := range [2][2]int{{0, 1}, {1, 0}} {
		c, s := mn.Inputs[order[0]], mn.Inputs[order[1]]
		cn := g.Node(c)
		if cn.Op != OpConcat || len(cn.Inputs) != 2 || len(cn.Type.Shape) != 4 || cn.Attrs.Axis != 3 {
			continue
		}
		neg, lo := cn.Inputs[0], cn.Inputs[1]
		nn := g.Node(neg)
		if nn.Op != OpNeg {
			continue
		}
		hi := nn.Inputs[0]
		d := cn.Type.Shape[3]
		xl, okl := halfSlice(g, lo, 0, d/2)
		xh, okh := halfSlice(g, hi, d/2, d)
		if !okl || !okh || xl != xh || d%2 != 0 || !slices.Equal(g.Node(xl).Type.Shape, cn.Type.Shape) {
			continue
		}
		return xl, s, []int{c, neg, hi, lo}, true
	}
	return 0, 0, nil, false
}

// halfSlice reports whether node s slices [start, end) with step 1 off
// the last axis of a rank-4 value, and returns that value.
func halfSlice(g *Graph, s, start, end int) (int, bool) {
	sn := g.Node(s)
	if sn.Op != OpSlice || sn.Attrs.Axis != 3 || sn.Attrs.Step != 1 || sn.Attrs.Start != start || sn.Attrs.End != end {
		return 0, false
	}
	return sn.Inputs[0], true
}

// otherFactor reports whether m is x·f or f·x, and returns f.
func otherFactor(g *Graph, m, x int) (int, bool) {
	mn := g.Node(m)
	if mn.Op != OpMul || len(mn.Inputs) != 2 {
		return 0, false
	}
	switch x {
	case mn.Inputs[0]:
		return mn.Inputs[1], true
	case mn.Inputs[1]:
		return mn.Inputs[0], true
	}
	return 0, false
}

// ropeTableShape reports whether a cos or sin table of type tab serves y
// [B, T, n, d] as rotary's table does: float, not batched, [T, 1, d] with
// any leading 1s.
func ropeTableShape(tab, y Type) bool {
	s := tab.Shape
	if !tab.DType.IsFloat() || tab.Batched() || len(s) < 3 || len(s) > 4 {
		return false
	}
	for _, d := range s[:len(s)-3] {
		if d != 1 {
			return false
		}
	}
	s = s[len(s)-3:]
	return s[0] == y.Shape[1] && s[1] == 1 && s[2] == y.Shape[3]
}
