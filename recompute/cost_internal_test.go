package recompute

import (
	"testing"

	"github.com/stretchr/testify/assert"

	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
)

// TestRatesFollowDTypes: a node is priced at the rate of its op and dtype
// (Profile): float32 GEMMs at MatMulFLOPS (TF32FLOPS under TF32), 16-bit
// ones at HalfFLOPS, or HalfUnalignedFLOPS when a row is not a whole
// number of 16-byte vectors; 16-bit convolutions at HalfConvFLOPS (float32
// ones at the GEMM rate); fused attention at HalfAttentionFLOPS on the
// tensor-core path, at the GEMM rate in float32 (cuBLAS) and
// AttentionFLOPS otherwise; everything else at
// VectorFLOPS. A rate left at 0 falls back as Profile says.
func TestRatesFollowDTypes(t *testing.T) {
	bf, f32 := graph.BFloat16, graph.Float32
	linear := func(dt graph.DType, in, out int) (*graph.Graph, *graph.Node) {
		x := lazy.Placeholder([]int{4, in}, dt, 0)
		y := x.Linear(lazy.ParamSpec([]int{out, in}, dt, "w"), nil)
		g := y.Graph().IR()
		return g, g.Node(y.ID())
	}
	attention := func(dt graph.DType, d int) (*graph.Graph, *graph.Node) {
		x := lazy.Placeholder([]int{2, 3, 8, d}, dt, 0)
		y := x.Attention(x, x, lazy.AttentionOptions{Causal: true})
		g := y.Graph().IR()
		return g, g.Node(y.ID())
	}
	conv := func(dt graph.DType) (*graph.Graph, *graph.Node) {
		x := lazy.Placeholder([]int{2, 3, 8, 8}, dt, 0)
		y := x.Conv2d(lazy.ParamSpec([]int{8, 3, 3, 3}, dt, "w"), nil, lazy.ConvOptions{Padding: [2]int{1, 1}})
		g := y.Graph().IR()
		return g, g.Node(y.ID())
	}
	relu := func() (*graph.Graph, *graph.Node) {
		y := lazy.Placeholder([]int{4, 8}, bf, 0).Relu()
		g := y.Graph().IR()
		return g, g.Node(y.ID())
	}
	p := Profile{MatMulFLOPS: 1, TF32FLOPS: 2, HalfFLOPS: 3, HalfUnalignedFLOPS: 4, AttentionFLOPS: 5, HalfAttentionFLOPS: 6, VectorFLOPS: 7,
		HalfConvFLOPS: 8}
	for _, c := range []struct {
		name string
		node func() (*graph.Graph, *graph.Node)
		tf32 bool
		want float64
	}{
		{"float32 GEMM", func() (*graph.Graph, *graph.Node) { return linear(f32, 16, 24) }, false, 1},
		{"float32 GEMM under TF32", func() (*graph.Graph, *graph.Node) { return linear(f32, 16, 24) }, true, 2},
		{"bf16 GEMM, rows of 16-byte vectors", func() (*graph.Graph, *graph.Node) { return linear(bf, 16, 24) }, false, 3},
		{"bf16 GEMM, 50,257-wide rows", func() (*graph.Graph, *graph.Node) { return linear(bf, 16, 50257) }, false, 4},
		{"float32 attention (cuBLAS GEMMs)", func() (*graph.Graph, *graph.Node) { return attention(f32, 64) }, false, 1},
		{"float32 attention under TF32", func() (*graph.Graph, *graph.Node) { return attention(f32, 64) }, true, 2},
		{"bf16 attention at head dim 32 (plain kernels)", func() (*graph.Graph, *graph.Node) { return attention(bf, 32) }, false, 5},
		{"bf16 attention at head dim 64 (tensor cores)", func() (*graph.Graph, *graph.Node) { return attention(bf, 64) }, false, 6},
		{"float32 convolution", func() (*graph.Graph, *graph.Node) { return conv(f32) }, false, 1},
		{"bf16 convolution", func() (*graph.Graph, *graph.Node) { return conv(bf) }, false, 8},
		{"elementwise", relu, false, 7},
	} {
		g, nd := c.node()
		assert.Equal(t, c.want, p.rate(kindOf(g, nd), c.tf32), c.name)
	}
	// float32 attention's bytes add its scores' passes through memory: 4
	// float32 writes or reads of each (query, key) pair, halved under
	// causal, beyond its inputs and output; bf16's do not.
	for _, dt := range []graph.DType{f32, bf} {
		g, nd := attention(dt, 64)
		_, bytes := work(g, nd, 2)
		io := float64(4 * 2 * 3 * 8 * 64 * dt.Size()) // q, k, v and o at 2 samples
		want := io
		if dt == f32 {
			want += 4 * 4 * 2 * 3 * 8 * 8 / 2
		}
		assert.Equal(t, want, bytes, "%s attention's bytes", dt)
	}
	// Fallbacks: without the 16-bit and attention rates, a bf16 GEMM is
	// priced as TF32 (then float32), attention at the vector rate.
	bare := Profile{MatMulFLOPS: 1, TF32FLOPS: 2, VectorFLOPS: 7}
	assert.Equal(t, 2.0, bare.rate(rateHalfUnalignedGEMM, false))
	assert.Equal(t, 7.0, bare.rate(rateHalfAttention, false))
	assert.Equal(t, 1.0, Profile{MatMulFLOPS: 1, VectorFLOPS: 7}.rate(rateHalfGEMM, false))
	assert.Equal(t, 3.0, Profile{MatMulFLOPS: 1, HalfFLOPS: 3, VectorFLOPS: 7}.rate(rateHalfConv, false), "16-bit convolutions fall back to HalfFLOPS")
}
