package lazy_test

import (
	"runtime"
	"strconv"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
)

// Between EnterInternal and LeaveInternal, ops made outside further
// scopes take the site found at EnterInternal; a scope opened meanwhile
// hides it (ops in a user's module point at their own lines), and closing
// the scope shows it again.
func TestEnterInternalSites(t *testing.T) {
	x := lazy.Placeholder([]int{2, 3}, graph.Float32, 0)
	g := x.Graph()
	_, _, line, _ := runtime.Caller(0)
	g.EnterInternal()   // line+1
	a := x.Add(x)       // line+2: takes line+1
	g.PushScope("user") // line+3
	b := a.Add(a)       // line+4: its own
	g.PopScope()        // line+5
	c := b.Add(b)       // line+6: line+1 again
	g.LeaveInternal()   // line+7
	d := c.Add(c)       // line+8: its own
	at := func(n int) string { return "lazy/enter_test.go:" + strconv.Itoa(line+n) }
	ir := g.IR()
	for _, c := range []struct {
		t    *lazy.Tensor
		want string
	}{{a, at(1)}, {b, at(4)}, {c, at(1)}, {d, at(8)}} {
		require.NoError(t, c.t.Err())
		require.Equal(t, c.want, ir.Node(c.t.ID()).Site)
	}
}
