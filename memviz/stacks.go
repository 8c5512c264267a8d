package memviz

import (
	"bufio"
	"bytes"
	"cmp"
	"compress/gzip"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"
	"slices"
	"strconv"
	"strings"

	"github.com/google/pprof/profile"
)

// StackBytes is a flame-graph stack (root first) and the bytes under it.
type StackBytes struct {
	Stack []string
	Bytes int64
}

// sample is one live block as a flame-graph sample.
type sample struct {
	stack     []string
	size      int64
	requested int64
	label     Label
	addr      uint64
	node      int
}

// samples lists the active blocks of s; with several devices each stack
// starts with "device N".
func samples(s Snapshot, n *Names) []sample {
	var out []sample
	for _, d := range s.Devices {
		for _, seg := range d.Segments {
			for _, b := range seg.Blocks {
				if !active(b.State) {
					continue
				}
				l := n.Of(b.Tag)
				st := l.Stack
				if len(s.Devices) > 1 {
					st = append([]string{"device " + strconv.Itoa(d.Device)}, st...)
				}
				out = append(out, sample{stack: st, size: b.Size, requested: b.Requested, label: l, addr: uint64(b.Addr), node: b.Tag.Node})
			}
		}
	}
	return out
}

// Stacks sums the active blocks of s (rounded bytes, so the total is the
// allocated bytes) by stack: the module path split on ".", then the op.
// n names blocks (nil: from their tags). The result is sorted by stack.
func Stacks(s Snapshot, n *Names) []StackBytes {
	sum := map[string]int64{}
	for _, x := range samples(s, n) {
		k := strings.Join(sanitize(x.stack), ";")
		sum[k] = addBytes(sum[k], x.size)
	}
	out := make([]StackBytes, 0, len(sum))
	for k, v := range sum {
		out = append(out, StackBytes{Stack: strings.Split(k, ";"), Bytes: v})
	}
	slices.SortFunc(out, func(a, b StackBytes) int { return slices.Compare(a.Stack, b.Stack) })
	return out
}

// TotalBytes is the bytes of every stack of s, saturated at
// math.MaxInt64 (the readers refuse files whose total passes it).
func TotalBytes(s []StackBytes) int64 {
	var n int64
	for _, x := range s {
		n = addBytes(n, x.Bytes)
	}
	return n
}

// sanitize keeps frames from breaking the folded format: no ";" inside a
// frame, no line breaks, no empty frames.
func sanitize(stack []string) []string {
	out := make([]string, len(stack))
	for i, f := range stack {
		f = strings.NewReplacer(";", ":", "\n", " ", "\r", " ").Replace(f)
		if f == "" {
			f = "<empty>"
		}
		out[i] = f
	}
	return out
}

// WriteFolded writes s as folded stacks, "a;b;c 1234" per line, for
// flamegraph.pl, speedscope or inferno; the byte total is the snapshot's
// allocated bytes.
func WriteFolded(w io.Writer, s Snapshot, n *Names) error {
	bw := bufio.NewWriter(w)
	for _, sb := range Stacks(s, n) {
		fmt.Fprintf(bw, "%s %d\n", strings.Join(sb.Stack, ";"), sb.Bytes)
	}
	return bw.Flush()
}

// ReadFolded's caps: a line of at most maxFoldedLine (1 MiB), an input of
// at most maxFoldedBytes (1 GiB), at most maxStacks (2¹⁹) distinct stacks
// of maxFrames (2²²) frames in all. Past any it returns a *FormatError
// wrapping ErrFormat and ErrTooLarge. It streams its input, keeping one
// copy of each distinct stack; its time is linear in the input and its
// memory in the distinct stacks' bytes. ReadPprof's stacks have the same
// caps, so a comparison of two files holds at most 2²⁰ stacks, within a
// gigabyte and a few seconds.
const (
	maxFoldedLine  = 1 << 20
	maxFoldedBytes = 1 << 30
	maxStacks      = 1 << 19
	maxFrames      = 1 << 22
)

