package batchfit_test

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/exec"
	"github.com/batchfit/batchfit/exec/cpu"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/internal/testutil"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/optim"
	"github.com/batchfit/batchfit/planner"
	"github.com/batchfit/batchfit/recompute"
	"github.com/batchfit/batchfit/shapeinfer"
)

// Per-chunk batch statistics (nn.BatchNorm2d.PerChunkStats): a
// training step split into chunks is gradient accumulation over
// those chunks as micro-batches. The tests build that reference
// independently, one graph per micro-batch, and sum.

// bnConvNet is conv → batch norm → relu → conv → batch norm → relu →
// global average pool → linear, over 3×8×8 images: the second batch norm's
// input depends on the per-chunk normalisation of the first.
type bnConvNet struct {
	conv1, conv2 *nn.Conv2d
	bn1, bn2     *nn.BatchNorm2d
	fc           *nn.Linear
}

const bnNetClasses, bnChannels = 3, 8

// newBNConvNet makes the net from a fixed seed: every call, the same
// parameters and fresh running statistics.
func newBNConvNet(perChunk bool) *bnConvNet {
	const c = bnChannels
	opt := nn.Seed(41)
	opt.PerChunkStats = perChunk
	pad := lazy.ConvOptions{Padding: [2]int{1, 1}}
	return &bnConvNet{
		conv1: nn.NewConv2d(opt, 3, c, [2]int{3, 3}, false, pad), bn1: nn.NewBatchNorm2d(opt, c, 1e-5, 0.1),
		conv2: nn.NewConv2d(opt, c, c, [2]int{3, 3}, false, pad), bn2: nn.NewBatchNorm2d(opt, c, 1e-5, 0.1),
		fc: nn.NewLinear(opt, c, bnNetClasses, true),
	}
}

// forward returns the logits and the inputs of the two batch norms. The
// conv, batch norm, relu stages run as blocks "blocks.0" and "blocks.1",
// which activation recomputation can checkpoint.
func (m *bnConvNet) forward(x *lazy.Tensor) (logits *lazy.Tensor, bnIn [2]*lazy.Tensor) {
	g := x.Graph()
	h := x
	for i, st := range []struct {
		conv *nn.Conv2d
		bn   *nn.BatchNorm2d
	}{{m.conv1, m.bn1}, {m.conv2, m.bn2}} {
		g.PushScope(fmt.Sprintf("blocks.%d", i))
		bnIn[i] = st.conv.Forward(h)
		h = st.bn.Forward(bnIn[i]).Relu()
		g.PopScope()
	}
	return m.fc.Forward(h.Mean(2, 3)), bnIn
}

func (m *bnConvNet) params() []*lazy.Tensor {
	var ps []*lazy.Tensor
	for _, p := range slices.Concat(m.conv1.Params(), m.bn1.Params(), m.conv2.Params(), m.bn2.Params(), m.fc.Params()) {
		ps = append(ps, p.Tensor())
	}
	return ps
}

func (m *bnConvNet) setTraining(on bool) { m.bn1.Training, m.bn2.Training = on, on }

// bnData is a batch of n images of 3×size×size and their labels.
type bnData struct {
	n, size int
	x       []float32
	labels  []int64
}

func (d bnData) image() int { return 3 * d.size * d.size }

func newBNData(rng *rand.Rand, n, size int) bnData {
	d := bnData{n: n, size: size, x: make([]float32, n*3*size*size), labels: make([]int64, n)}
	// Off-centre, each image with an offset of its own: the statistics
	// matter, and differ from chunk to chunk.
	for i := range n {
		off := 0.5 + 2*rng.NormFloat64()
		for j := range d.image() {
			d.x[i*d.image()+j] = float32(off + rng.NormFloat64())
		}
	}
	for i := range d.labels {
		d.labels[i] = int64(rng.IntN(bnNetClasses))
	}
	return d
}

// rows is samples [start, start+size) of d.
func (d bnData) rows(start, size int) (x, y *tensor.Dense) {
	im := d.image()
	x = tensor.New(tensor.WithShape(size, 3, d.size, d.size), tensor.WithBacking(slices.Clone(d.x[start*im:(start+size)*im])))
	y = tensor.New(tensor.WithShape(size), tensor.WithBacking(slices.Clone(d.labels[start:start+size])))
	return x, y
}

