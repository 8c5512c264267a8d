package memviz_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/exec/cpu"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/memviz"
	"github.com/batchfit/batchfit/models"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/optim"
	"github.com/batchfit/batchfit/planner"
	"github.com/batchfit/batchfit/shapeinfer"
)

// mlpParams are the MLP's parameter names and shapes, written out by hand.
var mlpParams = []struct {
	name  string
	shape []int
}{
	{"fc1.weight", []int{nHidden, nIn}}, {"fc1.bias", []int{nHidden}},
	{"fc2.weight", []int{nOut, nHidden}}, {"fc2.bias", []int{nOut}},
}

func numel(shape []int) int64 {
	n := int64(1)
	for _, d := range shape {
		n *= int64(d)
	}
	return n
}

// byName indexes a device report's tensors. Names of parameters,
// gradients and state are unique; activations are named by module path
// and op, so two inputs are both "input": those are keyed "input#node".
func byName(t *testing.T, d memviz.DeviceReport) map[string]memviz.Tensor {
	t.Helper()
	m := map[string]memviz.Tensor{}
	for _, x := range d.Tensors {
		k := x.Name
		if _, dup := m[k]; dup {
			require.Equal(t, memviz.KindActivation, x.Kind, "tensor %q listed twice", x.Name)
			k = fmt.Sprintf("%s#%d", x.Name, x.Node)
		}
		m[k] = x
	}
	return m
}

// checkTotals checks the itemisation against the allocator's own count.
func checkTotals(t *testing.T, d memviz.DeviceReport, stats alloc.Stats) {
	t.Helper()
	tot := d.Totals
	assert.Equal(t, stats.AllocatedBytes[alloc.All].Current, tot.Allocated, "allocated")
	assert.Equal(t, stats.ReservedBytes[alloc.All].Current, tot.Reserved, "reserved")
	assert.Equal(t, tot.Allocated, tot.Tensors+tot.Rounding+tot.Workspace+tot.Unowned, "itemised remainder")
	var rows, requested, kinds int64
	for _, x := range d.Tensors {
		rows += x.Size
		if x.Kind != memviz.KindWorkspace && x.Kind != memviz.KindUnknown && x.AliasOf == "" {
			requested += x.Requested
		}
	}
	for _, v := range tot.ByKind {
		kinds += v
	}
	assert.Equal(t, tot.Allocated, rows, "rows add up to the allocated bytes, aliases counted once")
	assert.Equal(t, tot.Tensors, requested)
	assert.Equal(t, tot.Allocated, kinds)
}

func TestReportNamesParamsGradsAndAdamState(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	x, y := batch(rng, 6, nIn, nOut)
	s := compileStep(t, newMLP(1), x, y, 2)
	e, a := tracedExecutor()
	r := execute(t, e, a, s, planner.ChunksOf(6, 6), optim.NewAdam(1e-3))

	// During the update: parameters, their gradients and Adam's two slots.
	rep, err := memviz.NewReport(s.prog, memviz.NewSnapshot(0, r.inUpdate), memviz.Options{})
	require.NoError(t, err)
	require.Len(t, rep.Devices, 1)
	d := rep.Devices[0]
	checkTotals(t, d, r.inUpdateStats)
	got := byName(t, d)
	var want int64
	for _, p := range mlpParams {
		bytes := 4 * numel(p.shape)
		for suffix, kind := range map[string]memviz.Kind{"": memviz.KindParam, ".grad": memviz.KindGrad,
			".exp_avg": memviz.KindState, ".exp_avg_sq": memviz.KindState} {
			x, ok := got[p.name+suffix]
			if !assert.True(t, ok, "missing %s%s", p.name, suffix) {
				continue
			}
			assert.Equal(t, kind, x.Kind, x.Name)
			assert.Equal(t, p.shape, x.Shape, x.Name)
			assert.Equal(t, "float32", x.DType, x.Name)
			assert.Equal(t, bytes, x.Requested, x.Name)
			assert.Equal(t, roundUp(bytes), x.Size, x.Name)
			want += roundUp(bytes)
		}
	}
	assert.Len(t, d.Tensors, 4*len(mlpParams), "nothing else is live during the update")
	assert.Equal(t, want, d.Totals.Allocated)
	assert.Zero(t, d.Totals.Unowned)
	assert.Zero(t, d.Totals.Workspace)

	// After the step the gradients are gone; parameters and state stay.
	after, err := memviz.NewReport(s.prog, memviz.NewSnapshot(0, a.Snapshot()), memviz.Options{})
	require.NoError(t, err)
	checkTotals(t, after.Devices[0], a.Stats())
	for _, x := range after.Devices[0].Tensors {
		assert.Contains(t, []memviz.Kind{memviz.KindParam, memviz.KindState}, x.Kind, x.Name)
	}
	assert.Len(t, after.Devices[0].Tensors, 3*len(mlpParams))

	var text, js bytes.Buffer
	require.NoError(t, rep.WriteText(&text))
	assert.Contains(t, text.String(), "fc1.weight.exp_avg_sq")
	assert.Contains(t, text.String(), "= allocated")
	require.NoError(t, rep.WriteJSON(&js))
	var back memviz.Report
	require.NoError(t, json.Unmarshal(js.Bytes(), &back))
	assert.Equal(t, *rep, back)
}

