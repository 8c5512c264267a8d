package recompute_test

import (
	"bytes"
	"fmt"
	"math"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/models"
	"github.com/batchfit/batchfit/planner"
	"github.com/batchfit/batchfit/recompute"
)

func TestCandidatesGPT2(t *testing.T) {
	st := gptStep(t, models.GPT2Small(), 2, 1024)
	blocks := recompute.Blocks(st.Graph, st.Boundary)
	require.Len(t, blocks, 12)
	assert.Equal(t, "h.0", blocks[0].Scope)
	var names []string
	for _, c := range recompute.Candidates(st.Graph, st.Boundary) {
		names = append(names, c.Name)
	}
	assert.Equal(t, []string{"none", "selective", "blocks 6/12", "blocks 9/12", "blocks 12/12", "blocks 12/12+selective"}, names)
	res, err := recompute.Search(st, recompute.Options{Planner: planner.Options{Budget: 8 * gib}, PlanAll: true})
	require.NoError(t, err)
	for _, c := range res.All {
		t.Logf("%-24s copies %4d chunks %v peak %v time %.3f ms err %v", c.Name, c.Copies, splitOf(c), peakOf(c), c.Time*1e3, c.Err)
	}
}

func splitOf(c *recompute.Choice) string {
	if c.Plan == nil {
		return "-"
	}
	return c.Plan.Split.String()
}

func peakOf(c *recompute.Choice) string {
	if c.Plan == nil {
		return "-"
	}
	return fmt.Sprint(c.Plan.PeakReserved >> 20)
}

// More budget never yields a slower plan, and no plan's peak exceeds its
// budget: a six-layer GPT's training step (AdamW) planned over a sweep of
// budgets from where nothing fits to where the plain step runs whole.
// Somewhere in the sweep recompute must be chosen, and somewhere only
// recompute fits.
func TestBudgetSweepMonotone(t *testing.T) {
	st := gptStep(t, models.GPTConfig{Vocab: 512, Context: 256, Layers: 6, Heads: 4, Dim: 128}, 8, 256)
	var (
		last     = math.Inf(1)
		lastPeak int64
		kinds    = map[string]bool{}
		onlyRe   bool
	)
	for b := int64(8 << 20); b <= 1<<30; b += 8 << 20 {
		res, err := recompute.Search(st, recompute.Options{Planner: planner.Options{Budget: b}})
		require.NoError(t, err)
		if res.Best == nil {
			require.True(t, math.IsInf(last, 1), "budget %d: nothing fits, but a smaller budget had a plan", b)
			continue
		}
		best := res.Best
		require.LessOrEqual(t, best.Plan.PeakReserved, b, "budget %d", b)
		require.LessOrEqual(t, best.Time, last, "budget %d MiB: %s in %s is slower than the plan at a smaller budget", b>>20, best.Name, best.Plan.Split)
		if best.Time == last {
			require.LessOrEqual(t, best.Plan.PeakReserved, max(lastPeak, best.Plan.PeakReserved))
		}
		last, lastPeak = best.Time, best.Plan.PeakReserved
		kinds[best.Name] = true
		if best.Name != "none" && res.Plain.Plan == nil {
			onlyRe = true
		}
		if best.Name == "none" && best.Plan.Split.K == 1 {
			break
		}
	}
	t.Logf("strategies chosen: %v", kinds)
	require.True(t, kinds["none"])
	require.Greater(t, len(kinds), 1, "recompute was never chosen")
	require.True(t, onlyRe, "no budget where only recompute fits")
}

func TestProfileFiles(t *testing.T) {
	var buf bytes.Buffer
	require.NoError(t, recompute.WriteProfile(&buf, recompute.H100Profile()))
	p, err := recompute.ReadProfile(&buf)
	require.NoError(t, err)
	assert.Equal(t, recompute.H100Profile(), p)
	for name, in := range map[string]string{
		"unknown field": `{"name":"x","matmul_flops":1,"vector_flops":1,"bandwidth":1,"warp":3}`,
		"negative":      `{"name":"x","matmul_flops":-1,"vector_flops":1,"bandwidth":1}`,
		"zero":          `{"name":"x","matmul_flops":1,"vector_flops":1}`,
		"trailing":      `{"name":"x","matmul_flops":1,"vector_flops":1,"bandwidth":1} {}`,
		"not json":      `flops=1`,
		"too large":     `{"name":"` + strings.Repeat("x", recompute.MaxProfileBytes) + `"}`,
		"launch":        `{"name":"x","matmul_flops":1,"vector_flops":1,"bandwidth":1,"launch":5}`,
	} {
		_, err := recompute.ReadProfile(strings.NewReader(in))
		assert.ErrorIs(t, err, recompute.ErrProfile, name)
	}
	_, err = recompute.LoadProfile("h100")
	assert.NoError(t, err)
	_, err = recompute.LoadProfile("/nonexistent/profile.json")
	assert.ErrorIs(t, err, recompute.ErrProfile)
}

