package main

import (
	"bytes"
	"compress/gzip"
	"encoding/csv"
	"encoding/json"
	"errors"
	"io"
	"io/fs"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/exec/cpu"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/memviz"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/optim"
	"github.com/batchfit/batchfit/planner"
	"github.com/batchfit/batchfit/shapeinfer"
)

// Tests of snapshot, compare and report.

// mlpSizes are the zoo's "mlp" layer widths, and mlpParamBytes its
// parameters' float32 bytes, written out by hand.
var (
	mlpSizes      = []int{784, 512, 512, 10}
	mlpParamBytes = []int64{4 * 784 * 512, 4 * 512, 4 * 512 * 512, 4 * 512, 4 * 512 * 10, 4 * 10}
)

func round512(n int64) int64 { return (n + 511) / 512 * 512 }

// mlpPlan builds the zoo's mlp training step at batch b the way a library
// user would and plans it within budget with AdamW's state: the
// independent route to the figures the commands print.
func mlpPlan(t *testing.T, b int, budget int64) (*planner.Program, *planner.Plan) {
	t.Helper()
	model := nn.MLP(nn.Options{ShapeOnly: true}, mlpSizes, nn.ReLU{})
	x := lazy.Placeholder([]int{b, 784}, graph.Float32, 0)
	labels := x.Graph().Placeholder([]int{b}, graph.Int64, 0)
	loss := model.Forward(x).CrossEntropy(labels, graph.ReduceMean)
	params := nn.ParamTensors(model)
	outs := []int{loss.ID()}
	var trained []int
	for i, gr := range lazy.Grad(loss, params...) {
		require.NoError(t, gr.Err())
		outs = append(outs, gr.ID())
		trained = append(trained, loss.Graph().NodeOf(params[i]))
	}
	g := loss.Graph().IR()
	info, err := shapeinfer.Analyze(g, outs...)
	require.NoError(t, err)
	p, err := planner.Compile(g, info, outs, planner.CompileOptions{Kept: outs[1:], Trained: trained,
		StateSlots: optim.NewAdamW(1e-3).StateSlots(), Workspace: cpu.Workspace})
	require.NoError(t, err)
	pl, err := planner.Make(p, planner.Options{Budget: budget, NoHeadroom: true})
	require.NoError(t, err)
	return p, pl
}

// writeSnapshot runs batchfit snapshot for the mlp at batch b into dir.
func writeSnapshot(t *testing.T, dir, name string, b int, extra ...string) string {
	t.Helper()
	path := filepath.Join(dir, name)
	args := append([]string{"snapshot", "--model", "mlp", "--batch", strconv.Itoa(b), "--budget", "1GiB", "-o", path}, extra...)
	code, stdout, stderr := runCLI(args...)
	require.Equal(t, exitOK, code, stderr)
	require.Empty(t, stderr)
	require.Contains(t, stdout, "wrote")
	return path
}

func readPickleFile(t *testing.T, path string) memviz.Snapshot {
	t.Helper()
	f, err := os.Open(path)
	require.NoError(t, err)
	defer f.Close()
	s, err := memviz.ReadPickle(f)
	require.NoError(t, err)
	return s
}

func stacksTotal(s []memviz.StackBytes) int64 {
	var n int64
	for _, x := range s {
		n += x.Bytes
	}
	return n
}