// bnLoss builds m's loss over samples [start, start+size) of d, a mean over
// the n samples of the whole batch, in one of two forms: the summed cross
// entropy times 1/n ("sum"), whose chunk partials a micro-batch graph
// computes with the very same float32 operations, or the mean-reduced
// cross entropy scaled by size/n ("mean", the usual PyTorch form of
// gradient accumulation; for the whole batch, plain ReduceMean).
func bnLoss(m *bnConvNet, d bnData, start, size int, form string) (loss *lazy.Tensor, bnIn [2]*lazy.Tensor) {
	x, y := d.rows(start, size)
	xs := lazy.Wrap(x, 0)
	logits, bnIn := m.forward(xs)
	ys := xs.Graph().Wrap(y, 0)
	switch {
	case form == "sum":
		return logits.CrossEntropy(ys, graph.ReduceSum).MulScalar(1 / float64(d.n)), bnIn
	case size == d.n:
		return logits.CrossEntropy(ys, graph.ReduceMean), bnIn
	}
	return logits.CrossEntropy(ys, graph.ReduceMean).MulScalar(float64(size) / float64(d.n)), bnIn
}

// accumulated is the gradient-accumulation reference: each chunk of split
// as a graph of its own (its micro-batch), run in one piece on the CPU
// executor, its loss and gradients summed in float32 in chunk order, and
// the inputs of both batch norms, gathered over the micro-batches.
type accumulated struct {
	loss  float32
	grads [][]float32
	bnIn  [2][][]float32 // per batch norm, per micro-batch: its input [size, C, H, W]
}

func accumulate(t *testing.T, d bnData, chunks []planner.Chunk, form string) accumulated {
	return accumulateFrom(t, nil, d, chunks, form)
}

// accumulateFrom is accumulate with the parameters of from (nil: the
// seed's).
func accumulateFrom(t *testing.T, from *bnConvNet, d bnData, chunks []planner.Chunk, form string) accumulated {
	t.Helper()
	var r accumulated
	for _, c := range chunks {
		m := newBNConvNet(true)
		if from != nil {
			for i, p := range m.params() {
				copy(f32sOf(p.Value()), f32sOf(from.params()[i].Value()))
			}
		}
		loss, bnIn := bnLoss(m, d, c.Start, c.Size, form)
		grads := lazy.Grad(loss, m.params()...)
		outs := []int{loss.ID(), bnIn[0].ID(), bnIn[1].ID()}
		for _, g := range grads {
			require.NoError(t, g.Err())
			outs = append(outs, g.ID())
		}
		vals, err := cpu.New().Run(context.Background(), loss.Graph().IR(), outs...)
		require.NoError(t, err)
		l, err := scalarValue(vals[0])
		require.NoError(t, err)
		r.loss += l
		for b := range 2 {
			r.bnIn[b] = append(r.bnIn[b], vals[1+b].Float32s())
		}
		if r.grads == nil {
			r.grads = make([][]float32, len(grads))
			for i := range grads {
				r.grads[i] = make([]float32, len(vals[3+i].Float32s()))
			}
		}
		for i := range grads {
			for j, v := range vals[3+i].Float32s() {
				r.grads[i][j] += v
			}
		}
	}
	return r
}

func scalarValue(d *tensor.Dense) (float32, error) {
	switch v := d.Data().(type) {
	case float32:
		return v, nil
	case []float32:
		if len(v) == 1 {
			return v[0], nil
		}
	}
	return 0, fmt.Errorf("not a scalar: %v", d.Shape())
}

// batchStats is the mean and unbiased variance per channel of a batch
// norm's inputs over every micro-batch together, in float64: each part is
// [size, c, hw] row-major.
func batchStats(parts [][]float32, c, hw int) (mean, variance []float64) {
	mean, variance = make([]float64, c), make([]float64, c)
	count := 0.0
	each := func(f func(k int, v float64)) {
		for _, p := range parts {
			for i := range len(p) / (c * hw) {
				for k := range c {
					for _, v := range p[(i*c+k)*hw : (i*c+k+1)*hw] {
						f(k, float64(v))
					}
				}
			}
		}
	}
	each(func(k int, v float64) { mean[k] += v; count++ })
	count /= float64(c)
	for k := range c {
		mean[k] /= count
	}
	each(func(k int, v float64) { variance[k] += (v - mean[k]) * (v - mean[k]) })
	for k := range c {
		variance[k] /= count - 1
	}
	return mean, variance
}

