package planner

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/shapeinfer"
)

// The plan cache finds plans by signature but serves one only to a
// program that replays as the one it was made for: a rebuilt program of
// the same graph, or a Rebind of the same one, gets the plan; a program
// whose signature collides with it (forged here) is planned anew.
func TestCacheVerifiesSignatureHits(t *testing.T) {
	build := func(width int) *Program {
		x := lazy.Placeholder([]int{64, width}, graph.Float32, 0)
		w := lazy.ParamSpec([]int{width}, graph.Float32, "w")
		loss := x.Mul(w).Tanh().Sum()
		g := loss.Graph().IR()
		info, err := shapeinfer.Analyze(g, loss.ID())
		require.NoError(t, err)
		p, err := Compile(g, info, []int{loss.ID()}, CompileOptions{})
		require.NoError(t, err)
		return p
	}
	var c Cache
	o := Options{Budget: 1 << 30}
	a := build(1 << 14)
	pa, err := c.Plan(a, o)
	require.NoError(t, err)
	again, err := c.Plan(build(1<<14), o)
	require.NoError(t, err)
	require.Same(t, pa, again, "a rebuilt program of the same graph")
	again, err = c.Plan(a.Rebind(build(1<<14).Graph), o)
	require.NoError(t, err)
	require.Same(t, pa, again, "a Rebind of the same program")
	require.Equal(t, 2, c.Hits())

	b := build(1 << 10)
	b.sig = a.Signature() // a collision
	pb, err := c.Plan(b, o)
	require.NoError(t, err)
	require.NotSame(t, pa, pb)
	want, err := Make(b, o)
	require.NoError(t, err)
	require.Equal(t, want.PeakReserved, pb.PeakReserved)
	require.Less(t, pb.PeakReserved, pa.PeakReserved)
	require.Equal(t, 2, c.Hits())
}
