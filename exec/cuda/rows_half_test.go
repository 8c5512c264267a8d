package cuda_test

import (
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/exec/cuda"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/internal/conformance"
	"github.com/batchfit/batchfit/internal/ref"
	"github.com/batchfit/batchfit/lazy"
)

// The 16-bit kernels of reduce.cu, softmax.cu, layernorm.cu, batchnorm.cu
// and loss.cu against the reference interpreter, which rounds where the
// executor rounds (conformance.BFloat16Tol and Float16Tol say how far they
// may differ).

var halfDTypes = []struct {
	dt  graph.DType
	tol conformance.Tolerance
}{{graph.BFloat16, conformance.BFloat16Tol}, {graph.Float16, conformance.Float16Tol}}

// rowsCases are the conformance cases whose 16-bit values meet no op but
// those kernels, the elementwise ones and casts (sum_mean and
// sum_leading_axes also need a 16-bit expand, from movement.cu).
var rowsCases = []string{
	"max", "softmax", "log_softmax", "layer_norm", "layer_norm_plain",
	"batch_norm_train", "batch_norm_train_weight_rank3", "batch_norm_train_plain_rank2",
	"batch_norm_eval", "batch_norm_eval_plain", "cross_entropy", "cross_entropy_classes", "mse", "ties_max_maximum_relu",
}

func TestRowsConformanceHalf(t *testing.T) {
	run := runOn(executor(t))
	for _, h := range halfDTypes {
		rng := rand.New(rand.NewPCG(2026, 12))
		for _, c := range ref.Cases {
			if !slices.Contains(rowsCases, c.Name) {
				continue
			}
			t.Run(h.dt.String()+"/"+c.Name, func(t *testing.T) {
				b, err := c.BuildAs(rng, h.dt)
				require.NoError(t, err)
				outs := append([]int{b.Out, b.Loss}, b.Grads...)
				want, err := ref.Eval(b.Graph, b.Vals, outs...)
				require.NoError(t, err)
				got, err := run(b.Graph, b.Vals, outs...)
				require.NoError(t, err)
				for k, id := range outs {
					requireHalfClose(t, want[k], got[k], h.tol, fmt.Sprintf("node %d (%s)", id, b.Graph.Node(id).Op))
				}
			})
		}
	}
}

// TestSplitReductionsHalf runs the split paths of every reduction layout
// (float32 partials, then reduce_splits_* into the 16-bit result) and of
// layer_norm_grad_w, with a GPT-2 bias gradient among them: a bfloat16
// [2048, 768] summed over its rows.
func TestSplitReductionsHalf(t *testing.T) {
	run := runOn(executor(t))
	specs := []struct {
		name  string
		shape []int
		fn    func(x *lazy.Tensor) []*lazy.Tensor
	}{
		{"mid", []int{16384, 4}, func(x *lazy.Tensor) []*lazy.Tensor { return []*lazy.Tensor{x.Sum(0), x.Mean(0), x.Max(0)} }},
		{"rows", []int{4, 32768}, func(x *lazy.Tensor) []*lazy.Tensor { return []*lazy.Tensor{x.Sum(1), x.Mean(1), x.Max(1)} }},
		{"strided", []int{64, 3, 128}, func(x *lazy.Tensor) []*lazy.Tensor { return []*lazy.Tensor{x.Sum(0, 2), x.Max(0, 2)} }},
		{"bias_grad", []int{2048, 768}, func(x *lazy.Tensor) []*lazy.Tensor { return []*lazy.Tensor{x.Sum(0)} }},
		{"layer_norm_grads", []int{16384, 4}, func(x *lazy.Tensor) []*lazy.Tensor {
			w := lazy.ParamSpec([]int{4}, x.DType(), "w")
			b := lazy.ParamSpec([]int{4}, x.DType(), "b")
			ln := x.LayerNorm(w, b, 1, 1e-5).Cast(graph.Float32)
			return lazy.Grad(ln.Mul(ln).Sum(), w, b)
		}},
	}
	for _, h := range halfDTypes {
		for _, sp := range specs {
			t.Run(h.dt.String()+"/"+sp.name, func(t *testing.T) {
				x := lazy.Placeholder(sp.shape, h.dt, 0)
				outs := sp.fn(x)
				ids := make([]int, len(outs))
				for i, o := range outs {
					require.NoError(t, o.Err())
					ids[i] = o.ID()
				}
				ir := x.Graph().IR()
				rng := rand.New(rand.NewPCG(57, 58))
				feeds := map[int]ref.Value{}
				for _, nd := range ir.Nodes() {
					if (nd.Op == graph.OpInput || nd.Op == graph.OpParam) && nd.Value == nil {
						v := ref.Zeros(nd.Type.Shape...)
						for i := range v.Data {
							v.Data[i] = rng.Float64()*2 - 1
						}
						feeds[nd.ID] = v
					}
				}
				want, err := ref.Eval(ir, feeds, ids...)
				require.NoError(t, err)
				got, err := run(ir, feeds, ids...)
				require.NoError(t, err)
				for k, id := range ids {
					requireHalfClose(t, want[k], got[k], h.tol, fmt.Sprintf("output %d (%s)", k, ir.Node(id).Op))
				}
			})
		}
	}
}

