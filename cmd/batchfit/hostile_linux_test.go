package main

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The bounds on every command that reads a file from outside: within
// hostileRSS of peak resident memory and hostileCPU of processor time
// (user and system: the test machine's cores are shared, so its wall
// clock says more about its neighbours than about the command) for an
// input of up to 100 MB, or a refusal at once (which the bounds hold
// too). hostileWall catches a command that blocks.
const (
	hostileRSS  = 1 << 30
	hostileCPU  = 5 * time.Second
	hostileWall = 30 * time.Second
)

// runBounded runs the command args in a child process (the test binary,
// as runChild does), killed after a minute, and returns its exit code,
// stderr, wall and processor time and peak resident memory.
func runBounded(t *testing.T, args ...string) (code int, stderr string, wall, cpu time.Duration, maxRSS int64) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^TestAbsurdBatch$")
	cmd.Env = append(os.Environ(), cliEnv+"="+strings.Join(args, "\x1f"))
	var o, e bytes.Buffer
	cmd.Stdout, cmd.Stderr = &o, &e
	start := time.Now()
	err := cmd.Run()
	wall = time.Since(start)
	require.NoError(t, ctx.Err(), "%v did not finish within a minute", args)
	if err != nil {
		var ee *exec.ExitError
		require.ErrorAs(t, err, &ee)
	}
	ru, ok := cmd.ProcessState.SysUsage().(*syscall.Rusage)
	require.True(t, ok)
	cpu = cmd.ProcessState.UserTime() + cmd.ProcessState.SystemTime()
	return cmd.ProcessState.ExitCode(), e.String(), wall, cpu, ru.Maxrss << 10
}

// pickleOps is a protocol-2 pickle: PROTO 2, body, STOP.
func pickleOps(body ...[]byte) []byte {
	out := []byte{0x80, 2}
	for _, b := range body {
		out = append(out, b...)
	}
	return append(out, '.')
}

// manyBlocks is a valid snapshot pickle of one segment of n 512-byte
// inactive blocks, as compact as PyTorch's pickler makes it: keys and the
// state string memoized once, referenced by BINGET after; 12 bytes a
// block, in APPENDS batches of 1000.
func manyBlocks(n int) []byte {
	var b bytes.Buffer
	str := func(s string) {
		b.WriteByte('X')
		_ = binary.Write(&b, binary.LittleEndian, uint32(len(s)))
		b.WriteString(s)
	}
	long := func(v int64) { // LONG1 of 8 bytes
		b.Write([]byte{0x8a, 8})
		_ = binary.Write(&b, binary.LittleEndian, v)
	}
	b.Write([]byte{0x80, 2, '}', '('})
	str("segments")
	b.Write([]byte{']', '(', '}', '('})
	str("address")
	b.Write([]byte{'K', 0})
	str("total_size")
	long(int64(512 * n))
	str("blocks")
	b.WriteByte(']')
	// The first block memoizes "size" (1), "state" (2), "inactive" (3).
	b.Write([]byte{'(', '}', '('})
	str("size")
	b.Write([]byte{'q', 1, 'M', 0, 2})
	str("state")
	b.Write([]byte{'q', 2})
	str("inactive")
	b.Write([]byte{'q', 3, 'u'})
	block := []byte{'}', '(', 'h', 1, 'M', 0, 2, 'h', 2, 'h', 3, 'u'}
	for i := 1; i < n; i++ {
		if i%1000 == 0 {
			b.Write([]byte{'e', '('})
		}
		b.Write(block)
	}
	b.Write([]byte{'e', 'u', 'e'})
	str("device_traces")
	b.Write([]byte{']', 'u', '.'})
	return b.Bytes()
}