// runningAfter is the documented update applied once to running
// statistics (rm, rv) with batch statistics (bm, bv): in float32, as
// UpdateRunning folds float32 batch statistics in.
func runningAfter(momentum float32, rm, rv []float32, bm, bv []float64) (mean, variance []float32) {
	mean, variance = make([]float32, len(rm)), make([]float32, len(rv))
	for k := range rm {
		mean[k] = (1-momentum)*rm[k] + momentum*float32(bm[k])
		variance[k] = (1-momentum)*rv[k] + momentum*float32(bv[k])
	}
	return mean, variance
}

// close32 requires |got − want| ≤ atol + rtol·|want| element by element.
func close32(t *testing.T, want, got []float32, rtol, atol float64, what string) {
	t.Helper()
	require.Len(t, got, len(want), what)
	for i := range want {
		d := math.Abs(float64(got[i]) - float64(want[i]))
		require.LessOrEqual(t, d, atol+rtol*math.Abs(float64(want[i])), "%s element %d: got %g, want %g", what, i, got[i], want[i])
	}
}

func f32sOf(t tensor.Tensor) []float32 { return t.(*tensor.Dense).Float32s() }

// updateIDs lists the node ids of g's step updates.
func updateIDs(g *lazy.Graph) []int {
	var ids []int
	for _, u := range g.StepUpdates() {
		ids = append(ids, u.Value.ID())
	}
	return ids
}

// The splits the tests run: whole, 2, 3 and 4 balanced chunks of 10
// samples (5+5, 4+3+3, 3+3+2+2) and a lopsided list, 6+1+3.
var bnSplits = [][]planner.Chunk{
	planner.Chunks(10, 1), planner.Chunks(10, 2), planner.Chunks(10, 3), planner.Chunks(10, 4),
	{{Index: 0, Start: 0, Size: 6}, {Index: 1, Start: 6, Size: 1}, {Index: 2, Start: 7, Size: 3}},
}

// A training step with per-chunk batch statistics, run in chunks by the
// CPU executor, is gradient accumulation over those chunks: its loss and
// every parameter gradient equal the sums over the chunks' micro-batches,
// each built and run as a graph of its own. With the loss as summed cross
// entropy times 1/N, each chunk's partials are computed by the same
// float32 operations as its micro-batch's and summed in the same order, so
// they are equal bit for bit; with the mean-reduced loss (1/N inside the
// kernel, against size/N outside it in the reference) within 1e-5
// relative. The batch_norm_stats outputs are the statistics of all the
// micro-batches' batch norm inputs together, to float32 rounding (1e-6
// relative, 1e-7 absolute).
func TestPerChunkBatchNormIsGradientAccumulation(t *testing.T) {
	const n, size, c = 10, 8, bnChannels
	rng := rand.New(rand.NewPCG(71, 72))
	d := newBNData(rng, n, size)
	for _, form := range []string{"sum", "mean"} {
		whole := accumulate(t, d, planner.Chunks(n, 1), form)
		for _, chunks := range bnSplits {
			t.Run(fmt.Sprintf("%s/%v", form, planner.Sizes(chunks)), func(t *testing.T) {
				m := newBNConvNet(true)
				loss, _ := bnLoss(m, d, 0, n, form)
				params := m.params()
				stats := updateIDs(loss.Graph())
				require.Len(t, stats, 2, "each batch norm registers its running statistics")
				p := testutil.StepProgram(t, cpu.Workspace, loss, params, 0, stats...)
				require.True(t, p.Info.Chunkable(), "%v", p.Info.NotChunkable)
				require.Len(t, p.Info.ChunkStats, 2)
				res, err := cpu.New().Execute(context.Background(), p, chunks, exec.Options{})
				require.NoError(t, err)
				ref := accumulate(t, d, chunks, form)

				got, err := scalarValue(res.Outputs[0])
				require.NoError(t, err)
				grads := res.Outputs[1 : 1+len(params)]
				if len(chunks) > 1 { // the statistics are the chunks' own: the reference sees the split
					require.NotEqual(t, whole.grads[0], grads[0].Float32s(), "per-chunk gradients equal the whole batch's")
				}
				if form == "sum" {
					require.Equal(t, math.Float32bits(ref.loss), math.Float32bits(got), "loss %g, want %g", got, ref.loss)
					for i, g := range grads {
						require.Equal(t, testutil.Bits(ref.grads[i]), testutil.Bits(g.Float32s()), "gradient of %s", params[i].Name())
					}
				} else {
					close32(t, []float32{ref.loss}, []float32{got}, 1e-5, 0, "loss")
					for i, g := range grads {
						close32(t, ref.grads[i], g.Float32s(), 1e-5, 1e-7, "gradient of "+params[i].Name())
					}
				}
				for b := range 2 {
					mean, variance := batchStats(ref.bnIn[b], c, size*size)
					st := res.Outputs[1+len(params)+b].Float32s()
					for k := range c {
						assert.InDelta(t, mean[k], float64(st[k]), 1e-7+1e-6*math.Abs(mean[k]), "bn%d mean %d", b+1, k)
						assert.InDelta(t, variance[k], float64(st[c+k]), 1e-7+1e-6*variance[k], "bn%d variance %d", b+1, k)
					}
				}
			})
		}
	}
}

