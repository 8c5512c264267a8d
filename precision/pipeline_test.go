package precision_test

import (
	"slices"

	"github.com/batchfit/batchfit/compile"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/precision"
)

// disabled are the pipeline's passes that the tests' steps (trainStep) leave
// out, set by the switches below to compare a step with and without one.
var disabled []string

// trainStep builds a training step through the pipeline (compile.Train),
// without the passes disabled names.
func trainStep(g *graph.Graph, loss int, params []int, o compile.Options) (*precision.Step, error) {
	o.Disable = append(slices.Clone(o.Disable), disabled...)
	st, err := compile.Train(g, loss, params, o)
	if err != nil {
		return nil, err
	}
	return &st.Step, nil
}

// passSwitch turns the pipeline's pass name on or off for trainStep, and
// returns whether it was on.
func passSwitch(name string) func(on bool) bool {
	return func(on bool) bool {
		was := !slices.Contains(disabled, name)
		disabled = slices.DeleteFunc(disabled, func(n string) bool { return n == name })
		if !on {
			disabled = append(disabled, name)
		}
		return was
	}
}

var (
	setFoldCasts         = passSwitch("fold-casts")               // folding widening casts into matmuls
	setFuseGelu          = passSwitch("fuse-gelu-grad")           // the gelu_grad fusion
	setFuseLayerNormGrad = passSwitch("fuse-layer-norm-grad-add") // the layer_norm_grad_x + add fusion
)
