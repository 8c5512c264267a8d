package memviz_test

import (
	"bufio"
	"bytes"
	"compress/gzip"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/batchfit/batchfit/memviz"
	"github.com/google/pprof/profile"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Crafted files: small inputs that describe huge ones through shared
// references or compression. Readers must refuse them with ErrTooLarge
// (or read them) in time and memory linear in the input.

// pk builds pickle bytes by opcode.
type pk struct{ bytes.Buffer }

func (p *pk) op(b ...byte) *pk { p.Write(b); return p }

func (p *pk) str(s string) *pk {
	p.op('X')
	_ = binary.Write(p, binary.LittleEndian, uint32(len(s)))
	p.WriteString(s)
	return p
}

func (p *pk) int(n int32) *pk {
	p.op('J')
	_ = binary.Write(p, binary.LittleEndian, n)
	return p
}

// put stores the top of the stack as memo i; get pushes memo i again.
func (p *pk) put(i byte) *pk { return p.op('q', i) }
func (p *pk) get(i byte) *pk { return p.op('h', i) }

// repeat pushes memo i n times.
func (p *pk) repeat(i byte, n int) *pk {
	for range n {
		p.get(i)
	}
	return p
}

// allocatedBy is the bytes f allocates (and whatever else runs meanwhile).
func allocatedBy(f func()) uint64 {
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	f()
	runtime.ReadMemStats(&after)
	return after.TotalAlloc - before.TotalAlloc
}

// linearBound is what ReadPickle and ReadFolded may allocate for n input
// bytes, and ReadPprof for n decompressed bytes (its input's size at most
// 16 times): their caps keep them linear in it.
func linearBound(n int) uint64 { return 256*uint64(n) + 4<<20 }

// pprofBound is what ReadPprof may allocate for n input bytes: 128 bytes
// per decompressed byte, of which there are at most 16 per input byte.
func pprofBound(n int) uint64 { return 128*16*uint64(n) + 4<<20 }

// hostilePickles are pickles of a few times n bytes that repeat one dict,
// list or string through memo references into n² segments, blocks, trace
// entries or frames.
func hostilePickles(n int) map[string][]byte {
	// One segment of n 512-byte blocks, all the same block dict.
	segment := func(p *pk) *pk {
		p.op('}', '(').str("address").int(0).str("total_size").int(int32(512*n)).str("blocks").op(']', '(')
		p.op('}', '(').str("size").int(512).str("state").str("inactive").op('u').put(1).repeat(1, n-1)
		return p.op('e', 'u')
	}
	return map[string][]byte{
		// segments: [seg, seg, seg, …], one dict n times.
		"segment": segment(new(pk).op(0x80, 2, '}', '(').str("segments").op(']', '(')).put(0).repeat(0, n-1).
			op('e').str("device_traces").op(']', 'u', '.').Bytes(),
		// device_traces: [l, l, …, l], l = [e, e, …, e], one entry n times,
		// one list n times.
		"trace": new(pk).op(0x80, 2, '}', '(').str("segments").op(']').str("device_traces").op(']', '(', ']', '(').
			op('}', '(').str("action").str("alloc").str("addr").int(0).str("size").int(512).op('u').put(1).repeat(1, n-1).
			op('e').put(0).repeat(0, n-1).op('e', 'u', '.').Bytes(),
		// One segment of n blocks that share one frames list, whose frame's
		// filename is 5n module path components: 5n² frames for Stacks.
		"shared frame": sharedFrame(n, strings.Repeat("m.", 5*n)),
	}
}

// sharedFrame is a snapshot of one segment of n active blocks whose frames
// list, memo 2, is one frame of filename file.
func sharedFrame(n int, file string) []byte {
	p := new(pk).op(0x80, 2, '}', '(').str("segments").op(']', '(')
	p.op('}', '(').str("address").int(0).str("total_size").int(int32(512*n)).str("blocks").op(']', '(')
	p.op('}', '(').str("size").int(512).str("state").str("active_allocated").str("frames")
	p.op(']', '}', '(').str("filename").str(file).str("line").int(1).str("name").str("op").op('u', 'a').put(2).op('u')
	for range n - 1 {
		p.op('}', '(').str("size").int(512).str("state").str("active_allocated").str("frames").get(2).op('u')
	}
	return p.op('e', 'u', 'e', 'u', '.').Bytes()
}

// TestReadPickleRepeatedReferences checks that memo references repeating
// one segment, one block or one trace list thousands of times are counted
// each time against ReadPickle's cap: the read fails with ErrTooLarge
// (and ErrFormat) having allocated a bounded multiple of the input, where
// it used to build every copy (gigabytes from tens of kilobytes).
func TestReadPickleRepeatedReferences(t *testing.T) {
	refused(t, func(r io.Reader) error { _, err := memviz.ReadPickle(r); return err }, hostilePickles(1500))
}

// refused checks that read refuses each input of cases with ErrTooLarge
// (and ErrFormat), having allocated within linearBound of its size.
func refused(t *testing.T, read func(io.Reader) error, cases map[string][]byte) {
	for name, data := range cases {
		t.Run(name, func(t *testing.T) {
			var err error
			used := allocatedBy(func() { err = read(bytes.NewReader(data)) })
			require.ErrorIs(t, err, memviz.ErrTooLarge)
			assert.ErrorIs(t, err, memviz.ErrFormat)
			assert.LessOrEqual(t, used, linearBound(len(data)), "bytes allocated reading %d bytes", len(data))
		})
	}
}

// TestReadPickleSharedFrames checks that what PyTorch does share, one
// frames list under many blocks, reads, and costs its size once.
func TestReadPickleSharedFrames(t *testing.T) {
	const n = 2000
	p := new(pk).op(0x80, 2, '}', '(').str("segments").op(']', '(')
	p.op('}', '(').str("address").int(0).str("total_size").int(512*n).str("blocks").op(']', '(')
	// The first block's frames list, one frame, a dict of many keys, is
	// memo 2; the other blocks repeat it.
	p.op('}', '(').str("size").int(512).str("state").str("active_allocated").str("frames")
	p.op(']', '}', '(').str("filename").str("m").str("line").int(1).str("name").str("op")
	for i := range 5000 {
		p.str("k" + strings.Repeat("x", i%7)).int(int32(i))
	}
	p.op('u', 'a').put(2).op('u')
	for range n - 1 {
		p.op('}', '(').str("size").int(512).str("state").str("active_allocated").str("frames").get(2).op('u')
	}
	data := p.op('e', 'u', 'e', 'u', '.').Bytes()
	var s memviz.Snapshot
	var err error
	used := allocatedBy(func() { s, err = memviz.ReadPickle(bytes.NewReader(data)) })
	require.NoError(t, err)
	assert.Equal(t, int64(512*n), s.Allocated())
	assert.LessOrEqual(t, used, linearBound(len(data)))
}

// TestReadPickleNestedTupleKeys checks that a dict key made of tuples that
// share sub-tuples (each level 30 references to the level below, 8 deep:
// 30⁸ leaves from a few hundred bytes) is checked for hashability in time
// linear in the input, not by walking every path.
func TestReadPickleNestedTupleKeys(t *testing.T) {
	// MARK×8, (1,), then per level: 29 more references, TUPLE.
	p := new(pk).op(0x80, 2, '}', '(', '(', '(', '(', '(', '(', '(', '(').int(1).op(0x85).put(0)
	for level := range 8 {
		p.repeat(byte(level), 29).op('t').put(byte(level + 1))
	}
	data := p.op('N', 's', '.').Bytes()
	done := make(chan error, 1)
	go func() { _, err := memviz.ReadPickle(bytes.NewReader(data)); done <- err }()
	select {
	case err := <-done:
		// The key is hashable; the dict is no snapshot.
		require.ErrorIs(t, err, memviz.ErrFormat)
		assert.NotContains(t, err.Error(), "unhashable")
		assert.False(t, errors.Is(err, memviz.ErrTooLarge))
	case <-time.After(20 * time.Second):
		t.Fatal("ReadPickle still checking the key after 20s")
	}
}

func gzipped(t testing.TB, data []byte) []byte {
	t.Helper()
	var b bytes.Buffer
	zw, err := gzip.NewWriterLevel(&b, gzip.BestCompression)
	require.NoError(t, err)
	_, err = zw.Write(data)
	require.NoError(t, err)
	require.NoError(t, zw.Close())
	return b.Bytes()
}

// TestReadPprofBombs checks ReadPprof's caps on crafted profiles: each is
// refused with ErrTooLarge (and ErrFormat) having allocated a bounded
// multiple of the file, where it used to decompress and decode it all
// (hundreds of megabytes here; an out-of-memory crash from 97 KB).
func TestReadPprofBombs(t *testing.T) {
	emptySamples := bytes.Repeat([]byte{0x12, 0x00}, 2<<20) // field 2, length 0
	// One function with a 16 KiB name, one location, and a sample that
	// lists that location 10,000 times: 160 MB of stack from 27 KB.
	fn := &profile.Function{ID: 1, Name: strings.Repeat("f", 16<<10)}
	loc := &profile.Location{ID: 1, Line: []profile.Line{{Function: fn}}}
	deep := &profile.Sample{Value: []int64{1, 1}}
	for range 10000 {
		deep.Location = append(deep.Location, loc)
	}
	var long bytes.Buffer
	require.NoError(t, (&profile.Profile{
		SampleType: []*profile.ValueType{{Type: memviz.SampleInuse, Unit: "bytes"}, {Type: memviz.SampleRequested, Unit: "bytes"}},
		Sample:     []*profile.Sample{deep}, Location: []*profile.Location{loc}, Function: []*profile.Function{fn},
	}).Write(&long))
	refused(t, func(r io.Reader) error { _, err := memviz.ReadPprof(r); return err }, map[string][]byte{
		"gzipped empty samples":      gzipped(t, emptySamples),
		"gzipped zeros":              gzipped(t, make([]byte, 64<<20)),
		"uncompressed empty samples": emptySamples[:200<<10],
		"long stack":                 long.Bytes(),
	})
}

// TestReadPprofTruncated checks that a profile cut short is reported as
// such, through io.ErrUnexpectedEOF.
func TestReadPprofTruncated(t *testing.T) {
	var b bytes.Buffer
	require.NoError(t, memviz.WritePprof(&b, tinySnapshot(), nil))
	for _, data := range [][]byte{b.Bytes()[:b.Len()/2], gunzip(t, b.Bytes())[:20]} {
		_, err := memviz.ReadPprof(bytes.NewReader(data))
		assert.ErrorIs(t, err, io.ErrUnexpectedEOF)
		assert.ErrorIs(t, err, memviz.ErrFormat)
	}
}

func gunzip(t *testing.T, data []byte) []byte {
	t.Helper()
	zr, err := gzip.NewReader(bytes.NewReader(data))
	require.NoError(t, err)
	out, err := io.ReadAll(zr)
	require.NoError(t, err)
	return out
}

// TestReadPprofLinear checks ReadPprof's allocations on profiles just
// inside its caps, dense with what costs most to decode: one-location
// samples of 8 bytes, empty labels, one location of many empty lines.
// Each is held to 128 bytes per decompressed byte.
func TestReadPprofLinear(t *testing.T) {
	fn := &profile.Function{ID: 1, Name: "f"}
	loc := &profile.Location{ID: 1, Line: []profile.Line{{Function: fn}}}
	base := func() *profile.Profile {
		return &profile.Profile{SampleType: []*profile.ValueType{{Type: memviz.SampleInuse, Unit: "bytes"}},
			Location: []*profile.Location{loc}, Function: []*profile.Function{fn}}
	}
	const n = 1 << 16
	dense := base()
	for range n {
		dense.Sample = append(dense.Sample, &profile.Sample{Value: []int64{1}, Location: []*profile.Location{loc, loc}})
	}
	labels := base()
	for range n / 16 {
		s := &profile.Sample{Value: []int64{1}, Location: []*profile.Location{loc}, Label: map[string][]string{}}
		for i := range 16 {
			s.Label[strings.Repeat("k", i)] = []string{""}
		}
		labels.Sample = append(labels.Sample, s)
	}
	lines := base()
	long := &profile.Location{ID: 2}
	for range n {
		long.Line = append(long.Line, profile.Line{Function: fn})
	}
	lines.Location = append(lines.Location, long)
	lines.Sample = []*profile.Sample{{Value: []int64{1}, Location: []*profile.Location{long}}}
	for name, p := range map[string]*profile.Profile{"8-byte samples": dense, "labels": labels, "lines": lines} {
		t.Run(name, func(t *testing.T) {
			var raw bytes.Buffer
			require.NoError(t, p.WriteUncompressed(&raw))
			for _, data := range [][]byte{raw.Bytes(), gzipped(t, raw.Bytes())} {
				var err error
				used := allocatedBy(func() { _, err = memviz.ReadPprof(bytes.NewReader(data)) })
				if !errors.Is(err, memviz.ErrTooLarge) { // gzipped past 16×
					require.NoError(t, err)
				}
				t.Logf("%d bytes (%d decompressed): %.1f allocated bytes per decompressed byte", len(data), raw.Len(), float64(used)/float64(raw.Len()))
				assert.LessOrEqual(t, used, 128*uint64(raw.Len())+4<<20)
			}
		})
	}
}

// TestReadFoldedLongLine checks that a line past ReadFolded's 1 MiB cap is
// refused with ErrTooLarge (and ErrFormat, and bufio.ErrTooLong), the
// same sentinel every reader's caps give.
func TestReadFoldedLongLine(t *testing.T) {
	data := "a 1\n" + strings.Repeat("a;", 1<<19) + "b 1\n"
	_, err := memviz.ReadFolded(strings.NewReader(data))
	assert.ErrorIs(t, err, memviz.ErrTooLarge)
	assert.ErrorIs(t, err, memviz.ErrFormat)
	assert.ErrorIs(t, err, bufio.ErrTooLong)
	var fe *memviz.FormatError
	require.ErrorAs(t, err, &fe)
	assert.Equal(t, int64(2), fe.Offset, "the line number")
}

// absoluteBound is what a reader may allocate on any input, whatever its
// size: its absolute caps (decoded values, memo entries, stacks) keep a
// command reading one within a gigabyte.
const absoluteBound = 640 << 20

// TestReadPickleOpcodeChains checks that chains of one-byte opcodes, each
// of which builds a value (TUPLE1 and TUPLE2 a tuple of the last, MEMOIZE
// a memo entry, MARK a mark), are refused with ErrTooLarge having
// allocated within absoluteBound: each byte used to cost tens of bytes
// (a 20 MB chain took 1.1 to 1.8 GB, a 60 MB one crashed the process).
func TestReadPickleOpcodeChains(t *testing.T) {
	const n = 8 << 20
	chain := func(head []byte, op []byte, k int) []byte {
		return append(append(append([]byte{0x80, 2}, head...), bytes.Repeat(op, k)...), '.')
	}
	for name, data := range map[string][]byte{
		"TUPLE1":           chain([]byte{'K', 0}, []byte{0x85}, n),
		"TUPLE2":           chain([]byte{'K', 0}, []byte{'K', 0, 0x86}, n/3),
		"MEMOIZE":          chain([]byte{'K', 0}, []byte{0x94}, n),
		"TUPLE1 of a list": chain([]byte{']'}, []byte{0x85}, n),
	} {
		t.Run(name, func(t *testing.T) {
			var err error
			used := allocatedBy(func() { _, err = memviz.ReadPickle(bytes.NewReader(data)) })
			require.ErrorIs(t, err, memviz.ErrTooLarge)
			assert.ErrorIs(t, err, memviz.ErrFormat)
			assert.LessOrEqual(t, used, uint64(absoluteBound), "bytes allocated reading %d bytes", len(data))
		})
	}
	_, err := memviz.ReadPickle(bytes.NewReader(chain(nil, []byte{'('}, n)))
	require.ErrorIs(t, err, memviz.ErrFormat, "more marks than the stack takes")
}

// TestReadStacksCaps checks that folded stacks and pprof profiles of more
// distinct stacks than the readers take (2¹⁹) are refused with ErrTooLarge
// within absoluteBound, and that a profile's records past 2²⁰ are refused
// before it is decoded.
func TestReadStacksCaps(t *testing.T) {
	var folded bytes.Buffer
	for i := range 1<<19 + 1 {
		fmt.Fprintf(&folded, "root;f%d 1\n", i)
	}
	var err error
	used := allocatedBy(func() { _, err = memviz.ReadFolded(bytes.NewReader(folded.Bytes())) })
	require.ErrorIs(t, err, memviz.ErrTooLarge)
	assert.LessOrEqual(t, used, uint64(absoluteBound))
	_, err = memviz.ReadFolded(strings.NewReader(strings.Repeat("a;", 1<<22) + "a 1\n"))
	require.ErrorIs(t, err, memviz.ErrTooLarge, "a stack of more frames than the readers take")

	// 2²⁰ + 1 samples of 8 bytes (the density cap allows them).
	sample := []byte{0x12, 6, 8, 1, 16, 0x80, 0x80, 1}
	data := bytes.Repeat(sample, 1<<20+1)
	used = allocatedBy(func() { _, err = memviz.ReadPprof(bytes.NewReader(data)) })
	require.ErrorIs(t, err, memviz.ErrTooLarge)
	assert.LessOrEqual(t, used, uint64(64<<20), "refused before decoding")
}
