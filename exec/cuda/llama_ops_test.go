package cuda_test

import (
	"fmt"
	"math"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/autodiff"
	"github.com/batchfit/batchfit/exec/cuda"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/internal/ref"
)

// llamaTol is the tolerance of a Llama op's output on the device against
// the CPU's: both compute in at least float32 and round once, so a
// float32 value agrees within 1e-5 of its magnitude plus 1e-6 of the
// output's largest. A 16-bit one may round to the neighbouring value (the
// two sum in float32 in different orders: a sum one float32 ulp either
// side of a rounding boundary), so it agrees within one unit in its last
// place at the top of its binade, 2⁻⁷ (bfloat16) or 2⁻¹⁰ (float16) of its
// magnitude, plus that. Measured on the H200: differences of exactly one
// ulp, in bfloat16 rms_norm_grad and float16 rotary_grad.
func llamaTol(dt graph.DType) float64 {
	switch dt {
	case graph.BFloat16:
		return 1.0 / 128
	case graph.Float16:
		return 1.0 / 1024
	}
	return 1e-5
}

func requireClose(t *testing.T, dt graph.DType, what string, want, got ref.Value) {
	t.Helper()
	requireCloseUlps(t, dt, 1, what, want, got)
}

// requireCloseUlps is requireClose within ulps 16-bit ulps.
func requireCloseUlps(t *testing.T, dt graph.DType, ulps float64, what string, want, got ref.Value) {
	t.Helper()
	big := 0.0
	for _, v := range want.Data {
		big = max(big, math.Abs(v))
	}
	tol := llamaTol(dt)
	if dt != graph.Float32 {
		tol *= ulps
	}
	for i, v := range want.Data {
		require.InDelta(t, v, got.Data[i], tol*math.Abs(v)+1e-6*big+1e-30, "%s element %d", what, i)
	}
}

// requireCloseCancelling is requireCloseUlps for a value that is a
// difference of terms as large as the output's typical magnitude (a norm's
// input gradient, w·g − x̂·mean(w·g·x̂)): a term's rounding is absolute at
// that scale, so each element may also be off by ulps 16-bit ulps of the
// mean |value|, however near zero the difference lands.
func requireCloseCancelling(t *testing.T, dt graph.DType, ulps float64, what string, want, got ref.Value) {
	t.Helper()
	big, mean := 0.0, 0.0
	for _, v := range want.Data {
		big, mean = max(big, math.Abs(v)), mean+math.Abs(v)/float64(len(want.Data))
	}
	tol := llamaTol(dt)
	if dt != graph.Float32 {
		tol *= ulps
	}
	for i, v := range want.Data {
		require.InDelta(t, v, got.Data[i], tol*(math.Abs(v)+mean)+1e-6*big+1e-30, "%s element %d", what, i)
	}
}

// An add whose result an rms_norm reads runs as one add_rms_norm pass
// (graph.AddRMSNormProducer) and matches the CPU: the float32 sum exactly
// (both add in float32), the norm within llamaTol. Cases: Llama's residual
// (float32 + bfloat16, d = 2048: one warp a row, the vector path) with a
// float32 and a bfloat16 norm, and d = 13 (the scalar path).
func TestAddRMSNormMatchesCPU(t *testing.T) {
	e := executor(t)
	gpu, cpuRun := runOn(e), cpuRunner()
	rng := newRand(61)
	rms := graph.Attrs{NormDims: 1, Eps: 1e-5}
	h := &halfGraph{t: t, g: graph.New(), dt: graph.Float32}
	var outs []int
	for _, c := range []struct {
		d  int
		to graph.DType
	}{{2048, graph.Float32}, {2048, graph.BFloat16}, {13, graph.Float32}} {
		x := h.input(3, 5, c.d)
		hb := h.add(graph.Node{Op: graph.OpInput, Type: graph.Type{Shape: []int{3, 5, c.d}, DType: graph.BFloat16, BatchAxis: 0}})
		s := h.op(graph.OpAdd, graph.Attrs{}, x, hb)
		a := rms
		a.Target = graph.Type{DType: c.to}
		y := h.op(graph.OpRMSNorm, a, s, h.param(c.d))
		require.Equal(t, s, graph.CompanionProducer(h.g, y))
		outs = append(outs, s, y)
	}
	feeds := h.uniformFeeds(rng, -2, 2)
	want, err := cpuRun(h.g, feeds, outs...)
	require.NoError(t, err)
	before := cuda.AddRMSNorms()
	got, err := gpu(h.g, feeds, outs...)
	require.NoError(t, err)
	require.Equal(t, int64(3), cuda.AddRMSNorms()-before, "each add ran with its norm")
	for k, o := range outs {
		if h.g.Node(o).Op == graph.OpAdd {
			require.Equal(t, want[k].Data, got[k].Data, "sum %d", o)
			continue
		}
		requireClose(t, h.g.Node(o).Type.DType, fmt.Sprintf("norm %d", o), want[k], got[k])
	}
}

