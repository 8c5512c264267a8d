package nn_test

import (
	"runtime"
	"strconv"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/nn"
)

// doubler is a user's module: its ops are made in this file.
type doubler struct{ line int }

func (d *doubler) Forward(x *lazy.Tensor) *lazy.Tensor {
	_, _, d.line, _ = runtime.Caller(0)
	return x.Add(x) // the op on the line after runtime.Caller
}

func (*doubler) Params() []*nn.Param { return nil }

// Every node records where the user made it. Ops inside nn's own modules
// take the site recorded when the outermost of them was entered
// (lazy.Graph.PushInternalScope): the user's line calling Forward. Ops
// inside a user's module, even one held by nn.Sequential, still walk
// their own stack and point into that module.
func TestNodeSitesThroughModules(t *testing.T) {
	d := &doubler{}
	m := nn.NewSequential(nn.NewLinear(nn.Seed(1), 4, 4, true), d, nn.ReLU{})
	x := lazy.Placeholder([]int{2, 4}, graph.Float32, 0)
	_, _, line, _ := runtime.Caller(0)
	y := m.Forward(x) // the line after runtime.Caller
	require.NoError(t, y.Err())
	caller := "nn/site_test.go:" + strconv.Itoa(line+1)
	inside := "nn/site_test.go:" + strconv.Itoa(d.line+1)
	ir := y.Graph().IR()
	var sites []string
	for id := range ir.Len() {
		nd := ir.Node(id)
		switch nd.Op {
		case graph.OpInput, graph.OpParam, graph.OpConst:
			continue
		}
		sites = append(sites, nd.Op.String()+" "+nd.Site)
	}
	assert.Equal(t, []string{"linear " + caller, "add " + inside, "relu " + caller}, sites)
}
