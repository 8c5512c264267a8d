package shapeinfer_test

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/shapeinfer"
)

const f32, i64 = graph.Float32, graph.Int64

func pspec(shape ...int) *lazy.Tensor { return lazy.ParamSpec(shape, f32, "p") }

// analyze builds nothing itself: it checks every tensor built, then runs
// the analysis with outs as outputs.
func analyze(t *testing.T, outs ...*lazy.Tensor) *shapeinfer.Result {
	t.Helper()
	require.NotEmpty(t, outs)
	ids := make([]int, len(outs))
	for k, o := range outs {
		require.NoError(t, o.Err())
		ids[k] = o.ID()
	}
	res, err := shapeinfer.Analyze(outs[0].Graph().IR(), ids...)
	require.NoError(t, err)
	return res
}

// notChunkableAt asserts that the analysis blames node at.
func notChunkableAt(t *testing.T, res *shapeinfer.Result, at *lazy.Tensor) {
	t.Helper()
	require.False(t, res.Chunkable())
	assert.True(t, errors.Is(res.NotChunkable, graph.ErrNotChunkable))
	var ce *shapeinfer.ChunkError
	require.True(t, errors.As(error(res.NotChunkable), &ce))
	assert.Equal(t, at.ID(), ce.Node, "blamed node (%s: %s)", ce.Op, ce.Reason)
	assert.Equal(t, at.Graph().IR().Node(at.ID()).Op.String(), ce.Op)
}

func TestMLPWithMeanCrossEntropyIsChunkable(t *testing.T) {
	g := lazy.NewGraph()
	x := g.Placeholder([]int{16, 8}, f32, 0)
	labels := g.Placeholder([]int{16}, i64, 0)
	h := x.Linear(pspec(32, 8), pspec(32)).Relu()
	logits := h.Linear(pspec(10, 32), pspec(10))
	loss := logits.CrossEntropy(labels, graph.ReduceMean)

	res := analyze(t, loss)
	require.True(t, res.Chunkable(), "%v", res.NotChunkable)
	assert.Nil(t, res.NotChunkable)
	assert.Equal(t, 16, res.Batch)
	assert.Equal(t, shapeinfer.CrossBatch, res.Class[loss.ID()])
	assert.Equal(t, shapeinfer.CombineSum, res.Combine[loss.ID()])
	assert.Equal(t, shapeinfer.PerSample, res.Class[h.ID()])
	assert.Equal(t, shapeinfer.CombineNone, res.Combine[h.ID()])
	// The mean's 1/N uses the full batch, so chunk partials add.
	assert.InDelta(t, 1.0/16, g.IR().Node(loss.ID()).Attrs.Scalar, 1e-15)
	// The weights are constants.
	for _, n := range g.IR().Nodes() {
		if n.Op == graph.OpParam {
			assert.Equal(t, shapeinfer.Constant, res.Class[n.ID])
		}
	}
}

func TestBatchStatisticIntoPerSampleWorkIsNotChunkable(t *testing.T) {
	x := lazy.Placeholder([]int{16, 8}, f32, 0)
	mu := x.Mean(0)
	centred := x.Sub(mu)
	res := analyze(t, centred.Sum())
	notChunkableAt(t, res, centred)
	assert.Equal(t, shapeinfer.CrossBatch, res.Class[mu.ID()])
	assert.Equal(t, shapeinfer.CombineSum, res.Combine[mu.ID()])
}

func TestLogOfBatchMeanIsNotChunkable(t *testing.T) {
	x := lazy.Placeholder([]int{16, 8}, f32, 0)
	l := x.Mean(0).Log()
	notChunkableAt(t, analyze(t, l), l)
}

func TestSoftmaxAlongBatchIsNotChunkable(t *testing.T) {
	x := lazy.Placeholder([]int{16, 8}, f32, 0)
	s := x.Softmax(0)
	notChunkableAt(t, analyze(t, s.Sum(1)), s)

	// Along the features it is fine.
	x = lazy.Placeholder([]int{16, 8}, f32, 0)
	assert.True(t, analyze(t, x.Softmax(1)).Chunkable())
}

