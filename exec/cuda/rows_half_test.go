package cuda_test

import (
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"

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
	"batch_norm_eval", "batch_norm_eval_plain", "cross_entropy", "mse", "ties_max_maximum_relu",
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
