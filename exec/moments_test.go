package exec_test

import (
	"context"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/exec"
	"github.com/batchfit/batchfit/exec/cpu"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/planner"
	"github.com/batchfit/batchfit/shapeinfer"
)

// direct is the mean and Σ (x − mean)² of xs in float64, two passes.
func direct(xs []float64) (mean, m2 float64) {
	for _, x := range xs {
		mean += x
	}
	mean /= float64(len(xs))
	for _, x := range xs {
		m2 += (x - mean) * (x - mean)
	}
	return mean, m2
}

// MergeMoments over any split of a set of values, merged part by part,
// gives the set's mean and sum of squared deviations: exactly up to
// float64 rounding, with values far from zero (no cancellation).
func TestMergeMoments(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	xs := make([]float64, 101)
	for i := range xs {
		xs[i] = 1000 + rng.NormFloat64()
	}
	wantMean, wantM2 := direct(xs)
	for _, cuts := range [][]int{{1}, {50}, {100}, {2, 3, 90}, {33, 66}, {1, 2, 3, 4, 5, 6}} {
		var n, mean, m2 float64
		lo := 0
		for _, hi := range append(cuts, len(xs)) {
			pm, p2 := direct(xs[lo:hi])
			if n == 0 {
				mean, m2 = pm, p2
			} else {
				mean, m2 = exec.MergeMoments(n, mean, m2, float64(hi-lo), pm, p2)
			}
			n += float64(hi - lo)
			lo = hi
		}
		assert.InDelta(t, wantMean, mean, 1e-12, "cuts %v", cuts)
		assert.InDelta(t, wantM2, m2, 1e-9*wantM2, "cuts %v", cuts)
	}
}

// A batch_norm_stats output run in uneven chunks is the statistics of the
// whole batch (to float32 rounding), however the batch is split: the CPU
// executor's chunks combine through exec.Combine.
func TestBatchStatsCombine(t *testing.T) {
	const n, c, hw = 7, 3, 4
	rng := rand.New(rand.NewPCG(5, 6))
	data := make([]float32, n*c*hw)
	for i := range data {
		data[i] = float32(50 + 3*rng.NormFloat64())
	}
	x := lazy.Wrap(tensor.New(tensor.WithShape(n, c, 2, 2), tensor.WithBacking(data)), 0)
	stats := x.BatchStats()
	require.NoError(t, stats.Err())
	g := x.Graph().IR()
	info, err := shapeinfer.Analyze(g, stats.ID())
	require.NoError(t, err)
	p, err := planner.Compile(g, info, []int{stats.ID()}, planner.CompileOptions{Workspace: cpu.Workspace})
	require.NoError(t, err)
	for ch := range c {
		var vals []float64
		for i := range n {
			for j := range hw {
				vals = append(vals, float64(data[(i*c+ch)*hw+j]))
			}
		}
		mean, m2 := direct(vals)
		variance := m2 / float64(len(vals)-1)
		for _, k := range []int{1, 2, 3, 7} {
			res, err := cpu.New().Execute(context.Background(), p, planner.Chunks(n, k), exec.Options{})
			require.NoError(t, err)
			got := res.Outputs[0].Float32s()
			assert.InDelta(t, mean, float64(got[ch]), 1e-6*math.Abs(mean), "%d chunks: channel %d mean", k, ch)
			assert.InDelta(t, variance, float64(got[c+ch]), 1e-5*variance, "%d chunks: channel %d variance", k, ch)
		}
	}
}
