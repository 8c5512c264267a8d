package optim_test

import (
	"errors"
	"math"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/half"
	"github.com/batchfit/batchfit/optim"
)

// offloadCase is three parameters, one larger than a shard and one of
// several shards, with bfloat16 gradients of every step drawn from seed.
type offloadCase struct {
	keys   []*int
	names  []string
	init   [][]float32
	grads  [][][]half.BF16 // [step][param]
	steps  int
	shapes []int
}

func newOffloadCase(seed uint64, steps int) *offloadCase {
	r := rand.New(rand.NewPCG(seed, 1))
	c := &offloadCase{names: []string{"embed.weight", "norm.weight", "mlp.weight"},
		shapes: []int{optim.OffloadShard + 4464, 300, 2*optim.OffloadShard + 5}, steps: steps}
	for i, n := range c.shapes {
		c.keys = append(c.keys, new(int))
		*c.keys[i] = i
		w := make([]float32, n)
		for j := range w {
			w[j] = float32(r.NormFloat64() * 0.5)
		}
		c.init = append(c.init, w)
	}
	for range steps {
		var gs [][]half.BF16
		for _, n := range c.shapes {
			g := make([]half.BF16, n)
			for j := range g {
				g[j] = half.BF16From(float32(r.NormFloat64() * 0.02))
			}
			gs = append(gs, g)
		}
		c.grads = append(c.grads, gs)
	}
	return c
}

// adamw is AdamW with weight decay, a no-decay group of its own rate and
// betas, clipping that binds, and a warmup schedule.
func (c *offloadCase) adamw() *optim.Adam {
	o := optim.NewAdamW(3e-3)
	o.WeightDecay = 0.1
	g := o.AddGroup("no_decay", c.keys[1])
	g.WeightDecay, g.LR, g.Beta2 = 0, 1e-2, 0.99
	o.Clip = optim.Clip{MaxNorm: 0.5}
	o.Schedule = optim.WarmupLinear{Warmup: 2, Total: 10}
	return o
}

// reference runs steps from..to of c with Step over float32 gradients
// equal to the widened bfloat16 ones.
func (c *offloadCase) reference(t *testing.T, o *optim.Adam, data [][]float32, from, to int) {
	t.Helper()
	for s := from; s < to; s++ {
		ps := make([]optim.Param, len(data))
		for i := range data {
			g := make([]float32, len(data[i]))
			half.DecodeBF16(g, c.grads[s][i])
			ps[i] = optim.Param{Key: c.keys[i], Name: c.names[i], Data: data[i], Grad: g}
		}
		require.NoError(t, o.Step(ps))
	}
}

// offloaded runs steps from..to with StepOffload on workers goroutines,
// the staging buffer being the gradient's, and checks each step's
// weights are the masters rounded to bfloat16.
func (c *offloadCase) offloaded(t *testing.T, o *optim.Adam, masters [][]float32, from, to, workers int) {
	t.Helper()
	for s := from; s < to; s++ {
		ps := make([]optim.OffloadParam, len(masters))
		for i := range masters {
			stage := slices.Clone(c.grads[s][i])
			ps[i] = optim.OffloadParam{Key: c.keys[i], Name: c.names[i], Master: masters[i], Grad: stage, Weight: stage}
		}
		require.NoError(t, o.StepOffload(ps, workers))
		for i, p := range ps {
			for j, w := range p.Weight {
				if w != half.BF16From(masters[i][j]) {
					t.Fatalf("step %d %s[%d]: weight %#x, master %g rounds to %#x", s, c.names[i], j, w, masters[i][j], half.BF16From(masters[i][j]))
				}
			}
		}
	}
}

func clone2(x [][]float32) [][]float32 {
	out := make([][]float32, len(x))
	for i := range x {
		out[i] = slices.Clone(x[i])
	}
	return out
}

