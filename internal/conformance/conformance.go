// Package conformance is the suite every executor passes: each case of
// ref.Cases (every forward op, and through its backward pass every gradient
// op) runs on the executor and is compared, output by output, with the
// float64 reference interpreter. The CPU executor runs it in CI; the CUDA
// executor runs the same suite on the GPU machine.
package conformance

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"testing"

	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/internal/ref"
)

// Runner evaluates outputs of g on an executor. feeds holds the data of every
// data-less source (inputs and parameters); int64 sources hold integral
// values. It returns the outputs as float64 values.
type Runner func(g *graph.Graph, feeds map[int]ref.Value, outputs ...int) ([]ref.Value, error)

// RunBatch is an executor's RunBatch method: it evaluates outputs of g for
// b samples, feed supplying the data of data-less sources.
type RunBatch func(ctx context.Context, g *graph.Graph, b int, feed func(id int) tensor.Tensor, outputs ...int) ([]*tensor.Dense, error)

// RunnerOf adapts an executor's RunBatch to a Runner: it feeds each source
// its value as a float32 tensor (int64 for int64 sources), runs the whole
// batch, and widens the outputs to float64.
func RunnerOf(run RunBatch) Runner {
	return func(g *graph.Graph, feeds map[int]ref.Value, outputs ...int) ([]ref.Value, error) {
		feed := func(id int) tensor.Tensor {
			v, ok := feeds[id]
			if !ok {
				return nil
			}
			if g.Node(id).Type.DType == graph.Int64 {
				d := make([]int64, len(v.Data))
				for i, x := range v.Data {
					d[i] = int64(x)
				}
				return tensor.New(tensor.WithShape(v.Shape...), tensor.WithBacking(d))
			}
			d := make([]float32, len(v.Data))
			for i, x := range v.Data {
				d[i] = float32(x)
			}
			return tensor.New(tensor.WithShape(v.Shape...), tensor.WithBacking(d))
		}
		out, err := run(context.Background(), g, g.Batch(), feed, outputs...)
		if err != nil {
			return nil, err
		}
		vals := make([]ref.Value, len(out))
		for i, d := range out {
			if vals[i], err = ref.FromTensor(d); err != nil {
				return nil, err
			}
		}
		return vals, nil
	}
}

// Tolerance bounds |got − want| by ATol + RTol·|want| per element.
type Tolerance struct{ RTol, ATol float64 }

// RunAll runs every case on run and compares its output, loss and every
// gradient with ref.Eval.
func RunAll(t *testing.T, run Runner, tol Tolerance) {
	t.Helper()
	RunAllAs(t, run, graph.Float32, tol)
}

// Half-precision tolerances for RunAllAs. Executor and reference round to
// the 16-bit dtype at the same points, so they differ only where their
// float32 and float64 results fall on two sides of a rounding boundary:
// one unit in the last place (2⁻⁸ relative for bfloat16, 2⁻¹¹ for
// float16), grown by the few ops a case chains after it.
var (
	BFloat16Tol = Tolerance{RTol: 3e-2, ATol: 3e-2}
	Float16Tol  = Tolerance{RTol: 5e-3, ATol: 5e-3}
)

// RunAllAs runs every case with its input and parameters of dtype dt
// (ref.Case.BuildAs), so each op runs on dt values, and compares with
// ref.Eval, which rounds where the executor rounds.
func RunAllAs(t *testing.T, run Runner, dt graph.DType, tol Tolerance) {
	t.Helper()
	rng := rand.New(rand.NewPCG(2026, 11))
	for _, c := range ref.Cases {
		t.Run(c.Name, func(t *testing.T) {
			if c.Rounds && !dt.IsHalf() {
				// Its casts store 16-bit values, which an executor without
				// 16-bit storage (CUDA, for now) refuses: RunAllAs with a
				// 16-bit dtype runs it.
				t.Skip("casts to 16 bits: run by RunAllAs with float16 or bfloat16")
			}
			b, err := c.BuildAs(rng, dt)
			if err != nil {
				t.Fatalf("build: %v", err)
			}
			outs := append([]int{b.Out, b.Loss}, b.Grads...)
			want, err := ref.Eval(b.Graph, b.Vals, outs...)
			if err != nil {
				t.Fatalf("reference: %v", err)
			}
			got, err := run(b.Graph, b.Vals, outs...)
			if err != nil {
				t.Fatalf("executor: %v", err)
			}
			for k := range outs {
				what := "output"
				switch {
				case k == 1:
					what = "loss"
				case k > 1:
					what = fmt.Sprintf("gradient of p%d", k-2)
				}
				if err := compare(want[k], got[k], tol); err != nil {
					t.Errorf("%s (node %d, %s): %v", what, outs[k], b.Graph.Node(outs[k]).Op, err)
				}
			}
		})
	}
}

func compare(want, got ref.Value, tol Tolerance) error { return compareScaled(want, got, tol, nil) }

// compareScaled is compare with each element's relative tolerance of
// scale[i] rather than |want[i]| when scale is given.
func compareScaled(want, got ref.Value, tol Tolerance, scale []float64) error {
	if fmt.Sprint(want.Shape) != fmt.Sprint(got.Shape) {
		return fmt.Errorf("shape %v, want %v", got.Shape, want.Shape)
	}
	if scale != nil && len(scale) != len(want.Data) {
		return fmt.Errorf("%d scales for %d values", len(scale), len(want.Data))
	}
	for i, w := range want.Data {
		of, what := math.Abs(w), "|want|"
		if scale != nil {
			of, what = scale[i], "Σ|term|"
		}
		if d := math.Abs(got.Data[i] - w); !(d <= tol.ATol+tol.RTol*of) {
			return fmt.Errorf("element %d: got %.8g, want %.8g (diff %.3g > %.3g + %.3g·%s)", i, got.Data[i], w, d, tol.ATol, tol.RTol, what)
		}
	}
	return nil
}

// RunPointwiseFuzz runs n random fused_pointwise graphs
// (ref.RandomPointwise: random expression DAGs over random shapes and
// dtypes) on run and compares every output with ref.Eval's: within tol,
// or within half where a 16-bit dtype appears (float32 and float64 may
// round a value to two sides of a 16-bit boundary, and later ops carry
// that one unit in the last place on). A column sum's relative tolerance
// is of Σ |term| (PointwiseCase.ColScale), not of |sum|: cancellation
// shrinks the sum, not its terms' rounding errors. The seed fixes the
// cases.
func RunPointwiseFuzz(t *testing.T, run Runner, n int, seed uint64, tol, half Tolerance) {
	t.Helper()
	rng := rand.New(rand.NewPCG(seed, 34))
	for i := range n {
		c, err := ref.RandomPointwise(rng)
		if err != nil {
			t.Fatalf("case %d: %v", i, err)
		}
		want, err := ref.Eval(c.Graph, c.Vals, c.Outs...)
		if err != nil {
			t.Fatalf("case %d (%v): reference: %v", i, c, err)
		}
		got, err := run(c.Graph, c.Vals, c.Outs...)
		if err != nil {
			t.Fatalf("case %d (%v): executor: %v", i, c, err)
		}
		tl := tol
		if c.Half {
			tl = half
		}
		for k := range c.Outs {
			if err := compareScaled(want[k], got[k], tl, c.ColScale[k]); err != nil {
				t.Errorf("case %d output %d (%v): %v", i, k, c, err)
			}
		}
	}
}
