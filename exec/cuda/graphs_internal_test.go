package cuda

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/planner"
)

// testOp is a pending node with distinct addresses, for the fingerprint
// tests.
func testOp(id int) pendingOp {
	nd := &graph.Node{ID: id}
	return pendingOp{nd: nd, c: planner.Chunk{Start: 8, Size: 4},
		in: []operand{{p: 0x1000}, {p: 0x2000}}, y: operand{p: 0x3000}, ws: &wsView{p: 0x4000, n: 64}}
}

// A fingerprint changes with everything a node's launches depend on
// beyond the program's signature: the node, the chunk's start and size,
// dropout's seed and counter, and each address (output, inputs,
// workspace and its size, companion), and with nothing else.
func TestFingerprintCoversLaunchInputs(t *testing.T) {
	base := testOp(3)
	fp := appendFingerprint(nil, &base)
	require.Equal(t, fp, appendFingerprint(nil, &base), "deterministic")
	again := testOp(3)
	assert.Equal(t, fp, appendFingerprint(nil, &again), "equal ops, equal words")
	for name, change := range map[string]func(op *pendingOp){
		"node":        func(op *pendingOp) { op.nd.ID = 4 },
		"chunk start": func(op *pendingOp) { op.c.Start = 12 },
		"chunk size":  func(op *pendingOp) { op.c.Size = 5 },
		"seed":        func(op *pendingOp) { op.nd.Attrs.Seed = 9 },
		"counter":     func(op *pendingOp) { op.nd.Attrs.Counter = 1 },
		"output":      func(op *pendingOp) { op.y.p = 0x3200 },
		"input":       func(op *pendingOp) { op.in[1].p = 0x2200 },
		"inputs":      func(op *pendingOp) { op.in = op.in[:1] },
		"workspace":   func(op *pendingOp) { op.ws = &wsView{p: 0x4200, n: 64} },
		"ws size":     func(op *pendingOp) { op.ws = &wsView{p: 0x4000, n: 128} },
		"no ws":       func(op *pendingOp) { op.ws = nil },
		"companion":   func(op *pendingOp) { op.cos = []coOut{{v: operand{p: 0}}} },
		"companions": func(op *pendingOp) {
			op.cos = []coOut{{v: operand{p: 0x5000}}, {v: operand{p: 0x6000}}}
		},
	} {
		op := testOp(3)
		change(&op)
		assert.NotEqual(t, fp, appendFingerprint(nil, &op), name)
		assert.NotEqual(t, hashWords(fp), hashWords(appendFingerprint(nil, &op)), name)
	}
	// Two ops make the concatenation of their words.
	a, b := testOp(1), testOp(2)
	two := appendFingerprint(appendFingerprint(nil, &a), &b)
	assert.Equal(t, append(appendFingerprint(nil, &a), appendFingerprint(nil, &b)...), two)
}

// A program's segments are found by their exact words, also when two
// share a hash bucket; prune destroys those not launched in the last keep
// calls; destroyAll destroys the rest.
func TestProgGraphsFindAndPrune(t *testing.T) {
	pg := newProgGraphs()
	var destroyed []uint64
	destroy := func(sg *segGraph) error { destroyed = append(destroyed, sg.fp[0]); return nil }
	pg.calls = 1
	s1 := &segGraph{fp: []uint64{1, 2, 3}, exec: 11, used: 1}
	s2 := &segGraph{fp: []uint64{4, 5}, exec: 12, used: 1}
	pg.add(s1)
	pg.add(s2)
	// A colliding segment, filed under s1's hash by hand.
	s3 := &segGraph{fp: []uint64{7}, exec: 13, used: 1}
	h := hashWords(s1.fp)
	pg.segs[h] = append(pg.segs[h], s3)
	pg.n++
	assert.Same(t, s1, pg.find([]uint64{1, 2, 3}))
	assert.Same(t, s2, pg.find([]uint64{4, 5}))
	assert.Nil(t, pg.find([]uint64{1, 2}))
	assert.Nil(t, pg.find([]uint64{7}), "found by its words' own hash only")
	pg.segs[h] = pg.segs[h][:1]
	pg.n--

	pg.calls = 3
	s2.used = 3
	require.NoError(t, pg.prune(3, destroy))
	assert.Empty(t, destroyed, "s1 went unused for 2 calls: kept")
	pg.calls = 4
	require.NoError(t, pg.prune(3, destroy))
	assert.Equal(t, []uint64{1}, destroyed)
	assert.Equal(t, 1, pg.n)
	assert.Nil(t, pg.find([]uint64{1, 2, 3}))
	assert.Same(t, s2, pg.find([]uint64{4, 5}))
	require.NoError(t, pg.destroyAll(destroy))
	assert.Equal(t, []uint64{1, 4}, destroyed)
	assert.Zero(t, pg.n)
	assert.Nil(t, pg.find([]uint64{4, 5}))
}