// bitEqual compares two runs' parameters and state to the bit.
func bitEqual(t *testing.T, c *offloadCase, what string, a, b [][]float32, oa, ob *optim.Adam) {
	t.Helper()
	for i := range a {
		for j := range a[i] {
			if math.Float32bits(a[i][j]) != math.Float32bits(b[i][j]) {
				t.Fatalf("%s: %s[%d] = %.9g and %.9g", what, c.names[i], j, a[i][j], b[i][j])
			}
		}
		sa, sb := oa.State(c.keys[i]), ob.State(c.keys[i])
		require.Len(t, sb, len(sa), what)
		for k := range sa {
			for j := range sa[k] {
				if math.Float32bits(sa[k][j]) != math.Float32bits(sb[k][j]) {
					t.Fatalf("%s: %s state %d[%d] = %.9g and %.9g", what, c.names[i], k, j, sa[k][j], sb[k][j])
				}
			}
		}
		require.Equal(t, oa.ParamStep(c.keys[i]), ob.ParamStep(c.keys[i]), what)
	}
	require.Equal(t, oa.Steps(), ob.Steps(), what)
}

// Tolerance: none. Five AdamW steps with weight decay, a group of its own
// and binding clipping give, offloaded on 1, 3 or 8 workers, the masters
// and moments of Step over the same (widened) gradients to the bit; the
// clipped norm agrees with GradNorm's to 1e-12 relative (the shards' sums
// add in another order).
func TestStepOffloadMatchesStep(t *testing.T) {
	c := newOffloadCase(7, 5)
	ref := c.adamw()
	want := clone2(c.init)
	c.reference(t, ref, want, 0, c.steps)
	wantNorm, err := ref.LastGradNorm()
	require.NoError(t, err)
	require.Greater(t, wantNorm, 0.5, "the clip must bind for the test to mean anything")
	for _, workers := range []int{1, 3, 8} {
		o := c.adamw()
		got := clone2(c.init)
		c.offloaded(t, o, got, 0, c.steps, workers)
		bitEqual(t, c, "offloaded vs Step", want, got, ref, o)
		norm, err := o.LastGradNorm()
		require.NoError(t, err)
		require.InEpsilon(t, wantNorm, norm, 1e-12)
	}
	// The updates moved the weights: nothing trivially equal.
	require.NotEqual(t, c.init[0][0], want[0][0])
}

// Tolerance: none. The ∞-norm is a maximum, the same in any order.
func TestStepOffloadInfNorm(t *testing.T) {
	c := newOffloadCase(3, 3)
	mk := func() *optim.Adam {
		o := c.adamw()
		o.Clip = optim.Clip{MaxNorm: 0.01, NormType: math.Inf(1)}
		return o
	}
	ref, o := mk(), mk()
	want, got := clone2(c.init), clone2(c.init)
	c.reference(t, ref, want, 0, c.steps)
	c.offloaded(t, o, got, 0, c.steps, 4)
	bitEqual(t, c, "∞-norm", want, got, ref, o)
	a, _ := ref.LastGradNorm()
	b, _ := o.LastGradNorm()
	require.Equal(t, a, b)
}

// Tolerance: none. State saved after two offloaded steps (ParamStep,
// State, Steps) and restored into a fresh optimizer continues as the run
// that never stopped, and mixes with host steps: the state is one.
func TestStepOffloadResume(t *testing.T) {
	c := newOffloadCase(11, 5)
	whole := c.adamw()
	wm := clone2(c.init)
	c.offloaded(t, whole, wm, 0, 5, 2)

	first := c.adamw()
	m := clone2(c.init)
	c.offloaded(t, first, m, 0, 2, 2)
	resumed := c.adamw()
	for _, k := range first.Keys() {
		i := *k.(*int)
		require.NoError(t, resumed.SetState(k, len(m[i]), first.ParamStep(k), first.State(k)))
	}
	require.NoError(t, resumed.SetSteps(first.Steps()))
	c.offloaded(t, resumed, m, 2, 5, 3)
	bitEqual(t, c, "resumed", wm, m, whole, resumed)

	// A host step in the middle reads and writes the same state.
	mixed := c.adamw()
	mm := clone2(c.init)
	c.offloaded(t, mixed, mm, 0, 2, 2)
	c.reference(t, mixed, mm, 2, 3)
	c.offloaded(t, mixed, mm, 3, 5, 2)
	bitEqual(t, c, "mixed", wm, mm, whole, mixed)
}

