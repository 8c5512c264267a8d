package cuda_test

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/exec/cuda"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/internal/ref"
)

// linear_cross_entropy on CUDA matches the CPU executor, in float32 and
// bfloat16: the loss, and both gradients twice, once from the forward
// pass (a fill seed: graph.LinearCrossEntropyGradProducer pairs them
// with the loss, and FusedLinearCEs counts the launch) and once in
// backward from a computed seed (_grad_h giving _grad_w). Shapes: 300
// rows in chunks of 128 (the last partial), a padded W of 1,030 rows
// scoring 1,000 classes (rows 1,030 apart in a pitch of 1,032), rows
// ignored, a scale; and rows of 9,000 classes (the row pass's online
// path, past the registers). Tolerance: ‖got − want‖/‖want‖ within 1e-5
// in float32 (TF32 off: full-precision GEMMs, sums in other orders) and
// 1e-2 in bfloat16 (the 16-bit logits and gradients of the two may round
// one ulp, 2⁻⁸, apart), the loss within 1e-5 and 2e-3 relative.
func TestLinearCrossEntropyMatchesCPU(t *testing.T) {
	e := executor(t)
	gpu, cpuRun := runOn(e), cpuRunner()
	for _, dt := range []graph.DType{graph.Float32, graph.BFloat16} {
		for _, c := range []struct{ n, c, v, end, chunk int }{{300, 64, 1030, 1000, 128}, {64, 32, 9000, 0, 32}} {
			t.Run(fmt.Sprintf("%s/n=%d/v=%d", dt, c.n, c.v), func(t *testing.T) {
				rng := newRand(71)
				h := &halfGraph{t: t, g: graph.New(), dt: dt}
				x := h.input(c.n, c.c)
				w := h.param(c.v, c.c)
				labels := h.add(graph.Node{Op: graph.OpInput, Type: graph.Type{Shape: []int{c.n}, DType: graph.Int64, BatchAxis: 0, PerSample: 1}})
				scale := h.add(graph.Node{Op: graph.OpParam, Name: "scale", Type: graph.Type{Shape: []int{}, DType: graph.Float32}})
				a := graph.Attrs{End: c.end, LossChunk: c.chunk}
				loss := h.op(graph.OpLinearCrossEntropy, a, x, w, labels, scale)
				ga := h.g.Node(loss).Attrs
				seed := h.add(graph.Node{Op: graph.OpFill, Attrs: graph.Attrs{Scalar: 0.5, Target: graph.Type{Shape: []int{}, DType: graph.Float32}}})
				gh := h.op(graph.OpLinearCrossEntropyGradH, ga, seed, x, w, labels, scale)
				gw := h.op(graph.OpLinearCrossEntropyGradW, ga, seed, x, w, labels, scale)
				require.Equal(t, loss, graph.CompanionProducer(h.g, gh))
				require.Equal(t, loss, graph.CompanionProducer(h.g, gw))
				g2 := h.op(graph.OpMulScalar, graph.Attrs{Scalar: 0.5}, loss)
				gh2 := h.op(graph.OpLinearCrossEntropyGradH, ga, g2, x, w, labels, scale)
				gw2 := h.op(graph.OpLinearCrossEntropyGradW, ga, g2, x, w, labels, scale)
				require.Equal(t, gh2, graph.CompanionProducer(h.g, gw2))
				feeds := h.uniformFeeds(rng, -1, 1)
				classes := graph.CrossEntropyClasses(&ga, c.v)
				lv := ref.Zeros(c.n)
				for i := range lv.Data {
					lv.Data[i] = float64(rng.IntN(classes))
					if i%7 == 3 {
						lv.Data[i] = graph.IgnoreLabel
					}
				}
				feeds[labels] = lv
				feeds[scale] = ref.Value{Shape: []int{}, Data: []float64{0.75}}
				outs := []int{loss, gh, gw, gh2, gw2}
				want, err := cpuRun(h.g, feeds, outs...)
				require.NoError(t, err)
				before := cuda.FusedLinearCEs()
				got, err := gpu(h.g, feeds, outs...)
				require.NoError(t, err)
				require.Equal(t, int64(1), cuda.FusedLinearCEs()-before, "the loss's pass gave its gradients")
				tol, ltol := 1e-5, 1e-5
				if dt != graph.Float32 {
					tol, ltol = 1e-2, 2e-3
				}
				require.InEpsilon(t, want[0].Data[0], got[0].Data[0], ltol, "loss")
				for k, name := range []string{"dh (forward)", "dW (forward)", "dh (backward)", "dW (backward)"} {
					r := relNorm(t, want[k+1], got[k+1], name)
					t.Logf("%s: ‖Δ‖/‖want‖ %.3g", name, r)
					require.Less(t, r, tol, name)
				}
				// W's rows past the classes get exactly zero gradient.
				for i := classes * c.c; i < c.v*c.c; i++ {
					require.Zero(t, got[2].Data[i], "dW element %d past the classes", i)
				}
			})
		}
	}
}

// A label outside the classes is an error naming the op and the row, on
// the device as on the CPU.
func TestLinearCrossEntropyBadLabel(t *testing.T) {
	e := executor(t)
	gpu := runOn(e)
	h := &halfGraph{t: t, g: graph.New(), dt: graph.Float32}
	x, w := h.input(8, 4), h.param(6, 4)
	labels := h.add(graph.Node{Op: graph.OpInput, Type: graph.Type{Shape: []int{8}, DType: graph.Int64, BatchAxis: 0, PerSample: 1}})
	loss := h.op(graph.OpLinearCrossEntropy, graph.Attrs{LossChunk: 4}, x, w, labels)
	feeds := h.uniformFeeds(newRand(72), -1, 1)
	feeds[labels] = ref.Value{Shape: []int{8}, Data: []float64{0, 1, 2, 3, 4, 6, 0, 1}}
	_, err := gpu(h.g, feeds, loss)
	require.Error(t, err)
	require.Contains(t, err.Error(), "linear_cross_entropy")
	_, err = cpuRunner()(h.g, feeds, loss)
	require.Error(t, err)
}
