package memviz

import (
	"bufio"
	"encoding/binary"
	"fmt"
	"io"
	"math"
	"unicode/utf8"
)

// A small pickle codec for the values a memory snapshot holds. Values are
// *pyDict (insertion-ordered), *pyList, pyTuple, string, int64, bool, nil
// and float64. The encoder writes protocol 2, the oldest protocol both
// Python and memory_viz's JavaScript unpickler read, without memo entries;
// the decoder also reads the protocol 3–5 opcodes Python writes for such
// values (torch.cuda.memory._dump_snapshot pickles with Python's default
// protocol), so snapshots taken by PyTorch load too.

type pyDict struct {
	items []pyItem
	// index maps each string key among items[:indexed] to its first
	// item; get builds it for dicts of more than indexAbove items.
	index   map[string]int
	indexed int
}

type pyItem struct{ key, val any }

type pyList struct{ items []any }

type pyTuple []any

// indexAbove is the size past which get indexes a dict, so that looking
// up a few keys in each of many references to one large dict costs the
// dict's size once, not once per lookup.
const indexAbove = 16

// get returns the value under string key k (the first, if repeated).
func (d *pyDict) get(k string) (any, bool) {
	if len(d.items) <= indexAbove {
		for _, it := range d.items {
			if s, ok := it.key.(string); ok && s == k {
				return it.val, true
			}
		}
		return nil, false
	}
	if d.index == nil {
		d.index = make(map[string]int, len(d.items))
	}
	for ; d.indexed < len(d.items); d.indexed++ {
		if s, ok := d.items[d.indexed].key.(string); ok {
			if _, dup := d.index[s]; !dup {
				d.index[s] = d.indexed
			}
		}
	}
	i, ok := d.index[k]
	if !ok {
		return nil, false
	}
	return d.items[i].val, true
}

func (d *pyDict) set(k string, v any) { d.items = append(d.items, pyItem{k, v}) }

// Pickle opcodes.
const (
	opProto          = 0x80
	opFrame          = 0x95
	opStop           = '.'
	opMark           = '('
	opEmptyDict      = '}'
	opEmptyList      = ']'
	opEmptyTuple     = ')'
	opSetItem        = 's'
	opSetItems       = 'u'
	opAppend         = 'a'
	opAppends        = 'e'
	opDict           = 'd'
	opList           = 'l'
	opTuple          = 't'
	opTuple1         = 0x85
	opTuple2         = 0x86
	opTuple3         = 0x87
	opBinInt         = 'J'
	opBinInt1        = 'K'
	opBinInt2        = 'M'
	opLong1          = 0x8a
	opBinUnicode     = 'X'
	opShortBinUni    = 0x8c
	opBinUnicode8    = 0x8d
	opNone           = 'N'
	opNewTrue        = 0x88
	opNewFalse       = 0x89
	opBinFloat       = 'G'
	opBinPut         = 'q'
	opLongBinPut     = 'r'
	opMemoize        = 0x94
	opBinGet         = 'h'
	opLongBinGet     = 'j'
	pickleBatchLimit = 1000 // items per SETITEMS/APPENDS, as Python batches them
)

// pickleWriter encodes values as protocol 2.
type pickleWriter struct {
	w   *bufio.Writer
	err error
}

func writePickle(w io.Writer, v any) error {
	pw := &pickleWriter{w: bufio.NewWriter(w)}
	pw.bytes(opProto, 2)
	pw.value(v)
	pw.bytes(opStop)
	if pw.err != nil {
		return pw.err
	}
	return pw.w.Flush()
}

func (p *pickleWriter) bytes(b ...byte) {
	if p.err == nil {
		_, p.err = p.w.Write(b)
	}
}

