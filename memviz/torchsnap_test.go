package memviz_test

import (
	"bytes"
	"encoding/json"
	"errors"
	"flag"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/memviz"
	"github.com/batchfit/batchfit/optim"
	"github.com/batchfit/batchfit/planner"
)

var update = flag.Bool("update", false, "rewrite testdata golden files")

const seg0 = alloc.Ptr(0x100000000)

// tinySnapshot is a hand-made state: a 2 MiB small segment holding a
// parameter and an activation, after a third block was allocated and
// freed.
func tinySnapshot() memviz.Snapshot {
	param := alloc.Tag{Node: 2, Op: "param", Scope: "fc1.weight"}
	linear := alloc.Tag{Node: 4, Op: "linear", Scope: "fc1"}
	relu := alloc.Tag{Node: 5, Op: "relu", Scope: "act"}
	const mib2 = 2 << 20
	return memviz.Snapshot{Devices: []memviz.DeviceSnapshot{{
		Device: 0,
		Segments: []alloc.SegmentInfo{{Addr: seg0, Size: mib2, Pool: alloc.SmallPool, Allocated: 1536, Blocks: []alloc.BlockInfo{
			{Addr: seg0, Size: 512, Requested: 400, State: alloc.ActiveAllocated, Tag: param},
			{Addr: seg0 + 512, Size: 1024, Requested: 1000, State: alloc.ActiveAllocated, Tag: linear},
			{Addr: seg0 + 1536, Size: mib2 - 1536, State: alloc.Inactive, Tag: alloc.Tag{Node: -1}},
		}}},
		Trace: []alloc.Event{
			{Seq: 0, Kind: alloc.EventSegmentAlloc, Addr: seg0, Size: mib2, Tag: param, Allocated: 0, Reserved: mib2},
			{Seq: 1, Kind: alloc.EventAlloc, Addr: seg0, Size: 512, Tag: param, Allocated: 512, Reserved: mib2},
			{Seq: 2, Kind: alloc.EventAlloc, Addr: seg0 + 512, Size: 1024, Tag: linear, Allocated: 1536, Reserved: mib2},
			{Seq: 3, Kind: alloc.EventAlloc, Addr: seg0 + 1536, Size: 512, Tag: relu, Allocated: 2048, Reserved: mib2},
			{Seq: 4, Kind: alloc.EventFree, Addr: seg0 + 1536, Size: 512, Tag: relu, Allocated: 1536, Reserved: mib2},
		},
	}}}
}

// tinyJSON is tinySnapshot as torch.cuda.memory._snapshot() would give it,
// written out by hand (tuples as JSON lists).
const tinyJSON = `{
 "segments": [{
  "device": 0, "address": 4294967296, "total_size": 2097152, "allocated_size": 1536, "active_size": 1536,
  "requested_size": 1400, "stream": 0, "segment_type": "small", "segment_pool_id": [0, 0],
  "is_expandable": false, "frames": [],
  "blocks": [
   {"address": 4294967296, "size": 512, "requested_size": 400, "state": "active_allocated",
    "frames": [{"filename": "fc1.weight", "line": 2, "name": "param"}]},
   {"address": 4294967808, "size": 1024, "requested_size": 1000, "state": "active_allocated",
    "frames": [{"filename": "fc1", "line": 4, "name": "linear"}]},
   {"address": 4294968832, "size": 2095616, "requested_size": 0, "state": "inactive", "frames": []}
  ]}],
 "device_traces": [[
  {"action": "segment_alloc", "addr": 4294967296, "frames": [{"filename": "fc1.weight", "line": 2, "name": "param"}], "size": 2097152, "stream": 0, "time_us": 0},
  {"action": "alloc", "addr": 4294967296, "frames": [{"filename": "fc1.weight", "line": 2, "name": "param"}], "size": 512, "stream": 0, "time_us": 1},
  {"action": "alloc", "addr": 4294967808, "frames": [{"filename": "fc1", "line": 4, "name": "linear"}], "size": 1024, "stream": 0, "time_us": 2},
  {"action": "alloc", "addr": 4294968832, "frames": [{"filename": "act", "line": 5, "name": "relu"}], "size": 512, "stream": 0, "time_us": 3},
  {"action": "free_requested", "addr": 4294968832, "frames": [{"filename": "act", "line": 5, "name": "relu"}], "size": 512, "stream": 0, "time_us": 4},
  {"action": "free_completed", "addr": 4294968832, "frames": [{"filename": "act", "line": 5, "name": "relu"}], "size": 512, "stream": 0, "time_us": 4}
 ]]
}`

const tinyGolden = "testdata/tiny_snapshot.pickle"

