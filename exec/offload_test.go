package exec_test

import (
	"errors"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/exec"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/half"
	"github.com/batchfit/batchfit/optim"
	"github.com/batchfit/batchfit/planner"
)

// offloadProgram is a program as OffloadHost.Step reads it: two bfloat16
// trained parameters of n and 3 elements and their bfloat16 gradients.
func offloadProgram(t *testing.T, n int) (*planner.Program, []*tensor.Dense) {
	t.Helper()
	g := graph.New()
	r := rand.New(rand.NewPCG(1, 2))
	var hosts []*tensor.Dense
	var trained, kept []int
	for i, size := range []int{n, 3} {
		w := make([]float32, size)
		for j := range w {
			w[j] = float32(r.NormFloat64())
		}
		d := tensor.New(tensor.WithShape(size), tensor.WithBacking(w))
		hosts = append(hosts, d)
		id, err := g.Append(graph.Node{Op: graph.OpParam, Name: []string{"a", "b"}[i], Type: graph.Type{DType: graph.BFloat16, Shape: []int{size}}, Value: d})
		require.NoError(t, err)
		trained = append(trained, id)
	}
	for _, size := range []int{n, 3} {
		id, err := g.Append(graph.Node{Op: graph.OpParam, Name: "grad", Type: graph.Type{DType: graph.BFloat16, Shape: []int{size}}})
		require.NoError(t, err)
		kept = append(kept, id)
	}
	return &planner.Program{Graph: g, Trained: trained, Kept: kept, Offloaded: true}, hosts
}

// A step whose second weight cannot be copied back returns a
// PartialStepError naming it; the masters, the state and the step count
// are the new step's, and the host tensors get the masters on SyncHost.
// The host memory is 14 bytes an element; Release leaves the optimizer
// copies of its state.
func TestOffloadHostPartialStep(t *testing.T) {
	p, hosts := offloadProgram(t, 1000)
	source := func(id int) tensor.Tensor { return p.Graph.Node(id).Value }
	was := [][]float32{slices.Clone(hosts[0].Float32s()), slices.Clone(hosts[1].Float32s())}
	grads := [][]half.BF16{make([]half.BF16, 1000), make([]half.BF16, 3)}
	for i := range grads {
		for j := range grads[i] {
			grads[i][j] = half.BF16From(float32(j%7) - 3)
		}
	}
	var h exec.OffloadHost
	opt := optim.NewAdamW(1e-2)
	device := [][]half.BF16{make([]half.BF16, 1000), make([]half.BF16, 3)}
	down := func(i int, dst []half.BF16) error { copy(dst, grads[i]); return nil }
	cause := errors.New("copy failed")
	up := func(i int, src []half.BF16) error {
		if i == 1 {
			return cause
		}
		copy(device[i], src)
		return nil
	}
	err := h.Step(p, source, opt, down, up)
	var pe *optim.PartialStepError
	require.ErrorAs(t, err, &pe)
	require.ErrorIs(t, err, optim.ErrPartialStep)
	require.ErrorIs(t, err, cause)
	// Weights go back as updates finish, in any order: "b" failed, "a"
	// went back or not.
	require.Contains(t, pe.Stale, "b")
	require.Equal(t, 2, pe.Copied+len(pe.Stale))
	require.Equal(t, 2, pe.Total)
	require.Equal(t, 1, opt.Steps())
	require.Equal(t, int64(14*1003), h.Pinned())
	require.Equal(t, was, [][]float32{hosts[0].Float32s(), hosts[1].Float32s()}, "host tensors before SyncHost")
	h.SyncHost()
	for i := range hosts {
		require.NotEqual(t, was[i], hosts[i].Float32s(), "parameter %d updated", i)
	}
	if pe.Copied == 1 {
		for j, x := range hosts[0].Float32s() {
			require.Equal(t, half.BF16From(x), device[0][j])
		}
	}
	st := opt.State(hosts[0])
	require.Len(t, st, 2)
	m := slices.Clone(st[0])
	require.NoError(t, h.Release())
	require.Zero(t, h.Pinned())
	require.Equal(t, m, opt.State(hosts[0])[0], "the optimizer keeps its state")

	// Another optimizer than Adam is refused before anything changes.
	err = h.Step(p, source, optim.NewSGD(0.1, 0), down, up)
	require.ErrorIs(t, err, graph.ErrAttr)
	require.Zero(t, h.Pinned())
	// A failed gradient copy changes nothing.
	before := slices.Clone(hosts[0].Float32s())
	err = h.Step(p, source, opt, func(int, []half.BF16) error { return cause }, up)
	require.ErrorIs(t, err, cause)
	require.Equal(t, 1, opt.Steps())
	h.SyncHost()
	require.Equal(t, before, hosts[0].Float32s())
}

// CheckOffload refuses what an offloaded run cannot take.
func TestCheckOffload(t *testing.T) {
	p, _ := offloadProgram(t, 4)
	adam := optim.NewAdamW(1e-3)
	require.NoError(t, exec.CheckOffload(p, exec.Options{Offload: true, Resident: true, Optimizer: adam}))
	for _, o := range []exec.Options{
		{Offload: true, Optimizer: adam},
		{Offload: true, Resident: true, Optimizer: adam, LossScale: 2},
		{Offload: true, Resident: true, Optimizer: optim.NewSGD(0.1, 0)},
		{Resident: true, Optimizer: adam},
	} {
		require.ErrorIs(t, exec.CheckOffload(p, o), graph.ErrAttr, "%+v", o)
	}
	p.Offloaded = false
	require.ErrorIs(t, exec.CheckOffload(p, exec.Options{Offload: true, Resident: true, Optimizer: adam}), graph.ErrAttr)
}
