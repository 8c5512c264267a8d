package cuda_test

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/exec/cuda"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/half"
	"github.com/batchfit/batchfit/internal/ref"
)

// TestCuDNNConvDescribeFails: a convolution cuDNN's descriptors cannot
// describe (x [4096, 3, 224, 224] into y [4096, 64, 218, 218]: y beyond
// 2³¹ elements, x within; and x itself beyond) fails descriptor creation,
// the timed search's workspace query and a plan with a *cuda.CUDNNError,
// never a panic (a failed descriptor once left a nil plan to destroy).
// cuDNN 9.14 on the H100 answered CUDNN_STATUS_NOT_SUPPORTED (3000) from
// cudnnSetTensor4dDescriptor for all six.
func TestCuDNNConvDescribeFails(t *testing.T) {
	n := dnnExecutor(t, nil).DNN()
	for _, c := range []struct {
		name    string
		x, w, y [4]int64
	}{
		{"y_beyond", [4]int64{4096, 3, 224, 224}, [4]int64{64, 3, 7, 7}, [4]int64{4096, 64, 218, 218}},
		{"x_beyond", [4]int64{1 << 20, 64, 8, 8}, [4]int64{64, 64, 1, 1}, [4]int64{1 << 20, 64, 8, 8}},
	} {
		t.Run(c.name, func(t *testing.T) {
			descs, query, plan := n.ConvDescribeErrors(graph.Float32, c.x, c.w, c.y)
			for i, err := range []error{descs, query, plan} {
				var ce *cuda.CUDNNError
				require.True(t, errors.As(err, &ce), "call %d: %v", i, err)
				t.Logf("call %d: %v", i, err)
			}
		})
	}
}

// convSliceOf is the slicing rule under test (exec/cuda/convsplit.go),
// restated: with at most lim elements a descriptor, n images of x (xi
// elements each) and y (yi) run in slices of ⌊lim / max(xi, yi)⌋ images,
// less enough that every slice starts 16-byte aligned; the whole batch
// when it fits.
func convSliceOf(dt graph.DType, n, xi, yi, lim int) int {
	s := lim / max(xi, yi)
	if n <= s {
		return n
	}
	gcd := func(a, b int) int {
		for b != 0 {
			a, b = b, a%b
		}
		return a
	}
	mx, my := 16/gcd(16, xi*dt.Size()), 16/gcd(16, yi*dt.Size())
	m := mx / gcd(mx, my) * my
	return s - s%m
}

