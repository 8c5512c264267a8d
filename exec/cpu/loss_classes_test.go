package cpu_test

import (
	"context"
	"errors"
	"math"
	"testing"

	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/exec"
	"github.com/batchfit/batchfit/exec/cpu"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
)

// cross_entropy over the first end of c columns (Attrs.End), loss and
// gradient, against a float64 reference over those columns and against
// slicing them off first. The padded columns hold ±1e4: read by the
// max or the sum, they would swamp every row. Tolerances: the reference
// within requireClose's atol/rtol (float32 outputs of float64 sums); the
// sliced graph within 1e-7 of the fused one (the same float64 sums); the
// padded columns' gradient exactly 0.
func TestCrossEntropyClasses(t *testing.T) {
	const n, c, end = 6, 11, 7
	r := newRNG(640)
	logits := uniform(r, n*c, -3, 3)
	labels := make([]int64, n)
	for i := range n {
		labels[i] = r.Int64N(end)
		for j := end; j < c; j++ {
			logits[i*c+j] = float32(1e4 * float64(1-2*((i+j)%2)))
		}
	}
	labels[n-1] = end - 1 // the last class counts
	var sum float64
	wantGrad := make([]float64, n*c)
	for i := range n {
		row := logits[i*c : i*c+end]
		m := math.Inf(-1)
		for _, v := range row {
			m = max(m, float64(v))
		}
		var z float64
		for _, v := range row {
			z += math.Exp(float64(v) - m)
		}
		sum += m + math.Log(z) - float64(row[labels[i]])
		for j, v := range row {
			wantGrad[i*c+j] = math.Exp(float64(v)-m) / z
		}
		wantGrad[i*c+int(labels[i])]--
	}
	for _, red := range []graph.Reduction{graph.ReduceMean, graph.ReduceSum} {
		t.Run(red.String(), func(t *testing.T) {
			scale := 1.0
			if red == graph.ReduceMean {
				scale = 1.0 / n
			}
			// loss and gradient of f(x, labels), x the logits (a graph each)
			lossGrad := func(f func(x, y *lazy.Tensor) *lazy.Tensor) []*tensor.Dense {
				x := param([]int{n, c}, logits)
				loss := f(x, lazy.Const(denseInt([]int{n}, labels)))
				grad := lazy.Grad(loss, x)[0]
				require.NoError(t, grad.Err())
				res, err := cpu.New().Run(context.Background(), grad.Graph().IR(), loss.ID(), grad.ID())
				require.NoError(t, err)
				return res
			}
			res := append(lossGrad(func(x, y *lazy.Tensor) *lazy.Tensor { return x.CrossEntropyClasses(y, end, red) }),
				lossGrad(func(x, y *lazy.Tensor) *lazy.Tensor { return x.Slice(1, 0, end).CrossEntropy(y, red) })...)

			requireClose(t, arr{shape: []int{}, v: []float64{sum * scale}}, res[0])
			want := arr{shape: []int{n, c}, v: make([]float64, n*c)}
			for i, w := range wantGrad {
				want.v[i] = w * scale
			}
			requireClose(t, want, res[1])

			require.InDelta(t, floats(t, res[2])[0], floats(t, res[0])[0], 1e-7*math.Abs(sum))
			g, gs := floats(t, res[1]), floats(t, res[3])
			for i := range g {
				if i%c >= end {
					require.Zero(t, g[i], "padded column %d of row %d", i%c, i/c)
				}
				require.InDelta(t, gs[i], g[i], 1e-7, "element %d", i)
			}
		})
	}
}

// A class count outside (0, C] is a shape error where the graph is built;
// a label at or past it, though inside C, is the kernel's typed error
// naming the label and the class count.
func TestCrossEntropyClassesErrors(t *testing.T) {
	x := input([]int{3, 6}, uniform(newRNG(641), 18, -1, 1))
	l := lazy.Const(denseInt([]int{3}, []int64{0, 1, 2}))
	for _, end := range []int{-1, 0, 7} {
		require.ErrorIs(t, x.CrossEntropyClasses(l, end, graph.ReduceMean).Err(), graph.ErrShape, "end %d", end)
	}
	for _, bad := range []int64{4, 5, -1} {
		y := x.CrossEntropyClasses(lazy.Const(denseInt([]int{3}, []int64{1, bad, 0})), 4, graph.ReduceMean)
		runErr(t, y, graph.ErrAttr)
		_, err := cpu.New().Run(context.Background(), y.Graph().IR(), y.ID())
		var re *exec.RowError
		require.True(t, errors.As(err, &re), "%v", err)
		require.Equal(t, bad, re.Value)
		require.Equal(t, 4, re.Limit, "labels must be below the class count")
	}
}