// A step with mismatched sizes, a bad hyperparameter or a parameter that
// changed size is refused with ErrOptim and changes nothing.
func TestStepOffloadErrors(t *testing.T) {
	c := newOffloadCase(5, 2)
	o := c.adamw()
	m := clone2(c.init)
	c.offloaded(t, o, m, 0, 1, 2)
	before := clone2(m)
	steps := o.Steps()
	stage := slices.Clone(c.grads[1][0])
	bad := []optim.OffloadParam{{Key: c.keys[0], Name: "embed.weight", Master: m[0], Grad: stage[:10], Weight: stage[:10]}}
	err := o.StepOffload(bad, 2)
	require.ErrorIs(t, err, optim.ErrOptim)
	require.ErrorContains(t, err, "embed.weight")
	resized := []optim.OffloadParam{{Key: c.keys[0], Name: "embed.weight", Master: m[0][:10], Grad: stage[:10], Weight: stage[:10]}}
	require.ErrorIs(t, o.StepOffload(resized, 2), optim.ErrOptim)
	require.ErrorIs(t, o.StepOffload(nil, -1), optim.ErrOptim)
	o.Beta1 = 1
	ok := []optim.OffloadParam{{Key: c.keys[0], Name: "embed.weight", Master: m[0], Grad: stage, Weight: stage}}
	require.ErrorIs(t, o.StepOffload(ok, 2), optim.ErrOptim)
	require.Equal(t, steps, o.Steps())
	require.Equal(t, before, m)
}

func TestPartialStepError(t *testing.T) {
	cause := errors.New("copy failed")
	err := error(&optim.PartialStepError{Copied: 1, Total: 3, Stale: []string{"b", "c"}, Err: cause})
	require.ErrorIs(t, err, optim.ErrPartialStep)
	require.ErrorIs(t, err, cause)
	var pe *optim.PartialStepError
	require.ErrorAs(t, err, &pe)
	require.Equal(t, []string{"b", "c"}, pe.Stale)
}

func TestOffloadBytes(t *testing.T) {
	// Masters, m and v in float32, one bfloat16 staging buffer: 14 bytes
	// an element for Adam.
	require.Equal(t, int64(14*1000), optim.OffloadBytes(1000, 2))
}

// BenchmarkStepOffload is one AdamW step of 16M parameters on the host.
func BenchmarkStepOffload(b *testing.B) {
	const n = 1 << 24
	r := rand.New(rand.NewPCG(1, 2))
	m := make([]float32, n)
	g := make([]half.BF16, n)
	for i := range m {
		m[i] = float32(r.NormFloat64())
		g[i] = half.BF16From(float32(r.NormFloat64() * 0.01))
	}
	o := optim.NewAdamW(1e-3)
	o.Clip = optim.Clip{MaxNorm: 1}
	key := new(int)
	stage := make([]half.BF16, n)
	b.SetBytes(n * 14)
	for b.Loop() {
		copy(stage, g)
		if err := o.StepOffload([]optim.OffloadParam{{Key: key, Name: "w", Master: m, Grad: stage, Weight: stage}}, 0); err != nil {
			b.Fatal(err)
		}
	}
}

