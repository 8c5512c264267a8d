package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/memviz"
)

// chromium finds a headless-capable Chromium: $BATCHFIT_CHROMIUM, else
// Debian's chromium (scripts/install-chromium installs it) or a Chrome
// on PATH; "" when there is none.
func chromium() string {
	if p := os.Getenv("BATCHFIT_CHROMIUM"); p != "" {
		return p
	}
	for _, name := range []string{"chromium", "chromium-browser", "google-chrome", "google-chrome-stable"} {
		if p, err := exec.LookPath(name); err == nil {
			return p
		}
	}
	return ""
}

// artifacts is where the headless test leaves its pages and screenshots:
// $BATCHFIT_ARTIFACTS when set, else a temporary directory.
func artifacts(t *testing.T) string {
	if d := os.Getenv("BATCHFIT_ARTIFACTS"); d != "" {
		require.NoError(t, os.MkdirAll(d, 0o755))
		return d
	}
	return t.TempDir()
}

// headless is what one run of the browser on a page gave.
type headless struct {
	dom        string
	firstPaint float64 // ms from navigation to first contentful paint, −1 when not logged
	wall       time.Duration
}

var firstPaintRE = regexp.MustCompile(`batchfit-report first-contentful-paint-ms=([0-9.]+)`)

// openHeadless loads page in headless Chromium, saves a screenshot of
// its first width×height pixels to png and returns the DOM after the
// page's script ran.
func openHeadless(t *testing.T, browser, page, png string, width, height int) headless {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	profile := t.TempDir() // a fresh profile: no state shared between runs
	cmd := exec.CommandContext(ctx, browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
		"--no-first-run", "--disable-extensions", "--disable-background-networking", "--hide-scrollbars",
		"--user-data-dir="+profile, "--enable-logging=stderr", "--v=0",
		fmt.Sprintf("--window-size=%d,%d", width, height), "--screenshot="+png, "--dump-dom", "file://"+page)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	start := time.Now()
	err := cmd.Run()
	h := headless{dom: stdout.String(), firstPaint: -1, wall: time.Since(start)}
	require.NoError(t, err, "chromium: %s", lastLines(stderr.String(), 5))
	if m := firstPaintRE.FindStringSubmatch(stderr.String()); m != nil {
		h.firstPaint, _ = strconv.ParseFloat(m[1], 64)
	}
	return h
}

func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	return strings.Join(lines[max(0, len(lines)-n):], "\n")
}

// pageJSON is the data a report page embeds.
func pageJSON(t *testing.T, html []byte) []byte {
	t.Helper()
	m := regexp.MustCompile(`(?s)<script id="data" type="application/json">(.*?)</script>`).FindSubmatch(html)
	require.NotNil(t, m, "the page embeds its data")
	return m[1]
}

// bodyAttr reads a data attribute the page's script set on <body>.
func bodyAttr(dom, name string) (string, bool) {
	m := regexp.MustCompile(`<body[^>]*\s` + regexp.QuoteMeta(name) + `="([^"]*)"`).FindStringSubmatch(dom)
	if m == nil {
		return "", false
	}
	return m[1], true
}

