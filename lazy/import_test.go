package lazy_test

import (
	"context"
	"errors"
	"testing"

	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/exec/cpu"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
)

func mat(r, c int, data ...float32) *tensor.Dense {
	return tensor.New(tensor.WithShape(r, c), tensor.WithBacking(data))
}

func vec(data ...float32) *tensor.Dense {
	return tensor.New(tensor.WithShape(len(data)), tensor.WithBacking(data))
}

// A value computed from parameters alone (here an L2 penalty) joins the
// graph of the batched loss it is added to.
func TestParamOnlyValuesJoinTheBatchedGraph(t *testing.T) {
	w := lazy.Param(mat(2, 2, 1, 2, 3, 4), "w")
	penalty := w.Mul(w).Sum().MulScalar(0.5) // ½·Σw² = 15, in a graph of its own
	require.NoError(t, penalty.Err())
	x := lazy.Wrap(mat(3, 2, 1, 0, 0, 1, 1, 1), 0)
	data := x.Linear(w, nil).Sum() // Σ x·wᵀ = (1+3) + (2+4) + (3+7) = 20
	loss := data.Add(penalty)
	require.NoError(t, loss.Err())
	require.Same(t, x.Graph(), loss.Graph())

	// w was adopted once: the imported penalty reuses the node the linear made.
	n := 0
	for _, nd := range loss.Graph().IR().Nodes() {
		if nd.Name == "w" {
			n++
		}
	}
	require.Equal(t, 1, n)

	out, err := cpu.New().Run(context.Background(), loss.Graph().IR(), loss.ID())
	require.NoError(t, err)
	require.InDelta(t, 35, out[0].Data().(float32), 1e-5)

	// The gradient flows through both uses: d/dw of Σ x·wᵀ is Σ_rows x (per
	// output row of w), plus w from the penalty.
	g := lazy.Grad(loss, w)[0]
	require.NoError(t, g.Err())
	gv, err := cpu.New().Run(context.Background(), loss.Graph().IR(), g.ID())
	require.NoError(t, err)
	require.InDeltaSlice(t, []float32{2 + 1, 2 + 2, 2 + 3, 2 + 4}, gv[0].Data().([]float32), 1e-5)
}

func TestImportingTheSameValueTwiceCopiesItOnce(t *testing.T) {
	w := lazy.Param(vec(1, 2), "w")
	c := w.Exp()
	x := lazy.Wrap(mat(3, 2, 1, 2, 3, 4, 5, 6), 0)
	before := x.Add(c)
	n := before.Graph().IR().Len()
	after := before.Add(c)
	require.NoError(t, after.Err())
	require.Equal(t, n+1, after.Graph().IR().Len(), "only the new add is appended")
}

func TestTwoBatchedGraphsStillDoNotMix(t *testing.T) {
	a := lazy.Wrap(mat(2, 2, 1, 2, 3, 4), 0)
	b := lazy.Wrap(mat(2, 2, 1, 2, 3, 4), 0)
	w := lazy.Param(vec(1, 2), "w")
	for _, bad := range []*lazy.Tensor{a.Add(b), w.Exp().Add(a).Add(b), lazy.Concat(0, w.Reshape(1, 2), a, b)} {
		require.True(t, errors.Is(bad.Err(), graph.ErrMixedGraphs), "%v", bad.Err())
	}
}

// A failing op imports nothing into the batched graph.
func TestFailedOpImportsNothing(t *testing.T) {
	w := lazy.Param(vec(1, 2, 3), "w")
	c := w.Exp()
	x := lazy.Wrap(mat(2, 2, 1, 2, 3, 4), 0)
	n := x.Graph().IR().Len()
	require.True(t, errors.Is(x.Add(c).Err(), graph.ErrShape))
	require.Equal(t, n, x.Graph().IR().Len())
}