func (p *pickleWriter) value(v any) {
	switch v := v.(type) {
	case nil:
		p.bytes(opNone)
	case bool:
		if v {
			p.bytes(opNewTrue)
		} else {
			p.bytes(opNewFalse)
		}
	case int:
		p.int(int64(v))
	case int64:
		p.int(v)
	case float64:
		var b [9]byte
		b[0] = opBinFloat
		binary.BigEndian.PutUint64(b[1:], math.Float64bits(v))
		p.bytes(b[:]...)
	case string:
		var b [5]byte
		b[0] = opBinUnicode
		binary.LittleEndian.PutUint32(b[1:], uint32(len(v)))
		p.bytes(b[:]...)
		if p.err == nil {
			_, p.err = p.w.WriteString(v)
		}
	case pyTuple:
		switch len(v) {
		case 0:
			p.bytes(opEmptyTuple)
		case 1, 2, 3:
			for _, x := range v {
				p.value(x)
			}
			p.bytes([...]byte{opTuple1, opTuple2, opTuple3}[len(v)-1])
		default:
			p.bytes(opMark)
			for _, x := range v {
				p.value(x)
			}
			p.bytes(opTuple)
		}
	case *pyList:
		// Batched as CPython's _pickle does: one item is an APPEND,
		// more go in MARK … APPENDS groups of up to 1000.
		p.bytes(opEmptyList)
		if len(v.items) == 1 {
			p.value(v.items[0])
			p.bytes(opAppend)
			break
		}
		for i := 0; i < len(v.items); i += pickleBatchLimit {
			p.bytes(opMark)
			for _, x := range v.items[i:min(i+pickleBatchLimit, len(v.items))] {
				p.value(x)
			}
			p.bytes(opAppends)
		}
	case *pyDict:
		// As CPython: one item is a SETITEM; otherwise MARK … SETITEMS
		// groups of up to 1000, and after a full group another, possibly
		// empty, one.
		p.bytes(opEmptyDict)
		if len(v.items) == 1 {
			p.value(v.items[0].key)
			p.value(v.items[0].val)
			p.bytes(opSetItem)
			break
		}
		for i := 0; len(v.items) > 0; i += pickleBatchLimit {
			batch := v.items[i:min(i+pickleBatchLimit, len(v.items))]
			p.bytes(opMark)
			for _, it := range batch {
				p.value(it.key)
				p.value(it.val)
			}
			p.bytes(opSetItems)
			if len(batch) < pickleBatchLimit {
				break
			}
		}
	default:
		if p.err == nil {
			p.err = fmt.Errorf("memviz: cannot pickle a %T", v)
		}
	}
}

// int writes n in the shortest form Python's pickler uses at protocol 2.
func (p *pickleWriter) int(n int64) {
	switch {
	case n >= 0 && n < 1<<8:
		p.bytes(opBinInt1, byte(n))
	case n >= 0 && n < 1<<16:
		p.bytes(opBinInt2, byte(n), byte(n>>8))
	case n >= math.MinInt32 && n <= math.MaxInt32:
		var b [5]byte
		b[0] = opBinInt
		binary.LittleEndian.PutUint32(b[1:], uint32(int32(n)))
		p.bytes(b[:]...)
	default:
		// LONG1: little-endian two's complement in as few bytes as keep
		// the sign, the length Python's encode_long picks.
		var b [8]byte
		binary.LittleEndian.PutUint64(b[:], uint64(n))
		k := 8
		for k > 1 && ((b[k-1] == 0 && b[k-2]&0x80 == 0) || (b[k-1] == 0xff && b[k-2]&0x80 != 0)) {
			k--
		}
		p.bytes(opLong1, byte(k))
		p.bytes(b[:k]...)
	}
}

// pickleReader decodes a pickle of the value kinds above. It never panics
// and allocates no more than the input's size suggests: every length is
// checked against the bytes left.
type pickleReader struct {
	buf   []byte
	off   int
	stack []any
	marks []int
	// The memo: dense indices (MEMOIZE's, and BINPUT's as Python's
	// pickler numbers them: 0, 1, 2, …) in seq, every one set; others in
	// sparse. n counts the entries, MEMOIZE's next index.
	seq    []any
	sparse map[uint64]any
	n      uint64
	// left is what the decoded values may still take, in estimated bytes
	// (the cost constants below): a chain of one-byte opcodes (TUPLE1,
	// MEMOIZE) would otherwise build tens of bytes per input byte.
	left int64
	// unhashable holds the tuples (by their first element) that contain a
	// list or dict, at any depth: worked out once, as each tuple is built,
	// so checking a key never walks a tuple's shared sub-tuples again.
	unhashable map[*any]bool
}

// maxPickleStack bounds the decoder's stack and marks.
const maxPickleStack = 1 << 20

// maxMemo bounds the memo's entries: 2²², some four per block of the
// largest snapshot (Python's pickler memoizes every dict, list and string).
const maxMemo = 1 << 22

// maxDecoded bounds the decoded values of a pickle, in the estimated bytes
// the cost constants count: 256 MiB, about a million segments, blocks
// and trace entries, the most a snapshot may hold (maxPickleItems).
const maxDecoded = 256 << 20

// Estimated bytes of decoded values, per opcode's result (the Go values
// and their share of the slices they are appended to).
const (
	costValue = 32 // a boxed scalar or a string header, and its stack or container slot
	costDict  = 64
	costList  = 48
	costTuple = 48 // a tuple header, plus costValue per element
	costItem  = 48 // a dict item (or two list items): key and value, grown slack
	costMemo  = 32 // a memo slot; a sparse one costs twice
	costMark  = 8
)

