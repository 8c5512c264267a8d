package graph

import (
	"hash/maphash"
	"math"
	"math/bits"
	"slices"
)

// sigSeed seeds Signature's hash: signatures are keys within one process
// (the session's and planner's caches), never stored.
var sigSeed = maphash.MakeSeed()

// Signature hashes everything about g that shapes and memory depend on:
// ops, wiring, attributes, types, batch size and parameter names — not the
// data. Two graphs with one signature get one analysis and one plan, so a
// training loop that rebuilds its graph every step re-plans nothing.
//
// It runs every training step (the step templates, the program and plan
// caches), so it streams the fields through a 64-bit hash (xxHash64's
// round and finish, seeded per process) rather than encoding them first:
// about 60 words a node, a few nanoseconds each.
func (g *Graph) Signature() uint64 {
	h := newSigHash()
	ints := func(s []int) {
		h.put(uint64(len(s)))
		for _, v := range s {
			h.put(uint64(v))
		}
	}
	typ := func(t Type) {
		ints(t.Shape)
		h.put(uint64(t.DType))
		h.put(uint64(t.BatchAxis))
		h.put(uint64(t.PerSample))
	}
	h.put(uint64(g.batch))
	for i := range g.nodes {
		n := &g.nodes[i]
		h.put(uint64(n.Op))
		ints(n.Inputs)
		typ(n.Type)
		h.str(n.Name)
		a := &n.Attrs
		h.put(math.Float64bits(a.Scalar))
		h.put(math.Float64bits(a.Eps))
		ints(a.Axes)
		ints(a.Shape)
		ints(a.Perm)
		for _, v := range [...]int{a.Axis, a.Start, a.End, a.Step, a.NormDims, a.Groups, a.KVHeads, a.LossChunk, int(a.Reduction),
			a.Kernel[0], a.Kernel[1], a.Stride[0], a.Stride[1], a.Padding[0], a.Padding[1], a.Dilation[0], a.Dilation[1]} {
			h.put(uint64(v))
		}
		flags := uint64(0)
		for bit, f := range [...]bool{a.Approx, a.KeepDim, a.TransA, a.TransB, a.Training, a.Causal, a.PerChunk, a.ChannelsLast} {
			if f {
				flags |= 1 << bit
			}
		}
		h.put(flags)
		typ(a.Target)
		if a.Pointwise != nil {
			h.str(a.Pointwise.Text())
		}
	}
	return h.sum()
}

// SameSignature reports whether g and h agree in everything Signature
// hashes, compared exactly: a cache that keeps a graph's structure (its
// nodes without data) verifies a hit with it, so two graphs whose
// signatures collide never share an entry, and a training loop that finds
// its step by the latest step's graph needs no hash at all. Keep it in
// step with Signature (TestSameSignatureSeesWhatSignatureHashes).
func (g *Graph) SameSignature(h *Graph) bool {
	if g == h {
		return true
	}
	if g.batch != h.batch || len(g.nodes) != len(h.nodes) {
		return false
	}
	for i := range g.nodes {
		if !sameSigNode(&g.nodes[i], &h.nodes[i]) {
			return false
		}
	}
	return true
}

// sameSigNode compares what Signature hashes of a node.
func sameSigNode(m, n *Node) bool {
	if m.Op != n.Op || m.Name != n.Name || !slices.Equal(m.Inputs, n.Inputs) || !sameSigType(&m.Type, &n.Type) {
		return false
	}
	a, b := &m.Attrs, &n.Attrs
	return math.Float64bits(a.Scalar) == math.Float64bits(b.Scalar) && math.Float64bits(a.Eps) == math.Float64bits(b.Eps) &&
		slices.Equal(a.Axes, b.Axes) && slices.Equal(a.Shape, b.Shape) && slices.Equal(a.Perm, b.Perm) &&
		a.Axis == b.Axis && a.Start == b.Start && a.End == b.End && a.Step == b.Step && a.NormDims == b.NormDims &&
		a.Groups == b.Groups && a.KVHeads == b.KVHeads && a.LossChunk == b.LossChunk && a.Reduction == b.Reduction &&
		a.Kernel == b.Kernel && a.Stride == b.Stride && a.Padding == b.Padding && a.Dilation == b.Dilation &&
		a.Approx == b.Approx && a.KeepDim == b.KeepDim && a.TransA == b.TransA && a.TransB == b.TransB &&
		a.Training == b.Training && a.Causal == b.Causal && a.PerChunk == b.PerChunk && a.ChannelsLast == b.ChannelsLast &&
		sameSigType(&a.Target, &b.Target) && (a.Pointwise == b.Pointwise || a.Pointwise.Text() == b.Pointwise.Text())
}

func sameSigType(s, t *Type) bool {
	return s.DType == t.DType && s.BatchAxis == t.BatchAxis && s.PerSample == t.PerSample && slices.Equal(s.Shape, t.Shape)
}

// xxHash64's primes.
const (
	sigPrime1 = 0x9E3779B185EBCA87
	sigPrime2 = 0xC2B2AE3D27D4EB4F
	sigPrime3 = 0x165667B19E3779F9
	sigPrime4 = 0x85EBCA77C2B2AE63
)

// sigHash is a streaming 64-bit hash of words: xxHash64's round per word
// and its finish, started from a per-process random seed.
type sigHash struct{ acc, n uint64 }

func newSigHash() sigHash { return sigHash{acc: maphash.String(sigSeed, "signature")} }

func (h *sigHash) put(w uint64) {
	h.acc ^= bits.RotateLeft64(w*sigPrime2, 31) * sigPrime1
	h.acc = bits.RotateLeft64(h.acc, 27)*sigPrime1 + sigPrime4
	h.n++
}

// str hashes s as its length and its own maphash (names are rare and short).
func (h *sigHash) str(s string) {
	h.put(uint64(len(s)))
	if s != "" {
		h.put(maphash.String(sigSeed, s))
	}
}

func (h *sigHash) sum() uint64 {
	x := h.acc + h.n*8
	x ^= x >> 33
	x *= sigPrime2
	x ^= x >> 29
	x *= sigPrime3
	return x ^ x>>32
}