// The RMS norm's backward pass on the device: dx, dx plus the residual
// stream's gradient (rms_norm_grad_x_add, graph.FuseLayerNormGradAdd) and
// dw from one rms_norm_grad_* pass with its companion, against the CPU,
// in float32 (d = 2048 vector, d = 13 scalar) and bfloat16.
func TestRMSNormGradFusedMatchesCPU(t *testing.T) {
	e := executor(t)
	gpu, cpuRun := runOn(e), cpuRunner()
	rng := newRand(62)
	for _, c := range []struct {
		dt graph.DType
		d  int
	}{{graph.Float32, 2048}, {graph.Float32, 13}, {graph.BFloat16, 2048}} {
		t.Run(fmt.Sprintf("%s_d%d", c.dt, c.d), func(t *testing.T) {
			h := &halfGraph{t: t, g: graph.New(), dt: c.dt}
			x, w, r := h.input(4, 6, c.d), h.param(c.d), h.input(4, 6, c.d)
			y := h.op(graph.OpRMSNorm, graph.Attrs{NormDims: 1, Eps: 1e-6}, x, w)
			// out = x + tanh(rms(x))·r: x's gradient through the norm meets the stream's.
			out := h.op(graph.OpAdd, graph.Attrs{}, x, h.op(graph.OpMul, graph.Attrs{}, h.op(graph.OpTanh, graph.Attrs{}, y), r))
			loss := h.op(graph.OpSum, graph.Attrs{}, h.op(graph.OpMul, graph.Attrs{}, out, r))
			grads, err := autodiff.Backward(h.g, loss, []int{x, w})
			require.NoError(t, err)
			g, ids, err := graph.FuseLayerNormGradAdd(h.g, grads)
			require.NoError(t, err)
			outs := []int{ids[grads[0]], ids[grads[1]]}
			require.Equal(t, graph.OpRMSNormGradXAdd, g.Node(outs[0]).Op)
			h.g = g
			feeds := map[int]ref.Value{}
			for id, v := range h.uniformFeeds(rng, -2, 2) {
				feeds[id] = v
			}
			want, err := cpuRun(g, feeds, outs...)
			require.NoError(t, err)
			before := cuda.FusedRMSNorms()
			got, err := gpu(g, feeds, outs...)
			require.NoError(t, err)
			require.Equal(t, int64(1), cuda.FusedRMSNorms()-before, "dx and dw in one pass")
			// In bfloat16, dx meets four rounded values on its way (y,
			// tanh(y), the product, the incoming gradient), each of which
			// the device's fp32 math may round the other way: two ulps
			// (seen on the H200: 0.3359 against 0.3398 at d = 2048), of
			// the terms' scale where they cancel (−0.03418 against
			// −0.03516).
			requireCloseCancelling(t, c.dt, 2, "dx", want[0], got[0])
			requireClose(t, c.dt, "dw", want[1], got[1])
		})
	}
}