// stackCaps counts distinct stacks and their frames against maxStacks and
// maxFrames.
type stackCaps struct{ stacks, frames int }

// add counts a new distinct stack of frames frames, or says which cap it
// passes.
func (c *stackCaps) add(frames int) string {
	c.stacks++
	c.frames += frames
	switch {
	case c.stacks > maxStacks:
		return fmt.Sprintf("more than %d distinct stacks", maxStacks)
	case c.frames > maxFrames:
		return fmt.Sprintf("distinct stacks of more than %d frames in all", maxFrames)
	}
	return ""
}

// ReadFolded reads folded stacks: lines "frame;frame;… count", the count a
// non-negative integer after the last space; blank lines are skipped and
// repeated stacks summed. Malformed input gives a *FormatError wrapping
// ErrFormat; input past the caps above, one wrapping ErrTooLarge too.
func ReadFolded(r io.Reader) ([]StackBytes, error) {
	lr := &io.LimitedReader{R: r, N: maxFoldedBytes + 1}
	sc := bufio.NewScanner(lr)
	sc.Buffer(make([]byte, 0, 64<<10), maxFoldedLine)
	index := map[string]int{} // a stack's place in out
	var out []StackBytes
	var total int64 // every count, so no stack's sum (nor the file's) passes int64
	var caps stackCaps
	line := 0
	for sc.Scan() {
		line++
		// The line's bytes, not a string of it: only a new stack is
		// copied (the map lookup of string(b) allocates nothing).
		text := bytes.TrimRight(sc.Bytes(), "\r")
		if len(bytes.TrimSpace(text)) == 0 {
			continue
		}
		fail := func(format string, args ...any) error {
			return &FormatError{Format: "folded", Offset: int64(line), Msg: fmt.Sprintf(format, args...)}
		}
		i := bytes.LastIndexByte(text, ' ')
		if i < 0 {
			return nil, fail("no count after the stack")
		}
		stack, num := bytes.TrimRight(text[:i], " "), text[i+1:]
		n, err := strconv.ParseInt(string(num), 10, 64)
		if err != nil || n < 0 {
			return nil, fail("count %q is not a non-negative integer", num)
		}
		if len(stack) == 0 {
			return nil, fail("empty stack")
		}
		if stack[0] == ';' || stack[len(stack)-1] == ';' || bytes.Contains(stack, []byte(";;")) {
			return nil, fail("empty frame in %q", stack)
		}
		if n > math.MaxInt64-total {
			return nil, &FormatError{Format: "folded", Offset: int64(line), Msg: "byte total past int64", Err: ErrTooLarge}
		}
		total += n
		if i, seen := index[string(stack)]; seen {
			out[i].Bytes += n
			continue
		}
		if msg := caps.add(bytes.Count(stack, []byte{';'}) + 1); msg != "" {
			return nil, &FormatError{Format: "folded", Offset: int64(line), Msg: msg, Err: ErrTooLarge}
		}
		k := string(stack)
		index[k] = len(out)
		out = append(out, StackBytes{Stack: strings.Split(k, ";"), Bytes: n})
	}
	switch err := sc.Err(); {
	case lr.N <= 0:
		return nil, &FormatError{Format: "folded", Offset: int64(line + 1), Msg: "input over 1 GiB", Err: ErrTooLarge}
	case errors.Is(err, bufio.ErrTooLong):
		return nil, &FormatError{Format: "folded", Offset: int64(line + 1), Msg: "line over 1 MiB", Err: fmt.Errorf("%w: %w", ErrTooLarge, err)}
	case err != nil:
		return nil, &FormatError{Format: "folded", Offset: int64(line + 1), Msg: "reading", Err: err}
	}
	return out, nil
}

// StackDelta is how a stack's bytes changed between two snapshots.
type StackDelta struct {
	Stack         []string
	Before, After int64
}