func TestMatMulContractingBatchOfBothIsChunkable(t *testing.T) {
	g := lazy.NewGraph()
	x := g.Placeholder([]int{16, 8}, f32, 0)
	y := g.Placeholder([]int{16, 5}, f32, 0)
	xty := x.Transpose(0, 1).MatMul(y) // [8, 5] = Σ over samples of xᵢᵀyᵢ
	require.Equal(t, []int{8, 5}, xty.Shape())
	res := analyze(t, xty)
	require.True(t, res.Chunkable(), "%v", res.NotChunkable)
	assert.Equal(t, shapeinfer.CrossBatch, res.Class[xty.ID()])
	assert.Equal(t, shapeinfer.CombineSum, res.Combine[xty.ID()])

	// The same product through the transpose flag, without a permute node.
	g = lazy.NewGraph()
	x = g.Placeholder([]int{16, 8}, f32, 0)
	xty = x.MatMulT(g.Placeholder([]int{16, 5}, f32, 0), true, false)
	require.Equal(t, []int{8, 5}, xty.Shape())
	res = analyze(t, xty)
	require.True(t, res.Chunkable(), "%v", res.NotChunkable)
	assert.Equal(t, shapeinfer.CombineSum, res.Combine[xty.ID()])
}

func TestMaxOverBatchCombinesByMax(t *testing.T) {
	x := lazy.Placeholder([]int{16, 8}, f32, 0)
	m := x.Max(0)
	r := m.Reshape(2, 4)
	res := analyze(t, r)
	require.True(t, res.Chunkable(), "%v", res.NotChunkable)
	assert.Equal(t, shapeinfer.CombineMax, res.Combine[m.ID()])
	assert.Equal(t, shapeinfer.CombineMax, res.Combine[r.ID()], "movement keeps max")

	// Summing maxima is not a max.
	x = lazy.Placeholder([]int{16, 8}, f32, 0)
	s := x.Max(0).Sum()
	notChunkableAt(t, analyze(t, s), s)
}

func TestCrossBatchSumsStayLinear(t *testing.T) {
	x := lazy.Placeholder([]int{16, 8}, f32, 0)
	s := x.Sum(0)                            // Σ xᵢ
	d := s.MulScalar(2).Sub(x.Mean(0)).Neg() // still a sum over samples
	res := analyze(t, d)
	require.True(t, res.Chunkable(), "%v", res.NotChunkable)
	assert.Equal(t, shapeinfer.CombineSum, res.Combine[d.ID()])

	// Adding a constant to a sum is not (each chunk would add it once).
	x = lazy.Placeholder([]int{16, 8}, f32, 0)
	a := x.Sum(0).Add(pspec(8))
	notChunkableAt(t, analyze(t, a), a)
}