func readPickle(data []byte) (any, error) {
	r := &pickleReader{buf: data, sparse: map[uint64]any{}, unhashable: map[*any]bool{}, left: maxDecoded}
	return r.run()
}

// spend takes n estimated bytes from the decode budget at offset at.
func (r *pickleReader) spend(at int, n int64) error {
	if r.left -= n; r.left < 0 {
		return &FormatError{Format: "pickle", Offset: int64(at), Err: ErrTooLarge,
			Msg: fmt.Sprintf("decoded values past %d MiB (a snapshot of about a million blocks)", maxDecoded>>20)}
	}
	return nil
}

// put sets memo entry idx to v.
func (r *pickleReader) put(at int, idx uint64, v any) error {
	if idx < uint64(len(r.seq)) {
		r.seq[idx] = v
		return nil
	}
	if r.n >= maxMemo {
		return &FormatError{Format: "pickle", Offset: int64(at), Err: ErrTooLarge, Msg: fmt.Sprintf("more than %d memo entries", maxMemo)}
	}
	if idx == uint64(len(r.seq)) {
		if len(r.sparse) > 0 {
			if _, ok := r.sparse[idx]; ok { // moves into seq
				delete(r.sparse, idx)
				r.n--
			}
		}
		r.seq = append(r.seq, v)
		r.n++
		return r.spend(at, costMemo)
	}
	if _, ok := r.sparse[idx]; !ok {
		r.n++
		if err := r.spend(at, 2*costMemo); err != nil {
			return err
		}
	}
	r.sparse[idx] = v
	return nil
}

// get is memo entry idx.
func (r *pickleReader) get(idx uint64) (any, bool) {
	if idx < uint64(len(r.seq)) {
		return r.seq[idx], true
	}
	v, ok := r.sparse[idx]
	return v, ok
}

func (r *pickleReader) fail(off int, format string, args ...any) error {
	return &FormatError{Format: "pickle", Offset: int64(off), Msg: fmt.Sprintf(format, args...)}
}

func (r *pickleReader) truncated(off int) error {
	return &FormatError{Format: "pickle", Offset: int64(off), Msg: "input ends inside an opcode", Err: io.ErrUnexpectedEOF}
}

// take returns the next n bytes.
func (r *pickleReader) take(n uint64) ([]byte, error) {
	if n > uint64(len(r.buf)-r.off) {
		return nil, r.truncated(r.off)
	}
	b := r.buf[r.off : r.off+int(n)]
	r.off += int(n)
	return b, nil
}

// pushRef puts v, a value decoded before (a memo entry), on the stack:
// only its slot is new.
func (r *pickleReader) pushRef(v any) error {
	if len(r.stack) >= maxPickleStack {
		return r.fail(r.off, "stack deeper than %d", maxPickleStack)
	}
	if err := r.spend(r.off, costValue/2); err != nil {
		return err
	}
	r.stack = append(r.stack, v)
	return nil
}

// push puts v on the stack, counting it as a new value.
func (r *pickleReader) push(v any) error {
	if len(r.stack) >= maxPickleStack {
		return r.fail(r.off, "stack deeper than %d", maxPickleStack)
	}
	cost := int64(costValue)
	switch v := v.(type) {
	case string:
		cost += int64(len(v))
	case *pyDict:
		cost = costDict
	case *pyList:
		cost = costList
	case pyTuple:
		cost = costTuple + costValue*int64(len(v))
	}
	if err := r.spend(r.off, cost); err != nil {
		return err
	}
	r.stack = append(r.stack, v)
	return nil
}

func (r *pickleReader) pop(at int) (any, error) {
	v, err := r.top(at)
	if err == nil {
		r.stack = r.stack[:len(r.stack)-1]
	}
	return v, err
}

// top returns the value on top of the stack, above the last MARK.
func (r *pickleReader) top(at int) (any, error) {
	if len(r.stack) == 0 || (len(r.marks) > 0 && len(r.stack) == r.marks[len(r.marks)-1]) {
		return nil, r.fail(at, "stack underflow")
	}
	return r.stack[len(r.stack)-1], nil
}

// topList is the list on top of the stack, for opcode name.
func (r *pickleReader) topList(at int, name string) (*pyList, error) {
	v, err := r.top(at)
	if err != nil {
		return nil, err
	}
	l, ok := v.(*pyList)
	if !ok {
		return nil, r.fail(at, "%s to a %s", name, pyType(v))
	}
	return l, nil
}