func TestReportSGDMomentumAndChunkedGradients(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	x, y := batch(rng, 8, nIn, nOut)
	s := compileStep(t, newMLP(2), x, y, 1)
	e, a := tracedExecutor()
	// Two chunks: the gradients are summed in accumulators.
	r := execute(t, e, a, s, planner.ChunksOf(8, 4), optim.NewSGD(0.1, 0.9))
	rep, err := memviz.NewReport(s.prog, memviz.NewSnapshot(0, r.inUpdate), memviz.Options{})
	require.NoError(t, err)
	d := rep.Devices[0]
	checkTotals(t, d, r.inUpdateStats)
	got := byName(t, d)
	for _, p := range mlpParams {
		for _, suffix := range []string{"", ".grad", ".momentum_buffer"} {
			x, ok := got[p.name+suffix]
			if assert.True(t, ok, "missing %s%s", p.name, suffix) {
				assert.Equal(t, p.shape, x.Shape)
			}
		}
	}

	// Names given by the caller win.
	rep, err = memviz.NewReport(s.prog, memviz.NewSnapshot(0, r.inUpdate), memviz.Options{StateNames: []string{"velocity"}})
	require.NoError(t, err)
	assert.Contains(t, byName(t, rep.Devices[0]), "fc2.bias.velocity")
}

// snapshotAt is a planner.Hooks that runs nothing and calls at when a node
// with op runs for the first time.
type snapshotAt struct {
	op graph.Op
	at func()
	ok bool
}

func (h *snapshotAt) Resident(planner.Buffer) *alloc.Block    { return nil }
func (h *snapshotAt) Fill(planner.Buffer, *alloc.Block) error { return nil }
func (h *snapshotAt) Freed(planner.Buffer, *alloc.Block)      {}
func (h *snapshotAt) ChunkDone(planner.Chunk, []*alloc.Block, []*alloc.Block) error {
	return nil
}
func (h *snapshotAt) Finish([]*alloc.Block, *alloc.Block) error { return nil }
func (h *snapshotAt) EveryChunk() bool                          { return true }
func (h *snapshotAt) Run(nd *graph.Node, _ planner.Chunk, _ *alloc.Block, _ []*alloc.Block, _ *alloc.Block) error {
	if nd.Op == h.op && !h.ok {
		h.ok = true
		h.at()
	}
	return nil
}

