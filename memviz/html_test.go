package memviz_test

import (
	"bytes"
	"encoding/json"
	"math/rand/v2"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/memviz"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/optim"
	"github.com/batchfit/batchfit/planner"
)

// pageData is the part of a report page's embedded JSON the tests check.
type pageData struct {
	Title             string  `json:"title"`
	Unit              int64   `json:"unit"`
	Points            int     `json:"points"`
	Index             []int   `json:"index"`
	Allocated         []int64 `json:"allocated"`
	Reserved          []int64 `json:"reserved"`
	MeasuredAllocated []int64 `json:"measured_allocated"`
	Peak              int     `json:"peak"`
	Kinds             []string
	Tensors           struct {
		Strings []string `json:"strings"`
		Rows    [][]any  `json:"rows"`
	} `json:"tensors"`
	Live struct {
		T []int   `json:"t"`
		S []int   `json:"s"`
		E []int   `json:"e"`
		B []int64 `json:"b"`
	} `json:"live"`
	Segments []struct {
		Size   int64      `json:"size"`
		Blocks [][4]int64 `json:"blocks"`
	} `json:"segments"`
	Alternatives []memviz.Alternative `json:"alternatives"`
}

var dataRE = regexp.MustCompile(`(?s)<script id="data" type="application/json">(.*?)</script>`)

// readPage writes p's page and decodes its data.
func readPage(t *testing.T, p *planner.Program, chunks []planner.Chunk, sim *memviz.Simulation, o memviz.HTMLOptions) (string, pageData) {
	t.Helper()
	var b bytes.Buffer
	require.NoError(t, memviz.WriteHTML(&b, p, chunks, sim, o))
	m := dataRE.FindStringSubmatch(b.String())
	require.NotNil(t, m, "the page embeds its data")
	var d pageData
	require.NoError(t, json.Unmarshal([]byte(m[1]), &d))
	return b.String(), d
}

// checkPage checks that the live tensors at every point the page carries
// add up to its allocated bytes, and that its peak is the simulation's,
// with the segment map holding the tensors live there.
func checkPage(t *testing.T, d pageData, sim *memviz.Simulation) {
	t.Helper()
	peak := checkLive(t, d)
	assert.Equal(t, sim.Usage.PeakAllocated, peak)
	assert.Equal(t, sim.Usage.PeakAllocated, checkSegments(t, d, d.Peak), "the segment map is the allocator's state at the peak")
}

// checkLive checks that the live tensors at every carried point add up to
// its allocated bytes and returns the largest.
func checkLive(t *testing.T, d pageData) int64 {
	t.Helper()
	n := len(d.Index)
	require.Len(t, d.Allocated, n)
	live := make([]int64, n+1)
	for i := range d.Live.T {
		require.Less(t, d.Live.S[i], d.Live.E[i], "lifetime %d", i)
		live[d.Live.S[i]] += d.Live.B[i]
		live[d.Live.E[i]] -= d.Live.B[i]
	}
	var sum, peak int64
	for j := range n {
		sum += live[j]
		require.Equal(t, d.Allocated[j]*d.Unit, sum*d.Unit, "carried point %d (point %d): live tensors against allocated bytes", j, d.Index[j])
		peak = max(peak, d.Allocated[j]*d.Unit)
	}
	assert.Equal(t, peak, d.Allocated[d.Peak]*d.Unit)
	return peak
}