// The cache keeps graphPrograms signatures and destroys the least
// recently used one's graphs to take another.
func TestGraphCacheEvictsLeastRecentProgram(t *testing.T) {
	var gc graphCache
	var destroyed []uint64
	destroy := func(sg *segGraph) error { destroyed = append(destroyed, sg.fp[0]); return nil }
	for sig := range uint64(graphPrograms) {
		pg, err := gc.forProgram(sig, destroy)
		require.NoError(t, err)
		pg.add(&segGraph{fp: []uint64{100 + sig}, exec: 1})
	}
	_, err := gc.forProgram(0, destroy) // 0 is now the most recent
	require.NoError(t, err)
	pg, err := gc.forProgram(1000, destroy)
	require.NoError(t, err)
	assert.Equal(t, []uint64{101}, destroyed, "signature 1 was the least recently used")
	assert.Len(t, gc.progs, graphPrograms)
	assert.Equal(t, uint64(1), pg.calls)
	again, err := gc.forProgram(1000, destroy)
	require.NoError(t, err)
	assert.Same(t, pg, again)
	assert.Equal(t, uint64(2), pg.calls)
}

// Nodes whose kernels read a device flag on the host end a segment.
func TestHostReadsEndSegments(t *testing.T) {
	for _, op := range []graph.Op{graph.OpCrossEntropy, graph.OpCrossEntropyGrad, graph.OpEmbedding, graph.OpEmbeddingGrad} {
		assert.True(t, hostReads(op), op.String())
	}
	for _, op := range []graph.Op{graph.OpMatMul, graph.OpAttention, graph.OpLayerNorm, graph.OpMSE} {
		assert.False(t, hostReads(op), op.String())
	}
}

// Graphs are on by default, off with ExecutorOptions.NoCUDAGraphs, and
// BATCHFIT_CUDA_GRAPHS overrides the option both ways.
func TestGraphsEnvOverride(t *testing.T) {
	t.Setenv(graphsEnv, "")
	assert.True(t, graphsOn(ExecutorOptions{}))
	assert.False(t, graphsOn(ExecutorOptions{NoCUDAGraphs: true}))
	t.Setenv(graphsEnv, "1")
	assert.True(t, graphsOn(ExecutorOptions{NoCUDAGraphs: true}))
	t.Setenv(graphsEnv, "0")
	assert.False(t, graphsOn(ExecutorOptions{}))
}

// A workspace view keeps the block's address and size as they were.
func TestWorkspaceView(t *testing.T) {
	assert.Nil(t, viewOf(nil))
	w := &wsView{p: 0x100, n: 32}
	assert.EqualValues(t, 0x100, w.Ptr())
	assert.EqualValues(t, 32, w.Requested())
}

// A segment is noted the first time it comes and captured the second, so
// a fingerprint that changes every step is never captured; short segments,
// failed captures and segments beyond graphSegments are never captured,
// and a captured one is launched, not captured again.
func TestDecideCapturesOnSecondSighting(t *testing.T) {
	pg := newProgGraphs()
	pg.calls = 1
	fp := []uint64{1, 2, 3}
	sg, capture := pg.decide(fp, 5)
	require.NotNil(t, sg)
	assert.False(t, capture, "first sighting: eager")
	fp[0] = 9 // the caller reuses its slice: the segment keeps its own words
	pg.calls = 2
	again, capture := pg.decide([]uint64{1, 2, 3}, 5)
	assert.Same(t, sg, again)
	assert.True(t, capture, "second sighting: capture")
	assert.Equal(t, uint64(2), sg.used)
	sg.exec = 7 // captured
	_, capture = pg.decide([]uint64{1, 2, 3}, 5)
	assert.False(t, capture, "captured: launch it")

	short := []uint64{4}
	pg.decide(short, 1)
	_, capture = pg.decide(short, 1)
	assert.False(t, capture, "too short to capture")

	failed, _ := pg.decide([]uint64{5}, 3)
	failed.failed = true
	_, capture = pg.decide([]uint64{5}, 3)
	assert.False(t, capture, "a failed capture is not tried again")

	for i := pg.n; i < graphSegments; i++ {
		pg.add(&segGraph{fp: []uint64{1000 + uint64(i)}})
	}
	full, capture := pg.decide([]uint64{6}, 3)
	assert.Nil(t, full, "beyond graphSegments nothing is noted")
	assert.False(t, capture)
}