// TestHTMLReportHeadless renders the report page of GPT-2 small (in
// chunks) and the ConvNet in headless Chromium and checks that the peak
// the page shows is the plan's predicted peak, to the byte. Screenshots
// and pages stay in $BATCHFIT_ARTIFACTS (or a logged temporary
// directory).
func TestHTMLReportHeadless(t *testing.T) {
	browser := chromium()
	if browser == "" {
		t.Skip("no headless browser: install Debian's chromium (scripts/install-chromium) or set BATCHFIT_CHROMIUM")
	}
	dir := artifacts(t)
	for _, tc := range []struct {
		name string
		args []string
	}{
		{"gpt2-small-written", []string{"--model", "gpt2-small-written", "--batch", "8", "--budget", "8GiB"}},
		{"convnet", []string{"--model", "convnet", "--batch", "256", "--budget", "96MiB"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			page := filepath.Join(dir, "report-"+tc.name+".html")
			code, stdout, stderr := runCLI(append([]string{"snapshot", "-o", page}, tc.args...)...)
			require.Equal(t, exitOK, code, stderr)
			assert.Contains(t, stdout, "(html, ")
			c, err := parseSnapshot(append([]string{"-o", page}, tc.args...))
			require.NoError(t, err)
			s, err := simulate(c.step, 0)
			require.NoError(t, err)
			if tc.name == "convnet" {
				require.Greater(t, len(s.plan.Chunks), 1, "the ConvNet's budget makes it run in chunks")
			}
			html, err := os.ReadFile(page)
			require.NoError(t, err)
			assert.False(t, regexp.MustCompile(`(?i)https?:|\bsrc\s*=|\bhref\s*=|url\(|@import`).Match(html), "the page fetches nothing")

			png := filepath.Join(dir, "report-"+tc.name+".png")
			h := openHeadless(t, browser, page, png, 1280, 1000)
			ready, _ := bodyAttr(h.dom, "data-ready")
			require.Equal(t, "1", ready, "the page's script ran to the end")
			got, ok := bodyAttr(h.dom, "data-peak-allocated")
			require.True(t, ok)
			// The page draws the first step's replay; the plan's peak is the
			// larger of two steps', the second starting from the first's cache
			// (see planner.simulate), where a block carved from a cached
			// segment may keep a remainder too small to split. The headline
			// figures are the plan's, and say so when the second step's are
			// larger than the timeline drawn.
			assert.Equal(t, strconv.FormatInt(s.sim.Usage.PeakAllocated, 10), got, "the peak drawn is the replayed step's peak")
			gotRes, _ := bodyAttr(h.dom, "data-peak-reserved")
			assert.Equal(t, strconv.FormatInt(s.sim.Usage.PeakReserved, 10), gotRes, "the reserved peak of the replay drawn")
			require.GreaterOrEqual(t, s.plan.PeakAllocated, s.sim.Usage.PeakAllocated)
			require.GreaterOrEqual(t, s.plan.PeakReserved, s.sim.Usage.PeakReserved)
			if s.plan.PeakAllocated > s.sim.Usage.PeakAllocated || s.plan.PeakReserved > s.sim.Usage.PeakReserved {
				assert.Contains(t, h.dom, "in the second step, from the first's cache", "the page says where the plan's larger peak comes from")
			}
			assert.Contains(t, h.dom, thousands(s.plan.PeakReserved)+" B", "the figure states the plan's reserved bytes")
			assert.Contains(t, h.dom, thousands(s.plan.PeakAllocated)+" B", "the figure states the exact bytes")
			assert.Contains(t, h.dom, `id="peaklabel"`, "the timeline marks the peak")
			assert.NotContains(t, h.dom, "<img")
			info, err := os.Stat(png)
			require.NoError(t, err, "a screenshot was saved")
			assert.Greater(t, info.Size(), int64(10_000))
			render, _ := bodyAttr(h.dom, "data-render-ms")
			drawn, _ := bodyAttr(h.dom, "data-drawn-ms")
			t.Logf("%s: page %s (%d B), %d chunks; first contentful paint %.0f ms, drawn %s ms after navigation (script %s ms), browser run %v; screenshot %s",
				tc.name, alloc.FormatBytes(int64(len(html))), len(html), len(s.plan.Chunks), h.firstPaint, drawn, render, h.wall.Round(time.Millisecond), png)
		})
	} // A snapshot file whose names are markup, through report FILE -o: the
	// browser shows them as text and runs nothing of them.
	t.Run("pickle with markup names", func(t *testing.T) {
		const evil = `</script><img src=x onerror="document.body.dataset.pwned=1">`
		a := alloc.New(alloc.NewSimBackend(1<<30), alloc.Options{TraceEntries: 64})
		_, err := a.Malloc(3<<20, alloc.Tag{Node: 1, Op: evil, Scope: evil})
		require.NoError(t, err)
		_, err = a.Malloc(4096, alloc.Tag{Node: 2, Op: "matmul", Scope: "fc." + evil})
		require.NoError(t, err)
		snap := memviz.NewSnapshot(0, a.Snapshot())
		pickle := filepath.Join(dir, "markup.pickle")
		f, err := os.Create(pickle)
		require.NoError(t, err)
		require.NoError(t, memviz.WritePickle(f, snap))
		require.NoError(t, f.Close())
		page := filepath.Join(dir, "report-markup.html")
		code, _, stderr := runCLI("report", pickle, "-o", page)
		require.Equal(t, exitOK, code, stderr)
		h := openHeadless(t, browser, page, filepath.Join(dir, "report-markup.png"), 1280, 900)
		ready, _ := bodyAttr(h.dom, "data-ready")
		require.Equal(t, "1", ready)
		_, pwned := bodyAttr(h.dom, "data-pwned")
		assert.False(t, pwned, "no markup from the file ran")
		assert.NotContains(t, h.dom, "<img")
		assert.Contains(t, h.dom, "&lt;/script&gt;&lt;img", "the names are shown as text")
		got, _ := bodyAttr(h.dom, "data-peak-allocated")
		assert.Equal(t, strconv.FormatInt(snap.Allocated(), 10), got)
	})
}

