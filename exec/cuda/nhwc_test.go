package cuda_test

import (
	"fmt"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/exec/cuda"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/internal/ref"
)

// nhwc is an NCHW shape (or a [O, C/g, kh, kw] weight) channels last.
func nhwc(s []int) []int { return graph.ToNHWC(graph.Type{Shape: s, BatchAxis: -1}).Shape }

// relNorm is ‖got − want‖ / ‖want‖; want must not be all zero.
func relNorm(t *testing.T, want, got ref.Value, name string) float64 {
	t.Helper()
	require.Equal(t, want.Shape, got.Shape, name)
	var diff, norm float64
	for i, wv := range want.Data {
		d := got.Data[i] - wv
		diff += d * d
		norm += wv * wv
	}
	require.Greater(t, norm, 0.0, "%s: the reference is all zero", name)
	return math.Sqrt(diff / norm)
}

// feedsFor draws every listed source's values uniformly from [−1, 1).
func feedsFor(h *halfGraph, rng *rand.Rand, ids ...int) map[int]ref.Value {
	feeds := map[int]ref.Value{}
	for _, id := range ids {
		v := ref.Zeros(h.g.Node(id).Type.Shape...)
		for i := range v.Data {
			v.Data[i] = 2*rng.Float64() - 1
		}
		feeds[id] = v
	}
	return feeds
}

// TestCuDNNConvChannelsLastMatchesRef runs channels-last convolutions
// (graph.Attrs.ChannelsLast: x and y NHWC, the weight KRSC) and both their
// gradients on cuDNN, with a bias, over the shapes of
// TestCuDNNConvMatchesCPU (stride, padding, dilation, groups, depthwise,
// odd channel counts, the 3-channel stem) and 4 channels, against the
// float64 reference interpreter on the same graph (which computes in
// NCHW). Tolerance, on the error's norm relative to the reference's: 1e-5
// in float32 (FMA math, sums in another order), 1e-2 in 16 bits (outputs
// rounded once). Every case must run: a pass cuDNN refuses channels last
// (cuDNN 9.14's float16 depthwise input gradient) runs on NCHW copies,
// which the "copies" executor, without cuDNN, does for every pass of every
// case (ChannelsLastOnCopies counts three a case there).
func TestCuDNNConvChannelsLastMatchesRef(t *testing.T) {
	cases := []struct {
		name string
		x, w []int
		a    graph.Attrs
	}{
		{"stem_7x7_s2", []int{2, 3, 64, 64}, []int{64, 3, 7, 7}, graph.Attrs{Stride: [2]int{2, 2}, Padding: [2]int{3, 3}, Groups: 1}},
		{"3x3", []int{4, 64, 28, 28}, []int{64, 64, 3, 3}, graph.Attrs{Stride: [2]int{1, 1}, Padding: [2]int{1, 1}, Groups: 1}},
		{"3x3_s2", []int{4, 128, 28, 28}, []int{128, 128, 3, 3}, graph.Attrs{Stride: [2]int{2, 2}, Padding: [2]int{1, 1}, Groups: 1}},
		{"1x1", []int{4, 256, 14, 14}, []int{64, 256, 1, 1}, graph.Attrs{Stride: [2]int{1, 1}, Groups: 1}},
		{"1x1_s2", []int{4, 256, 14, 14}, []int{512, 256, 1, 1}, graph.Attrs{Stride: [2]int{2, 2}, Groups: 1}},
		{"depthwise", []int{4, 32, 16, 16}, []int{32, 1, 3, 3}, graph.Attrs{Stride: [2]int{1, 1}, Padding: [2]int{1, 1}, Groups: 32}},
		{"grouped_dilated", []int{2, 16, 15, 13}, []int{24, 4, 3, 3}, graph.Attrs{Stride: [2]int{1, 2}, Padding: [2]int{2, 2}, Dilation: [2]int{2, 2}, Groups: 4}},
		{"odd_channels", []int{3, 5, 9, 9}, []int{7, 5, 3, 3}, graph.Attrs{Stride: [2]int{1, 1}, Padding: [2]int{1, 1}, Groups: 1}},
		{"narrow_4", []int{4, 4, 8, 8}, []int{4, 4, 3, 3}, graph.Attrs{Stride: [2]int{1, 1}, Padding: [2]int{1, 1}, Groups: 1}},
	}
	runs := []struct {
		dt  graph.DType
		tol float64
	}{{graph.Float32, 1e-5}, {graph.BFloat16, 1e-2}, {graph.Float16, 1e-2}}
	executors := []struct {
		name   string
		e      *cuda.Executor
		copies bool // every pass on NCHW copies
	}{
		{"cudnn", dnnExecutor(t, nil), false},
		{"copies", freshExecutor(t, cuda.ExecutorOptions{NoCuDNN: true}), true},
	}
	rng := rand.New(rand.NewPCG(5, 13))
	for _, ex := range executors {
		for _, r := range runs {
			for _, c := range cases {
				t.Run(fmt.Sprintf("%s/%s/%s", ex.name, r.dt, c.name), func(t *testing.T) {
					testConvChannelsLast(t, ex.e, ex.copies, rng, r.dt, r.tol, c.x, c.w, c.a)
				})
			}
		}
	}
}