// The cost model: a GEMM is compute bound, an elementwise op bandwidth
// bound, and a step's time never grows as its chunks merge.
func TestCostMonotoneInChunks(t *testing.T) {
	st := gptStep(t, models.GPTConfig{Vocab: 64, Context: 32, Layers: 2, Heads: 2, Dim: 32}, 12, 32)
	c, err := recompute.Build(st, "none", nil)
	require.NoError(t, err)
	cost := recompute.NewCost(c.Program, recompute.H100Profile(), false)
	prev := math.Inf(1)
	for b := 1; b <= 12; b++ {
		s := cost.Step(planner.SplitOf(12, b))
		require.LessOrEqual(t, s, prev, "chunk %d", b)
		prev = s
	}
	require.Positive(t, cost.FLOPs)
}

// Fused attention is priced by its products, not as an elementwise op: a
// causal step over q, k, v [B, H, T, d] costs four and a half [T, d]·[d, T]
// products per head (forward two, dq three, dk|dv four, causal halving all
// nine; the log-sum-exp the backward pass needs comes out of the forward
// pass, its companion), plus elementwise work of order B·H·T·d.
func TestCostOfFusedAttention(t *testing.T) {
	const b, h, tt, d = 2, 2, 256, 64
	x := lazy.Placeholder([]int{b, 3 * h, tt, d}, graph.Float32, 0)
	w := lazy.ParamSpec([]int{d}, graph.Float32, "w")
	y := x.Mul(w)
	out := y.Slice(1, 0, h).Attention(y.Slice(1, h, 2*h), y.Slice(1, 2*h, 3*h), lazy.AttentionOptions{Causal: true})
	st := stepOf(t, out.Sum(), []*lazy.Tensor{w}, 0, nil)
	c, err := recompute.Build(st, "none", nil)
	require.NoError(t, err)
	cost := recompute.NewCost(c.Program, recompute.H100Profile(), false)
	products := 4.5 * 2 * float64(b*h*tt*tt*d)
	assert.GreaterOrEqual(t, cost.FLOPs, products)
	assert.Less(t, cost.FLOPs, 1.1*products)
}

// A profile's figures must be plausible for a device: rates from 1e6 to
// 1e18 flop/s, bandwidths from 1e6 to 1e15 B/s, a launch from 1 ns to 1 s.
// Rates of 1e-300 (a step time past any Duration) or 1e300 are ErrProfile,
// from ReadProfile and Validate; the built-in profiles pass.
func TestProfileBounds(t *testing.T) {
	for name, p := range recompute.Profiles() {
		require.NoError(t, p.Validate(), name)
	}
	tiny := `{"name":"x","matmul_flops":1e-300,"vector_flops":1e-300,"bandwidth":1e-300,"launch":1e-300}`
	_, err := recompute.ReadProfile(strings.NewReader(tiny))
	require.ErrorIs(t, err, recompute.ErrProfile)
	for _, mod := range []func(*recompute.Profile){
		func(p *recompute.Profile) { p.MatMulFLOPS = 1e-300 },
		func(p *recompute.Profile) { p.MatMulFLOPS = 1e300 },
		func(p *recompute.Profile) { p.TF32FLOPS = 1 },
		func(p *recompute.Profile) { p.HalfFLOPS = 1e19 },
		func(p *recompute.Profile) { p.VectorFLOPS = 5e5 },
		func(p *recompute.Profile) { p.Bandwidth = 1e16 },
		func(p *recompute.Profile) { p.Bandwidth = 1 },
		func(p *recompute.Profile) { p.HostBandwidth = 1e-300 },
		func(p *recompute.Profile) { p.Launch = 1e-12 },
		func(p *recompute.Profile) { p.Launch = 2 },
	} {
		p := recompute.H100Profile()
		mod(&p)
		require.ErrorIs(t, p.Validate(), recompute.ErrProfile, "%+v", p)
	}
}