// Each of these keeps or consumes a batch axis in a way that mixes samples
// or makes a chunk's shapes disagree; the analysis must blame the op.
func TestSampleMixingOpsAreNotChunkable(t *testing.T) {
	for _, c := range []struct {
		name  string
		build func() (out, blamed *lazy.Tensor)
	}{
		{"slice along the batch", func() (*lazy.Tensor, *lazy.Tensor) {
			s := lazy.Placeholder([]int{16, 8}, f32, 0).Slice(0, 0, 4)
			return s, s
		}},
		{"reshape folding the batch under a leading axis", func() (*lazy.Tensor, *lazy.Tensor) {
			r := lazy.Placeholder([]int{2, 16, 3}, f32, 1).Reshape(32, 3)
			return r, r
		}},
		{"linear over the batch axis", func() (*lazy.Tensor, *lazy.Tensor) {
			l := lazy.Placeholder([]int{8, 16}, f32, 1).Linear(pspec(4, 16), nil)
			return l, l
		}},
		{"layer_norm over the batch axis", func() (*lazy.Tensor, *lazy.Tensor) {
			l := lazy.Placeholder([]int{16, 8}, f32, 0).LayerNorm(nil, nil, 2, 1e-5)
			return l, l
		}},
		{"bias spanning the batch", func() (*lazy.Tensor, *lazy.Tensor) {
			a := lazy.Placeholder([]int{16, 8}, f32, 0).Add(pspec(16, 8))
			return a, a
		}},
		{"concat with a constant spanning the batch", func() (*lazy.Tensor, *lazy.Tensor) {
			c := lazy.Concat(1, lazy.Placeholder([]int{16, 8}, f32, 0), pspec(16, 2))
			return c, c
		}},
		{"batched matmul with a constant spanning the batch", func() (*lazy.Tensor, *lazy.Tensor) {
			m := lazy.Placeholder([]int{16, 2, 3}, f32, 0).MatMul(pspec(16, 3, 4))
			return m, m
		}},
		{"matmul contracting one operand's batch, keeping the other's", func() (*lazy.Tensor, *lazy.Tensor) {
			g := lazy.NewGraph()
			a := g.Placeholder([]int{3, 16}, f32, 1)     // batch on the contracted axis
			b := g.Placeholder([]int{16, 16, 2}, f32, 0) // batch on a leading axis
			m := a.MatMul(b)
			return m, m
		}},
		{"matmul with TransA contracting one operand's batch, keeping the other's", func() (*lazy.Tensor, *lazy.Tensor) {
			g := lazy.NewGraph()
			a := g.Placeholder([]int{16, 3}, f32, 0)     // transposed: batch on the contracted axis
			b := g.Placeholder([]int{16, 16, 2}, f32, 0) // batch on a leading axis
			m := a.MatMulT(b, true, false)
			return m, m
		}},
		{"linear with a batched weight", func() (*lazy.Tensor, *lazy.Tensor) {
			g := lazy.NewGraph()
			l := g.Placeholder([]int{16, 8}, f32, 0).Linear(g.Placeholder([]int{16, 8}, f32, 0), nil)
			return l, l
		}},
		{"mse against a constant target", func() (*lazy.Tensor, *lazy.Tensor) {
			m := lazy.Placeholder([]int{16, 8}, f32, 0).MSE(pspec(16, 8), graph.ReduceMean)
			return m, m
		}},
		{"cross_entropy against constant labels", func() (*lazy.Tensor, *lazy.Tensor) {
			c := lazy.Placeholder([]int{16, 10}, f32, 0).CrossEntropy(lazy.ParamSpec([]int{16}, i64, "y"), graph.ReduceMean)
			return c, c
		}},
		{"cross_entropy with the batch on the class axis", func() (*lazy.Tensor, *lazy.Tensor) {
			g := lazy.NewGraph()
			logits := g.Placeholder([]int{16, 16}, f32, 1)
			c := logits.CrossEntropy(g.Placeholder([]int{16}, i64, 0), graph.ReduceSum)
			return c, c
		}},
		{"conv over a batch on the channels", func() (*lazy.Tensor, *lazy.Tensor) {
			c := lazy.Placeholder([]int{2, 16, 5, 5}, f32, 1).Conv2d(pspec(4, 16, 3, 3), nil, lazy.ConvOptions{})
			return c, c
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			out, blamed := c.build()
			notChunkableAt(t, analyze(t, out), blamed)
		})
	}
}