func TestSnapshotFormats(t *testing.T) {
	dir := t.TempDir()
	_, pl := mlpPlan(t, 64, 1<<30)

	peak := readPickleFile(t, writeSnapshot(t, dir, "peak.pickle", 64))
	require.Len(t, peak.Devices, 1)
	assert.Equal(t, pl.PeakAllocated, peak.Allocated(), "the snapshot is taken at the predicted peak")
	assert.LessOrEqual(t, peak.Reserved(), pl.PeakReserved)
	assert.NotEmpty(t, peak.Devices[0].Trace, "memory_viz draws its timeline from the trace")

	// After the step: each parameter and its two AdamW slots, rounded to
	// 512 bytes, and nothing else.
	end := readPickleFile(t, writeSnapshot(t, dir, "end.pkl", 64, "--at", "end"))
	var held int64
	for _, n := range mlpParamBytes {
		held += 3 * round512(n)
	}
	assert.Equal(t, held, end.Allocated())
	assert.Equal(t, pl.PeakReserved, end.Reserved(), "the step's segments stay cached")

	// pprof and folded stacks total the allocated bytes; the extension
	// picks the format unless --format says otherwise.
	for _, c := range []struct {
		name, format string
		read         func(io.Reader) ([]memviz.StackBytes, error)
	}{
		{"peak.pb.gz", "", memviz.ReadPprof},
		{"peak.folded", "", memviz.ReadFolded},
		{"peak.out", "folded", memviz.ReadFolded},
		{"peak.data", "pprof", memviz.ReadPprof},
	} {
		var extra []string
		if c.format != "" {
			extra = []string{"--format", c.format}
		}
		f, err := os.Open(writeSnapshot(t, dir, c.name, 64, extra...))
		require.NoError(t, err)
		stacks, err := c.read(f)
		f.Close()
		require.NoError(t, err, c.name)
		assert.Equal(t, pl.PeakAllocated, stacksTotal(stacks), c.name)
	}

	// -o - writes the pickle to standard output and the summary to
	// standard error.
	code, stdout, stderr := runCLI("snapshot", "--model", "mlp", "--batch", "64", "--budget", "1GiB", "-o", "-")
	require.Equal(t, exitOK, code, stderr)
	s, err := memviz.ReadPickle(strings.NewReader(stdout))
	require.NoError(t, err)
	assert.Equal(t, pl.PeakAllocated, s.Allocated())
	assert.Contains(t, stderr, "wrote")
}

// A budget that splits the batch: the snapshot is of the chunked step.
func TestSnapshotChunked(t *testing.T) {
	_, whole := mlpPlan(t, 4096, 1<<40)
	budget := whole.PeakReserved - 1
	_, pl := mlpPlan(t, 4096, budget)
	require.Greater(t, len(pl.Chunks), 1)
	dir := t.TempDir()
	path := filepath.Join(dir, "chunked.pickle")
	code, stdout, stderr := runCLI("snapshot", "--model", "mlp", "--batch", "4096", "--budget", strconv.FormatInt(budget, 10), "-o", path)
	require.Equal(t, exitOK, code, stderr)
	assert.Contains(t, stdout, planner.DescribeSizes(planner.Sizes(pl.Chunks)))
	s := readPickleFile(t, path)
	assert.Equal(t, pl.PeakAllocated, s.Allocated())
}

// The snapshot's summary says which peak it shows: taken at the peak of
// allocated bytes, its reserved bytes are not the step's reserved peak
// when the cache grows later (the ConvNet in two chunks), and after the
// step it is the other way round.
func TestSnapshotSaysWhichPeak(t *testing.T) {
	path := filepath.Join(t.TempDir(), "c.pickle")
	args := []string{"snapshot", "--model", "convnet", "--batch", "256", "--budget", "96MiB", "-o", path}
	code, stdout, stderr := runCLI(args...)
	require.Equal(t, exitOK, code, stderr)
	assert.Contains(t, stdout, "at the predicted peak of allocated bytes, while node")
	assert.Regexp(t, `(?m)^allocated +51\.67 MiB .* in \d+ blocks: the step's peak allocated$`, stdout)
	assert.Regexp(t, `(?m)^reserved +60\.00 MiB .*; the step's peak reserved, 76\.00 MiB, is at another point$`, stdout)

	code, stdout, stderr = runCLI(append(args, "--at", "end")...)
	require.Equal(t, exitOK, code, stderr)
	assert.Regexp(t, `(?m)^allocated .*; the step's peak allocated, 51\.67 MiB, is at another point$`, stdout)
	assert.Regexp(t, `(?m)^reserved +76\.00 MiB .*: the step's peak reserved$`, stdout)
}

// An -o name whose ending tells no format is refused, the known endings
// listed, rather than written as a pickle.
func TestSnapshotUnknownExtension(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "x.unknown")
	code, stdout, stderr := runCLI("snapshot", "--model", "mlp", "--batch", "8", "--budget", "1GiB", "-o", path)
	assert.Equal(t, exitUsage, code)
	assert.Empty(t, stdout)
	first := usageLines(t, "snapshot", stderr)
	for _, end := range []string{".pickle", ".pkl", ".pb.gz", ".pprof", ".folded", ".txt", ".html", "--format"} {
		assert.Contains(t, first, end)
	}
	_, err := os.Stat(path)
	assert.ErrorIs(t, err, fs.ErrNotExist, "nothing written")
	code, _, stderr = runCLI("snapshot", "--model", "mlp", "--batch", "8", "--budget", "1GiB", "--format", "pickle", "-o", path)
	assert.Equal(t, exitOK, code, "--format names it: %s", stderr)
}

