package cuda_test

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"testing"

	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/exec/cpu"
	"github.com/batchfit/batchfit/exec/cuda"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/internal/conformance"
	"github.com/batchfit/batchfit/internal/ref"
)

// dnnExecutor is an executor whose convolutions run on cuDNN: the shared
// one, or a fresh one with o. It skips when cuDNN does not load, and fails
// instead under BATCHFIT_REQUIRE_GPU (the GPU machine has cuDNN 9).
func dnnExecutor(t *testing.T, o *cuda.ExecutorOptions) *cuda.Executor {
	t.Helper()
	e := executor(t)
	if o != nil {
		e = freshExecutor(t, *o)
	}
	if e.DNN() == nil {
		if os.Getenv("BATCHFIT_REQUIRE_GPU") != "" {
			t.Fatalf("convolutions: %s", e.Convolutions())
		}
		t.Skipf("convolutions: %s", e.Convolutions())
	}
	return e
}

func TestCuDNNLoads(t *testing.T) {
	e := dnnExecutor(t, nil)
	t.Logf("convolutions: %s; the handle took %d bytes of device memory (Reserve %d)", e.Convolutions(), e.DNN().Overhead(), e.Reserve())
	require.Equal(t, cuda.DriverReserve+e.DNN().Overhead()+e.GraphStats().DriverBytes, e.Reserve())
}

// TestConformanceIm2col runs the suite with cuDNN off: the im2col
// convolutions stay the fallback (no cuDNN, or a shape no algorithm takes
// within its workspace), so they keep their own check.
func TestConformanceIm2col(t *testing.T) {
	e := freshExecutor(t, cuda.ExecutorOptions{NoCuDNN: true})
	require.Nil(t, e.DNN())
	require.Contains(t, e.Convolutions(), "ExecutorOptions.NoCuDNN")
	conformance.RunAll(t, runOn(e), fp32Tolerance)
	conformance.RunAllAs(t, runOn(e), graph.BFloat16, conformance.BFloat16Tol)
}