// checkSegments checks that the segment map's blocks are the tensors live
// at carried point j and returns their bytes.
func checkSegments(t *testing.T, d pageData, j int) int64 {
	t.Helper()
	var alloc int64
	inSegments := map[int64]int64{} // tensor → bytes of its blocks
	for _, s := range d.Segments {
		for _, b := range s.Blocks {
			if b[2] >= 0 {
				alloc += b[1] * d.Unit
				inSegments[b[2]] += b[1] // by name below: a block and a lifetime may be two tensors of one name
			}
		}
	}
	name := func(ti int64) string { return d.Tensors.Rows[ti][0].(string) }
	live, held := map[string]int64{}, map[string]int64{}
	for i, ti := range d.Live.T {
		if d.Live.S[i] <= j && j < d.Live.E[i] {
			live[name(int64(ti))] += d.Live.B[i]
		}
	}
	for ti, b := range inSegments {
		held[name(ti)] += b
	}
	assert.Equal(t, live, held, "the segment map's blocks are the tensors live at carried point %d", j)
	return alloc
}

// simulated compiles m's training step on a batch of b with slots
// optimizer state slots and simulates it in k chunks.
func simulated(t *testing.T, m nn.Module, seed uint64, b, k, slots int) (trainStep, []planner.Chunk, *memviz.Simulation) {
	t.Helper()
	rng := rand.New(rand.NewPCG(seed, seed+1))
	x, y := batch(rng, b, nIn, nOut)
	s := compileStep(t, m, x, y, slots)
	chunks := planner.Chunks(b, k)
	sim, err := memviz.Simulate(s.prog, chunks, memviz.SimOptions{})
	require.NoError(t, err)
	return s, chunks, sim
}

func TestWriteHTML(t *testing.T) {
	for _, k := range []int{1, 3} { // whole batch, then three chunks with accumulators
		s, chunks, sim := simulated(t, newMLP(5), 21, 6, k, 2)
		e, a := tracedExecutor()
		r := execute(t, e, a, s, chunks, optim.NewAdam(1e-3))
		html, d := readPage(t, s.prog, chunks, sim, memviz.HTMLOptions{Title: "mlp", Measured: r.res.Usage.Timeline, MeasuredLabel: "CPU executor"})
		checkPage(t, d, sim)
		assert.Equal(t, len(sim.Usage.Timeline), d.Points)
		assert.Len(t, d.Index, d.Points, "a small step is carried whole")
		assert.Equal(t, d.Allocated, d.MeasuredAllocated, "a first step on a fresh device measures what was predicted")
		names := map[string]bool{}
		for _, row := range d.Tensors.Rows {
			names[row[0].(string)] = true
		}
		for _, want := range []string{"fc1.weight", "fc1.weight.grad", "fc1.weight.exp_avg_sq", "fc2.bias.exp_avg"} {
			assert.True(t, names[want], "tensor %s is named", want)
		}
		assert.Empty(t, d.Alternatives)
		assert.NotContains(t, html, `"alternatives"`, "no alternatives, nothing said of them")
		checkOffline(t, html)
	}
}

// TestWriteHTMLMerges bounds the points a page carries: merged points keep
// the peak and the live tensors still add up.
func TestWriteHTMLMerges(t *testing.T) {
	s, chunks, sim := simulated(t, newMLP(6), 23, 8, 4, 2)
	for _, limit := range []int{7, 40, 1} {
		_, d := readPage(t, s.prog, chunks, sim, memviz.HTMLOptions{MaxPoints: limit})
		assert.LessOrEqual(t, len(d.Index), limit)
		assert.Greater(t, d.Points, limit)
		checkPage(t, d, sim)
	}
}

func TestWriteHTMLAlternatives(t *testing.T) {
	s, chunks, sim := simulated(t, newMLP(7), 25, 4, 1, 1)
	alt := memviz.Alternative{Name: "recompute fc1", Chunk: 4, PeakReserved: 4 << 20, Description: "drop fc1's activations, run it again in backward"}
	_, d := readPage(t, s.prog, chunks, sim, memviz.HTMLOptions{Alternatives: []memviz.Alternative{alt}})
	assert.Equal(t, []memviz.Alternative{alt}, d.Alternatives)
}