// TestSnapshotHTMLRun measures the step on the CPU executor and draws it
// over the prediction: a first step measures exactly what was predicted.
func TestSnapshotHTMLRun(t *testing.T) {
	page := filepath.Join(t.TempDir(), "mlp.htm")
	code, stdout, stderr := runCLI("snapshot", "--model", "mlp", "--batch", "2048", "--budget", "26MiB", "--run", "-o", page)
	require.Equal(t, exitOK, code, stderr)
	assert.Contains(t, stdout, "(html, ")
	html, err := os.ReadFile(page)
	require.NoError(t, err)
	var d struct {
		Chunks            []json.RawMessage `json:"chunks"`
		Allocated         []int64           `json:"allocated"`
		MeasuredAllocated []int64           `json:"measured_allocated"`
		MeasuredReserved  []int64           `json:"measured_reserved"`
		Reserved          []int64           `json:"reserved"`
	}
	require.NoError(t, json.Unmarshal(pageJSON(t, html), &d))
	assert.Greater(t, len(d.Chunks), 2, "persistent allocations, then several chunks")
	assert.Equal(t, d.Allocated, d.MeasuredAllocated)
	assert.Equal(t, d.Reserved, d.MeasuredReserved)

	for _, args := range [][]string{
		{"--model", "mlp", "--batch", "8", "--budget", "1GiB", "--run", "-o", "x.pickle"},
		{"--model", "gpt2-small", "--batch", "8", "--budget", "8GiB", "--run", "-o", "x.html"},
	} {
		_, err := parseSnapshot(args)
		assert.ErrorIs(t, err, errNotApplicable, "%v", args)
	}
	_, err = parseSnapshot([]string{"--model", "mlp", "--batch", "1000000", "--budget", "1GiB", "--run", "-o", "x.html"})
	assert.ErrorIs(t, err, errRange, "a million samples of random data")
	c, err := parseSnapshot([]string{"--model", "mlp", "--batch", "8", "--budget", "1GiB", "--format", "html", "-o", "-"})
	require.NoError(t, err)
	assert.Equal(t, formatHTML, c.format)
}

// TestReportFileHTML draws a pickle through the readers report FILE uses;
// files that are not pickles, and flags that do not apply, are refused.
func TestReportFileHTML(t *testing.T) {
	dir := t.TempDir()
	path := writeSnapshot(t, dir, "peak.pickle", 64)
	page := filepath.Join(dir, "peak.html")
	code, stdout, stderr := runCLI("report", path, "-o", page)
	require.Equal(t, exitOK, code, stderr)
	assert.Contains(t, stdout, "wrote "+page+" (html, ")
	html, err := os.ReadFile(page)
	require.NoError(t, err)
	var d struct {
		Source    string  `json:"source"`
		Unit      int64   `json:"unit"`
		Allocated []int64 `json:"allocated"`
	}
	require.NoError(t, json.Unmarshal(pageJSON(t, html), &d))
	assert.Equal(t, "snapshot", d.Source)
	snap := readPickleFile(t, path)
	assert.Equal(t, snap.Allocated(), d.Allocated[len(d.Allocated)-1]*d.Unit, "the page ends where the snapshot was taken")

	folded := writeSnapshot(t, dir, "peak.folded", 64)
	code, _, stderr = runCLI("report", folded, "-o", filepath.Join(dir, "f.html"))
	assert.Equal(t, exitPlan, code)
	assert.Contains(t, stderr, "stacks only")
	code, _, stderr = runCLI("report", filepath.Join(dir, "missing.pickle"), "-o", filepath.Join(dir, "m.html"))
	assert.Equal(t, exitPlan, code)
	assert.Contains(t, stderr, "missing.pickle")

	for _, c := range []struct {
		args []string
		kind error
	}{
		{[]string{"--csv", path, "-o", page}, errFlag},
		{[]string{"--model", "mlp", "--batch", "8", "--budget", "1GiB", "-o", page}, errNotApplicable},
	} {
		_, err := parseReport(c.args)
		assert.ErrorIs(t, err, c.kind, "%v", c.args)
	}
}