// TestCuDNNConvSlicesMatchRef lowers the element limit of cuDNN's
// descriptors (cuda.SetCuDNNMaxElems) so that small convolutions run on
// cuDNN in slices along N, with a shorter last slice, as those with 2³¹
// or more elements do (convsplit.go), and runs the forward pass with a
// bias and both gradients, NCHW and channels last, in float32 (the timed
// search, and the heuristics) and bfloat16 (the heuristics, and the
// search), against the float64 reference interpreter. The shapes take a
// 3-channel 7×7/2 stem, a 3×3, a grouped strided 1×1, and one whose slices
// are cut to 16-byte boundaries (8 bfloat16 images of 3·7·7 elements, 4
// float32 ones).
//
// Where the heuristics run, every convolution cuDNN took must have run in
// the expected number of slices (DNN.SplitStats). A bfloat16 weight
// gradient is summed slice by slice into its bfloat16 output (beta = 1),
// so its reference rounds there too: each slice's exact sum added to the
// rounded total, rounded again. Tolerance, on the error's norm relative to
// the reference's: 1e-5 in float32, 1e-2 in bfloat16, as
// TestCuDNNConvChannelsLastMatchesRef. A channels-last pass cuDNN refuses
// runs on NCHW copies, split the same way.
func TestCuDNNConvSlicesMatchRef(t *testing.T) {
	pad1 := graph.Attrs{Stride: [2]int{1, 1}, Padding: [2]int{1, 1}, Groups: 1}
	cases := []struct {
		name string
		x, w []int
		a    graph.Attrs
		lim  int // elements a descriptor
	}{
		{"stem_7x7_s2", []int{7, 3, 20, 20}, []int{8, 3, 7, 7}, graph.Attrs{Stride: [2]int{2, 2}, Padding: [2]int{3, 3}, Groups: 1}, 2*1200 + 600},
		{"3x3", []int{10, 16, 12, 12}, []int{16, 16, 3, 3}, pad1, 3 * 2304},
		{"1x1_s2_grouped", []int{9, 32, 8, 8}, []int{64, 8, 1, 1}, graph.Attrs{Stride: [2]int{2, 2}, Groups: 4}, 2 * 2048},
		{"aligned_slices", []int{20, 3, 7, 7}, []int{4, 3, 3, 3}, pad1, 12 * 196},
	}
	runs := []struct {
		name       string
		dt         graph.DType
		o          cuda.ExecutorOptions
		heuristics bool
		tol        float64
	}{
		{"fp32-search", graph.Float32, cuda.ExecutorOptions{}, false, 1e-5},
		{"fp32-heuristics", graph.Float32, cuda.ExecutorOptions{ConvHeuristics: true}, true, 1e-5},
		{"bf16", graph.BFloat16, cuda.ExecutorOptions{}, true, 1e-2},
		{"bf16-search", graph.BFloat16, cuda.ExecutorOptions{ConvSearchAll: true}, false, 1e-2},
	}
	rng := rand.New(rand.NewPCG(23, 29))
	for _, r := range runs {
		// A fresh executor a run: every case's shapes are its own, so the
		// plans and timed choices made at each case's limit stay its own.
		e := dnnExecutor(t, &r.o)
		for _, nhwcLayout := range []bool{false, true} {
			for _, c := range cases {
				name := fmt.Sprintf("%s/nchw/%s", r.name, c.name)
				if nhwcLayout {
					name = fmt.Sprintf("%s/nhwc/%s", r.name, c.name)
				}
				t.Run(name, func(t *testing.T) {
					old := cuda.SetCuDNNMaxElems(int64(c.lim))
					defer cuda.SetCuDNNMaxElems(old)
					testConvSlices(t, e, rng, r.dt, c.x, c.w, c.a, nhwcLayout, c.lim, r.heuristics, r.tol)
				})
			}
		}
	}
}

func testConvSlices(t *testing.T, e *cuda.Executor, rng *rand.Rand, dt graph.DType, xs, ws []int, a graph.Attrs, nhwcLayout bool, lim int, heuristics bool, tol float64) {
	h := &halfGraph{t: t, g: graph.New(), dt: dt}
	shape := func(s []int) []int { return s }
	if nhwcLayout {
		a.ChannelsLast = true
		shape = nhwc
	}
	x, w, b := h.input(shape(xs)...), h.param(shape(ws)...), h.param(ws[0])
	y := h.op(graph.OpConv2d, a, x, w, b)
	gi, gw := a, a
	gi.Target = h.target(shape(xs)...)
	gw.Target = graph.Type{Shape: shape(ws), DType: dt, BatchAxis: -1, PerSample: 1}
	ys := h.g.Node(y).Type.Shape
	g := h.input(ys...)
	outs := []int{y, h.op(graph.OpConv2dGradInput, gi, g, w), h.op(graph.OpConv2dGradWeight, gw, g, x)}
	feeds := feedsFor(h, rng, x, w, b, g)

	n, xi, yi := xs[0], graph.Numel(xs[1:]), graph.Numel(ys[1:])
	s := convSliceOf(dt, n, xi, yi, lim)
	require.Positive(t, s)
	require.Less(t, s, n, "the case must split")
	k := (n + s - 1) / s

	want, err := ref.Eval(h.g, feeds, outs...)
	require.NoError(t, err)
	if dt != graph.Float32 { // dw summed slice by slice, rounded after each
		want[2] = slicedGradWeight(t, dt, feeds[g], feeds[x], ys, shape(ws), gw, s)
	}
	convs0, slices0 := e.DNN().SplitStats()
	copies0 := e.ChannelsLastOnCopies()
	got, err := runOn(e)(h.g, feeds, outs...)
	require.NoError(t, err)
	if n := e.ChannelsLastOnCopies() - copies0; n > 0 {
		t.Logf("%d of 3 passes on NCHW copies (cuDNN refused them channels last)", n)
	}
	convs, slices := e.DNN().SplitStats()
	convs, slices = convs-convs0, slices-slices0
	t.Logf("%d images in slices of %d: %d of 3 convolutions split on cuDNN, %d slices", n, s, convs, slices)
	if heuristics {
		require.Positive(t, convs, "no convolution ran in slices")
		require.Equal(t, int64(k)*convs, slices)
	}
	for i, name := range []string{"conv2d", "conv2d_grad_input", "conv2d_grad_weight"} {
		rel := relNorm(t, want[i], got[i], name)
		require.LessOrEqual(t, rel, tol, "%s: relative error %.3g in norm", name, rel)
	}
}