// Session steps with per-chunk batch statistics under budgets that give
// 1, 2, 3 and more chunks: the plan says which statistics are in force,
// its peaks are the ones measured on the CPU executor to the byte, the
// loss and the SGD update are gradient accumulation's over the plan's
// chunks, and the running statistics have been updated once, as
// documented: running = ½·running + ½·batch (momentum ½, so that the batch
// statistics weigh), with the mean and
// unbiased variance of the batch norm's input over the whole batch. For
// the first batch norm those are the same at every split (its input does
// not depend on it); the second's come from the per-chunk normalisation
// before it. A second step, whose step graph comes from the session's step
// template, folds in its own statistics, once more.
func TestPerChunkBatchNormSession(t *testing.T) {
	const n, size, c, lr, momentum = 40, 32, bnChannels, 0.5, 0.5
	rng := rand.New(rand.NewPCG(73, 74))
	d := newBNData(rng, n, size)
	ctx := context.Background()
	m := newBNConvNet(true)
	loss, _ := bnLoss(m, d, 0, n, "mean")
	budgets := testutil.TightBudgets(t, testutil.StepProgram(t, cpu.Workspace, loss, m.params(), 0, updateIDs(loss.Graph())...))
	counts := testutil.Counts(budgets)
	require.Subset(t, counts, []int{1, 2, 3})
	require.Greater(t, counts[len(counts)-1], 3, "chunk counts %v", counts)
	var firstMean []float32 // bn1's running mean after the whole-batch step
	for _, k := range counts {
		t.Run(fmt.Sprintf("chunks=%d", k), func(t *testing.T) {
			m := newBNConvNet(true)
			m.bn1.Momentum, m.bn2.Momentum = momentum, momentum
			sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, Budget: budgets[k]})
			loss, _ := bnLoss(m, d, 0, n, "mean")
			params := m.params()
			before := make([][]float32, len(params))
			for i, p := range params {
				before[i] = slices.Clone(f32sOf(p.Value()))
			}
			got, err := sess.Step(ctx, loss, params, optim.NewSGD(lr, 0))
			require.NoError(t, err)

			pl, used := sess.LastPlan(), sess.LastUsage()
			require.Len(t, pl.Chunks, k)
			require.Equal(t, pl.PeakReserved, used.PeakReserved, "reserved: predicted = measured")
			require.Equal(t, pl.PeakAllocated, used.PeakAllocated, "allocated: predicted = measured")
			require.LessOrEqual(t, pl.PeakReserved, budgets[k])
			require.Equal(t, 2, pl.BatchNormNodes)
			if k == 1 {
				require.Equal(t, planner.WholeBatchStats, pl.BatchStats)
			} else {
				require.Equal(t, planner.PerChunkStats, pl.BatchStats)
			}

			ref := accumulate(t, d, pl.Chunks, "mean")
			close32(t, []float32{ref.loss}, []float32{got}, 1e-5, 0, "loss")
			for i, p := range params {
				want := make([]float32, len(before[i]))
				for j := range want {
					want[j] = before[i][j] - lr*ref.grads[i][j]
				}
				close32(t, want, f32sOf(p.Value()), 1e-5, 1e-6, "parameter "+p.Name())
			}
			ones := slices.Repeat([]float32{1}, c)
			for b, bn := range []*nn.BatchNorm2d{m.bn1, m.bn2} {
				bm, bv := batchStats(ref.bnIn[b], c, size*size)
				wm, wv := runningAfter(momentum, make([]float32, c), ones, bm, bv)
				close32(t, wm, f32sOf(bn.RunningMean.Value()), 1e-6, 1e-7, fmt.Sprintf("bn%d running mean", b+1))
				close32(t, wv, f32sOf(bn.RunningVar.Value()), 1e-6, 1e-7, fmt.Sprintf("bn%d running variance", b+1))
			}
			if firstMean == nil {
				firstMean = slices.Clone(f32sOf(m.bn1.RunningMean.Value()))
			}
			close32(t, firstMean, f32sOf(m.bn1.RunningMean.Value()), 1e-6, 1e-7, "bn1's running mean against the whole batch's")

			// A second step reuses the first's step graph (the session's
			// step template) and still applies this step's statistics.
			hits := sess.StepGraphHits()
			prevMean := slices.Clone(f32sOf(m.bn2.RunningMean.Value()))
			prevVar := slices.Clone(f32sOf(m.bn2.RunningVar.Value()))
			ref = accumulateFrom(t, m, d, pl.Chunks, "mean")
			loss, _ = bnLoss(m, d, 0, n, "mean")
			_, err = sess.Step(ctx, loss, m.params(), optim.NewSGD(lr, 0))
			require.NoError(t, err)
			require.Equal(t, hits+1, sess.StepGraphHits(), "the step graph came from the template")
			require.Len(t, sess.LastPlan().Chunks, k)
			bm, bv := batchStats(ref.bnIn[1], c, size*size)
			wm, wv := runningAfter(momentum, prevMean, prevVar, bm, bv)
			close32(t, wm, f32sOf(m.bn2.RunningMean.Value()), 1e-5, 1e-6, "bn2 running mean after step 2")
			close32(t, wv, f32sOf(m.bn2.RunningVar.Value()), 1e-5, 1e-6, "bn2 running variance after step 2")
		})
	}
}