func requireHalfClose(t *testing.T, want, got ref.Value, tol conformance.Tolerance, what string) {
	t.Helper()
	require.Equal(t, want.Shape, got.Shape, what)
	for i, w := range want.Data {
		if d := math.Abs(got.Data[i] - w); !(d <= tol.ATol+tol.RTol*math.Abs(w)) {
			t.Fatalf("%s element %d: got %.8g, want %.8g", what, i, got.Data[i], w)
		}
	}
}

// TestCrossEntropyLongRows runs cross_entropy and its gradient on rows too
// long for registers (10,007 classes: the one-pass online log-sum-exp and
// the 16-byte packs of row_split, whose rows start at a different offset
// each since the length is odd) in float32, bfloat16 and float16, against
// the reference. A 16-bit loss is float32, so it is held to float32's
// tolerance; a gradient element to its dtype's rounding (2⁻⁸ relative for
// bfloat16, 2⁻¹¹ for float16, 1e-5 for float32) plus 1e-3 (16-bit) or 1e-6
// of the largest one, since softmax terms span e⁸.
// With fewer classes than columns (Attrs.End: GPT-2's head padded from
// 50,257 to 50,304 outputs, here 10,007 of 10,048 and, rows then starting
// at odd offsets, 9,990 of 10,007) the padded columns hold ±1e4, which
// would swamp the loss if read, and their gradient must be exactly 0.
func TestCrossEntropyLongRows(t *testing.T) {
	run := runOn(executor(t))
	const rows = 5
	for _, c := range []struct {
		dt          graph.DType
		rtol, floor float64
	}{{graph.Float32, 1e-5, 1e-6}, {graph.BFloat16, 1.0 / 256, 1e-3}, {graph.Float16, 1.0 / 2048, 1e-3}} {
		for _, l := range []struct {
			classes, cols int
			fused         bool
		}{{10007, 10007, true}, {10007, 10048, true}, {9990, 10007, true}, {10007, 10048, false}} {
			t.Run(fmt.Sprintf("%s/%d_of_%d/fused=%v", c.dt, l.classes, l.cols, l.fused), func(t *testing.T) {
				logits := lazy.ParamSpec([]int{rows, l.cols}, c.dt, "logits")
				labels := lazy.Const(tensor.New(tensor.WithShape(rows), tensor.WithBacking([]int64{0, int64(l.classes - 1), 5003, 17, 9989})))
				loss := logits.CrossEntropy(labels, graph.ReduceSum)
				if l.classes < l.cols {
					loss = logits.CrossEntropyClasses(labels, l.classes, graph.ReduceSum)
				}
				if !l.fused {
					// The seed of cross_entropy_grad is then computed, not a
					// fill: its own kernel runs (graph.CrossEntropyGradProducer).
					loss = loss.MulScalar(0.75)
				}
				fusedBefore := cuda.FusedCrossEntropies()
				grads := lazy.Grad(loss, logits)
				require.NoError(t, grads[0].Err())
				require.Equal(t, graph.Float32, loss.DType(), "a 16-bit cross_entropy's loss is float32")
				ir := loss.Graph().IR()
				rng := rand.New(rand.NewPCG(3, 4))
				v := ref.Zeros(rows, l.cols)
				for i := range v.Data {
					v.Data[i] = rng.Float64()*8 - 4
					if i%l.cols >= l.classes {
						v.Data[i] = 1e4 * float64(1-2*(i%2))
					}
				}
				feeds := map[int]ref.Value{}
				for _, nd := range ir.Nodes() {
					if nd.Op == graph.OpParam {
						feeds[nd.ID] = v
					}
				}
				require.Len(t, feeds, 1)
				ids := []int{loss.ID(), grads[0].ID()}
				want, err := ref.Eval(ir, feeds, ids...)
				require.NoError(t, err)
				got, err := run(ir, feeds, ids...)
				require.NoError(t, err)
				require.InDelta(t, want[0].Data[0], got[0].Data[0], 1e-5*math.Abs(want[0].Data[0]), "loss")
				fusedRuns := int64(0)
				if l.fused {
					fusedRuns = 1
				}
				require.Equal(t, fusedRuns, cuda.FusedCrossEntropies()-fusedBefore, "cross_entropy passes that wrote the gradient too")
				largest := 0.0
				for _, w := range want[1].Data {
					largest = max(largest, math.Abs(w))
				}
				for i, w := range want[1].Data {
					if i%l.cols >= l.classes {
						require.Zero(t, got[1].Data[i], "gradient of padded column %d (row %d)", i%l.cols, i/l.cols)
					}
					if d := math.Abs(got[1].Data[i] - w); d > c.rtol*math.Abs(w)+c.floor*largest {
						t.Fatalf("gradient element %d (row %d): got %.8g, want %.8g", i, i/l.cols, got[1].Data[i], w)
					}
				}
			})
		}
	}
}