// Training-mode batch_norm normalises every sample with the whole batch's
// statistics: no chunk can compute its samples' outputs alone. The analysis
// blames the batch_norm node, in forward-only and training graphs alike;
// evaluation mode is per-sample.
func TestBatchNormChunkability(t *testing.T) {
	const n, c = 16, 4
	build := func(training bool) (g *lazy.Graph, bn, loss *lazy.Tensor, params []*lazy.Tensor) {
		g = lazy.NewGraph()
		x := g.Placeholder([]int{n, c, 5, 5}, f32, 0)
		w, b, mean, variance := pspec(c), pspec(c), pspec(c), pspec(c)
		bn = x.BatchNorm2d(w, b, mean, variance, training, 1e-5)
		return g, bn, bn.Relu().Mean(), []*lazy.Tensor{w, b}
	}

	_, bn, _, _ := build(true)
	res := analyze(t, bn)
	notChunkableAt(t, res, bn)
	var ce *shapeinfer.ChunkError
	require.True(t, errors.As(error(res.NotChunkable), &ce))
	assert.Equal(t, "batch_norm", ce.Op)
	assert.NotEmpty(t, ce.Reason)
	assert.Equal(t, shapeinfer.PerSample, res.Class[bn.ID()], "the output keeps its batch axis; its values do not")

	// With the backward pass appended the forward node is still the one blamed.
	_, bn, loss, params := build(true)
	grads := lazy.Grad(loss, params...)
	notChunkableAt(t, analyze(t, append([]*lazy.Tensor{loss}, grads...)...), bn)

	_, bn, loss, params = build(false)
	grads = lazy.Grad(loss, params...)
	res = analyze(t, append([]*lazy.Tensor{loss, bn}, grads...)...)
	require.True(t, res.Chunkable(), "%v", res.NotChunkable)
	assert.Equal(t, shapeinfer.PerSample, res.Class[bn.ID()])
	for k, gr := range grads {
		assert.Equal(t, shapeinfer.CombineSum, res.Combine[gr.ID()], "grad %d", k)
	}

	// Samples on the channel axis: each chunk would need its slice of the
	// running statistics.
	bc := lazy.Placeholder([]int{2, n, 5}, f32, 1).BatchNorm(nil, nil, pspec(n), pspec(n), false, 1e-5)
	notChunkableAt(t, analyze(t, bc), bc)

	// Running statistics computed from the batch flow back into per-sample work.
	g := lazy.NewGraph()
	x := g.Placeholder([]int{n, c}, f32, 0)
	fromBatch := x.BatchNorm(nil, nil, x.Mean(0), x.Mul(x).Mean(0), false, 1e-5)
	notChunkableAt(t, analyze(t, fromBatch), fromBatch)
}

// Per-chunk statistics (the opt-in, lazy's BatchNorm2dPerChunk) make the
// same training graph chunkable: the forward node and batch_norm_grad_x
// are per-sample, the weight gradient a sum over chunks, and the analysis
// lists the node as normalising with each chunk's statistics, where the
// default lists it as the whole batch's. batch_norm_stats combines by
// moments; a slice of it is no pair of moments any more.
func TestPerChunkBatchNormChunkability(t *testing.T) {
	const n, c = 16, 4
	g := lazy.NewGraph()
	x := g.Placeholder([]int{n, c, 5, 5}, f32, 0)
	w, b := pspec(c), pspec(c)
	bn := x.BatchNorm2dPerChunk(w, b, 1e-5)
	stats := x.BatchStats()
	loss := bn.Relu().Mean()
	grads := lazy.Grad(loss, w, b)
	res := analyze(t, append([]*lazy.Tensor{loss, stats}, grads...)...)
	require.True(t, res.Chunkable(), "%v", res.NotChunkable)
	assert.Equal(t, []int{bn.ID()}, res.ChunkStats)
	assert.Empty(t, res.WholeStats)
	assert.Equal(t, 1, res.MinChunk, "25 values per channel in one sample")
	assert.Equal(t, shapeinfer.CombineMoments, res.Combine[stats.ID()])
	for k, gr := range grads {
		assert.Equal(t, shapeinfer.CombineSum, res.Combine[gr.ID()], "grad %d", k)
	}
	for _, nd := range g.IR().Nodes() {
		if nd.Op == graph.OpBatchNormGradX || nd.Op == graph.OpBatchNormGradW {
			assert.True(t, nd.Attrs.PerChunk, "%s carries the forward node's PerChunk", nd.Op)
		}
	}

	// The default names the node it refuses for, and lists it as whole.
	g = lazy.NewGraph()
	x = g.Placeholder([]int{n, c, 5, 5}, f32, 0)
	whole := x.BatchNorm2d(w, b, nil, nil, true, 1e-5)
	res = analyze(t, whole.Mean())
	notChunkableAt(t, res, whole)
	assert.Equal(t, []int{whole.ID()}, res.WholeStats)
	assert.Empty(t, res.ChunkStats)

	// [N, C] input: one value per channel in a sample, so chunks of two.
	g = lazy.NewGraph()
	x2 := g.Placeholder([]int{n, c}, f32, 0)
	res = analyze(t, x2.BatchNormPerChunk(nil, nil, 1e-5).Mean(), x2.BatchStats())
	require.True(t, res.Chunkable(), "%v", res.NotChunkable)
	assert.Equal(t, 2, res.MinChunk)

	// Samples on the channel axis: each channel's statistics are its own,
	// so batch_norm_stats stays per-sample.
	bc := lazy.Placeholder([]int{2, n, 5}, f32, 1).BatchStats()
	res = analyze(t, bc)
	require.True(t, res.Chunkable(), "%v", res.NotChunkable)
	assert.Equal(t, shapeinfer.PerSample, res.Class[bc.ID()])

	// A slice of the statistics, or arithmetic on them, is not chunkable.
	g = lazy.NewGraph()
	x = g.Placeholder([]int{n, c, 5, 5}, f32, 0)
	st := x.BatchStats()
	mean := st.Slice(0, 0, 1)
	notChunkableAt(t, analyze(t, mean), mean)
	scaled := st.MulScalar(2)
	notChunkableAt(t, analyze(t, scaled), scaled)
}