func TestSnapshotUsageErrors(t *testing.T) {
	base := []string{"--model", "mlp", "--batch", "8", "--budget", "1GiB"}
	with := func(extra ...string) []string { return append(append([]string(nil), base...), extra...) }
	for _, c := range []struct {
		name string
		args []string
		kind error
	}{
		{"missing output", base, errMissing},
		{"unknown format", with("-o", "x.pickle", "--format", "png"), errUnknown},
		{"unknown at", with("-o", "x.pickle", "--at", "start"), errUnknown},
		{"negative trace", with("-o", "x.pickle", "--trace", "-1"), errRange},
		{"trace over alloc.MaxTraceEntries", with("-o", "x.pickle", "--trace", "16777217"), errRange},
		{"trace in pprof", with("-o", "x.pb.gz", "--trace", "10"), errNotApplicable},
		{"positional", with("-o", "x.pickle", "extra"), errFlag},
		{"missing model", []string{"--batch", "8", "--budget", "1GiB", "-o", "x.pickle"}, errMissing},
		{"unknown extension", with("-o", "x.unknown"), errUnknown},
		{"no extension", with("-o", "snapshot"), errUnknown},
	} {
		t.Run(c.name, func(t *testing.T) {
			_, err := parseSnapshot(c.args)
			assert.ErrorIs(t, err, errUsage)
			assert.ErrorIs(t, err, c.kind)
			code, stdout, stderr := runCLI(append([]string{"snapshot"}, c.args...)...)
			assert.Equal(t, exitUsage, code)
			assert.Empty(t, stdout)
			assert.Equal(t, "batchfit snapshot: "+err.Error(), usageLines(t, "snapshot", stderr))
		})
	}
}

// A file that cannot be written fails with a typed error and leaves
// nothing behind.
func TestSnapshotWriteFails(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "missing", "x.pickle")
	code, stdout, stderr := runCLI("snapshot", "--model", "mlp", "--batch", "8", "--budget", "1GiB", "-o", path)
	assert.Equal(t, exitPlan, code)
	assert.Empty(t, stdout)
	assert.Contains(t, stderr, path)
	_, err := writeFile(path, nil, func(io.Writer) error { return nil })
	var fe *fileError
	require.ErrorAs(t, err, &fe)
	assert.ErrorIs(t, err, fs.ErrNotExist)

	failing := errors.New("disk full")
	_, err = writeFile(filepath.Join(dir, "y.pickle"), nil, func(w io.Writer) error {
		_, _ = w.Write([]byte("partial"))
		return failing
	})
	assert.ErrorIs(t, err, failing)
	entries, rerr := os.ReadDir(dir)
	require.NoError(t, rerr)
	assert.Empty(t, entries, "no partial or temporary file")
}

// The temporary file goes beside the target, and a directory target (or
// one ending in a separator) is refused with syscall.EISDIR before anything
// is written, in it or in its parent.
func TestSnapshotWriteBesideTheTarget(t *testing.T) {
	root := t.TempDir()
	dir := filepath.Join(root, "out")
	require.NoError(t, os.Mkdir(dir, 0o755))
	entries := func(d string) []string {
		es, err := os.ReadDir(d)
		require.NoError(t, err)
		var names []string
		for _, e := range es {
			names = append(names, e.Name())
		}
		return names
	}
	for _, target := range []string{dir, dir + "/"} {
		called := false
		_, err := writeFile(target, nil, func(io.Writer) error { called = true; return nil })
		assert.ErrorIs(t, err, syscall.EISDIR, target)
		var fe *fileError
		assert.ErrorAs(t, err, &fe, target)
		assert.False(t, called, "%s: nothing written", target)
		assert.Equal(t, []string{"out"}, entries(root), target)
		assert.Empty(t, entries(dir), target)

		code, stdout, stderr := runCLI("snapshot", "--model", "mlp", "--batch", "8", "--budget", "1GiB", "--format", "pickle", "-o", target)
		assert.Equal(t, exitPlan, code, target)
		assert.Empty(t, stdout)
		assert.Contains(t, stderr, target)
		assert.Equal(t, []string{"out"}, entries(root), target)
		assert.Empty(t, entries(dir), target)
	}
	target := filepath.Join(dir, "s.pickle")
	_, err := writeFile(target, nil, func(io.Writer) error {
		names := entries(dir)
		if assert.Len(t, names, 1) {
			assert.True(t, strings.HasPrefix(names[0], ".s.pickle."), "temporary file %s beside %s", names[0], target)
		}
		assert.Equal(t, []string{"out"}, entries(root))
		return nil
	})
	require.NoError(t, err)
	assert.Equal(t, []string{"s.pickle"}, entries(dir))
}