// TestWriteHTMLEscapes builds a model whose module names are markup: the
// page must carry them as data, never as markup.
func TestWriteHTMLEscapes(t *testing.T) {
	const evil = `</script><img src=x onerror=alert(1)>`
	m := nn.NewSequentialNamed(
		nn.Child{Name: evil, Module: nn.NewLinear(nn.Seed(1), nIn, nHidden, true)},
		nn.Child{Name: "act", Module: nn.ReLU{}},
		nn.Child{Name: "fc2", Module: nn.NewLinear(nn.Seed(2), nHidden, nOut, true)},
	)
	s, chunks, sim := simulated(t, m, 27, 4, 1, 2)
	html, d := readPage(t, s.prog, chunks, sim, memviz.HTMLOptions{Title: evil, Subtitle: evil,
		Alternatives: []memviz.Alternative{{Name: evil, Description: evil}}})
	assert.Equal(t, evil, d.Title)
	found := false
	for _, row := range d.Tensors.Rows {
		found = found || strings.HasPrefix(row[0].(string), evil)
	}
	assert.True(t, found, "the hostile name is kept, as data")
	assert.NotContains(t, html, "<img")
	assert.Equal(t, 2, strings.Count(html, "</script>"), "only the page's own two script elements end")
	assert.Contains(t, html, `\u003c/script\u003e\u003cimg`)
	data := dataRE.FindStringSubmatch(html)[1]
	assert.NotContains(t, data, "<", "the data carries no markup")
	assert.NotContains(t, data, ">")
	checkOffline(t, strings.Replace(html, data, "", 1))
}

// offlineRE finds anything that would make a browser fetch: a URL, a
// protocol-relative or resource attribute, CSS imports and urls, script
// loaders.
var offlineRE = regexp.MustCompile(`(?i)(https?:|ftp:|wss?:|data:|//[a-z0-9.-]+\.[a-z]{2,}|\bsrc\s*=|\bhref\s*=|<link|<img|<iframe|<object|<embed|url\(|@import|\bfetch\(|XMLHttpRequest|sendBeacon|WebSocket|EventSource|importScripts|\bimport\(|new Image|\.src\s*=)`)

// checkOffline asserts that a page fetches nothing: no external URL at all
// (a test whose names are markup checks the page without its data, which
// a browser only parses as JSON and shows as text).
func checkOffline(t *testing.T, html string) {
	t.Helper()
	assert.Empty(t, offlineRE.FindAllString(html, 10), "the page must not reach the network")
	assert.True(t, strings.HasPrefix(html, "<!DOCTYPE html>"))
}

// snapshotPage writes a snapshot as a pickle, reads it back as a file
// would be read, and makes its page.
func snapshotPage(t *testing.T, s memviz.Snapshot, o memviz.HTMLOptions) (string, pageData) {
	t.Helper()
	var pk bytes.Buffer
	require.NoError(t, memviz.WritePickle(&pk, s))
	back, err := memviz.ReadPickle(&pk)
	require.NoError(t, err)
	var b bytes.Buffer
	require.NoError(t, memviz.WriteHTMLSnapshot(&b, back, o))
	m := dataRE.FindStringSubmatch(b.String())
	require.NotNil(t, m)
	var d pageData
	require.NoError(t, json.Unmarshal([]byte(m[1]), &d))
	return b.String(), d
}

// TestWriteHTMLSnapshot draws a snapshot file: its trace's blocks add up
// to the allocated bytes after every event, whole or cut short, and its
// segments are the blocks live after the last event.
func TestWriteHTMLSnapshot(t *testing.T) {
	rng := rand.New(rand.NewPCG(29, 30))
	x, y := batch(rng, 6, nIn, nOut)
	s := compileStep(t, newMLP(8), x, y, 2)
	chunks := planner.Chunks(6, 2)
	for _, entries := range []int{traceEntries, 25, 0} { // whole trace, its last 25 events, none
		sim, err := memviz.Simulate(s.prog, chunks, memviz.SimOptions{TraceEntries: entries})
		require.NoError(t, err)
		snap := memviz.NewSnapshot(0, sim.Snapshot)
		html, d := snapshotPage(t, snap, memviz.HTMLOptions{})
		checkOffline(t, html)
		assert.Equal(t, len(sim.Snapshot.Trace)+1, d.Points)
		peak := checkLive(t, d)
		last := len(d.Index) - 1
		assert.Equal(t, snap.Allocated(), d.Allocated[last]*d.Unit)
		assert.Equal(t, snap.Allocated(), checkSegments(t, d, last), "the segments are the snapshot's")
		if entries == traceEntries {
			assert.Equal(t, sim.Usage.PeakAllocated, peak, "the trace runs up to the peak")
		}
	}
}

