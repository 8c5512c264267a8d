package ref

import (
	"math"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
)

// x [N=2, C=2, H=1, W=2] laid out n0c0, n0c1, n1c0, n1c1.
// Channel 0 holds 1, 3, 5, 7: mean 4, biased variance (9+1+1+9)/4 = 5.
// Channel 1 holds 0, 2, 0, 2: mean 1, biased variance 1.
func bnInput() *lazy.Tensor { return lazy.Wrap(tf([]int{2, 2, 1, 2}, 1, 3, 0, 2, 5, 7, 0, 2), 0) }

func TestBatchNormTrainingByHand(t *testing.T) {
	x := bnInput()
	w, b := lazy.Const(tf([]int{2}, 2, -1)), lazy.Const(tf([]int{2}, 0.5, 0))
	// eps 4: rstd = 1/√(5+4) = 1/3 on channel 0, 1/√(1+4) = 1/√5 on channel 1.
	got := eval(t, x.BatchNorm2d(w, b, nil, nil, true, 4), x.BatchNorm2d(nil, nil, nil, nil, true, 4))
	r5 := 1 / math.Sqrt(5)
	// Channel 0: (x − 4)/3 = −1, −⅓, ⅓, 1, then ·2 + ½. Channel 1: (x − 1)/√5 = ∓1/√5, then ·(−1).
	requireClose(t, val([]int{2, 2, 1, 2}, -1.5, 0.5-2.0/3, r5, -r5, 0.5+2.0/3, 2.5, r5, -r5), got[0], handTol)
	requireClose(t, val([]int{2, 2, 1, 2}, -1, -1.0/3, -r5, r5, 1.0/3, 1, -r5, r5), got[1], handTol)
}

func TestBatchNormEvalByHand(t *testing.T) {
	x := bnInput()
	mean, variance := lazy.Const(tf([]int{2}, 1, -1)), lazy.Const(tf([]int{2}, 3, 0))
	w, b := lazy.Const(tf([]int{2}, 2, -1)), lazy.Const(tf([]int{2}, 0.5, 0))
	// eps 1: rstd = ½ on channel 0, 1 on channel 1. Channel 0: (x − 1)/2·2 + ½;
	// channel 1: (x + 1)·(−1). The batch's own statistics play no part.
	got := eval(t, x.BatchNorm2d(w, b, mean, variance, false, 1))
	requireClose(t, val([]int{2, 2, 1, 2}, 0.5, 2.5, -1, -3, 4.5, 6.5, -1, -3), got[0], handTol)
}

// The training-mode input gradient removes from ĝ its projections on the
// constant and on x̂ per channel: Σ dx = 0 and Σ dx·x̂ = 0 for any upstream
// gradient. The second holds up to a factor ε/(σ² + ε) (Σ x̂² is
// M·σ²/(σ² + ε), not M), so eps is 1e-12 here and the tolerance 1e-9.
func TestBatchNormGradXIsOrthogonal(t *testing.T) {
	rng := newRand()
	shape := []int{3, 2, 2, 2}
	d := newDSL(t)
	g, x, w := d.param(shape...), d.param(shape...), d.param(2)
	a := graph.Attrs{Training: true, Eps: 1e-12}
	dx := d.op(graph.OpBatchNormGradX, a, g, x, w)
	y := d.op(graph.OpBatchNorm, a, x)
	vals := map[int]Value{g: randValue(rng, -1, 1, shape...), x: randValue(rng, -1, 1, shape...), w: randValue(rng, 0.5, 2, 2)}
	got := d.eval(vals, dx, y)
	for k := range 2 {
		var s, sx float64
		for i, v := range got[0].Data {
			if (i/4)%2 == k { // [n, c, 2·2]: channel (i/4) mod 2
				s += v
				sx += v * got[1].Data[i] // y = x̂ without weight or bias
			}
		}
		require.InDelta(t, 0, s, 1e-9, "Σ dx over channel %d", k)
		require.InDelta(t, 0, sx, 1e-9, "Σ dx·x̂ over channel %d", k)
	}
}