func testConvChannelsLast(t *testing.T, e *cuda.Executor, copies bool, rng *rand.Rand, dt graph.DType, tol float64, xs, ws []int, ca graph.Attrs) {
	h := &halfGraph{t: t, g: graph.New(), dt: dt}
	a := ca
	a.ChannelsLast = true
	x, w, b := h.input(nhwc(xs)...), h.param(nhwc(ws)...), h.param(ws[0])
	y := h.op(graph.OpConv2d, a, x, w, b)
	gi, gw := a, a
	gi.Target = h.target(nhwc(xs)...)
	gw.Target = graph.Type{Shape: nhwc(ws), DType: dt, BatchAxis: -1, PerSample: 1}
	g := h.input(h.g.Node(y).Type.Shape...)
	outs := []int{y, h.op(graph.OpConv2dGradInput, gi, g, w), h.op(graph.OpConv2dGradWeight, gw, g, x)}
	feeds := feedsFor(h, rng, x, w, b, g)
	want, err := ref.Eval(h.g, feeds, outs...)
	require.NoError(t, err)
	before := e.ChannelsLastOnCopies()
	got, err := runOn(e)(h.g, feeds, outs...)
	require.NoError(t, err)
	ran := e.ChannelsLastOnCopies() - before
	if copies {
		require.EqualValues(t, 3, ran, "passes on NCHW copies")
	} else if ran > 0 {
		t.Logf("%d of 3 passes on NCHW copies (cuDNN refused them channels last)", ran)
	}
	for k, name := range []string{"conv2d", "conv2d_grad_input", "conv2d_grad_weight"} {
		rel := relNorm(t, want[k], got[k], name)
		require.LessOrEqual(t, rel, tol, "%s: relative error %.3g in norm", name, rel)
	}
}

// TestBatchNormChannelsLastMatchesRef runs batch norm over channels-last
// x [N, H, W, C] (batchnorm.cu's channels-last kernels, with or without
// cuDNN in the executor): training mode (forward, batch_norm_grad_x,
// batch_norm_grad_w, the bias gradient's sum over N, H and W, a batch norm
// without weight and bias) and evaluation mode (forward, the weight
// gradient), in float32 and with 16-bit x (float32 per-channel values, as
// autocast runs it), against the float64 reference. Values have a
// channel-dependent offset. The shapes take the vector path (C a multiple
// of 16 bytes' worth: 64, 256 and 2048 channels, 24 for a group count no
// power of two, and enough positions at [8, 64, 56, 56] for two
// positions a thread) and the scalar one (C = 5; C = 12 in 16 bits, where
// float32 takes the vector path); each case checks which ran, and that
// batch_norm_grad_x gave the bias gradient (its companion; the sum is
// checked against the reference like every output), and that a second run
// gives the same bits (no atomics: CUDA graphs replay bit for bit).
// Tolerance as
// TestBatchNormMatchesCPU: 1e-4 in float32, 1e-2 in 16 bits, on the
// error's norm relative to the reference's.
func TestBatchNormChannelsLastMatchesRef(t *testing.T) {
	t.Run("cudnn", func(t *testing.T) { testBatchNormChannelsLast(t, dnnExecutor(t, nil)) })
	t.Run("kernels", func(t *testing.T) {
		testBatchNormChannelsLast(t, freshExecutor(t, cuda.ExecutorOptions{NoCuDNNBatchNorm: true}))
	})
}