// CompareStacks lists the stacks whose bytes differ, largest change first.
func CompareStacks(before, after []StackBytes) []StackDelta {
	index := make(map[string]int, max(len(before), len(after)))
	all := make([]StackDelta, 0, max(len(before), len(after)))
	get := func(st []string) *StackDelta {
		k := strings.Join(st, ";")
		i, ok := index[k]
		if !ok {
			i = len(all)
			index[k] = i
			all = append(all, StackDelta{Stack: st})
		}
		return &all[i]
	}
	for _, s := range before {
		d := get(s.Stack)
		d.Before = addBytes(d.Before, s.Bytes)
	}
	for _, s := range after {
		d := get(s.Stack)
		d.After = addBytes(d.After, s.Bytes)
	}
	var out []StackDelta
	for _, d := range all {
		if d.Before != d.After {
			out = append(out, d)
		}
	}
	abs := func(x int64) int64 { return max(x, -x) }
	slices.SortFunc(out, func(a, b StackDelta) int {
		return cmp.Or(cmp.Compare(abs(b.After-b.Before), abs(a.After-a.Before)), slices.Compare(a.Stack, b.Stack))
	})
	return out
}

// Pprof sample types: the default is the blocks' bytes, so `go tool pprof
// -top` totals the allocated bytes.
const (
	SampleInuse     = "inuse_space"
	SampleRequested = "requested_space"
)

// Pprof builds a pprof heap-style profile of s: one sample per active
// block, valued at its size (and requested bytes), whose stack is the
// module path split on "." with the op as the leaf, labelled with the
// block's kind, name and address.
func Pprof(s Snapshot, n *Names) *profile.Profile {
	p := &profile.Profile{
		SampleType:        []*profile.ValueType{{Type: SampleInuse, Unit: "bytes"}, {Type: SampleRequested, Unit: "bytes"}},
		DefaultSampleType: SampleInuse,
		PeriodType:        &profile.ValueType{Type: "space", Unit: "bytes"},
		Period:            1,
	}
	locs := map[string]*profile.Location{}
	for _, x := range samples(s, n) {
		st := sanitize(x.stack)
		sm := &profile.Sample{Value: []int64{x.size, x.requested},
			Label:    map[string][]string{"kind": {string(x.label.Kind)}, "name": {x.label.Name}},
			NumLabel: map[string][]int64{"address": {int64(x.addr)}, "node": {int64(x.node)}}}
		for i := len(st) - 1; i >= 0; i-- { // leaf first
			loc := locs[st[i]]
			if loc == nil {
				fn := &profile.Function{ID: uint64(len(p.Function) + 1), Name: st[i], SystemName: st[i]}
				p.Function = append(p.Function, fn)
				loc = &profile.Location{ID: uint64(len(p.Location) + 1), Line: []profile.Line{{Function: fn}}}
				p.Location = append(p.Location, loc)
				locs[st[i]] = loc
			}
			sm.Location = append(sm.Location, loc)
		}
		p.Sample = append(p.Sample, sm)
	}
	return p
}

// WritePprof writes Pprof(s, n), gzipped protobuf, for `go tool pprof
// -top` (totals) and `go tool pprof -http` (flame graphs).
func WritePprof(w io.Writer, s Snapshot, n *Names) error {
	return Pprof(s, n).Write(w)
}

// ReadPprof's caps, past which it returns a *FormatError wrapping ErrFormat
// and ErrTooLarge:
//   - input: at most maxPprofBytes (1 GiB);
//   - decompressed: at most pprofExpansion (16) times the input
//     (WritePprof's profiles compress 2 to 5 times), and at most
//     maxPprofDecoded (128 MiB) however it came;
//   - records: at most one sample, mapping, location, function, string or
//     label per pprofBytesPerRecord (8) decompressed bytes (an empty
//     sample takes 2 bytes, and a hundred times that once decoded), and at
//     most maxPprofRecords (2²⁰) in all; at most maxPprofRefs (2²³)
//     location ids and sample values in all (a packed one takes a byte);
//   - stacks: frame names (and separators) of at most pprofStackExpansion
//     (64) bytes per decompressed byte, or 1 MiB for smaller profiles, and
//     256 MiB in all, in all samples together (a long name repeated down a
//     deep stack); distinct stacks as ReadFolded's (maxStacks, maxFrames).
//
// The counts are taken on the encoded profile before it is decoded. Within
// them its time and memory are linear in the decompressed size (the tests
// hold it to 128 allocated bytes per decompressed byte), so in the
// input's, and bounded whatever the input.
const (
	maxPprofBytes       = 1 << 30
	maxPprofDecoded     = 128 << 20
	pprofExpansion      = 16
	pprofBytesPerRecord = 8
	maxPprofRecords     = 1 << 20
	maxPprofRefs        = 1 << 23
	pprofStackExpansion = 64
	pprofMinStack       = 1 << 20
	maxPprofStack       = 256 << 20
)