// Tolerance: none. State buffers the caller brings (an executor's pinned
// memory) hold the state from the step on: State returns them, a
// SetState in between is copied into them by the next step, and the run
// is the one with the optimizer's own buffers.
func TestStepOffloadCallerState(t *testing.T) {
	c := newOffloadCase(13, 4)
	own, theirs := c.adamw(), c.adamw()
	a, b := clone2(c.init), clone2(c.init)
	bufs := make([][][]float32, len(b))
	for i := range b {
		bufs[i] = [][]float32{make([]float32, len(b[i])), make([]float32, len(b[i]))}
		for k := range bufs[i] {
			for j := range bufs[i][k] {
				bufs[i][k][j] = 99 // garbage a first step must not read
			}
		}
	}
	step := func(o *optim.Adam, m [][]float32, s int, state bool) {
		ps := make([]optim.OffloadParam, len(m))
		for i := range m {
			stage := slices.Clone(c.grads[s][i])
			ps[i] = optim.OffloadParam{Key: c.keys[i], Name: c.names[i], Master: m[i], Grad: stage, Weight: stage}
			if state {
				ps[i].State = bufs[i]
			}
		}
		require.NoError(t, o.StepOffload(ps, 2))
	}
	for s := range 2 {
		step(own, a, s, false)
		step(theirs, b, s, true)
	}
	bitEqual(t, c, "caller's buffers", a, b, own, theirs)
	require.Same(t, &bufs[2][1][0], &theirs.State(c.keys[2])[1][0])
	// Restored state replaces the buffers until the next step copies it in.
	saved := clone2(theirs.State(c.keys[0]))
	require.NoError(t, theirs.SetState(c.keys[0], len(b[0]), theirs.ParamStep(c.keys[0]), saved))
	clear(bufs[0][0])
	for s := 2; s < 4; s++ {
		step(own, a, s, false)
		step(theirs, b, s, true)
	}
	bitEqual(t, c, "after SetState", a, b, own, theirs)
	require.Same(t, &bufs[0][0][0], &theirs.State(c.keys[0])[0][0])
	bad := []optim.OffloadParam{{Key: c.keys[0], Name: "embed.weight", Master: b[0], Grad: c.grads[0][0], Weight: slices.Clone(c.grads[0][0]),
		State: [][]float32{make([]float32, 3)}}}
	require.ErrorIs(t, theirs.StepOffload(bad, 1), optim.ErrOptim)
}

// Tolerance: none. StepOffloadEach calls done once for each parameter,
// on the caller's goroutine, after its update; a done that fails stops
// the calls but not the update, which ends as StepOffload's, and the
// error is a PartialStepError naming the parameters done did not take.
func TestStepOffloadEach(t *testing.T) {
	c := newOffloadCase(17, 1)
	ref := c.adamw()
	want := clone2(c.init)
	c.offloaded(t, ref, want, 0, 1, 3)

	o := c.adamw()
	got := clone2(c.init)
	ps := make([]optim.OffloadParam, len(got))
	for i := range got {
		stage := slices.Clone(c.grads[0][i])
		ps[i] = optim.OffloadParam{Key: c.keys[i], Name: c.names[i], Master: got[i], Grad: stage, Weight: stage}
	}
	calls := map[int]int{}
	cause := errors.New("device copy failed")
	err := o.StepOffloadEach(ps, 3, func(i int) error {
		calls[i]++ // the caller's goroutine: no lock needed
		for j, w := range ps[i].Weight {
			if w != half.BF16From(got[i][j]) {
				return errors.New("weights not final")
			}
		}
		if len(calls) == 2 {
			return cause
		}
		return nil
	})
	var pe *optim.PartialStepError
	require.ErrorAs(t, err, &pe)
	require.ErrorIs(t, err, cause)
	require.Equal(t, 1, pe.Copied)
	require.Len(t, pe.Stale, 2)
	require.Len(t, calls, 2)
	for _, n := range calls {
		require.Equal(t, 1, n)
	}
	bitEqual(t, c, "partial", want, got, ref, o)
}
