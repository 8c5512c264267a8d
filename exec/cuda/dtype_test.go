package cuda

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/exec"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/shapeinfer"
)

// A graph with float16 or bfloat16 values is refused before anything runs,
// with an error naming the op and the dtype (no GPU needed: Execute
// checks before it touches the device).
func TestHalfPrecisionRefused(t *testing.T) {
	x := lazy.Placeholder([]int{2, 3}, graph.Float32, 0)
	require.NoError(t, checkDTypes(x.Tanh().Graph().IR()))
	for _, dt := range []graph.DType{graph.BFloat16, graph.Float16} {
		x := lazy.Placeholder([]int{2, 3}, graph.Float32, 0)
		y := x.Cast(dt).Tanh()
		require.NoError(t, y.Err())
		err := checkDTypes(y.Graph().IR())
		require.ErrorIs(t, err, graph.ErrDType)
		var oe *graph.OpError
		require.ErrorAs(t, err, &oe)
		require.Equal(t, "cast", oe.Op)
		require.Contains(t, err.Error(), "cuda executor: "+dt.String()+" kernels not yet available")
	}
	y := lazy.Placeholder([]int{2, 3}, graph.Float32, 0).Cast(graph.BFloat16)
	info, err := shapeinfer.Analyze(y.Graph().IR(), y.ID())
	require.NoError(t, err)
	p, chunks, err := exec.Single(y.Graph().IR(), info, 2, Workspace, []int{y.ID()})
	require.NoError(t, err)
	_, err = (&Executor{}).Execute(t.Context(), p, chunks, ExecOptions{}) // a zero executor: no device touched
	require.ErrorIs(t, err, graph.ErrDType)
}
