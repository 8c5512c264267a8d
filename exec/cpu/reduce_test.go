package cpu_test

import (
	"context"
	"fmt"
	"math"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/exec/cpu"
	"github.com/batchfit/batchfit/lazy"
)

func TestReduce(t *testing.T) {
	shape := []int{2, 3, 4, 5}
	d := uniform(newRNG(200), numel(shape), -2, 2)
	x := ref64(shape, d)
	sum := func(acc, v float64) float64 { return acc + v }
	cases := []struct {
		axes []int // as passed
		norm []int // normalised, for the reference
	}{
		{nil, []int{0, 1, 2, 3}},
		{[]int{1}, []int{1}},
		{[]int{-1}, []int{3}},
		{[]int{0, 2}, []int{0, 2}},
		{[]int{-1, 1}, []int{1, 3}},
		{[]int{-3, -2}, []int{1, 2}},
		{[]int{3, 0, 1}, []int{0, 1, 3}},
	}
	for _, c := range cases {
		for _, keep := range []bool{false, true} {
			t.Run(fmt.Sprintf("axes%v_keep%v", c.axes, keep), func(t *testing.T) {
				in := input(shape, d)
				count := 1
				for _, ax := range c.norm {
					count *= shape[ax]
				}
				var s, m, mx *lazy.Tensor
				if keep {
					s, m, mx = in.SumKeepDim(c.axes...), in.MeanKeepDim(c.axes...), in.MaxKeepDim(c.axes...)
				} else {
					s, m, mx = in.Sum(c.axes...), in.Mean(c.axes...), in.Max(c.axes...)
				}
				refSum := refReduce(x, c.norm, keep, 0, sum)
				requireClose(t, refSum, run(t, s))
				requireClose(t, refMap(refSum, func(v float64) float64 { return v / float64(count) }), run(t, m))
				requireClose(t, refReduce(x, c.norm, keep, math.Inf(-1), math.Max), run(t, mx))
			})
		}
	}
}

// A chunk's mean over the batch is its share of the full-batch mean: the
// kernel scales by the 1/N fixed at build time, not by the chunk's size.
func TestMeanChunkUsesFullBatchScale(t *testing.T) {
	const n, f, chunk = 6, 4, 2
	d := uniform(newRNG(201), n*f, -1, 3)
	x := input([]int{n, f}, d)
	m := x.Mean(0)
	require.NoError(t, m.Err())
	feed := func(int) tensor.Tensor { return dense([]int{chunk, f}, d[:chunk*f]) }
	res, err := cpu.New().RunBatch(context.Background(), m.Graph().IR(), chunk, feed, m.ID())
	require.NoError(t, err)
	want := refReduce(ref64([]int{chunk, f}, slices.Clone(d[:chunk*f])), []int{0}, false, 0,
		func(acc, v float64) float64 { return acc + v/n })
	requireClose(t, want, res[0])
}