func TestPickleGoldenTinySnapshot(t *testing.T) {
	var b bytes.Buffer
	require.NoError(t, memviz.WritePickle(&b, tinySnapshot()))
	if *update {
		require.NoError(t, os.MkdirAll("testdata", 0o755))
		require.NoError(t, os.WriteFile(tinyGolden, b.Bytes(), 0o644))
	}
	want, err := os.ReadFile(tinyGolden)
	require.NoError(t, err)
	assert.Equal(t, want, b.Bytes(), "encoding changed; rerun with -update if intended")

	back, err := memviz.ReadPickle(bytes.NewReader(want))
	require.NoError(t, err)
	assert.Equal(t, tinySnapshot(), back, "read back, Allocated and Reserved recomputed")
}

// TestPickleGoldenLoadsInPython checks the golden file with Python's own
// unpickler against the layout written out by hand.
func TestPickleGoldenLoadsInPython(t *testing.T) {
	py, err := exec.LookPath("python3")
	if err != nil {
		t.Skip("python3 not found")
	}
	path, err := filepath.Abs(tinyGolden)
	require.NoError(t, err)
	out, err := exec.Command(py, "-c", "import json, pickle, sys\n"+
		"print(json.dumps(pickle.load(open(sys.argv[1], 'rb'))))", path).Output()
	require.NoError(t, err)
	var got, want any
	require.NoError(t, json.Unmarshal(out, &got))
	require.NoError(t, json.Unmarshal([]byte(tinyJSON), &want))
	assert.Equal(t, want, got)
}

// normalised clears the tags of free blocks: a fresh segment's remainder
// carries a zero tag, a freed block Node −1, and neither is written.
func normalised(s memviz.Snapshot) memviz.Snapshot {
	for i := range s.Devices {
		for j := range s.Devices[i].Segments {
			seg := &s.Devices[i].Segments[j]
			for k := range seg.Blocks {
				if seg.Blocks[k].State == alloc.Inactive {
					seg.Blocks[k].Tag = alloc.Tag{Node: -1}
				}
			}
		}
	}
	return s
}

// grownBatch makes the hidden activations 2 MiB: large-pool blocks in a
// 20 MiB segment of their own.
const grownBatch = 32768

// grownRun trains the MLP at batch 4, then at a batch large enough to
// need new segments, on one traced executor; it returns the snapshots
// after each step and the executor's allocator.
func grownRun(t *testing.T) (small, grown memviz.Snapshot, a *alloc.Allocator) {
	t.Helper()
	rng := rand.New(rand.NewPCG(21, 22))
	m := newMLP(8)
	e, a := tracedExecutor()
	opt := optim.NewAdam(1e-3)
	x, y := batch(rng, 4, nIn, nOut)
	execute(t, e, a, compileStep(t, m, x, y, 2), planner.Chunks(4, 1), opt)
	small = memviz.NewSnapshot(0, a.Snapshot())
	x, y = batch(rng, grownBatch, nIn, nOut)
	execute(t, e, a, compileStep(t, m, x, y, 2), planner.Chunks(grownBatch, 1), opt)
	grown = memviz.NewSnapshot(0, a.Snapshot())
	return small, grown, a
}

func TestPickleRoundTripOfATracedRun(t *testing.T) {
	_, _, a := grownRun(t)
	require.NoError(t, a.EmptyCache()) // segment_free events too
	s := memviz.NewSnapshot(0, a.Snapshot())
	kinds := map[alloc.EventKind]int{}
	for _, e := range s.Devices[0].Trace {
		kinds[e.Kind]++
	}
	for _, k := range []alloc.EventKind{alloc.EventAlloc, alloc.EventFree, alloc.EventSegmentAlloc, alloc.EventSegmentFree} {
		require.Positive(t, kinds[k], "the run should record %s events", k)
	}
	var b bytes.Buffer
	require.NoError(t, memviz.WritePickle(&b, s))
	back, err := memviz.ReadPickle(&b)
	require.NoError(t, err)
	assert.Equal(t, normalised(s), back)
}

func TestReadPickleTruncated(t *testing.T) {
	data, err := os.ReadFile(tinyGolden)
	require.NoError(t, err)
	for n := range len(data) {
		_, err := memviz.ReadPickle(bytes.NewReader(data[:n]))
		var fe *memviz.FormatError
		require.True(t, errors.As(err, &fe), "%d bytes: %v", n, err)
		assert.True(t, errors.Is(err, memviz.ErrFormat), "%d bytes", n)
		assert.True(t, errors.Is(err, io.ErrUnexpectedEOF), "%d bytes: %v", n, err)
	}
}

func TestReadPickleCorrupt(t *testing.T) {
	data, err := os.ReadFile(tinyGolden)
	require.NoError(t, err)
	// Flip every byte in turn: the reader either refuses the input with a
	// typed error or reads a snapshot that passes validation.
	for i := range data {
		bad := bytes.Clone(data)
		bad[i] ^= 0xa5
		s, err := memviz.ReadPickle(bytes.NewReader(bad))
		if err != nil {
			assert.True(t, errors.Is(err, memviz.ErrFormat), "byte %d: %v", i, err)
			continue
		}
		assert.NoError(t, s.Validate(), "byte %d", i)
	}
}