// slicedGradWeight is the reference of a 16-bit conv2d_grad_weight run in
// slices of s images: each slice's sum exact (float64, from the rounded
// operands), added to the total so far and rounded to dt (through
// float32, as the device's float32 sum is stored).
func slicedGradWeight(t *testing.T, dt graph.DType, g, x ref.Value, ys, ws []int, a graph.Attrs, s int) ref.Value {
	round := func(v float64) float64 { return float64(half.RoundBF16(float32(v))) }
	if dt == graph.Float16 {
		round = func(v float64) float64 { return float64(half.RoundF16(float32(v))) }
	}
	n := x.Shape[0]
	xi, yi := len(x.Data)/n, len(g.Data)/n
	var acc ref.Value
	for n0 := 0; n0 < n; n0 += s {
		m := min(s, n-n0)
		h := &halfGraph{t: t, g: graph.New(), dt: graph.Float32} // exact: no rounding of the slice's sum
		xsl := append([]int{m}, x.Shape[1:]...)
		gsl := append([]int{m}, ys[1:]...)
		xs, gs := h.input(xsl...), h.input(gsl...)
		a.Target = graph.Type{Shape: ws, DType: graph.Float32, BatchAxis: -1, PerSample: 1}
		dw := h.op(graph.OpConv2dGradWeight, a, gs, xs)
		xv, gv := ref.Zeros(xsl...), ref.Zeros(gsl...)
		copy(xv.Data, x.Data[n0*xi:(n0+m)*xi])
		copy(gv.Data, g.Data[n0*yi:(n0+m)*yi])
		for _, v := range []ref.Value{xv, gv} { // the device's operands
			for i := range v.Data {
				v.Data[i] = round(v.Data[i])
			}
		}
		part, err := ref.Eval(h.g, map[int]ref.Value{xs: xv, gs: gv}, dw)
		require.NoError(t, err)
		if n0 == 0 {
			acc = ref.Zeros(ws...)
		}
		for i, p := range part[0].Data {
			acc.Data[i] = round(acc.Data[i] + p)
		}
	}
	return acc
}

// TestCuDNNConvImageBeyondDescriptors: with the limit below one image, a
// convolution cuDNN cannot take even one image of runs on the im2col
// kernels (NCHW), to the same tolerance; a channels-last one on NCHW
// copies of its operands; nothing panics.
func TestCuDNNConvImageBeyondDescriptors(t *testing.T) {
	old := cuda.SetCuDNNMaxElems(1000)
	defer cuda.SetCuDNNMaxElems(old)
	e := dnnExecutor(t, &cuda.ExecutorOptions{})
	rng := rand.New(rand.NewPCG(31, 37))
	xs, ws := []int{3, 8, 12, 12}, []int{8, 8, 3, 3} // 1,152 elements an image
	a := graph.Attrs{Stride: [2]int{1, 1}, Padding: [2]int{1, 1}, Groups: 1}
	for _, dt := range []graph.DType{graph.Float32, graph.BFloat16} {
		for _, nhwcLayout := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/nhwc=%t", dt, nhwcLayout), func(t *testing.T) {
				h := &halfGraph{t: t, g: graph.New(), dt: dt}
				at, shape := a, func(s []int) []int { return s }
				if nhwcLayout {
					at.ChannelsLast, shape = true, nhwc
				}
				x, w := h.input(shape(xs)...), h.param(shape(ws)...)
				y := h.op(graph.OpConv2d, at, x, w)
				feeds := feedsFor(h, rng, x, w)
				copies0 := e.ChannelsLastOnCopies()
				got, err := runOn(e)(h.g, feeds, y)
				require.NoError(t, err)
				copies := int64(0)
				if nhwcLayout {
					copies = 1
				}
				require.Equal(t, copies, e.ChannelsLastOnCopies()-copies0, "passes on NCHW copies")
				want, err := ref.Eval(h.g, feeds, y)
				require.NoError(t, err)
				tol := 1e-5
				if dt != graph.Float32 {
					tol = 1e-2
				}
				rel := relNorm(t, want[0], got[0], "conv2d")
				require.LessOrEqual(t, rel, tol, "relative error %.3g in norm", rel)
			})
		}
	}
}