// TestCuDNNConvMatchesCPU runs convolutions of the shapes conv nets train
// (ResNet's 7×7/2 stem, 3×3 and strided 3×3, 1×1, depthwise, grouped and
// dilated, odd channel counts) forward with a bias, and both gradients,
// on cuDNN in float32, TF32, bfloat16 and float16 (in float32 the
// algorithms of the timed search, which may pick the im2col path where it
// is faster, and those of the heuristics; in bfloat16 those of the
// heuristics, the default, and of the search, ConvSearchAll), against the CPU
// executor on the same values (float32 sums; 16-bit operands rounded as
// the GPU's are, the result rounded once).
//
// Tolerance, on the error's norm relative to the reference's (sums of up
// to 3,136 products in another order, and algorithms that transform their
// operands): 1e-5 in float32, 5e-3 in TF32 (10-bit products), 1e-2 in
// 16-bit (one rounding of every output, 2⁻⁹ relative on average, and
// 16-bit intermediates in some algorithms).
func TestCuDNNConvMatchesCPU(t *testing.T) {
	type ccase struct {
		name string
		x, w []int
		a    graph.Attrs
	}
	cases := []ccase{
		{"stem_7x7_s2", []int{2, 3, 64, 64}, []int{64, 3, 7, 7}, graph.Attrs{Stride: [2]int{2, 2}, Padding: [2]int{3, 3}, Groups: 1}},
		{"3x3", []int{4, 64, 28, 28}, []int{64, 64, 3, 3}, graph.Attrs{Stride: [2]int{1, 1}, Padding: [2]int{1, 1}, Groups: 1}},
		{"3x3_s2", []int{4, 128, 28, 28}, []int{128, 128, 3, 3}, graph.Attrs{Stride: [2]int{2, 2}, Padding: [2]int{1, 1}, Groups: 1}},
		{"1x1", []int{4, 256, 14, 14}, []int{64, 256, 1, 1}, graph.Attrs{Stride: [2]int{1, 1}, Groups: 1}},
		{"1x1_s2", []int{4, 256, 14, 14}, []int{512, 256, 1, 1}, graph.Attrs{Stride: [2]int{2, 2}, Groups: 1}},
		{"depthwise", []int{4, 32, 16, 16}, []int{32, 1, 3, 3}, graph.Attrs{Stride: [2]int{1, 1}, Padding: [2]int{1, 1}, Groups: 32}},
		{"grouped_dilated", []int{2, 16, 15, 13}, []int{24, 4, 3, 3}, graph.Attrs{Stride: [2]int{1, 2}, Padding: [2]int{2, 2}, Dilation: [2]int{2, 2}, Groups: 4}},
		{"odd_channels", []int{3, 5, 9, 9}, []int{7, 5, 3, 3}, graph.Attrs{Stride: [2]int{1, 1}, Padding: [2]int{1, 1}, Groups: 1}},
	}
	runs := []struct {
		name string
		dt   graph.DType
		o    *cuda.ExecutorOptions
		tol  float64
	}{
		{"fp32", graph.Float32, nil, 1e-5},
		{"fp32-heuristics", graph.Float32, &cuda.ExecutorOptions{ConvHeuristics: true}, 1e-5},
		{"tf32", graph.Float32, &cuda.ExecutorOptions{TF32: true}, 5e-3},
		{"bf16", graph.BFloat16, nil, 1e-2},
		{"bf16-search", graph.BFloat16, &cuda.ExecutorOptions{ConvSearchAll: true}, 1e-2},
		{"fp16", graph.Float16, nil, 1e-2},
	}
	cpuRun := conformance.RunnerOf(func(ctx context.Context, g *graph.Graph, b int, feed func(id int) tensor.Tensor, outputs ...int) ([]*tensor.Dense, error) {
		return cpu.New().RunBatch(ctx, g, b, feed, outputs...)
	})
	rng := rand.New(rand.NewPCG(5, 11))
	for _, r := range runs {
		e := dnnExecutor(t, r.o)
		gpu := runOn(e)
		for _, c := range cases {
			t.Run(r.name+"/"+c.name, func(t *testing.T) {
				h := &halfGraph{t: t, g: graph.New(), dt: r.dt}
				x, w, b := h.input(c.x...), h.param(c.w...), h.param(c.w[0])
				y := h.op(graph.OpConv2d, c.a, x, w, b)
				ys := h.g.Node(y).Type.Shape
				gi, gw := c.a, c.a
				gi.Target = h.target(c.x...)
				gw.Target = graph.Type{Shape: c.w, DType: r.dt, BatchAxis: -1, PerSample: 1}
				g := h.input(ys...)
				outs := []int{y, h.op(graph.OpConv2dGradInput, gi, g, w), h.op(graph.OpConv2dGradWeight, gw, g, x)}
				feeds := map[int]ref.Value{}
				for _, id := range []int{x, w, b, g} {
					v := ref.Zeros(h.g.Node(id).Type.Shape...)
					for i := range v.Data {
						v.Data[i] = 2*rng.Float64() - 1
					}
					feeds[id] = v
				}
				want, err := cpuRun(h.g, feeds, outs...)
				require.NoError(t, err)
				got, err := gpu(h.g, feeds, outs...)
				require.NoError(t, err)
				for k, name := range []string{"conv2d", "conv2d_grad_input", "conv2d_grad_weight"} {
					require.Equal(t, want[k].Shape, got[k].Shape, name)
					var diff, norm float64
					for i, wv := range want[k].Data {
						d := got[k].Data[i] - wv
						diff += d * d
						norm += wv * wv
					}
					rel := math.Sqrt(diff / norm)
					require.Greater(t, norm, 0.0, name)
					require.LessOrEqual(t, rel, r.tol, "%s: relative error %.3g in norm", name, rel)
				}
			})
		}
		plans, fallbacks := e.DNN().ConvStats()
		t.Logf("%s: %d convolution plans, %d on im2col for want of an algorithm within the workspace; search %+v", r.name, plans, fallbacks,
			e.DNN().SearchStats())
		require.Positive(t, plans)
	}
}

// TestBatchNormMatchesCPU runs batch norm in training mode (forward,
// batch_norm_grad_x, batch_norm_grad_w and the bias's sum, the last two
// batch_norm_grad_x's companions, given by its pass) and evaluation
// mode (forward, and the weight gradient with the running statistics), in
// float32 and in mixed precision (16-bit x, float32 weight, bias and
// running statistics, as autocast runs it), on batchfit's kernels and on
// cuDNN's, against the CPU executor on the same values. Values have a
// channel-dependent offset, so the statistics are not those of centred
// data.
//
// Tolerance, on the error's norm relative to the reference's: 1e-4 in
// float32 (the GPU sums in another order, cuDNN in float32), 1e-2 in
// 16-bit (one rounding of every output, 2⁻⁹ relative on average).
func TestBatchNormMatchesCPU(t *testing.T) {
	t.Run("kernels", func(t *testing.T) {
		testBatchNormMatchesCPU(t, freshExecutor(t, cuda.ExecutorOptions{NoCuDNNBatchNorm: true}))
	})
	t.Run("cudnn", func(t *testing.T) { testBatchNormMatchesCPU(t, dnnExecutor(t, nil)) })
}