// A small graph whose bytes and liveness are worked out by hand.
func TestBytesAndLastUseByHand(t *testing.T) {
	g := lazy.NewGraph()
	x := g.Placeholder([]int{8, 3}, f32, 0) // id 0
	labels := g.Placeholder([]int{8}, i64, 0)
	w, b := pspec(5, 3), pspec(5)
	h := x.Linear(w, b)            // binds w, b; then linear
	r := h.Relu()                  // [8, 5]
	s := r.Sum(0)                  // [5], cross-batch
	out := s.MulScalar(0.5)        // [5]
	folded := x.Reshape(-1)        // [24]: batch axis 0 with PerSample 3, unused
	perTok := r.Reshape(8, 5, 1)   // [8, 5, 1]
	loss := perTok.Sum(1, 2).Sum() // scalar

	// Adopted leaves get the ids between labels and the linear node.
	wid, bid := labels.ID()+1, labels.ID()+2
	require.Equal(t, graph.OpParam, g.IR().Node(wid).Op)
	require.Equal(t, graph.OpParam, g.IR().Node(bid).Op)
	require.Equal(t, []int{x.ID(), wid, bid}, g.IR().Node(h.ID()).Inputs)

	res, err := shapeinfer.Analyze(g.IR(), out.ID(), loss.ID())
	require.NoError(t, err)
	require.Equal(t, 8, res.Batch)

	type bytes struct{ fixed, per int64 }
	want := map[int]bytes{
		x.ID():      {0, 3 * 4},     // [N, 3] float32: 12 B per sample
		labels.ID(): {0, 8},         // [N] int64: 8 B per sample
		wid:         {5 * 3 * 4, 0}, // [5, 3] float32 = 60 B
		bid:         {5 * 4, 0},     // [5] = 20 B
		h.ID():      {0, 5 * 4},     // [N, 5]: 20 B per sample
		r.ID():      {0, 5 * 4},
		s.ID():      {5 * 4, 0}, // [5], the batch summed away
		out.ID():    {5 * 4, 0},
		folded.ID(): {0, 3 * 4}, // [24] = [N·3]: 96 B / 8 samples = 12 B per sample
		perTok.ID(): {0, 5 * 4},
		loss.ID():   {4, 0},
	}
	for id, wb := range want {
		assert.Equal(t, wb.fixed, res.Fixed[id], "Fixed of node %d (%s)", id, g.IR().Node(id).Op)
		assert.Equal(t, wb.per, res.PerSample[id], "PerSample of node %d (%s)", id, g.IR().Node(id).Op)
	}
	// Bytes(id, b) = Fixed + PerSample·b: at a chunk of 3 samples
	assert.Equal(t, int64(60), res.Bytes(h.ID(), 3))            // 0 + 20·3
	assert.Equal(t, int64(60), res.Bytes(wid, 3))               // 60 + 0·3
	assert.Equal(t, int64(36), res.Bytes(folded.ID(), 3))       // 12·3: [9] float32
	assert.Equal(t, int64(8*3*4), res.Bytes(x.ID(), res.Batch)) // the full batch: all of [8, 3]
	// At the full batch Bytes is the node's whole size.
	for _, n := range g.IR().Nodes() {
		assert.Equal(t, n.Type.Bytes(), res.Bytes(n.ID, res.Batch), "node %d (%s)", n.ID, n.Op)
	}

	// Last consumers, in id order.
	sumInner := g.IR().Node(loss.ID()).Inputs[0] // perTok.Sum(1, 2)
	lastUse := map[int]int{
		x.ID():      h.ID(), // read by linear; the reshape made later is never needed (nothing reads it)
		labels.ID(): -1,     // never read
		wid:         h.ID(),
		bid:         h.ID(),
		h.ID():      r.ID(),
		r.ID():      perTok.ID(), // the sum reads it first, the reshape last
		s.ID():      out.ID(),
		out.ID():    shapeinfer.End, // an output
		folded.ID(): -1,
		perTok.ID(): sumInner,
		sumInner:    loss.ID(),
		loss.ID():   shapeinfer.End,
	}
	for id, lu := range lastUse {
		assert.Equal(t, lu, res.LastUse[id], "LastUse of node %d (%s)", id, g.IR().Node(id).Op)
	}
	assert.Equal(t, []int{out.ID(), loss.ID()}, res.Outputs)

	classes := map[int]shapeinfer.Class{x.ID(): shapeinfer.PerSample, wid: shapeinfer.Constant,
		h.ID(): shapeinfer.PerSample, s.ID(): shapeinfer.CrossBatch, out.ID(): shapeinfer.CrossBatch,
		folded.ID(): shapeinfer.PerSample, loss.ID(): shapeinfer.CrossBatch}
	for id, c := range classes {
		assert.Equal(t, c, res.Class[id], "Class of node %d", id)
	}
	assert.True(t, res.Chunkable(), "%v", res.NotChunkable)
}