func TestCompareSegments(t *testing.T) {
	dir := t.TempDir()
	small := writeSnapshot(t, dir, "small.pickle", 64)
	big := writeSnapshot(t, dir, "big.pickle", 512)
	a, b := readPickleFile(t, small), readPickleFile(t, big)

	code, stdout, stderr := runCLI("compare", small, small)
	require.Equal(t, exitOK, code, stderr)
	assert.Contains(t, stdout, "only before: 0 segments")
	assert.Contains(t, stdout, "only after: 0 segments")

	code, stdout, stderr = runCLI("compare", small, big)
	require.Equal(t, exitOK, code, stderr)
	first, _, _ := strings.Cut(stdout, "\n")
	assert.Equal(t, "reserved "+alloc.FormatBytes(a.Reserved())+" → "+alloc.FormatBytes(b.Reserved())+", allocated "+
		alloc.FormatBytes(a.Allocated())+" → "+alloc.FormatBytes(b.Allocated())+"; "+
		strconv.Itoa(len(a.Devices[0].Segments))+" segments in both", first,
		"the larger batch keeps every segment and adds some")
	require.Greater(t, b.Reserved(), a.Reserved())

	// --folded lists the new segments' blocks, bytes adding up to the
	// reserved growth.
	code, stdout, stderr = runCLI("compare", "--folded", small, big)
	require.Equal(t, exitOK, code, stderr)
	var grown int64
	for _, l := range strings.Split(strings.TrimSpace(stdout), "\n") {
		require.True(t, strings.HasPrefix(l, "only_after;device_0;seg_"), l)
		n, err := strconv.ParseInt(l[strings.LastIndexByte(l, ' ')+1:], 10, 64)
		require.NoError(t, err)
		grown += n
	}
	assert.Equal(t, b.Reserved()-a.Reserved(), grown)
}

func TestCompareStacks(t *testing.T) {
	dir := t.TempDir()
	small := writeSnapshot(t, dir, "small.folded", 64)
	smallPprof := writeSnapshot(t, dir, "small.pb.gz", 64)
	big := writeSnapshot(t, dir, "big.pickle", 512)

	code, stdout, stderr := runCLI("compare", small, smallPprof)
	require.Equal(t, exitOK, code, stderr)
	assert.Contains(t, stdout, "no stack changed", "folded and pprof of one snapshot agree")

	// The input grows from 64 to 512 samples of 784 float32 features.
	code, stdout, stderr = runCLI("compare", "--folded", small, big)
	require.Equal(t, exitOK, code, stderr)
	assert.Contains(t, strings.Split(stdout, "\n"), "input "+strconv.Itoa(64*784*4)+" "+strconv.Itoa(512*784*4))

	code, stdout, stderr = runCLI("compare", big, "--top", "1", small)
	require.Equal(t, exitOK, code, stderr)
	assert.Contains(t, stdout, "the 1 largest changes")

	// Two pickles compare by stack on request.
	code, stdout, stderr = runCLI("compare", "--stacks", "--folded", writeSnapshot(t, dir, "small.pickle", 64), big)
	require.Equal(t, exitOK, code, stderr)
	assert.Contains(t, strings.Split(stdout, "\n"), "input "+strconv.Itoa(64*784*4)+" "+strconv.Itoa(512*784*4))
}

