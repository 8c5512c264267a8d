package graph

import (
	"encoding/binary"
	"hash/maphash"
	"math"
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
// caches), so it appends the fields to one buffer and hashes that once.
func (g *Graph) Signature() uint64 {
	buf := make([]byte, 0, 8+256*len(g.nodes))
	put := func(v int64) { buf = binary.LittleEndian.AppendUint64(buf, uint64(v)) }
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
		buf = append(buf, n.Name...)
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
		for bit, f := range []bool{a.Approx, a.KeepDim, a.TransA, a.TransB, a.Training, a.Causal, a.PerChunk, a.ChannelsLast} {
			if f {
				flags |= 1 << bit
			}
		}
		put(int64(flags))
		typ(a.Target)
	}
	return maphash.Bytes(sigSeed, buf)
}