// The default (whole-batch statistics) still refuses to split the step:
// below what the whole batch needs the Session's error wraps
// planner.ErrDoesNotFit and graph.ErrNotChunkable and names the first
// batch_norm node, no parameter or running statistic moves, and the graph
// registers no step update.
func TestBatchNormDefaultRefusesChunks(t *testing.T) {
	const n = 40
	rng := rand.New(rand.NewPCG(75, 76))
	d := newBNData(rng, n, 32)
	m := newBNConvNet(false)
	loss, _ := bnLoss(m, d, 0, n, "mean")
	require.Empty(t, loss.Graph().StepUpdates())
	p := testutil.StepProgram(t, cpu.Workspace, loss, m.params(), 0)
	require.Equal(t, []int{1}, testutil.Counts(testutil.TightBudgets(t, p)), "the default plans in one chunk only")
	first := -1
	for _, nd := range loss.Graph().IR().Nodes() {
		if nd.Op == graph.OpBatchNorm {
			first = nd.ID
			break
		}
	}
	whole, err := planner.Make(p, planner.Options{Budget: 1 << 40})
	require.NoError(t, err)
	require.Equal(t, planner.WholeBatchStats, whole.BatchStats)

	params := m.params()
	before := make([][]float32, len(params))
	for i, p := range params {
		before[i] = slices.Clone(f32sOf(p.Value()))
	}
	// NoFusedLoss: the step stepProgram planned, the head and loss unfused.
	sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, Budget: whole.PeakReserved / 2, NoFusedLoss: true})
	_, err = sess.Step(context.Background(), loss, params, optim.NewSGD(0.1, 0))
	require.ErrorIs(t, err, planner.ErrDoesNotFit)
	require.ErrorIs(t, err, graph.ErrNotChunkable)
	var ce *shapeinfer.ChunkError
	require.ErrorAs(t, err, &ce)
	assert.Equal(t, first, ce.Node, "the first batch_norm is blamed")
	assert.Equal(t, graph.OpBatchNorm.String(), ce.Op)
	for i, p := range params {
		assert.Equal(t, before[i], f32sOf(p.Value()), "parameter %s", p.Name())
	}
	assert.Equal(t, make([]float32, bnChannels), f32sOf(m.bn1.RunningMean.Value()))
	assert.Equal(t, slices.Repeat([]float32{1}, bnChannels), f32sOf(m.bn2.RunningVar.Value()))
}