func TestCompareUsageErrors(t *testing.T) {
	for _, c := range []struct {
		args []string
		kind error
	}{
		{nil, errMissing},
		{[]string{"a"}, errMissing},
		{[]string{"a", "b", "c"}, errFlag},
		{[]string{"-", "-"}, errFlag},
		{[]string{"--top", "-2", "a", "b"}, errRange},
		{[]string{"--bogus", "a", "b"}, errFlag},
	} {
		_, err := parseCompare(c.args)
		assert.ErrorIs(t, err, c.kind, "%q", c.args)
		code, stdout, stderr := runCLI(append([]string{"compare"}, c.args...)...)
		assert.Equal(t, exitUsage, code, "%q", c.args)
		assert.Empty(t, stdout)
		usageLines(t, "compare", stderr)
	}
}

// badFile is a snapshot file that cannot be read, and what its error
// wraps.
type badFile struct {
	name string
	path string
	want []error
}

// badFiles writes unreadable, wrong and truncated snapshot files into dir.
func badFiles(t *testing.T, dir string) []badFile {
	t.Helper()
	good, err := os.ReadFile(writeSnapshot(t, dir, "good.pickle", 64))
	require.NoError(t, err)
	goodPprof, err := os.ReadFile(writeSnapshot(t, dir, "good.pb.gz", 64))
	require.NoError(t, err)
	write := func(name string, data []byte) string {
		p := filepath.Join(dir, name)
		require.NoError(t, os.WriteFile(p, data, 0o644))
		return p
	}
	corrupt := bytes.Clone(good)
	for i := len(corrupt) / 3; i < len(corrupt)/3+16; i++ {
		corrupt[i] = 0xff
	}
	files := []badFile{
		{"missing", filepath.Join(dir, "nope.pickle"), []error{fs.ErrNotExist}},
		{"directory", dir, []error{syscall.EISDIR}},
		{"empty pickle", write("empty.pickle", nil), []error{memviz.ErrFormat, io.ErrUnexpectedEOF}},
		{"empty, no extension", write("empty", nil), []error{memviz.ErrFormat, io.ErrUnexpectedEOF}},
		{"truncated pickle", write("half.pickle", good[:len(good)/2]), []error{memviz.ErrFormat, io.ErrUnexpectedEOF}},
		{"pickle cut after its first byte", write("one.pickle", good[:1]), []error{memviz.ErrFormat, io.ErrUnexpectedEOF}},
		{"corrupt pickle", write("corrupt.pickle", corrupt), []error{memviz.ErrFormat}},
		{"pickle of a list", write("list.pickle", []byte("\x80\x02]q\x00.")), []error{memviz.ErrFormat}},
		{"truncated pprof", write("half.pb.gz", goodPprof[:len(goodPprof)/2]), []error{memviz.ErrFormat}},
		{"folded text named pickle", write("text.pickle", []byte("a;b 12\n")), []error{memviz.ErrFormat}},
		{"json", write("snap.json", []byte(`{"segments": []}`)), []error{memviz.ErrFormat}},
		{"folded with a bad count", write("bad.folded", []byte("a;b 12\nc;d twelve\n")), []error{memviz.ErrFormat}},
		{"png", write("image.png", []byte("\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")), []error{memviz.ErrFormat}},
		// Crafted to expand: memo references repeating one segment of
		// 2,000 blocks 2,000 times (16 KB: 4M blocks); 2 MB of empty pprof
		// samples and 64 MB of zeros, gzipped.
		{"pickle repeating a segment", write("repeat.pickle", repeatedSegments(2000)), []error{memviz.ErrFormat, memviz.ErrTooLarge}},
		{"gzip of empty samples", write("empty-samples.pb.gz", gzipped(t, bytes.Repeat([]byte{0x12, 0x00}, 1<<20))), []error{memviz.ErrFormat, memviz.ErrTooLarge}},
		{"gzip of zeros", write("zeros.pb.gz", gzipped(t, make([]byte, 64<<20))), []error{memviz.ErrFormat, memviz.ErrTooLarge}},
	}
	rng := rand.New(rand.NewPCG(7, 8))
	for i := range 4 {
		junk := make([]byte, 1+rng.IntN(4096))
		for j := range junk {
			junk[j] = byte(rng.Uint32())
		}
		if i%2 == 0 {
			junk[0] = 0x80 // read as a pickle
		}
		files = append(files, badFile{"random " + strconv.Itoa(i), write("junk"+strconv.Itoa(i), junk), []error{memviz.ErrFormat}})
	}
	if os.Geteuid() != 0 { // root reads files whatever their mode
		p := write("private.pickle", good)
		require.NoError(t, os.Chmod(p, 0))
		files = append(files, badFile{"no permission", p, []error{fs.ErrPermission}})
	}
	return files
}

