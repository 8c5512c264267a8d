package graph

import (
	"encoding/binary"
	"hash/fnv"
	"math"
)

// Signature hashes everything about g that shapes and memory depend on:
// ops, wiring, attributes, types, batch size and parameter names — not the
// data. Two graphs with one signature get one analysis and one plan, so a
// training loop that rebuilds its graph every step re-plans nothing.
func (g *Graph) Signature() uint64 {
	h := fnv.New64a()
	var buf [8]byte
	put := func(v int64) {
		binary.LittleEndian.PutUint64(buf[:], uint64(v))
		h.Write(buf[:])
	}
	ints := func(s []int) {
		put(int64(len(s)))
		for _, v := range s {
			put(int64(v))
		}
	}
	typ := func(t Type) {
		ints(t.Shape)
		put(int64(t.DType))
		put(int64(t.BatchAxis))
		put(int64(t.PerSample))
	}
	put(int64(g.batch))
	for i := range g.nodes {
		n := &g.nodes[i]
		put(int64(n.Op))
		ints(n.Inputs)
		typ(n.Type)
		h.Write([]byte(n.Name))
		put(0) // separates the name from what follows
		a := &n.Attrs
		put(int64(math.Float64bits(a.Scalar)))
		put(int64(math.Float64bits(a.Eps)))
		ints(a.Axes)
		ints(a.Shape)
		ints(a.Perm)
		ints([]int{a.Axis, a.Start, a.End, a.Step, a.NormDims, a.Groups, int(a.Reduction)})
		ints(a.Kernel[:])
		ints(a.Stride[:])
		ints(a.Padding[:])
		ints(a.Dilation[:])
		flags := 0
		for bit, f := range []bool{a.Approx, a.KeepDim, a.TransA, a.TransB, a.Training, a.Causal, a.PerChunk} {
			if f {
				flags |= 1 << bit
			}
		}
		put(int64(flags))
		typ(a.Target)
	}
	return h.Sum64()
}