// TestWriteHTMLSnapshotEscapes reads a pickle whose frames are markup.
func TestWriteHTMLSnapshotEscapes(t *testing.T) {
	const evil = `</script><img src=x onerror=alert(1)>`
	const url = "https://example.invalid/x.js"
	a := alloc.New(alloc.NewSimBackend(1<<30), alloc.Options{TraceEntries: 16})
	_, err := a.Malloc(512, alloc.Tag{Node: 3, Op: url, Scope: "//cdn.example.invalid/lib"})
	require.NoError(t, err)
	b1, err := a.Malloc(4096, alloc.Tag{Node: 1, Op: evil, Scope: evil})
	require.NoError(t, err)
	_, err = a.Malloc(1<<20, alloc.Tag{Node: 2, Op: "matmul", Scope: evil + ".fc"})
	require.NoError(t, err)
	require.NoError(t, a.Free(b1))
	html, d := snapshotPage(t, memviz.NewSnapshot(0, a.Snapshot()), memviz.HTMLOptions{Title: evil})
	assert.Equal(t, evil, d.Title)
	assert.NotContains(t, html, "<img")
	assert.Equal(t, 2, strings.Count(html, "</script>"))
	data := dataRE.FindStringSubmatch(html)[1]
	assert.NotContains(t, data, "<")
	assert.NotContains(t, html, "://", "a name that is a URL is no address in the file")
	assert.NotContains(t, html, "//cdn")
	checkOffline(t, strings.Replace(html, data, "", 1))
	checkLive(t, d)
	names := strings.Join(d.Tensors.Strings, " ")
	for _, row := range d.Tensors.Rows {
		names += " " + row[0].(string)
	}
	assert.Contains(t, names, url, "and it reads back as the same name")
}

// TestWriteHTMLSnapshotInconsistent draws a trace that contradicts itself
// (frees of blocks never allocated, an address allocated twice, sizes
// below zero) without failing or panicking: a file is outside data.
func TestWriteHTMLSnapshotInconsistent(t *testing.T) {
	a := alloc.New(alloc.NewSimBackend(1<<30), alloc.Options{TraceEntries: 16})
	_, err := a.Malloc(4096, alloc.Tag{Node: 1, Op: "x"})
	require.NoError(t, err)
	s := memviz.NewSnapshot(0, a.Snapshot())
	tr := s.Devices[0].Trace
	s.Devices[0].Trace = append(tr,
		alloc.Event{Kind: alloc.EventFree, Addr: 0xdead, Size: 1 << 40, Allocated: -5},
		alloc.Event{Kind: alloc.EventAlloc, Addr: tr[len(tr)-1].Addr, Size: -7, Allocated: 1 << 50},
		alloc.Event{Kind: alloc.EventOOM, Size: 1},
		alloc.Event{Kind: alloc.EventKind(200)})
	var b bytes.Buffer
	require.NoError(t, memviz.WriteHTMLSnapshot(&b, s, memviz.HTMLOptions{MaxPoints: 3}))
	checkOffline(t, b.String())
	assert.Error(t, memviz.WriteHTMLSnapshot(&b, memviz.Snapshot{}, memviz.HTMLOptions{}), "no device")
}