// topDict is the dict on top of the stack, for opcode name.
func (r *pickleReader) topDict(at int, name string) (*pyDict, error) {
	v, err := r.top(at)
	if err != nil {
		return nil, err
	}
	d, ok := v.(*pyDict)
	if !ok {
		return nil, r.fail(at, "%s on a %s", name, pyType(v))
	}
	return d, nil
}

// popMark returns the items pushed since the last MARK and removes them.
func (r *pickleReader) popMark(at int) ([]any, error) {
	if len(r.marks) == 0 {
		return nil, r.fail(at, "no MARK to pop")
	}
	m := r.marks[len(r.marks)-1]
	r.marks = r.marks[:len(r.marks)-1]
	items := append([]any(nil), r.stack[m:]...)
	r.stack = r.stack[:m]
	return items, nil
}

func (r *pickleReader) run() (any, error) {
	for {
		at := r.off
		b, err := r.take(1)
		if err != nil {
			return nil, &FormatError{Format: "pickle", Offset: int64(at), Msg: "no STOP opcode", Err: io.ErrUnexpectedEOF}
		}
		if err := r.step(b[0], at); err != nil {
			if err == errStop {
				if len(r.stack) != 1 || len(r.marks) != 0 {
					return nil, r.fail(at, "STOP with %d values and %d marks on the stack", len(r.stack), len(r.marks))
				}
				return r.stack[0], nil
			}
			return nil, err
		}
	}
}

var errStop = fmt.Errorf("stop")

func (r *pickleReader) uint(n int) (uint64, error) {
	b, err := r.take(uint64(n))
	if err != nil {
		return 0, err
	}
	var v uint64
	for i := n - 1; i >= 0; i-- {
		v = v<<8 | uint64(b[i])
	}
	return v, nil
}

func (r *pickleReader) step(op byte, at int) error {
	switch op {
	case opProto:
		v, err := r.uint(1)
		if err != nil {
			return err
		}
		if v > 5 {
			return r.fail(at, "unsupported protocol %d", v)
		}
	case opFrame:
		if _, err := r.uint(8); err != nil { // frames only group bytes
			return err
		}
	case opStop:
		return errStop
	case opMark:
		if len(r.marks) >= maxPickleStack {
			return r.fail(at, "more than %d marks", maxPickleStack)
		}
		if err := r.spend(at, costMark); err != nil {
			return err
		}
		r.marks = append(r.marks, len(r.stack))
	case opNone:
		return r.push(nil)
	case opNewTrue:
		return r.push(true)
	case opNewFalse:
		return r.push(false)
	case opBinInt1:
		v, err := r.uint(1)
		if err != nil {
			return err
		}
		return r.push(int64(v))
	case opBinInt2:
		v, err := r.uint(2)
		if err != nil {
			return err
		}
		return r.push(int64(v))
	case opBinInt:
		v, err := r.uint(4)
		if err != nil {
			return err
		}
		return r.push(int64(int32(uint32(v))))
	case opLong1:
		n, err := r.uint(1)
		if err != nil {
			return err
		}
		b, err := r.take(n)
		if err != nil {
			return err
		}
		if n > 8 {
			return r.fail(at, "integer of %d bytes does not fit 64 bits", n)
		}
		var v uint64
		for i := int(n) - 1; i >= 0; i-- {
			v = v<<8 | uint64(b[i])
		}
		if n > 0 && n < 8 && b[n-1]&0x80 != 0 { // sign-extend
			v |= ^uint64(0) << (8 * n)
		}
		return r.push(int64(v))
	case opBinFloat:
		b, err := r.take(8)
		if err != nil {
			return err
		}
		return r.push(math.Float64frombits(binary.BigEndian.Uint64(b)))
	case opShortBinUni, opBinUnicode, opBinUnicode8:
		n, err := r.uint(argWidth(op))
		if err != nil {
			return err
		}
		b, err := r.take(n)
		if err != nil {
			return err
		}
		if !utf8.Valid(b) {
			return r.fail(at, "string is not UTF-8")
		}
		return r.push(string(b))
	case opEmptyDict:
		return r.push(&pyDict{})
	case opEmptyList:
		return r.push(&pyList{})
	case opEmptyTuple:
		return r.push(pyTuple{})
	case opTuple1, opTuple2, opTuple3:
		n := int(op-opTuple1) + 1
		t := make(pyTuple, n)
		for i := n - 1; i >= 0; i-- {
			v, err := r.pop(at)
			if err != nil {
				return err
			}
			t[i] = v
		}
		return r.pushTuple(t)
	case opTuple:
		items, err := r.popMark(at)
		if err != nil {
			return err
		}
		return r.pushTuple(pyTuple(items))
	case opList:
		items, err := r.popMark(at)
		if err != nil {
			return err
		}
		return r.push(&pyList{items: items})
	case opDict:
		items, err := r.popMark(at)
		if err != nil {
			return err
		}
		d := &pyDict{}
		if err := r.setItems(d, items, at); err != nil {
			return err
		}
		return r.push(d)
	case opAppend:
		v, err := r.pop(at)
		if err != nil {
			return err
		}
		l, err := r.topList(at, "APPEND")
		if err != nil {
			return err
		}
		if err := r.spend(at, costItem/2); err != nil {
			return err
		}
		l.items = append(l.items, v)
	case opAppends:
		items, err := r.popMark(at)
		if err != nil {
			return err
		}
		l, err := r.topList(at, "APPENDS")
		if err != nil {
			return err
		}
		if err := r.spend(at, costItem/2*int64(len(items))); err != nil {
			return err
		}
		l.items = append(l.items, items...)
	case opSetItem:
		v, err := r.pop(at)
		if err != nil {
			return err
		}
		k, err := r.pop(at)
		if err != nil {
			return err
		}
		d, err := r.topDict(at, "SETITEM")
		if err != nil {
			return err
		}
		return r.setItems(d, []any{k, v}, at)
	case opSetItems:
		items, err := r.popMark(at)
		if err != nil {
			return err
		}
		d, err := r.topDict(at, "SETITEMS")
		if err != nil {
			return err
		}
		return r.setItems(d, items, at)
	case opBinPut, opLongBinPut:
		idx, err := r.uint(argWidth(op))
		if err != nil {
			return err
		}
		v, err := r.top(at)
		if err != nil {
			return err
		}
		return r.put(at, idx, v)
	case opMemoize:
		v, err := r.top(at)
		if err != nil {
			return err
		}
		return r.put(at, r.n, v)
	case opBinGet, opLongBinGet:
		idx, err := r.uint(argWidth(op))
		if err != nil {
			return err
		}
		v, ok := r.get(idx)
		if !ok {
			return r.fail(at, "memo %d is not set", idx)
		}
		return r.pushRef(v)
	default:
		return r.fail(at, "unsupported opcode %#02x", op)
	}
	return nil
}