func TestReportItemisesWorkspaceAndUnownedBlocks(t *testing.T) {
	const b, size, ch, width = 3, 8, 2, 3
	cfg := models.ConvNetConfig{Channels: ch, Size: size, Widths: []int{width}, Classes: 5}
	m := models.NewConvNet(nn.Seed(5), cfg)
	rng := rand.New(rand.NewPCG(5, 6))
	img := make([]float32, b*ch*size*size)
	for i := range img {
		img[i] = float32(rng.NormFloat64())
	}
	x := tensor.New(tensor.WithShape(b, ch, size, size), tensor.WithBacking(img))
	_, y := batch(rng, b, 1, cfg.Classes)
	s := compileStep(t, m, x, y, 2)

	// Replay on a traced simulated device and stop in the convolution,
	// with a block no program buffer explains beside it.
	a := alloc.New(alloc.NewSimBackend(1<<40), alloc.Options{TraceEntries: traceEntries})
	var snap alloc.Snapshot
	var stats alloc.Stats
	const strayBytes = 1000
	h := &snapshotAt{op: graph.OpConv2d, at: func() {
		stray, err := a.Malloc(strayBytes, alloc.Tag{Node: -1})
		require.NoError(t, err)
		snap, stats = a.Snapshot(), a.Stats()
		require.NoError(t, a.Free(stray))
	}}
	_, err := planner.Replay(s.prog, planner.ChunksOf(b, b), a, h, false)
	require.NoError(t, err)
	require.True(t, h.ok)

	rep, err := memviz.NewReport(s.prog, memviz.NewSnapshot(0, snap), memviz.Options{})
	require.NoError(t, err)
	d := rep.Devices[0]
	checkTotals(t, d, stats)
	assert.Equal(t, roundUp(strayBytes), d.Totals.Unowned)
	// The unfolded patches of a 3×3 convolution with padding 1:
	// [C·3·3, H·W] float32.
	assert.Equal(t, roundUp(ch*3*3*size*size*4), d.Totals.Workspace)
	got := byName(t, d)
	conv := got["0/conv2d"]
	assert.Equal(t, memviz.KindActivation, conv.Kind)
	assert.Equal(t, []int{b, width, size, size}, conv.Shape)
	assert.Equal(t, int64(b*width*size*size*4), conv.Requested)
	ws := got["0/conv2d.workspace"]
	assert.Equal(t, memviz.KindWorkspace, ws.Kind)
	assert.Equal(t, memviz.KindUnknown, got["<unknown>"].Kind)
	assert.Equal(t, []int{b, ch, size, size}, got["input"].Shape)
	assert.Equal(t, memviz.KindParam, got["0.weight"].Kind)
}

func TestReportSharedParameterBlockShownOnce(t *testing.T) {
	// Two parameters over the same data: a resident executor uploads it
	// once, and the report lists the second as pointing at the first.
	rng := rand.New(rand.NewPCG(7, 8))
	w := make([]float32, nIn*nIn)
	for i := range w {
		w[i] = float32(rng.Float64() - 0.5)
	}
	wt := tensor.New(tensor.WithShape(nIn, nIn), tensor.WithBacking(w))
	p1, p2 := lazy.Param(wt, "enc.weight"), lazy.Param(wt, "dec.weight")
	xd, _ := batch(rng, 5, nIn, 2)
	in := lazy.Wrap(xd, 0)
	out := in.Linear(p1, nil).Tanh().Linear(p2, nil)
	g := in.Graph().IR()
	info, err := shapeinfer.Analyze(g, out.ID())
	require.NoError(t, err)
	prog, err := planner.Compile(g, info, []int{out.ID()}, planner.CompileOptions{Workspace: cpu.Workspace})
	require.NoError(t, err)
	e, a := tracedExecutor()
	_, err = e.Execute(context.Background(), prog, planner.ChunksOf(5, 5), cpu.ExecOptions{Resident: true})
	require.NoError(t, err)

	rep, err := memviz.NewReport(prog, memviz.NewSnapshot(0, a.Snapshot()), memviz.Options{})
	require.NoError(t, err)
	d := rep.Devices[0]
	checkTotals(t, d, a.Stats())
	got := byName(t, d)
	require.Len(t, d.Tensors, 2)
	host, alias := got["enc.weight"], got["dec.weight"]
	assert.Equal(t, roundUp(nIn*nIn*4), host.Size)
	assert.Equal(t, []string{"dec.weight"}, host.Aliases)
	assert.Equal(t, "enc.weight", alias.AliasOf)
	assert.Zero(t, alias.Size)
	assert.Equal(t, host.Addr, alias.Addr)
	assert.Equal(t, []int{nIn, nIn}, alias.Shape)
	assert.Equal(t, roundUp(nIn*nIn*4), d.Totals.Allocated)
}

