package cuda_test

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/exec/cpu"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/internal/conformance"
	"github.com/batchfit/batchfit/internal/ref"
)

// halfGraph builds a graph of 16-bit values op by op, gradient ops
// included, without the loss and backward pass of ref.Case (whose sums and
// casts belong to other kernel files).
type halfGraph struct {
	t  *testing.T
	g  *graph.Graph
	dt graph.DType
}

func (h *halfGraph) add(n graph.Node) int {
	h.t.Helper()
	id, err := h.g.Append(n)
	require.NoError(h.t, err, "%s", n.Op)
	return id
}

// input is a batched input of shape (batch axis 0), param a parameter, both
// of h's dtype.
func (h *halfGraph) input(shape ...int) int {
	return h.add(graph.Node{Op: graph.OpInput, Type: graph.Type{Shape: shape, DType: h.dt, BatchAxis: 0}})
}

func (h *halfGraph) param(shape ...int) int {
	return h.add(graph.Node{Op: graph.OpParam, Name: fmt.Sprintf("p%d", h.g.Len()), Type: graph.Type{Shape: shape, DType: h.dt}})
}

func (h *halfGraph) op(op graph.Op, a graph.Attrs, in ...int) int {
	return h.add(graph.Node{Op: op, Inputs: in, Attrs: a})
}

// uniformFeeds draws every input and parameter of h's graph uniformly from
// [lo, hi), as float64 values each executor converts to its dtype.
func (h *halfGraph) uniformFeeds(rng *rand.Rand, lo, hi float64) map[int]ref.Value {
	feeds := map[int]ref.Value{}
	for _, nd := range h.g.Nodes() {
		if nd.Op == graph.OpInput || nd.Op == graph.OpParam {
			v := ref.Zeros(nd.Type.Shape...)
			for i := range v.Data {
				v.Data[i] = lo + (hi-lo)*rng.Float64()
			}
			feeds[nd.ID] = v
		}
	}
	return feeds
}

// cpuRunner runs graphs on the CPU executor, the oracle the CUDA kernels
// are held to.
func cpuRunner() conformance.Runner {
	return conformance.RunnerOf(func(ctx context.Context, g *graph.Graph, b int, feed func(id int) tensor.Tensor, outputs ...int) ([]*tensor.Dense, error) {
		return cpu.New().RunBatch(ctx, g, b, feed, outputs...)
	})
}

// target is h's dtype at shape, with the batch on axis 0.
func (h *halfGraph) target(shape ...int) graph.Type {
	return graph.Type{Shape: shape, DType: h.dt, BatchAxis: 0, PerSample: 1}
}