// pprofError is a *FormatError for a pprof profile.
func pprofError(msg string, err error) error {
	return &FormatError{Format: "pprof", Offset: -1, Msg: msg, Err: err}
}

// ReadPprof reads a profile written by WritePprof (gzipped or not; the
// legacy text formats go tool pprof also reads are not) back as stacks
// (root first) with their inuse bytes, summed per stack and sorted.
// Malformed input gives a *FormatError wrapping ErrFormat, input past the
// caps above one wrapping ErrTooLarge too.
func ReadPprof(r io.Reader) ([]StackBytes, error) {
	data, err := io.ReadAll(io.LimitReader(r, maxPprofBytes+1))
	if err != nil {
		return nil, err
	}
	if len(data) > maxPprofBytes {
		return nil, pprofError("larger than 1 GiB", ErrTooLarge)
	}
	if data, err = inflate(data); err != nil {
		return nil, err
	}
	if len(data) > maxPprofDecoded {
		return nil, pprofError(fmt.Sprintf("%d bytes decoded, more than %d", len(data), maxPprofDecoded), ErrTooLarge)
	}
	if err := countRecords(data); err != nil {
		return nil, err
	}
	p, err := profile.ParseUncompressed(data)
	if err == nil {
		err = p.CheckValid()
	}
	if err != nil {
		return nil, pprofError("parse", err)
	}
	vi := slices.IndexFunc(p.SampleType, func(t *profile.ValueType) bool { return t.Type == SampleInuse })
	if vi < 0 {
		return nil, pprofError("no "+SampleInuse+" sample type", nil)
	}
	sum := map[string]int64{}
	var total int64                                                               // every sample's bytes: no sum passes int64
	left := min(max(pprofStackExpansion*len(data), pprofMinStack), maxPprofStack) // bytes of stack text
	var caps stackCaps
	for _, sm := range p.Sample {
		if vi >= len(sm.Value) {
			return nil, pprofError("sample with too few values", nil)
		}
		switch v := sm.Value[vi]; {
		case v < 0:
			return nil, pprofError(fmt.Sprintf("sample of %d bytes", v), nil)
		case v > math.MaxInt64-total:
			return nil, pprofError("byte total past int64", ErrTooLarge)
		default:
			total += v
		}
		var st []string
		for i := len(sm.Location) - 1; i >= 0; i-- {
			for j := len(sm.Location[i].Line) - 1; j >= 0; j-- {
				if fn := sm.Location[i].Line[j].Function; fn != nil {
					if left -= len(fn.Name) + 1; left < 0 {
						return nil, pprofError(fmt.Sprintf("stacks longer than %d bytes per profile byte", pprofStackExpansion), ErrTooLarge)
					}
					st = append(st, fn.Name)
				}
			}
		}
		k := strings.Join(st, ";")
		if _, seen := sum[k]; !seen {
			if msg := caps.add(len(st)); msg != "" {
				return nil, pprofError(msg, ErrTooLarge)
			}
		}
		sum[k] += sm.Value[vi]
	}
	out := make([]StackBytes, 0, len(sum))
	for k, v := range sum {
		out = append(out, StackBytes{Stack: strings.Split(k, ";"), Bytes: v})
	}
	slices.SortFunc(out, func(a, b StackBytes) int { return slices.Compare(a.Stack, b.Stack) })
	return out, nil
}

