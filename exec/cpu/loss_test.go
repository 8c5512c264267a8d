package cpu_test

import (
	"context"
	"math"
	"testing"

	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/exec/cpu"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
)

func TestEmbedding(t *testing.T) {
	const v, d = 7, 3
	w := uniform(newRNG(600), v*d, -2, 2)
	idx := []int64{3, 0, 3, 6, 1, 3, 6, 0, 2, 3} // repeats on purpose
	shape := []int{2, 5}
	got := run(t, lazy.Wrap(denseInt(shape, idx), 0).Embedding(param([]int{v, d}, w)))

	want := arr{shape: []int{2, 5, d}}
	for _, ix := range idx {
		for j := range d {
			want.v = append(want.v, float64(w[int(ix)*d+j]))
		}
	}
	requireClose(t, want, got)
}

func refCrossEntropySum(logits []float32, labels []int64, c int) float64 {
	var total float64
	for n, label := range labels {
		row := logits[n*c : (n+1)*c]
		var s float64
		for _, v := range row {
			s += math.Exp(float64(v)) // small logits: no max needed
		}
		total += math.Log(s) - float64(row[label])
	}
	return total
}

func TestCrossEntropy(t *testing.T) {
	const n, c = 8, 5
	r := newRNG(610)
	logits := uniform(r, n*c, -3, 3)
	labels := make([]int64, n)
	for i := range labels {
		labels[i] = r.Int64N(c)
	}
	sum := refCrossEntropySum(logits, labels, c)
	for _, red := range []graph.Reduction{graph.ReduceMean, graph.ReduceSum} {
		t.Run(red.String(), func(t *testing.T) {
			x := input([]int{n, c}, logits)
			y := x.CrossEntropy(lazy.Const(denseInt([]int{n}, labels)), red)
			want := sum
			if red == graph.ReduceMean {
				want /= n
			}
			requireClose(t, arr{shape: []int{}, v: []float64{want}}, run(t, y))
		})
	}
}

// A chunk of the batch contributes its loss sum times 1/N of the full batch
// (the attribute fixed at build time), so chunk results add up to the mean.
func TestCrossEntropyChunkUsesFullBatchScale(t *testing.T) {
	const n, c, chunk = 6, 4, 2
	r := newRNG(620)
	logits := uniform(r, n*c, -3, 3)
	labels := make([]int64, n)
	for i := range labels {
		labels[i] = r.Int64N(c)
	}
	g := lazy.NewGraph()
	x := g.Wrap(dense([]int{n, c}, logits), 0)
	l := g.Wrap(denseInt([]int{n}, labels), 0)
	y := x.CrossEntropy(l, graph.ReduceMean)
	require.NoError(t, y.Err())
	feed := func(id int) tensor.Tensor {
		if id == x.ID() {
			return dense([]int{chunk, c}, logits[:chunk*c])
		}
		return denseInt([]int{chunk}, labels[:chunk])
	}
	res, err := cpu.New().RunBatch(context.Background(), g.IR(), chunk, feed, y.ID())
	require.NoError(t, err)
	want := refCrossEntropySum(logits[:chunk*c], labels[:chunk], c) / n
	requireClose(t, arr{shape: []int{}, v: []float64{want}}, res[0])
}

func TestMSE(t *testing.T) {
	shape := []int{4, 3, 2}
	r := newRNG(630)
	p := uniform(r, numel(shape), -2, 2)
	q := uniform(r, numel(shape), -2, 2)
	var sum float64
	for i := range p {
		d := float64(p[i]) - float64(q[i])
		sum += d * d
	}
	for _, red := range []graph.Reduction{graph.ReduceMean, graph.ReduceSum} {
		t.Run(red.String(), func(t *testing.T) {
			y := input(shape, p).MSE(param(shape, q), red)
			want := sum
			if red == graph.ReduceMean {
				want /= float64(len(p))
			}
			requireClose(t, arr{shape: []int{}, v: []float64{want}}, run(t, y))
		})
	}
}