// Evaluation mode is unaffected by the opt-in: the graph is the one the
// default builds (same signature, no per-chunk node, no step update), and
// its chunked run gives the whole batch's logits.
func TestPerChunkBatchNormEvalUnaffected(t *testing.T) {
	const n = 40
	rng := rand.New(rand.NewPCG(77, 78))
	d := newBNData(rng, n, 32)
	ctx := context.Background()

	// One per-chunk training step moves the running statistics first.
	m := newBNConvNet(true)
	loss, _ := bnLoss(m, d, 0, n, "mean")
	_, err := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU}).Step(ctx, loss, m.params(), optim.NewSGD(0.1, 0))
	require.NoError(t, err)
	require.NotEqual(t, make([]float32, bnChannels), f32sOf(m.bn1.RunningMean.Value()))
	def := newBNConvNet(false)
	for _, pair := range [][2]*nn.BatchNorm2d{{m.bn1, def.bn1}, {m.bn2, def.bn2}} {
		copy(f32sOf(pair[1].RunningMean.Value()), f32sOf(pair[0].RunningMean.Value()))
		copy(f32sOf(pair[1].RunningVar.Value()), f32sOf(pair[0].RunningVar.Value()))
	}
	for i, p := range def.params() {
		copy(f32sOf(p.Value()), f32sOf(m.params()[i].Value()))
	}
	m.setTraining(false)
	def.setTraining(false)

	x, _ := d.rows(0, n)
	logits, _ := m.forward(lazy.Wrap(x, 0))
	defLogits, _ := def.forward(lazy.Wrap(x, 0))
	require.Empty(t, logits.Graph().StepUpdates())
	require.Equal(t, defLogits.Graph().IR().Signature(), logits.Graph().IR().Signature())
	for _, nd := range logits.Graph().IR().Nodes() {
		require.False(t, nd.Attrs.PerChunk, "node %d (%s)", nd.ID, nd.Op)
	}
	whole := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU})
	want, err := whole.Eval(ctx, defLogits)
	require.NoError(t, err)
	chunked := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, Budget: whole.LastPlan().PeakReserved / 2})
	got, err := chunked.Eval(ctx, logits)
	require.NoError(t, err)
	require.Greater(t, len(chunked.LastPlan().Chunks), 1)
	require.Empty(t, chunked.LastPlan().BatchStats, "evaluation mode has no batch statistics")
	require.Equal(t, testutil.Bits(want[0].Float32s()), testutil.Bits(got[0].Float32s()))
}

// The step's running-statistics updates ride along the session's other
// step paths: under bf16-mixed (the policy rewrites the graph, the updates
// follow their nodes) and with activation recomputation forced (the
// transform renumbers the graph), the step runs in chunks with predicted =
// measured, and the first batch norm's running mean is the documented one
// (its input does not depend on the split): to bfloat16's precision under
// bf16-mixed, to float32 rounding with recomputation.
func TestPerChunkBatchNormMixedAndRecompute(t *testing.T) {
	const n, size, c = 40, 32, bnChannels
	rng := rand.New(rand.NewPCG(79, 80))
	d := newBNData(rng, n, size)
	ctx := context.Background()
	m := newBNConvNet(true)
	loss, bnIn := bnLoss(m, d, 0, n, "mean")
	budgets := testutil.TightBudgets(t, testutil.StepProgram(t, cpu.Workspace, loss, m.params(), 0, updateIDs(loss.Graph())...))
	counts := testutil.Counts(budgets)
	vals, err := cpu.New().Run(ctx, loss.Graph().IR(), bnIn[0].ID())
	require.NoError(t, err)
	bm, bv := batchStats([][]float32{vals[0].Float32s()}, c, size*size)
	wantMean, _ := runningAfter(0.1, make([]float32, c), slices.Repeat([]float32{1}, c), bm, bv)

	for _, o := range []struct {
		name       string
		opts       batchfit.Options
		rtol, atol float64
	}{
		{"bf16-mixed", batchfit.Options{Precision: "bf16-mixed", Budget: budgets[counts[len(counts)-1]]}, 1e-2, 1e-4},
		{"recompute", batchfit.Options{Recompute: recompute.FullCheckpoint, Budget: budgets[counts[len(counts)-1]]}, 1e-6, 1e-7},
	} {
		t.Run(o.name, func(t *testing.T) {
			o.opts.Device = batchfit.DeviceCPU
			m := newBNConvNet(true)
			sess := batchfit.NewSession(o.opts)
			loss, _ := bnLoss(m, d, 0, n, "mean")
			_, err := sess.Step(ctx, loss, m.params(), optim.NewSGD(0.1, 0))
			require.NoError(t, err)
			pl := sess.LastPlan()
			require.Greater(t, len(pl.Chunks), 1)
			require.Equal(t, planner.PerChunkStats, pl.BatchStats)
			require.Equal(t, pl.PeakReserved, sess.LastUsage().PeakReserved)
			if o.opts.Recompute != "" {
				require.NotEqual(t, "none", sess.LastRecompute().Strategy)
			}
			close32(t, wantMean, f32sOf(m.bn1.RunningMean.Value()), o.rtol, o.atol, "bn1 running mean")
		})
	}
}