func TestAnalyzeWithoutBatch(t *testing.T) {
	y := pspec(2, 3).Relu().Sum()
	res := analyze(t, y)
	assert.Equal(t, 0, res.Batch)
	assert.True(t, res.Chunkable())
	for id := range res.Class {
		assert.Equal(t, shapeinfer.Constant, res.Class[id])
		assert.Zero(t, res.PerSample[id])
	}
	assert.Equal(t, int64(24), res.Fixed[0]) // [2, 3] float32
}

func TestAnalyzeRejectsBadOutputs(t *testing.T) {
	x := lazy.Placeholder([]int{4, 3}, f32, 0)
	for _, id := range []int{-1, 1, 100} {
		_, err := shapeinfer.Analyze(x.Graph().IR(), id)
		assert.ErrorIs(t, err, graph.ErrArity, "output %d", id)
	}
}

// Training graphs: autodiff appends the backward pass to the same graph;
// parameter gradients are sums over samples, so the whole graph chunks.
func TestTrainingGraphsAreChunkable(t *testing.T) {
	for _, c := range []struct {
		name  string
		build func(g *lazy.Graph) (loss *lazy.Tensor, params []*lazy.Tensor)
	}{
		{"mlp, cross_entropy", func(g *lazy.Graph) (*lazy.Tensor, []*lazy.Tensor) {
			w1, b1, w2, b2 := pspec(32, 8), pspec(32), pspec(10, 32), pspec(10)
			x := g.Placeholder([]int{16, 8}, f32, 0)
			y := g.Placeholder([]int{16}, i64, 0)
			return x.Linear(w1, b1).Gelu().Linear(w2, b2).CrossEntropy(y, graph.ReduceMean), []*lazy.Tensor{w1, b1, w2, b2}
		}},
		{"sequence model, mse", func(g *lazy.Graph) (*lazy.Tensor, []*lazy.Tensor) {
			w, ln := pspec(6, 6), pspec(6)
			x := g.Placeholder([]int{16, 5, 6}, f32, 0)
			target := g.Placeholder([]int{16, 5, 6}, f32, 0)
			h := x.LayerNorm(ln, nil, 1, 1e-5).Linear(w, nil).Softmax(-1)
			return h.MSE(target, graph.ReduceMean), []*lazy.Tensor{w, ln}
		}},
		{"cnn with batch_norm in evaluation mode", func(g *lazy.Graph) (*lazy.Tensor, []*lazy.Tensor) {
			k, bw, bb, fc := pspec(4, 3, 3, 3), pspec(4), pspec(4), pspec(10, 4*8*8)
			mean, variance := pspec(4), pspec(4) // running statistics: constants to the graph
			x := g.Placeholder([]int{16, 3, 8, 8}, f32, 0)
			y := g.Placeholder([]int{16}, i64, 0)
			h := x.Conv2d(k, nil, lazy.ConvOptions{Padding: [2]int{1, 1}}).BatchNorm2d(bw, bb, mean, variance, false, 1e-5).Relu()
			return h.Reshape(16, -1).Linear(fc, nil).CrossEntropy(y, graph.ReduceMean), []*lazy.Tensor{k, bw, bb, fc, mean, variance}
		}},
		{"cnn, cross_entropy", func(g *lazy.Graph) (*lazy.Tensor, []*lazy.Tensor) {
			k, fc := pspec(4, 3, 3, 3), pspec(10, 4*3*3)
			x := g.Placeholder([]int{16, 3, 8, 8}, f32, 0)
			y := g.Placeholder([]int{16}, i64, 0)
			h := x.Conv2d(k, nil, lazy.ConvOptions{Padding: [2]int{1, 1}}).Relu().MaxPool2d(lazy.PoolOptions{Kernel: [2]int{2, 2}})
			h = h.AvgPool2d(lazy.PoolOptions{Kernel: [2]int{2, 2}, Stride: [2]int{1, 1}}) // [16, 4, 3, 3]
			return h.Reshape(16, -1).Linear(fc, nil).CrossEntropy(y, graph.ReduceMean), []*lazy.Tensor{k, fc}
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			g := lazy.NewGraph()
			loss, params := c.build(g)
			grads := lazy.Grad(loss, params...)
			res := analyze(t, append([]*lazy.Tensor{loss}, grads...)...)
			require.True(t, res.Chunkable(), "%v", res.NotChunkable)
			for k, gr := range grads {
				assert.Equal(t, params[k].Shape(), gr.Shape())
				assert.Equal(t, shapeinfer.CrossBatch, res.Class[gr.ID()], "grad %d", k)
				assert.Equal(t, shapeinfer.CombineSum, res.Combine[gr.ID()], "grad %d", k)
			}
		})
	}
}