// Rotary embedding and SwiGLU on the device against the CPU, forward and
// through their gradients: rotary of a packed projection's first heads at
// Llama's head dim 64 (the vector path) and at d = 6 (the scalar path),
// each with a table [T, d] and a full one [T, 2d] whose halves differ;
// swiglu's two gradients from one swiglu_grad pass.
func TestRotarySwiGLUMatchCPU(t *testing.T) {
	e := executor(t)
	gpu, cpuRun := runOn(e), cpuRunner()
	rng := newRand(63)
	for _, dt := range []graph.DType{graph.Float32, graph.BFloat16, graph.Float16} {
		t.Run(dt.String(), func(t *testing.T) {
			h := &halfGraph{t: t, g: graph.New(), dt: dt}
			var outs, wrt []int
			for _, d := range []int{64, 6} {
				for _, w := range []int{d, 2 * d} {
					x := h.input(2, 7, 6, d)
					cs := h.add(graph.Node{Op: graph.OpParam, Name: fmt.Sprintf("cs%d_%d", d, w), Type: graph.Type{Shape: []int{7, w}, DType: graph.Float32}})
					y := h.op(graph.OpRotary, graph.Attrs{End: 4}, x, cs)
					outs, wrt = append(outs, y), append(wrt, x)
				}
			}
			gate, up := h.input(2, 5, 40), h.input(2, 5, 40)
			outs, wrt = append(outs, h.op(graph.OpSwiGLU, graph.Attrs{}, gate, up)), append(wrt, gate, up)
			var terms []int
			for _, o := range outs {
				r := h.add(graph.Node{Op: graph.OpInput, Type: h.g.Node(o).Type})
				terms = append(terms, h.op(graph.OpSum, graph.Attrs{}, h.op(graph.OpMul, graph.Attrs{}, o, r)))
			}
			loss := terms[0]
			for _, s := range terms[1:] {
				loss = h.op(graph.OpAdd, graph.Attrs{}, loss, s)
			}
			grads, err := autodiff.Backward(h.g, loss, wrt)
			require.NoError(t, err)
			outs = append(outs, grads...)
			feeds := h.uniformFeeds(rng, -2, 2)
			for _, nd := range h.g.Nodes() {
				if nd.Op == graph.OpParam { // the tables: cos, sin of angles
					v := feeds[nd.ID]
					w := nd.Type.Shape[1]
					for p := range nd.Type.Shape[0] {
						if d := w / 2; nd.Name == fmt.Sprintf("cs%d_%d", d, w) { // full: an angle per element
							for i := range d {
								th := float64(p+1) * (0.3 + 0.2*float64(i))
								v.Data[p*w+i], v.Data[p*w+d+i] = math.Cos(th), math.Sin(th)
							}
							continue
						}
						for i := range w / 2 {
							th := float64(p+1) * (0.3 + 0.2*float64(i))
							v.Data[p*w+i], v.Data[p*w+w/2+i] = math.Cos(th), math.Sin(th)
						}
					}
				}
			}
			want, err := cpuRun(h.g, feeds, outs...)
			require.NoError(t, err)
			before := cuda.FusedSwiGLUGrads()
			got, err := gpu(h.g, feeds, outs...)
			require.NoError(t, err)
			require.Equal(t, int64(1), cuda.FusedSwiGLUGrads()-before, "d gate and d up in one pass")
			for k, o := range outs {
				requireClose(t, dt, fmt.Sprintf("%s (node %d)", h.g.Node(o).Op, o), want[k], got[k])
			}
		})
	}
}

// Grouped-query packed attention on the device, forward and backward,
// against the CPU: 8 query heads over 2 key/value heads of 64 (bfloat16:
// cuDNN where it takes grouped heads, else the kernels on copies) and
// float32 (the kernels on copies).
func TestAttentionQKVGQAMatchesCPU(t *testing.T) {
	e := executor(t)
	gpu, cpuRun := runOn(e), cpuRunner()
	rng := newRand(64)
	for _, dt := range []graph.DType{graph.Float32, graph.BFloat16} {
		t.Run(dt.String(), func(t *testing.T) {
			h := &halfGraph{t: t, g: graph.New(), dt: dt}
			qkv := h.input(2, 33, (8+2*2)*64)
			o := h.op(graph.OpAttentionQKV, graph.Attrs{Groups: 8, KVHeads: 2, Causal: true}, qkv)
			r := h.add(graph.Node{Op: graph.OpInput, Type: h.g.Node(o).Type})
			loss := h.op(graph.OpSum, graph.Attrs{}, h.op(graph.OpMul, graph.Attrs{}, o, r))
			grads, err := autodiff.Backward(h.g, loss, []int{qkv})
			require.NoError(t, err)
			outs := []int{o, grads[0]}
			feeds := h.uniformFeeds(rng, -1, 1)
			want, err := cpuRun(h.g, feeds, outs...)
			require.NoError(t, err)
			got, err := gpu(h.g, feeds, outs...)
			require.NoError(t, err)
			// Attention sums 33 keys' products: twice the elementwise
			// tolerance, and 16-bit q·k products round in the kernels.
			tol := 2 * llamaTol(dt)
			for k := range outs {
				big := 0.0
				for _, v := range want[k].Data {
					big = max(big, math.Abs(v))
				}
				for i, v := range want[k].Data {
					require.InDelta(t, v, got[k].Data[i], tol*(math.Abs(v)+big), "output %d element %d", k, i)
				}
			}
		})
	}
}