func testBatchNormMatchesCPU(t *testing.T, e *cuda.Executor) {
	gpu := runOn(e)
	cpuRun := conformance.RunnerOf(func(ctx context.Context, g *graph.Graph, b int, feed func(id int) tensor.Tensor, outputs ...int) ([]*tensor.Dense, error) {
		return cpu.New().RunBatch(ctx, g, b, feed, outputs...)
	})
	shapes := [][]int{{8, 64, 28, 28}, {4, 256, 7, 7}, {16, 10}, {3, 5, 9, 11}}
	rng := rand.New(rand.NewPCG(17, 19))
	for _, dt := range []graph.DType{graph.Float32, graph.BFloat16, graph.Float16} {
		tol := 1e-2
		if dt == graph.Float32 {
			tol = 1e-4
		}
		for _, shape := range shapes {
			t.Run(fmt.Sprintf("%s/%v", dt, shape), func(t *testing.T) {
				h := &halfGraph{t: t, g: graph.New(), dt: dt}
				c := shape[1]
				f32 := func(op graph.Op) int {
					return h.add(graph.Node{Op: op, Name: fmt.Sprintf("p%d", h.g.Len()), Type: graph.Type{Shape: []int{c}, DType: graph.Float32}})
				}
				x, w, b := h.input(shape...), f32(graph.OpParam), f32(graph.OpParam)
				mean, vr := f32(graph.OpParam), f32(graph.OpParam)
				g := h.input(shape...)
				train := graph.Attrs{Training: true, Eps: 1e-5}
				axes := []int{0}
				for i := 2; i < len(shape); i++ {
					axes = append(axes, i)
				}
				outs := []int{
					h.op(graph.OpBatchNorm, train, x, w, b),
					h.op(graph.OpBatchNormGradX, train, g, x, w),
					h.op(graph.OpBatchNormGradW, train, g, x),
					h.op(graph.OpSum, graph.Attrs{Axes: axes}, g),
					h.op(graph.OpBatchNorm, graph.Attrs{Eps: 1e-5}, x, mean, vr, w, b),
					h.op(graph.OpBatchNormGradW, graph.Attrs{Eps: 1e-5}, g, x, mean, vr),
					h.op(graph.OpBatchNorm, train, x), // no weight or bias: cuDNN's ones and zeros
					h.op(graph.OpBatchNormStats, graph.Attrs{}, x),
				}
				feeds := map[int]ref.Value{}
				for _, id := range []int{x, w, b, mean, vr, g} {
					v := ref.Zeros(h.g.Node(id).Type.Shape...)
					for i := range v.Data {
						v.Data[i] = 2*rng.Float64() - 1 + 0.5*float64(i%3)
					}
					if id == x { // a mean of 3 in channel 1
						inner := len(v.Data) / (shape[0] * c)
						for i := range v.Data {
							if i/inner%c == 1 {
								v.Data[i] += 3
							}
						}
					}
					if id == vr {
						for i := range v.Data {
							v.Data[i] = 0.5 + rng.Float64()
						}
					}
					feeds[id] = v
				}
				want, err := cpuRun(h.g, feeds, outs...)
				require.NoError(t, err)
				bias := cuda.BatchNormBiasGrads()
				got, err := gpu(h.g, feeds, outs...)
				require.NoError(t, err)
				require.Greater(t, cuda.BatchNormBiasGrads(), bias, "batch_norm_grad_x gave the bias gradient (output 3)")
				for k := range outs {
					require.Equal(t, want[k].Shape, got[k].Shape, "output %d", k)
					var diff, norm float64
					for i, wv := range want[k].Data {
						d := got[k].Data[i] - wv
						diff += d * d
						norm += wv * wv
					}
					require.Greater(t, norm, 0.0, "output %d", k)
					rel := math.Sqrt(diff / norm)
					require.LessOrEqual(t, rel, tol, "output %d (%s): relative error %.3g in norm", k, h.g.Node(outs[k]).Op, rel)
				}
			})
		}
	}
}