// A node that only dead nodes read is dead too: liveness follows needs
// backwards from the outputs, so a dead chain neither keeps values alive nor
// blocks chunking.
func TestDeadChainsAreNotLive(t *testing.T) {
	x := lazy.Placeholder([]int{4, 3}, graph.Float32, 0)
	y := x.Relu()
	dead1 := y.Sub(y.Mean(0)) // not chunkable, but nothing reads it
	dead2 := dead1.Exp()
	out := y.Sum()
	require.NoError(t, dead2.Err())
	res, err := shapeinfer.Analyze(x.Graph().IR(), out.ID())
	require.NoError(t, err)
	assert.Nil(t, res.NotChunkable, "the non-chunkable sub is dead")
	assert.Equal(t, out.ID(), res.LastUse[y.ID()], "y's dead readers do not extend its life")
	assert.Equal(t, -1, res.LastUse[dead1.ID()])
	assert.Equal(t, -1, res.LastUse[dead2.ID()])
	for _, id := range x.Graph().IR().Node(dead1.ID()).Inputs {
		if id != y.ID() {
			assert.Equal(t, -1, res.LastUse[id], "the mean only the dead sub reads is dead")
		}
	}
}

// Linear without bias is linear in a cross-batch sum; with a bias each
// chunk would add the bias once, so k chunks would add it k times.
func TestLinearBiasOnCrossBatchSumIsNotChunkable(t *testing.T) {
	x := lazy.Placeholder([]int{16, 8}, f32, 0)
	y := x.SumKeepDim(0).Linear(pspec(3, 8), nil)
	res := analyze(t, y)
	require.True(t, res.Chunkable(), "%v", res.NotChunkable)
	assert.Equal(t, shapeinfer.CombineSum, res.Combine[y.ID()])

	x = lazy.Placeholder([]int{16, 8}, f32, 0)
	y = x.SumKeepDim(0).Linear(pspec(3, 8), pspec(3))
	notChunkableAt(t, analyze(t, y), y)
}