// repeatedSegments is a snapshot pickle whose segments list holds one
// segment of n 512-byte blocks n times, through memo references (BINPUT
// q, BINGET h): the block dict is memo 1, the segment dict memo 0.
func repeatedSegments(n int) []byte {
	str := func(s string) string { return "X" + string([]byte{byte(len(s)), 0, 0, 0}) + s }
	size := 512 * n
	block := "}(" + str("size") + "M\x00\x02" + str("state") + str("inactive") + "uq\x01" + strings.Repeat("h\x01", n-1)
	segment := "}(" + str("address") + "K\x00" + str("total_size") + "J" + string([]byte{byte(size), byte(size >> 8), byte(size >> 16), 0}) +
		str("blocks") + "](" + block + "euq\x00" + strings.Repeat("h\x00", n-1)
	return []byte("\x80\x02}(" + str("segments") + "](" + segment + "e" + str("device_traces") + "]u.")
}

func gzipped(t *testing.T, data []byte) []byte {
	t.Helper()
	var b bytes.Buffer
	zw := gzip.NewWriter(&b)
	_, err := zw.Write(data)
	require.NoError(t, err)
	require.NoError(t, zw.Close())
	return b.Bytes()
}

// Every unreadable file gives a *fileError wrapping its cause, and report
// and compare print it as one line.
func TestUnreadableFilesGiveTypedErrors(t *testing.T) {
	dir := t.TempDir()
	good := writeSnapshot(t, dir, "ok.pickle", 64)
	for _, f := range badFiles(t, dir) {
		t.Run(f.name, func(t *testing.T) {
			_, err := readSnapshotFile(f.path, nil, "", "")
			require.Error(t, err)
			var fe *fileError
			require.ErrorAs(t, err, &fe)
			assert.Equal(t, f.path, fe.Path)
			for _, w := range f.want {
				assert.ErrorIs(t, err, w)
			}
			for _, args := range [][]string{{"compare", f.path, good}, {"compare", good, f.path}} {
				code, stdout, stderr := runCLI(args...)
				assert.Equal(t, exitPlan, code, "%q", args)
				assert.Empty(t, stdout, "%q", args)
				assert.Equal(t, "batchfit "+args[0]+": "+err.Error()+"\n", stderr, "%q: one line naming the file", args)
			}
			// report refuses a file that is not a pickle before parsing it:
			// its error may be that one.
			code, stdout, stderr := runCLI("report", f.path)
			assert.Equal(t, exitPlan, code)
			assert.Empty(t, stdout)
			assert.True(t, strings.HasPrefix(stderr, "batchfit report: "+f.path), stderr)
			assert.Equal(t, 1, strings.Count(stderr, "\n"), stderr)
		})
	}
}

// report reads pickles only: stacks have no blocks to list.
func TestReportNeedsAPickle(t *testing.T) {
	dir := t.TempDir()
	for _, name := range []string{"s.folded", "s.pb.gz"} {
		path := writeSnapshot(t, dir, name, 64)
		_, err := reportFile(&reportConfig{file: path}, nil)
		assert.ErrorIs(t, err, errFileKind)
		var fe *fileError
		assert.ErrorAs(t, err, &fe)
		code, _, stderr := runCLI("report", path)
		assert.Equal(t, exitPlan, code)
		assert.Contains(t, stderr, "batchfit compare")
	}
}

