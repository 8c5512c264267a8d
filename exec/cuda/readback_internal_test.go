package cuda

import (
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/compile"
	"github.com/batchfit/batchfit/exec"
	"github.com/batchfit/batchfit/exec/cpu"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/planner"
	"github.com/batchfit/batchfit/precision"
	"github.com/batchfit/batchfit/shapeinfer"
)

// readbackStep compiles an MLP's training step, its loss first among the
// outputs, then extra (forward nodes, by the builder) and the gradients,
// kept. It returns the program and the loss's node in it.
func readbackStep(t *testing.T, extra func(h, loss *lazy.Tensor) []*lazy.Tensor) (*planner.Program, []int) {
	t.Helper()
	rng := rand.New(rand.NewPCG(1, 2))
	randn := func(shape ...int) *tensor.Dense {
		v := make([]float32, graph.Numel(shape))
		for i := range v {
			v[i] = float32(rng.NormFloat64())
		}
		return tensor.New(tensor.WithShape(shape...), tensor.WithBacking(v))
	}
	x := lazy.Wrap(randn(8, 5), 0)
	y := x.Graph().Wrap(tensor.New(tensor.WithShape(8), tensor.WithBacking([]int64{0, 1, 2, 0, 1, 2, 0, 1})), 0)
	w1, w2 := lazy.Param(randn(5, 6), "w1"), lazy.Param(randn(6, 3), "w2")
	h := x.MatMul(w1).Relu()
	loss := h.MatMul(w2).CrossEntropy(y, graph.ReduceMean)
	more := extra(h, loss)
	require.NoError(t, loss.Err())
	wrt, err := lazy.ParamIDs(loss, w1, w2)
	require.NoError(t, err)
	st, err := compile.Train(loss.Graph().IR(), loss.ID(), wrt, compile.Options{Policy: precision.FP32})
	require.NoError(t, err)
	outs := []int{st.Loss}
	for _, m := range more {
		require.NoError(t, m.Err())
		outs = append(outs, st.IDs[m.ID()])
	}
	outs = append(outs, st.Grads...)
	info, err := shapeinfer.Analyze(st.Graph, outs...)
	require.NoError(t, err)
	p, err := planner.Compile(st.Graph, info, outs, planner.CompileOptions{Kept: st.Grads, Trained: st.Params,
		StateSlots: 2, Workspace: cpu.Workspace})
	require.NoError(t, err)
	return p, outs[:1+len(more)]
}

// runsOf lists the nodes of p's chunk runs, in order, as Replay calls
// Run.
func runsOf(p *planner.Program) []int {
	var runs []int
	for _, st := range p.Steps {
		if st.Kind == planner.StepRun {
			runs = append(runs, st.Node)
		}
	}
	return runs
}

// The read point is the first run after which every host output's value
// is final: every node writing its buffer has run, none after it, and
// the backward pass is still to come.
func TestReadPlanAfterLastHostOutput(t *testing.T) {
	for name, extra := range map[string]func(h, loss *lazy.Tensor) []*lazy.Tensor{
		"loss":            func(h, loss *lazy.Tensor) []*lazy.Tensor { return nil },
		"loss reshaped":   func(h, loss *lazy.Tensor) []*lazy.Tensor { return []*lazy.Tensor{loss.Reshape(1)} },
		"hidden and loss": func(h, loss *lazy.Tensor) []*lazy.Tensor { return []*lazy.Tensor{h.Mean(0)} },
	} {
		t.Run(name, func(t *testing.T) {
			p, host := readbackStep(t, extra)
			keptOf, err := exec.KeptOutputs(p)
			require.NoError(t, err)
			rp := planReads(p, keptOf)
			runs := runsOf(p)
			require.Positive(t, rp.after, "the host outputs are read early")
			require.Less(t, rp.after, len(runs), "runs follow the read point")
			writes := func(id, bi int) bool { return p.OutputBuf[id] == bi }
			for _, o := range host {
				bi := p.OutputBuf[o]
				require.GreaterOrEqual(t, bi, 0)
				assert.True(t, slices.ContainsFunc(runs[:rp.after], func(id int) bool { return writes(id, bi) }), "node %d is written before the read", o)
				assert.False(t, slices.ContainsFunc(runs[rp.after:], func(id int) bool { return writes(id, bi) }), "node %d is not written after the read", o)
			}
			// The read point is the last host output's write itself.
			last := p.OutputBuf[runs[rp.after-1]]
			assert.True(t, slices.ContainsFunc(host, func(o int) bool { return p.OutputBuf[o] == last }))
			// Every gradient is made after it.
			for _, k := range p.Kept {
				assert.Greater(t, slices.Index(runs, k), rp.after-1, "gradient %d", k)
			}
		})
	}
}

// A host output no chunk run writes (a parameter's value) is read at
// ChunkDone, and so are all the others with it.
func TestReadPlanPersistentOutputReadsAtChunkDone(t *testing.T) {
	p, _ := readbackStep(t, func(h, loss *lazy.Tensor) []*lazy.Tensor { return nil })
	outs := append([]int{p.Outputs[0], p.Trained[0]}, p.Kept...)
	info, err := shapeinfer.Analyze(p.Graph, outs...)
	require.NoError(t, err)
	q, err := planner.Compile(p.Graph, info, outs, planner.CompileOptions{Kept: p.Kept, Trained: p.Trained,
		StateSlots: 2, Workspace: cpu.Workspace})
	require.NoError(t, err)
	keptOf, err := exec.KeptOutputs(q)
	require.NoError(t, err)
	require.Equal(t, -1, keptOf[1], "the parameter is a host output")
	assert.Zero(t, planReads(q, keptOf).after)
	// Without host outputs there is nothing to read early.
	assert.Zero(t, planReads(p, slices.Repeat([]int{0}, len(p.Outputs))).after)
}

// The executor's cache of read plans answers the same plan for a program
// and starts again when it is full.
func TestReadPlansCache(t *testing.T) {
	p, _ := readbackStep(t, func(h, loss *lazy.Tensor) []*lazy.Tensor { return nil })
	keptOf, err := exec.KeptOutputs(p)
	require.NoError(t, err)
	var rs readPlans
	a := rs.of(p, keptOf)
	assert.Same(t, a, rs.of(p, keptOf))
	for range readPlansMax {
		rs.of(&planner.Program{}, nil)
	}
	assert.LessOrEqual(t, len(rs), readPlansMax)
}
