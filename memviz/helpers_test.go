package memviz_test

import (
	"context"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/exec/cpu"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/internal/testutil"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/optim"
	"github.com/batchfit/batchfit/planner"
)

const (
	nIn, nHidden, nOut = 8, 16, 4
	traceEntries       = 1 << 16
)

// newMLP is fc1 → relu → fc2 with PyTorch-style names ("fc1.weight", …).
func newMLP(seed uint64) nn.Module {
	return nn.NewSequentialNamed(
		nn.Child{Name: "fc1", Module: nn.NewLinear(nn.Seed(seed), nIn, nHidden, true)},
		nn.Child{Name: "act", Module: nn.ReLU{}},
		nn.Child{Name: "fc2", Module: nn.NewLinear(nn.Seed(seed+1), nHidden, nOut, true)},
	)
}

// tracedExecutor is a CPU executor whose allocator keeps a trace.
func tracedExecutor() (*cpu.Executor, *alloc.Allocator) {
	a := alloc.New(alloc.NewSimBackend(cpu.Unlimited), alloc.Options{TraceEntries: traceEntries})
	return cpu.NewOn(a), a
}

// batch draws inputs [b, in] and labels [b] from rng.
func batch(rng *rand.Rand, b, in, classes int) (*tensor.Dense, *tensor.Dense) {
	return testutil.UniformF32(rng, b, in), testutil.Classes(rng, classes, b)
}

// trainStep is one compiled training step of a model, as
// batchfit.Session.Step compiles it: outputs are the loss and the
// gradients, gradients are kept, parameters trained.
type trainStep struct {
	prog   *planner.Program
	params []*lazy.Tensor
}

func compileStep(t *testing.T, m nn.Module, x, y *tensor.Dense, slots int) trainStep {
	t.Helper()
	in := lazy.Wrap(x, 0)
	labels := in.Graph().Wrap(y, 0)
	loss := m.Forward(in).CrossEntropy(labels, graph.ReduceMean)
	params := nn.ParamTensors(m)
	p := testutil.StepProgram(t, cpu.Workspace, loss, params, slots)
	return trainStep{prog: p, params: params}
}

// stepResult is what running a step gave.
type stepResult struct {
	res *cpu.Result
	// During the optimizer update the gradients are live beside the
	// parameters and the optimizer state.
	inUpdate      alloc.Snapshot
	inUpdateStats alloc.Stats
}

// execute runs s for chunks on e, which accounts in a, with optimizer opt,
// parameters resident.
func execute(t *testing.T, e *cpu.Executor, a *alloc.Allocator, s trainStep, chunks []planner.Chunk, opt optim.Optimizer) stepResult {
	t.Helper()
	var r stepResult
	update := func(kept [][]float32) error {
		// e.Allocator would wait for Execute's lock: a is the same allocator.
		r.inUpdate, r.inUpdateStats = a.Snapshot(), a.Stats()
		ps := make([]optim.Param, len(s.params))
		for i, p := range s.params {
			ps[i] = optim.Param{Key: p.Value(), Name: p.Name(), Data: p.Value().(*tensor.Dense).Float32s(), Grad: kept[i]}
		}
		return opt.Step(ps)
	}
	res, err := e.Execute(context.Background(), s.prog, chunks, cpu.ExecOptions{Resident: true, Update: update, Timeline: true})
	require.NoError(t, err)
	r.res = res
	return r
}

// roundUp is the allocator's 512-byte rounding, worked out here so tests
// do not check alloc.RoundSize against itself.
func roundUp(n int64) int64 {
	if n == 0 {
		return 0
	}
	return (n + 511) / 512 * 512
}