func TestReportModel(t *testing.T) {
	_, pl := mlpPlan(t, 64, 1<<30)
	code, stdout, stderr := runCLI("report", "--model", "mlp", "--batch", "64", "--budget", "1GiB", "--json")
	require.Equal(t, exitOK, code, stderr)
	var r memReport
	require.NoError(t, json.Unmarshal([]byte(stdout), &r))
	require.Len(t, r.Report.Devices, 1)
	d := r.Report.Devices[0]
	assert.Equal(t, pl.PeakAllocated, d.Totals.Allocated)
	assert.Equal(t, d.Totals.Allocated, d.Totals.Tensors+d.Totals.Rounding+d.Totals.Workspace+d.Totals.Unowned)
	names := map[string]memviz.Tensor{}
	for _, x := range d.Tensors {
		names[x.Name] = x
	}
	for i, p := range []string{"0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"} {
		for _, suffix := range []string{"", ".exp_avg", ".exp_avg_sq"} {
			x, ok := names[p+suffix]
			if assert.True(t, ok, "%s%s is live at the peak", p, suffix) {
				assert.Equal(t, mlpParamBytes[i], x.Requested, p+suffix)
			}
		}
	}
	assert.Nil(t, r.Profile)
	assert.Nil(t, r.Measured)

	code, stdout, stderr = runCLI("report", "--model", "mlp", "--batch", "64", "--budget", "1GiB")
	require.Equal(t, exitOK, code, stderr)
	assert.Contains(t, stdout, "0.weight.exp_avg_sq")
	assert.Contains(t, stdout, "= allocated")

	// CSV: one row per tensor, sizes adding up to the allocated bytes.
	code, stdout, stderr = runCLI("report", "--model", "mlp", "--batch", "64", "--budget", "1GiB", "--csv")
	require.Equal(t, exitOK, code, stderr)
	rows, err := csv.NewReader(strings.NewReader(stdout)).ReadAll()
	require.NoError(t, err)
	require.Len(t, rows, 1+len(d.Tensors))
	var sum int64
	for _, row := range rows[1:] {
		n, err := strconv.ParseInt(row[6], 10, 64)
		require.NoError(t, err)
		sum += n
	}
	assert.Equal(t, pl.PeakAllocated, sum)
}

// --profile --run: the per-op profile predicted and measured on the CPU
// executor agree, row by row.
func TestReportProfileRun(t *testing.T) {
	for _, args := range [][]string{
		{"--model", "gpt-tiny", "--batch", "4", "--budget", "1GiB", "--optimizer", "adam"},
		{"--model", "mlp", "--batch", "2048", "--budget", "26MiB"}, // two chunks of 1024
		{"--model", "convnet", "--batch", "2", "--budget", "64MiB", "--mode", "infer"},
	} {
		t.Run(args[1], func(t *testing.T) {
			code, stdout, stderr := runCLI(append(append([]string{"report"}, args...), "--profile", "--run", "--json")...)
			require.Equal(t, exitOK, code, stderr)
			var r memReport
			require.NoError(t, json.Unmarshal([]byte(stdout), &r))
			require.NotNil(t, r.Measured)
			if args[1] == "mlp" {
				assert.Contains(t, r.Step, "as 2 × 1024")
			}
			assert.Equal(t, r.Measured.PredictedPeakReserved, r.Measured.PeakReserved)
			assert.Equal(t, r.Measured.PredictedPeakAllocated, r.Measured.PeakAllocated)
			require.NotNil(t, r.Profile)
			assert.Equal(t, r.Profile.PredictedPeakActive, r.Profile.MeasuredPeakActive)
			assert.Equal(t, r.Profile.PredictedPeakReserved, r.Profile.MeasuredPeakReserved)
			measured := 0
			for _, row := range r.Profile.Rows {
				if row.Measured != nil {
					measured++
					assert.Equal(t, row.Predicted, *row.Measured, "row %+v", row)
				}
			}
			assert.Equal(t, len(r.Profile.Rows), measured, "a first step measures every row")
			if slicesContain(args, "infer") {
				assert.Nil(t, r.Measured.Loss)
			} else {
				require.NotNil(t, r.Measured.Loss)
				assert.Greater(t, *r.Measured.Loss, float32(0))
			}
		})
	}
	code, stdout, stderr := runCLI("report", "--model", "gpt-tiny", "--batch", "4", "--budget", "1GiB", "--profile", "--run")
	require.Equal(t, exitOK, code, stderr)
	assert.Contains(t, stdout, "(as predicted)")
	assert.Contains(t, stdout, "measured peak:")

	code, stdout, stderr = runCLI("report", "--model", "gpt-tiny", "--batch", "4", "--budget", "1GiB", "--profile", "--csv")
	require.Equal(t, exitOK, code, stderr)
	assert.True(t, strings.HasPrefix(stdout, "chunk,step,node"), stdout[:min(len(stdout), 80)])
}