func TestReportWithoutProgramUsesTags(t *testing.T) {
	rng := rand.New(rand.NewPCG(9, 10))
	x, y := batch(rng, 4, nIn, nOut)
	s := compileStep(t, newMLP(3), x, y, 2)
	e, a := tracedExecutor()
	r := execute(t, e, a, s, planner.ChunksOf(4, 4), optim.NewAdam(1e-3))
	rep, err := memviz.NewReport(nil, memviz.NewSnapshot(0, r.inUpdate), memviz.Options{})
	require.NoError(t, err)
	d := rep.Devices[0]
	checkTotals(t, d, r.inUpdateStats)
	kinds := map[memviz.Kind]int{}
	for _, x := range d.Tensors {
		kinds[x.Kind]++
		assert.Nil(t, x.Shape, "a tag has no shape")
	}
	assert.Equal(t, map[memviz.Kind]int{memviz.KindParam: 4, memviz.KindState: 8, memviz.KindActivation: 4}, kinds,
		"without the program a kept gradient reads as the activation it is")
}

func TestReportRefusesInconsistentSnapshots(t *testing.T) {
	seg := func(addr alloc.Ptr, size int64, blocks ...alloc.BlockInfo) alloc.SegmentInfo {
		return alloc.SegmentInfo{Addr: addr, Size: size, Pool: alloc.SmallPool, Blocks: blocks}
	}
	blk := func(addr alloc.Ptr, size, req int64, st alloc.BlockState) alloc.BlockInfo {
		return alloc.BlockInfo{Addr: addr, Size: size, Requested: req, State: st}
	}
	for name, s := range map[string]memviz.Snapshot{
		"gap between blocks": {Devices: []memviz.DeviceSnapshot{{Segments: []alloc.SegmentInfo{
			seg(0x1000, 1024, blk(0x1000, 512, 512, alloc.ActiveAllocated), blk(0x1400, 512, 0, alloc.Inactive))}}}},
		"blocks short of the segment": {Devices: []memviz.DeviceSnapshot{{Segments: []alloc.SegmentInfo{
			seg(0x1000, 2048, blk(0x1000, 512, 512, alloc.ActiveAllocated))}}}},
		"overlapping segments": {Devices: []memviz.DeviceSnapshot{{Segments: []alloc.SegmentInfo{
			seg(0x1000, 1024, blk(0x1000, 1024, 0, alloc.Inactive)), seg(0x1200, 512, blk(0x1200, 512, 0, alloc.Inactive))}}}},
		"requested beyond the block": {Devices: []memviz.DeviceSnapshot{{Segments: []alloc.SegmentInfo{
			seg(0x1000, 512, blk(0x1000, 512, 513, alloc.ActiveAllocated))}}}},
		"unknown state": {Devices: []memviz.DeviceSnapshot{{Segments: []alloc.SegmentInfo{
			seg(0x1000, 512, blk(0x1000, 512, 0, "gone"))}}}},
		"device twice": {Devices: []memviz.DeviceSnapshot{{Device: 1}, {Device: 1}}},
	} {
		_, err := memviz.NewReport(nil, s, memviz.Options{})
		assert.True(t, errors.Is(err, memviz.ErrSnapshot), "%s: %v", name, err)
	}
}