// pprofSamples is an uncompressed pprof profile of n samples, 8 or 9
// bytes each (the reader takes one record per 8 bytes): what a profile of
// millions of blocks is made of. Every thousandth sample has a location of
// its own, so the stacks number n/1000.
func pprofSamples(n int) []byte {
	var b bytes.Buffer
	field := func(f int, payload []byte) {
		b.WriteByte(byte(f<<3 | 2))
		var l [binary.MaxVarintLen64]byte
		b.Write(l[:binary.PutUvarint(l[:], uint64(len(payload)))])
		b.Write(payload)
	}
	uv := func(x uint64) []byte { return binary.AppendUvarint(nil, x) }
	field(1, []byte{8, 1, 16, 2}) // sample_type {type: 1, unit: 2}
	for _, s := range []string{"", "inuse_space", "bytes", "op"} {
		field(6, []byte(s))
	}
	field(5, []byte{8, 1, 16, 3}) // function {id 1, name 3}
	locs := uint64(n/1000 + 1)
	for id := uint64(1); id <= locs; id++ {
		field(4, append(append([]byte{8}, uv(id)...), 0x22, 2, 8, 1)) // location {id, line {function_id 1}}
	}
	for i := range n {
		field(2, append(append([]byte{8}, uv(uint64(i/1000+1))...), 16, 0x80, 0x80, 1)) // {location_id, value 16384}
	}
	return b.Bytes()
}

// foldedStacks is n distinct folded stacks of one frame below a common
// root, "root;f<i> 512".
func foldedStacks(n int) []byte {
	var b bytes.Buffer
	for i := range n {
		fmt.Fprintf(&b, "root;f%d 512\n", i)
	}
	return b.Bytes()
}

// hostileDirEnv makes TestHostileFilesBounded's child write the files
// into the directory it names.
const hostileDirEnv = "BATCHFIT_TEST_HOSTILE_DIR"

// writeHostileFiles writes the crafted files into dir.
func writeHostileFiles(t *testing.T, dir string) {
	write := func(name string, data []byte) {
		require.NoError(t, os.WriteFile(filepath.Join(dir, name), data, 0o644))
	}
	const mb = 1 << 20
	write("tuple1.pickle", pickleOps([]byte{'K', 0}, bytes.Repeat([]byte{0x85}, 20*mb)))
	write("tuple1-60.pickle", pickleOps([]byte{'K', 0}, bytes.Repeat([]byte{0x85}, 60*mb)))
	write("tuple2.pickle", pickleOps([]byte{'K', 0}, bytes.Repeat([]byte{'K', 0, 0x86}, 20*mb/3)))
	write("memoize.pickle", pickleOps([]byte{'K', 0}, bytes.Repeat([]byte{0x94}, 20*mb)))
	write("marks.pickle", pickleOps(bytes.Repeat([]byte{'('}, 20*mb)))
	write("blocks.pickle", manyBlocks(3_000_000))
	write("fewer-blocks.pickle", manyBlocks(900_000))
	write("samples.pb", pprofSamples(48*mb/9))
	write("fewer-samples.pb", pprofSamples(1000_000))
	write("stacks.folded", foldedStacks(87*mb/13))
	write("fewer-stacks.folded", foldedStacks(500_000))
	write("small.folded", []byte("root;a 512\n"))
	require.NoError(t, os.Symlink("/dev/zero", filepath.Join(dir, "zero.pickle")))
	require.NoError(t, syscall.Mkfifo(filepath.Join(dir, "fifo.pickle"), 0o644))
	require.NoError(t, syscall.Mkfifo(filepath.Join(dir, "fifo.json"), 0o644))
}