// --run --at end reports the executor's own allocator after the step:
// the parameters and AdamW's state.
func TestReportRunAtEnd(t *testing.T) {
	code, stdout, stderr := runCLI("report", "--model", "mlp", "--batch", "64", "--budget", "1GiB", "--run", "--at", "end", "--json")
	require.Equal(t, exitOK, code, stderr)
	var r memReport
	require.NoError(t, json.Unmarshal([]byte(stdout), &r))
	assert.Contains(t, r.Snapshot, "measured")
	d := r.Report.Devices[0]
	var held int64
	for _, n := range mlpParamBytes {
		held += 3 * round512(n)
	}
	assert.Equal(t, held, d.Totals.Allocated)
	for _, x := range d.Tensors {
		assert.Contains(t, []memviz.Kind{memviz.KindParam, memviz.KindState}, x.Kind, x.Name)
	}
}

func slicesContain(s []string, x string) bool {
	for _, y := range s {
		if y == x {
			return true
		}
	}
	return false
}

// A pickle written by snapshot --at end reports the parameters and the
// optimizer state, named from their frames.
func TestReportFile(t *testing.T) {
	path := writeSnapshot(t, t.TempDir(), "end.pickle", 64, "--at", "end")
	code, stdout, stderr := runCLI("report", "--json", path)
	require.Equal(t, exitOK, code, stderr)
	var r memReport
	require.NoError(t, json.Unmarshal([]byte(stdout), &r))
	d := r.Report.Devices[0]
	assert.Len(t, d.Tensors, 3*len(mlpParamBytes), "parameters and two AdamW slots")
	var held int64
	for _, n := range mlpParamBytes {
		held += 3 * round512(n)
	}
	assert.Equal(t, held, d.Totals.Allocated)
	assert.Zero(t, d.Totals.Unowned, "every block has a frame")
}

func TestReportUsageErrors(t *testing.T) {
	base := []string{"--model", "mlp", "--batch", "8", "--budget", "1GiB"}
	with := func(extra ...string) []string { return append(append([]string(nil), base...), extra...) }
	for _, c := range []struct {
		name string
		args []string
		kind error
	}{
		{"csv and json", with("--csv", "--json"), errFlag},
		{"file and model", []string{"--model", "mlp", "x.pickle"}, errNotApplicable},
		{"file and profile", []string{"--profile", "x.pickle"}, errNotApplicable},
		{"two files", []string{"a.pickle", "b.pickle"}, errFlag},
		{"no model, no file", nil, errMissing},
		{"unknown at", with("--at", "middle"), errUnknown},
		{"seed without run", with("--seed", "3"), errNotApplicable},
		{"run in half precision", with("--run", "--dtype", "float16"), errNotApplicable},
		{"run GPT-2 small", []string{"--model", "gpt2-small", "--batch", "1", "--budget", "24GiB", "--run"}, errNotApplicable},
		// 10⁶ MNIST-sized samples are 3 GB of random data: refused before
		// any is drawn (it used to end in "fatal error: out of memory").
		{"run a million samples", []string{"--model", "mlp", "--batch", "1000000", "--budget", "1GiB", "--run"}, errRange},
		{"run a plan past the CPU's", []string{"--model", "mlp", "--batch", "60000", "--budget", "64GiB", "--run"}, errRange},
	} {
		t.Run(c.name, func(t *testing.T) {
			_, err := parseReport(c.args)
			assert.ErrorIs(t, err, errUsage)
			assert.ErrorIs(t, err, c.kind)
			code, stdout, stderr := runCLI(append([]string{"report"}, c.args...)...)
			assert.Equal(t, exitUsage, code)
			assert.Empty(t, stdout)
			assert.Equal(t, "batchfit report: "+err.Error(), usageLines(t, "report", stderr))
		})
	}
}

func TestMemoryCommandsHelp(t *testing.T) {
	for _, cmd := range []string{"snapshot", "report", "compare"} {
		code, stdout, stderr := runCLI(cmd, "-h")
		assert.Equal(t, exitOK, code, cmd)
		assert.True(t, strings.HasPrefix(stdout, "Usage:\n  batchfit "+cmd), stdout)
		assert.Empty(t, stderr)
	}
	code, stdout, _ := runCLI("help")
	assert.Equal(t, exitOK, code)
	for _, cmd := range []string{"snapshot", "report", "compare"} {
		assert.Contains(t, stdout, "batchfit "+cmd)
	}
}
