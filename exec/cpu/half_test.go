package cpu_test

import (
	"context"
	"math"
	"testing"

	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/exec/cpu"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/half"
	"github.com/batchfit/batchfit/lazy"
)

// 16-bit values cross the host boundary as float32 tensors: a float16 or
// bfloat16 input's float32 data is rounded to nearest even as it enters
// (the caller's tensor is left as it was), every op producing a 16-bit
// value stores it rounded, and outputs come back as float32 tensors
// holding those values. Matrix products accumulate in float32 from the
// rounded inputs and round once.
func TestHalfBoundary(t *testing.T) {
	data := []float32{1.00390625, 1 + 1.0/512, -3.0001, 65519, 1e-8, 0.1}
	for _, c := range []struct {
		dt    graph.DType
		round func(float32) float32
	}{{graph.BFloat16, half.RoundBF16}, {graph.Float16, half.RoundF16}} {
		host := tensor.New(tensor.WithShape(1, 6), tensor.WithBacking(append([]float32(nil), data...)))
		x := lazy.WrapAs(host, c.dt, 0)
		require.NoError(t, x.Err())
		y := x.MulScalar(1)                           // a 16-bit op: its output is stored rounded
		z := x.Cast(graph.Float32).MulScalar(1.0 / 3) // float32 from here on: not rounded
		w := lazy.ParamSpec([]int{6, 1}, c.dt, "w")
		mm := x.MatMul(w)
		ones := tensor.New(tensor.WithShape(6, 1), tensor.WithBacking([]float32{1, 1, 1, 1, 1, 1}))
		out, err := cpu.New().RunBatch(context.Background(), x.Graph().IR(), 1, func(id int) tensor.Tensor {
			if id == x.Graph().NodeOf(w) {
				return ones
			}
			return nil
		}, y.ID(), z.ID(), mm.ID())
		require.NoError(t, err)
		require.Equal(t, data, host.Data(), "%s: the caller's data is unchanged", c.dt)
		var sum float32
		for i, v := range out[0].Data().([]float32) {
			require.Equal(t, c.round(data[i]), v, "%s: element %d rounded as it entered", c.dt, i)
			sum += c.round(data[i])
		}
		for i, v := range out[1].Data().([]float32) {
			want := float64(c.round(data[i])) / 3
			require.InDelta(t, want, float64(v), 1e-7*math.Abs(want), "%s: element %d is float32 after the cast (tolerance 1e-7 relative)", c.dt, i)
		}
		require.Equal(t, c.round(sum), out[2].Data().([]float32)[0], "%s: matmul sums rounded inputs in float32 and rounds once", c.dt)
	}
}