// TestHostileFilesBounded runs report, compare, estimate --profile and
// report -o PAGE.html on files crafted to exhaust a reader: each finishes
// (with its answer, or an error wrapping memviz.ErrTooLarge, errFileKind
// or a not-regular-file error) within 1 GiB of peak resident memory and
// 5 s of processor time, where they used to take gigabytes and seconds,
// crash with fatal error: out of memory, or block forever in open(2).
func TestHostileFilesBounded(t *testing.T) {
	if testing.Short() {
		t.Skip("builds files of tens of megabytes and runs a child per case")
	}
	if raceEnabled {
		t.Skip("the race detector multiplies memory and time; the bounds are the plain build's")
	}
	dir := t.TempDir()
	if gen := os.Getenv(hostileDirEnv); gen != "" {
		writeHostileFiles(t, gen)
		os.Exit(0)
	}
	// The files are written by a child of their own: a child's peak
	// resident memory counts its parent's from before exec, so the parent
	// never holds them.
	gen := exec.Command(os.Args[0], "-test.run=^TestHostileFilesBounded$")
	gen.Env = append(os.Environ(), hostileDirEnv+"="+dir)
	out, err := gen.CombinedOutput()
	require.NoError(t, err, "%s", out)
	at := func(name string) string { return filepath.Join(dir, name) }
	tuple1, tuple1Big, tuple2, memoize, marks := at("tuple1.pickle"), at("tuple1-60.pickle"), at("tuple2.pickle"), at("memoize.pickle"), at("marks.pickle")
	blocks, blocksOK := at("blocks.pickle"), at("fewer-blocks.pickle")
	pprof, pprofOK := at("samples.pb"), at("fewer-samples.pb")
	folded, foldedOK, small := at("stacks.folded"), at("fewer-stacks.folded"), at("small.folded")
	zero, fifo, fifoProfile := at("zero.pickle"), at("fifo.pickle"), at("fifo.json")
	page := filepath.Join(dir, "page.html")
	for _, c := range []struct {
		name string
		args []string
		ok   bool // the command succeeds
	}{
		{"TUPLE1 chain, 20 MB", []string{"report", tuple1}, false},
		{"TUPLE1 chain, 60 MB", []string{"report", tuple1Big}, false},
		{"TUPLE2 chain, 20 MB", []string{"report", tuple2}, false},
		{"MEMOIZE chain, 20 MB", []string{"report", memoize}, false},
		{"MARK chain, 20 MB", []string{"report", marks}, false},
		{"3 M blocks: report", []string{"report", blocks}, false},
		{"3 M blocks: compare", []string{"compare", blocks, blocks}, false},
		{"3 M blocks: compare --stacks", []string{"compare", "--stacks", blocks, blocks}, false},
		{"3 M blocks: report page", []string{"report", blocks, "-o", page}, false},
		{"48 MB pprof: report", []string{"report", pprof}, false},
		{"48 MB pprof: compare", []string{"compare", small, pprof}, false},
		{"87 MB folded: report", []string{"report", folded}, false},
		{"87 MB folded: compare", []string{"compare", small, folded}, false},
		// Files within the readers' caps are read, within the same bounds.
		{"900 k blocks: report", []string{"report", blocksOK}, true},
		{"900 k blocks: compare", []string{"compare", blocksOK, blocksOK}, true},
		{"900 k blocks: compare --stacks", []string{"compare", "--stacks", blocksOK, blocksOK}, true},
		{"1 M pprof samples: compare", []string{"compare", small, pprofOK}, true},
		{"500 k folded stacks: compare", []string{"compare", foldedOK, foldedOK}, true},
		{"/dev/zero: report", []string{"report", zero}, false},
		{"/dev/zero: compare", []string{"compare", zero, zero}, false},
		{"FIFO: report", []string{"report", fifo}, false},
		{"FIFO: compare", []string{"compare", small, fifo}, false},
		{"FIFO: estimate --profile", []string{"estimate", "--model", "mlp", "--batch", "8", "--budget", "1GiB", "--recompute", "auto", "--profile", fifoProfile}, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			code, stderr, wall, cpu, rss := runBounded(t, c.args...)
			first, _, _ := strings.Cut(stderr, "\n")
			t.Logf("exit %d in %v (%v of processor time), peak RSS %d MiB: %s", code, wall.Round(time.Millisecond),
				cpu.Round(time.Millisecond), rss>>20, first)
			if c.ok {
				assert.Equal(t, exitOK, code, stderr)
			} else {
				assert.NotEqual(t, exitOK, code)
				assert.NotContains(t, stderr, "fatal error")
			}
			assert.Less(t, rss, int64(hostileRSS), "peak resident memory")
			assert.Less(t, cpu, hostileCPU, "processor time")
			assert.Less(t, wall, hostileWall, "wall time")
		})
	}
}