// TestHalfKernelsMatchCPU runs the 16-bit movement, index, dropout, fill,
// conv and pooling kernels, forward and gradient ops, in bfloat16 and
// float16 on both executors: the shapes take each launch's paths (paired
// and unpaired transposes, 16-byte gathers, copies and dropout packs with
// tails, strided slices, padded and dilated windows, grouped and 1×1
// convolutions). Movement, dropout, fill and pooling match the CPU bit for
// bit; the GEMMs and embedding_grad's atomics sum in float32 in another
// order, then round once as the CPU does: within one 16-bit rounding.
func TestHalfKernelsMatchCPU(t *testing.T) {
	e := executor(t)
	gpu := runOn(e)
	cpuRun := conformance.RunnerOf(func(ctx context.Context, g *graph.Graph, b int, feed func(id int) tensor.Tensor, outputs ...int) ([]*tensor.Dense, error) {
		return cpu.New().RunBatch(ctx, g, b, feed, outputs...)
	})
	type hcase struct {
		name  string
		exact bool
		build func(h *halfGraph) []int
	}
	permute := func(shape []int, perm ...int) func(h *halfGraph) []int {
		return func(h *halfGraph) []int {
			return []int{h.op(graph.OpPermute, graph.Attrs{Perm: perm}, h.input(shape...))}
		}
	}
	conv := graph.Attrs{Stride: [2]int{2, 1}, Padding: [2]int{1, 1}, Dilation: [2]int{1, 2}, Groups: 2}
	direct := graph.Attrs{Groups: 1}
	pool := graph.Attrs{Kernel: [2]int{3, 2}, Stride: [2]int{2, 1}, Padding: [2]int{1, 1}}
	avg := graph.Attrs{Kernel: [2]int{2, 3}, Stride: [2]int{1, 2}, Padding: [2]int{1, 1}}
	cases := []hcase{
		{"transpose_paired", true, permute([]int{3, 64, 66}, 0, 2, 1)},
		{"transpose_unpaired", true, permute([]int{2, 33, 70}, 0, 2, 1)},
		{"transpose_2d", true, permute([]int{130, 5}, 1, 0)},
		{"gather_rows", true, permute([]int{2, 6, 4, 16}, 0, 2, 1, 3)},
		{"gather_short_rows", true, permute([]int{3, 4, 5}, 1, 0, 2)},
		{"gather", true, permute([]int{2, 3, 4, 5}, 3, 1, 0, 2)},
		{"slice_runs", true, func(h *halfGraph) []int {
			x := h.input(3, 48)
			return []int{h.op(graph.OpSlice, graph.Attrs{Axis: 1, Start: 8, End: 24, Step: 1}, x),
				h.op(graph.OpSlice, graph.Attrs{Axis: 1, Start: 3, End: 10, Step: 1}, x),
				h.op(graph.OpSlice, graph.Attrs{Axis: 1, Start: 1, End: 46, Step: 3}, x)}
		}},
		{"concat", true, func(h *halfGraph) []int {
			a, b, c := h.input(2, 8, 3), h.input(2, 16, 3), h.input(2, 5, 3)
			return []int{h.op(graph.OpConcat, graph.Attrs{Axis: 1}, a, b, c), h.op(graph.OpConcat, graph.Attrs{Axis: 2}, a, a)}
		}},
		{"reshape", true, func(h *halfGraph) []int {
			return []int{h.op(graph.OpReshape, graph.Attrs{Shape: []int{4, 15}}, h.input(4, 3, 5))}
		}},
		{"slice_grad", true, func(h *halfGraph) []int {
			g := h.input(4, 4, 3)
			return []int{h.op(graph.OpSliceGrad, graph.Attrs{Axis: 1, Start: 1, End: 8, Step: 2, Target: h.target(4, 9, 3)}, g)}
		}},
		{"embedding", true, func(h *halfGraph) []int {
			idx := h.add(graph.Node{Op: graph.OpConst, Type: graph.Type{Shape: []int{2, 3}, DType: graph.Int64},
				Value: tensor.New(tensor.WithShape(2, 3), tensor.WithBacking([]int64{4, 0, 4, 1, 1, 3}))})
			w := h.param(5, 12)
			x := h.input(2, 3, 12)
			y := h.op(graph.OpEmbedding, graph.Attrs{}, idx, w)
			return []int{h.op(graph.OpAdd, graph.Attrs{}, y, x)}
		}},
		{"embedding_grad", false, func(h *halfGraph) []int {
			idx := h.add(graph.Node{Op: graph.OpConst, Type: graph.Type{Shape: []int{2, 3}, DType: graph.Int64},
				Value: tensor.New(tensor.WithShape(2, 3), tensor.WithBacking([]int64{4, 0, 4, 1, 1, 4}))})
			g := h.input(2, 3, 12)
			return []int{h.op(graph.OpEmbeddingGrad, graph.Attrs{Target: graph.Type{Shape: []int{5, 12}, DType: h.dt, BatchAxis: -1, PerSample: 1}}, g, idx)}
		}},
		{"dropout", true, func(h *halfGraph) []int {
			x := h.input(4, 3, 37)
			return []int{h.op(graph.OpDropout, graph.Attrs{Scalar: 0.4, Seed: 7, Counter: 3}, x)}
		}},
		{"fill", true, func(h *halfGraph) []int {
			x := h.input(3, 11)
			f := h.op(graph.OpFill, graph.Attrs{Scalar: 0.1, Target: h.target(3, 11)})
			return []int{h.op(graph.OpAdd, graph.Attrs{}, x, f)}
		}},
		{"conv2d", false, func(h *halfGraph) []int {
			x, w, b := h.input(2, 4, 6, 5), h.param(6, 2, 3, 2), h.param(6)
			return []int{h.op(graph.OpConv2d, conv, x, w, b), h.op(graph.OpConv2d, direct, x, h.param(3, 4, 1, 1))}
		}},
		{"conv2d_grads", false, func(h *halfGraph) []int {
			g, w, x := h.input(2, 6, 3, 5), h.param(6, 2, 3, 2), h.input(2, 4, 6, 5)
			gi, gw := conv, conv
			gi.Target = h.target(2, 4, 6, 5)
			gw.Target = graph.Type{Shape: []int{6, 2, 3, 2}, DType: h.dt, BatchAxis: -1, PerSample: 1}
			g1, w1 := h.input(2, 3, 6, 5), h.param(3, 4, 1, 1)
			di, dw := direct, direct
			di.Target = h.target(2, 4, 6, 5)
			dw.Target = graph.Type{Shape: []int{3, 4, 1, 1}, DType: h.dt, BatchAxis: -1, PerSample: 1}
			return []int{h.op(graph.OpConv2dGradInput, gi, g, w), h.op(graph.OpConv2dGradWeight, gw, g, x),
				h.op(graph.OpConv2dGradInput, di, g1, w1), h.op(graph.OpConv2dGradWeight, dw, g1, x)}
		}},
		{"pooling", true, func(h *halfGraph) []int {
			x, x2 := h.input(2, 2, 5, 5), h.input(2, 2, 5, 4)
			gm, ga := h.input(2, 2, 3, 6), h.input(2, 2, 6, 2)
			at := avg
			at.Target = h.target(2, 2, 5, 4)
			return []int{h.op(graph.OpMaxPool2d, pool, x), h.op(graph.OpAvgPool2d, avg, x2),
				h.op(graph.OpMaxPool2dGrad, pool, gm, x), h.op(graph.OpAvgPool2dGrad, at, ga)}
		}},
	}
	rng := newRand(16)
	for _, dt := range []graph.DType{graph.BFloat16, graph.Float16} {
		tol := conformance.BFloat16Tol
		if dt == graph.Float16 {
			tol = conformance.Float16Tol
		}
		for _, c := range cases {
			t.Run(dt.String()+"/"+c.name, func(t *testing.T) {
				h := &halfGraph{t: t, g: graph.New(), dt: dt}
				outs := c.build(h)
				feeds := map[int]ref.Value{}
				for _, nd := range h.g.Nodes() {
					if (nd.Op == graph.OpInput || nd.Op == graph.OpParam) && nd.Value == nil {
						v := ref.Zeros(nd.Type.Shape...)
						for i := range v.Data {
							v.Data[i] = 2*rng.Float64() - 1
						}
						feeds[nd.ID] = v
					}
				}
				want, err := cpuRun(h.g, feeds, outs...)
				require.NoError(t, err)
				got, err := gpu(h.g, feeds, outs...)
				require.NoError(t, err)
				for k := range outs {
					require.Equal(t, want[k].Shape, got[k].Shape)
					for i, w := range want[k].Data {
						g := got[k].Data[i]
						if c.exact {
							require.True(t, g == w || math.IsNaN(g) && math.IsNaN(w), "output %d element %d: got %v, want %v", k, i, g, w)
						} else {
							require.InDelta(t, w, g, tol.ATol+tol.RTol*math.Abs(w), "output %d element %d", k, i)
						}
					}
				}
			})
		}
	}
}