// inflate decompresses a gzipped profile, within pprofExpansion times its
// size; other data is returned as it is.
func inflate(data []byte) ([]byte, error) {
	if !bytes.HasPrefix(data, []byte{0x1f, 0x8b}) {
		return data, nil
	}
	limit := min(pprofExpansion*len(data), maxPprofDecoded)
	gz, err := gzip.NewReader(bytes.NewReader(data))
	if err != nil {
		return nil, pprofError("decompressing", err)
	}
	out, err := io.ReadAll(io.LimitReader(gz, int64(limit)+1))
	if err != nil {
		return nil, pprofError("decompressing", err)
	}
	if len(out) > limit {
		return nil, pprofError(fmt.Sprintf("decompresses to more than %d bytes (%d× its size)", limit, pprofExpansion), ErrTooLarge)
	}
	return out, nil
}

// countRecords checks, before the profile is decoded, that its records
// (top-level samples (field 2), mappings (3), locations (4), functions (5)
// and strings (6), and the samples' labels) number at most one per
// pprofBytesPerRecord bytes and maxPprofRecords in all, and the samples'
// location ids and values at most maxPprofRefs.
func countRecords(data []byte) error {
	records, refs := 0, 0
	// uvarint reads a varint of b at off, advancing it.
	uvarint := func(b []byte, off *int) (uint64, error) {
		v, n := binary.Uvarint(b[*off:])
		switch {
		case n == 0:
			return 0, pprofError("input ends inside a varint", io.ErrUnexpectedEOF)
		case n < 0:
			return 0, pprofError("varint over 64 bits", nil)
		}
		*off += n
		return v, nil
	}
	// fields walks the fields of message b, calling f with each field's
	// number, wire type and payload (a length-delimited field's bytes; a
	// varint's encoding).
	fields := func(b []byte, f func(num uint64, wire uint64, payload []byte) error) error {
		for off := 0; off < len(b); {
			key, err := uvarint(b, &off)
			if err != nil {
				return err
			}
			start := off
			var skip uint64
			switch key & 7 { // wire type
			case 0:
				if _, err := uvarint(b, &off); err != nil {
					return err
				}
			case 1:
				skip = 8
			case 2:
				if skip, err = uvarint(b, &off); err != nil {
					return err
				}
				start = off
			case 5:
				skip = 4
			default:
				return pprofError(fmt.Sprintf("wire type %d", key&7), nil)
			}
			if skip > uint64(len(b)-off) {
				return pprofError("field runs past the end", io.ErrUnexpectedEOF)
			}
			off += int(skip)
			if err := f(key>>3, key&7, b[start:off]); err != nil {
				return err
			}
		}
		return nil
	}
	err := fields(data, func(num, wire uint64, payload []byte) error {
		if wire != 2 || num < 2 || num > 6 {
			return nil
		}
		records++
		if num != 2 { // a sample: count its labels, location ids and values
			return nil
		}
		return fields(payload, func(num, wire uint64, payload []byte) error {
			switch {
			case num == 3:
				records++
			case (num == 1 || num == 2) && wire == 0:
				refs++
			case (num == 1 || num == 2) && wire == 2: // packed varints
				for _, c := range payload {
					if c < 0x80 {
						refs++
					}
				}
			}
			return nil
		})
	})
	switch {
	case err != nil:
		return err
	case records > len(data)/pprofBytesPerRecord || records > maxPprofRecords:
		return pprofError(fmt.Sprintf("%d samples, mappings, locations, functions, strings and labels in %d bytes (at most one per %d, %d in all)",
			records, len(data), pprofBytesPerRecord, maxPprofRecords), ErrTooLarge)
	case refs > maxPprofRefs:
		return pprofError(fmt.Sprintf("%d location ids and sample values (at most %d)", refs, maxPprofRefs), ErrTooLarge)
	}
	return nil
}