// TestBatchNormBeyondDescriptors runs TestBatchNormMatchesCPU's batch
// norms on a cuDNN executor with the descriptors' limit at 1,000
// elements: every batch norm but the [16, 10] one is beyond it and runs on
// batchnorm.cu's kernels (64-bit indices), to the same tolerance.
func TestBatchNormBeyondDescriptors(t *testing.T) {
	old := cuda.SetCuDNNMaxElems(1000)
	defer cuda.SetCuDNNMaxElems(old)
	testBatchNormMatchesCPU(t, dnnExecutor(t, &cuda.ExecutorOptions{}))
}

// TestCuDNNConvBeyondDescriptors runs a bfloat16 convolution whose input
// and output have more than 2³¹ elements each — 65,600 images of 32
// channels of 32×32 through a 3×3 convolution of 32 channels, 2,149,580,800
// elements (4.3 GB) in x, y, dy and dx each — forward and both gradients,
// on cuDNN's heuristics in two slices (65,535 images and 65), as
// ResNet-50's stem from batch 2,675 and the ConvNet's first convolution
// from 65,536 run. About 26 GB of device memory, seconds; skipped with
// -short or with less than 40 GB free.
//
// Image i's input is u_i·X and its upstream gradient v_i·G (X and G one
// image each, u_i and v_i drawn from {½, 1, 2}: scaling by a power of two
// is exact in bfloat16), made on the device by broadcasting, so the host
// holds 2·65,600 factors rather than 2³¹ values, and image i's results are
// its factor times one image's: the sums of y and dx over each image
// (every image checked, both slices) against u_i and v_i times the float64
// reference's sums for X and G (rounded as the device rounds: y and dx
// elements, then the sum), and dw against (Σ u_i·v_i over each slice) times
// the exact weight gradient of X and G, summed slice by slice and rounded
// after each. No bias: it would not scale. Tolerance 1e-2 relative (per
// image for the sums, in norm for dw): bfloat16 outputs, rounded once
// (dw once per slice).
func TestCuDNNConvBeyondDescriptors(t *testing.T) {
	if testing.Short() {
		t.Skip("26 GB of device memory")
	}
	e := dnnExecutor(t, &cuda.ExecutorOptions{})
	free, _, err := e.Device().Backend().MemInfo()
	require.NoError(t, err)
	if free < 40<<30 {
		t.Skipf("%d bytes free, the test needs 40 GB", free)
	}
	convs0, slices0 := e.DNN().SplitStats()
	testConvScaled(t, runOn(e), 65600, convSliceOf(graph.BFloat16, 65600, 32*32*32, 32*32*32, math.MaxInt32))
	convs, slices := e.DNN().SplitStats()
	require.Equal(t, int64(3), convs-convs0, "convolutions run in slices")
	require.Equal(t, int64(6), slices-slices0, "two slices each")
}