// argWidth is the byte width of the length or memo index that follows op.
func argWidth(op byte) int {
	switch op {
	case opBinUnicode, opLongBinPut, opLongBinGet:
		return 4
	case opBinUnicode8:
		return 8
	}
	return 1 // SHORT_BINUNICODE, BINPUT, BINGET
}

// setItems adds key/value pairs to d. Keys must be hashable: strings,
// numbers, booleans, None or tuples of those.
func (r *pickleReader) setItems(d *pyDict, kv []any, at int) error {
	if len(kv)%2 != 0 {
		return r.fail(at, "odd number of items (%d) for a dict", len(kv))
	}
	if err := r.spend(at, costItem*int64(len(kv)/2)); err != nil {
		return err
	}
	for i := 0; i < len(kv); i += 2 {
		if !r.hashable(kv[i]) {
			return r.fail(at, "unhashable dict key of type %s", pyType(kv[i]))
		}
		d.items = append(d.items, pyItem{kv[i], kv[i+1]})
	}
	return nil
}

// pushTuple pushes t, a tuple built from values decoded before it, noting
// whether it is hashable.
func (r *pickleReader) pushTuple(t pyTuple) error {
	for _, x := range t {
		if !r.hashable(x) {
			if err := r.spend(r.off, costItem); err != nil {
				return err
			}
			r.unhashable[&t[0]] = true
			break
		}
	}
	return r.push(t)
}

// hashable reports whether v may be a dict key: a string, number, boolean,
// None, or a tuple of those (nested tuples too). O(1): tuples were checked
// as they were built.
func (r *pickleReader) hashable(v any) bool {
	switch v := v.(type) {
	case nil, bool, int64, float64, string:
		return true
	case pyTuple:
		return len(v) == 0 || !r.unhashable[&v[0]]
	}
	return false
}

// pyType names a decoded value's Python type, for messages.
func pyType(v any) string {
	switch v.(type) {
	case nil:
		return "None"
	case bool:
		return "bool"
	case int64:
		return "int"
	case float64:
		return "float"
	case string:
		return "str"
	case pyTuple:
		return "tuple"
	case *pyList:
		return "list"
	case *pyDict:
		return "dict"
	}
	return fmt.Sprintf("%T", v)
}