func testBatchNormChannelsLast(t *testing.T, e *cuda.Executor) {
	gpu := runOn(e)
	rng := rand.New(rand.NewPCG(17, 23))
	shapes := [][]int{{8, 64, 28, 28}, {4, 256, 7, 7}, {3, 5, 9, 11}, {4, 2048, 3, 3}, {2, 24, 5, 7}, {4, 12, 6, 6}, {8, 64, 56, 56}}
	build := func(t *testing.T, dt graph.DType, shape []int) (*halfGraph, []int, map[int]ref.Value) {
		h := &halfGraph{t: t, g: graph.New(), dt: dt}
		c := shape[1]
		f32 := func() int {
			return h.add(graph.Node{Op: graph.OpParam, Name: fmt.Sprintf("p%d", h.g.Len()), Type: graph.Type{Shape: []int{c}, DType: graph.Float32}})
		}
		s := nhwc(shape)
		x, w, b, g := h.input(s...), f32(), f32(), h.input(s...)
		mean, vr := f32(), f32()
		train := graph.Attrs{Training: true, Eps: 1e-5, ChannelsLast: true}
		eval := graph.Attrs{Eps: 1e-5, ChannelsLast: true}
		outs := []int{
			h.op(graph.OpBatchNorm, train, x, w, b),
			h.op(graph.OpBatchNormGradX, train, g, x, w),
			h.op(graph.OpBatchNormGradW, train, g, x),
			h.op(graph.OpSum, graph.Attrs{Axes: []int{0, 1, 2}}, g),
			h.op(graph.OpBatchNorm, train, x), // no weight or bias
			h.op(graph.OpBatchNorm, eval, x, mean, vr, w, b),
			h.op(graph.OpBatchNormGradW, eval, g, x, mean, vr),
		}
		feeds := feedsFor(h, rng, x, w, b, g, mean, vr)
		for i := range feeds[x].Data {
			feeds[x].Data[i] += 0.5 * float64(i%c%3) // channel offsets
		}
		for i := range feeds[vr].Data {
			feeds[vr].Data[i] = 0.5 + rng.Float64()
		}
		return h, outs, feeds
	}
	for _, dt := range []graph.DType{graph.Float32, graph.BFloat16, graph.Float16} {
		tol := 1e-2
		if dt == graph.Float32 {
			tol = 1e-4
		}
		for _, shape := range shapes {
			t.Run(fmt.Sprintf("%s/%v", dt, shape), func(t *testing.T) {
				h, outs, feeds := build(t, dt, shape)
				want, err := ref.Eval(h.g, feeds, outs...)
				require.NoError(t, err)
				vec, bias := cuda.BatchNormVecPasses(), cuda.BatchNormBiasGrads()
				got, err := gpu(h.g, feeds, outs...)
				require.NoError(t, err)
				if shape[1]%(16/dt.Size()) == 0 {
					require.Greater(t, cuda.BatchNormVecPasses(), vec, "the vector path ran")
				} else {
					require.Equal(t, vec, cuda.BatchNormVecPasses(), "the scalar path ran")
				}
				require.Greater(t, cuda.BatchNormBiasGrads(), bias, "batch_norm_grad_x gave the bias gradient")
				again, err := gpu(h.g, feeds, outs...)
				require.NoError(t, err)
				for k := range outs {
					require.Equal(t, got[k].Data, again[k].Data, "output %d: a second run gives the same bits", k)
				}
				for k := range outs {
					name := h.g.Node(outs[k]).Op.String()
					rel := relNorm(t, want[k], got[k], name)
					require.LessOrEqual(t, rel, tol, "output %d (%s): relative error %.3g in norm", k, name, rel)
				}
			})
		}
	}
}

// TestPoolChannelsLastMatchesRef runs max and average pooling and their
// gradients over channels-last data (pool.cu's *_nhwc_* kernels) against
// the float64 reference: the same windows, taps and sums as the NCHW
// kernels, so within 1e-6 in float32 and one 16-bit rounding (1e-2) in
// bfloat16, on the error's norm relative to the reference's.
func TestPoolChannelsLastMatchesRef(t *testing.T) {
	gpu := runOn(executor(t))
	rng := rand.New(rand.NewPCG(3, 31))
	cases := []struct {
		name string
		x    []int
		a    graph.Attrs
	}{
		{"3x3_s2_p1", []int{4, 64, 28, 28}, graph.Attrs{Kernel: [2]int{3, 3}, Stride: [2]int{2, 2}, Padding: [2]int{1, 1}}},
		{"2x2", []int{2, 5, 9, 10}, graph.Attrs{Kernel: [2]int{2, 2}}},
		{"dilated", []int{2, 3, 11, 9}, graph.Attrs{Kernel: [2]int{3, 2}, Stride: [2]int{1, 2}, Dilation: [2]int{2, 1}}},
	}
	for _, dt := range []graph.DType{graph.Float32, graph.BFloat16} {
		tol := 1e-6
		if dt != graph.Float32 {
			tol = 1e-2
		}
		for _, c := range cases {
			t.Run(fmt.Sprintf("%s/%s", dt, c.name), func(t *testing.T) {
				h := &halfGraph{t: t, g: graph.New(), dt: dt}
				a := c.a
				a.ChannelsLast = true
				x := h.input(nhwc(c.x)...)
				mp := h.op(graph.OpMaxPool2d, a, x)
				g := h.input(h.g.Node(mp).Type.Shape...)
				outs := []int{mp, h.op(graph.OpMaxPool2dGrad, a, g, x)}
				if a.Dilation == [2]int{} {
					ap := h.op(graph.OpAvgPool2d, a, x)
					ag := a
					ag.Target = h.target(nhwc(c.x)...)
					outs = append(outs, ap, h.op(graph.OpAvgPool2dGrad, ag, g))
				}
				feeds := feedsFor(h, rng, x, g)
				want, err := ref.Eval(h.g, feeds, outs...)
				require.NoError(t, err)
				got, err := gpu(h.g, feeds, outs...)
				require.NoError(t, err)
				for k := range outs {
					name := h.g.Node(outs[k]).Op.String()
					rel := relNorm(t, want[k], got[k], name)
					require.LessOrEqual(t, rel, tol, "%s: relative error %.3g in norm", name, rel)
				}
			})
		}
	}
}