// testConvScaled runs TestCuDNNConvBeyondDescriptors's graph over n
// images on run, whose convolutions run in slices of s images, and checks
// its results.
func testConvScaled(t *testing.T, run func(g *graph.Graph, feeds map[int]ref.Value, outputs ...int) ([]ref.Value, error), n, s int) {
	const c, side = 32, 32
	dt := graph.BFloat16
	h := &halfGraph{t: t, g: graph.New(), dt: dt}
	a := graph.Attrs{Stride: [2]int{1, 1}, Padding: [2]int{1, 1}, Groups: 1}
	u, v := h.input(n, 1, 1, 1), h.input(n, 1, 1, 1)
	X, G, w := h.param(1, c, side, side), h.param(1, c, side, side), h.param(c, c, 3, 3)
	x, g := h.op(graph.OpMul, graph.Attrs{}, u, X), h.op(graph.OpMul, graph.Attrs{}, v, G)
	y := h.op(graph.OpConv2d, a, x, w)
	gi, gw := a, a
	gi.Target = h.target(n, c, side, side)
	gw.Target = graph.Type{Shape: []int{c, c, 3, 3}, DType: dt, BatchAxis: -1, PerSample: 1}
	dx, dw := h.op(graph.OpConv2dGradInput, gi, g, w), h.op(graph.OpConv2dGradWeight, gw, g, x)
	per := graph.Attrs{Axes: []int{1, 2, 3}}
	sy, sdx := h.op(graph.OpSum, per, y), h.op(graph.OpSum, per, dx)

	rng := rand.New(rand.NewPCG(41, 43))
	feeds := feedsFor(h, rng, X, G, w)
	for _, id := range []int{X, G, w} { // positive: sums far from zero
		for i, f := range feeds[id].Data {
			feeds[id].Data[i] = math.Abs(f)
		}
	}
	factors := []float64{0.5, 1, 2}
	for _, id := range []int{u, v} {
		f := ref.Zeros(n, 1, 1, 1)
		for i := range f.Data {
			f.Data[i] = factors[rng.IntN(len(factors))]
		}
		feeds[id] = f
	}
	got, err := run(h.g, feeds, sy, sdx, dw)
	require.NoError(t, err)

	// The reference: one image of X and G.
	r := &halfGraph{t: t, g: graph.New(), dt: dt}
	rX, rG, rw := r.input(1, c, side, side), r.input(1, c, side, side), r.param(c, c, 3, 3)
	rgi := gi
	rgi.Target = r.target(1, c, side, side)
	ry := r.op(graph.OpSum, per, r.op(graph.OpConv2d, a, rX, rw))
	rdx := r.op(graph.OpSum, per, r.op(graph.OpConv2dGradInput, rgi, rG, rw))
	sums, err := ref.Eval(r.g, map[int]ref.Value{rX: feeds[X], rG: feeds[G], rw: feeds[w]}, ry, rdx)
	require.NoError(t, err)
	for k, f := range []struct {
		name   string
		factor ref.Value
	}{{"sum of y", feeds[u]}, {"sum of dx", feeds[v]}} {
		want := sums[k].Data[0]
		require.Positive(t, want, f.name)
		for i, gv := range got[k].Data {
			wi := f.factor.Data[i] * want
			require.InDelta(t, wi, gv, 1e-2*wi, "%s of image %d (factor %g)", f.name, i, f.factor.Data[i])
		}
	}
	// dw: the exact weight gradient of one image pair (float32 graph,
	// operands rounded as the device's are) times Σ u_i·v_i over each
	// slice, added slice by slice and rounded after each.
	exact := &halfGraph{t: t, g: graph.New(), dt: graph.Float32}
	eX, eG := exact.input(1, c, side, side), exact.input(1, c, side, side)
	egw := gw
	egw.Target.DType = graph.Float32
	edw := exact.op(graph.OpConv2dGradWeight, egw, eG, eX)
	rounded := func(v ref.Value) ref.Value {
		v = v.Clone()
		for i := range v.Data {
			v.Data[i] = float64(half.RoundBF16(float32(v.Data[i])))
		}
		return v
	}
	one, err := ref.Eval(exact.g, map[int]ref.Value{eX: rounded(feeds[X]), eG: rounded(feeds[G])}, edw)
	require.NoError(t, err)
	want := ref.Zeros(c, c, 3, 3)
	for n0 := 0; n0 < n; n0 += s {
		var uv float64
		for i := n0; i < min(n, n0+s); i++ {
			uv += feeds[u].Data[i] * feeds[v].Data[i]
		}
		for i, p := range one[0].Data {
			want.Data[i] = float64(half.RoundBF16(float32(want.Data[i] + uv*p)))
		}
	}
	rel := relNorm(t, want, got[2], "conv2d_grad_weight")
	t.Logf("sums of y and dx within 1e-2 of the reference on all %d images; dw relative error %.3g in norm", n, rel)
	require.LessOrEqual(t, rel, 1e-2)
}
