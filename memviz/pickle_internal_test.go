package memviz

import (
	"bytes"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"math"
	"os/exec"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func encode(t *testing.T, v any) []byte {
	t.Helper()
	var b bytes.Buffer
	require.NoError(t, writePickle(&b, v))
	return b.Bytes()
}

func list(items ...any) *pyList { return &pyList{items: items} }

func dict(kv ...any) *pyDict {
	d := &pyDict{}
	for i := 0; i < len(kv); i += 2 {
		d.items = append(d.items, pyItem{kv[i], kv[i+1]})
	}
	return d
}

// TestPickleBytesByHand checks encodings worked out from the pickle
// opcode table (Lib/pickletools.py): protocol 2 header, EMPTY_DICT, a
// BINUNICODE key, EMPTY_LIST, MARK, BININT1 1, NEWTRUE, NONE, APPENDS,
// SETITEM, STOP.
func TestPickleBytesByHand(t *testing.T) {
	for _, c := range []struct {
		v   any
		hex string
	}{
		{dict("a", list(int64(1), true, nil)), "8002" + "7d" + "5801000000" + "61" + "5d" + "28" + "4b01" + "88" + "4e" + "65" + "73" + "2e"},
		{list(int64(-1)), "8002" + "5d" + "4affffffff" + "61" + "2e"},
		{pyTuple{int64(0), int64(0)}, "8002" + "4b00" + "4b00" + "86" + "2e"},
		{int64(1) << 32, "8002" + "8a05" + "0000000001" + "2e"},
		{int64(-1) << 40, "8002" + "8a06" + "0000000000ff" + "2e"},
		{int64(math.MaxInt64), "8002" + "8a08" + "ffffffffffffff7f" + "2e"},
		{1.5, "8002" + "47" + "3ff8000000000000" + "2e"},
		{false, "8002" + "89" + "2e"},
		{pyTuple{}, "8002" + "29" + "2e"},
	} {
		assert.Equal(t, c.hex, hex.EncodeToString(encode(t, c.v)), "%#v", c.v)
	}
}

// pyRepr writes v as a Python literal.
func pyRepr(v any) string {
	switch v := v.(type) {
	case nil:
		return "None"
	case bool:
		if v {
			return "True"
		}
		return "False"
	case int64:
		return strconv.FormatInt(v, 10)
	case float64:
		return strconv.FormatFloat(v, 'g', -1, 64)
	case string:
		return strconv.Quote(v)
	case pyTuple:
		s := make([]string, len(v))
		for i, x := range v {
			s[i] = pyRepr(x)
		}
		if len(v) == 1 {
			return "(" + s[0] + ",)"
		}
		return "(" + strings.Join(s, ", ") + ")"
	case *pyList:
		s := make([]string, len(v.items))
		for i, x := range v.items {
			s[i] = pyRepr(x)
		}
		return "[" + strings.Join(s, ", ") + "]"
	case *pyDict:
		s := make([]string, len(v.items))
		for i, it := range v.items {
			s[i] = pyRepr(it.key) + ": " + pyRepr(it.val)
		}
		return "{" + strings.Join(s, ", ") + "}"
	}
	panic(fmt.Sprintf("pyRepr: %T", v))
}

func python(t *testing.T, script string) []byte {
	t.Helper()
	py, err := exec.LookPath("python3")
	if err != nil {
		t.Skip("python3 not found")
	}
	out, err := exec.Command(py, "-c", script).Output()
	require.NoError(t, err, script)
	return out
}

// crossCheck values use distinct strings: Python memoizes a repeated
// string and refers back to it, which this encoder never does.
func crossCheckValues() []any {
	ints := list()
	for _, n := range []int64{0, 1, 255, 256, 65535, 65536, -1, -256, math.MaxInt32, math.MinInt32,
		math.MaxInt32 + 1, math.MinInt32 - 1, 1 << 40, -1 << 40, 1<<47 - 1, -1 << 47, 1 << 55, math.MaxInt64, math.MinInt64} {
		ints.items = append(ints.items, n)
	}
	long := list()
	for i := range 2500 { // three APPENDS batches
		long.items = append(long.items, int64(i))
	}
	big, full := dict(), dict()
	for i := range 1001 { // a SETITEMS batch of 1000, then one of 1
		big.items = append(big.items, pyItem{"k" + strconv.Itoa(i), int64(i)})
	}
	for i := range 1000 { // a full batch, then an empty one
		full.items = append(full.items, pyItem{"f" + strconv.Itoa(i), int64(i)})
	}
	one := list() // one APPENDS batch of 1000, then one of 1
	for i := range 1001 {
		one.items = append(one.items, int64(i))
	}
	return []any{
		dict("segments", list(dict("device", int64(0), "address", int64(1)<<32, "pool", pyTuple{int64(0), int64(0)},
			"flag", false, "ratio", 0.25, "note", nil, "blocks", list()))),
		ints, long, big, full, one, list(int64(7)), dict(),
		pyTuple{int64(1), "x", pyTuple{}, pyTuple{int64(2)}, pyTuple{int64(3), int64(4), int64(5)}},
		list("ünïcødé", "", -2.5e-300, math.Inf(1)),
	}
}

// TestPickleMatchesPython checks the encoder byte for byte against
// Python's protocol-2 pickler with its unused memo entries stripped
// (pickletools.optimize).
func TestPickleMatchesPython(t *testing.T) {
	for i, v := range crossCheckValues() {
		repr := strings.ReplaceAll(pyRepr(v), "+Inf", "float('inf')")
		out := python(t, "import pickle, pickletools, sys\n"+
			"sys.stdout.write(pickletools.optimize(pickle.dumps("+repr+", 2)).hex())")
		// Compared as strings, a mismatch would print kilobytes of hex.
		assert.True(t, string(out) == hex.EncodeToString(encode(t, v)), "value %d differs from Python's pickle", i)
	}
}

// TestPickleDecodesPythonProtocols reads what Python writes at protocols
// 2 to 5, memo references to repeated strings and frames included.
func TestPickleDecodesPythonProtocols(t *testing.T) {
	v := dict("blocks", list(dict("state", "inactive", "size", int64(512)), dict("state", "inactive", "size", int64(1)<<33)),
		"pool", pyTuple{int64(0), int64(0)}, "r", -0.5, "e", nil, "t", true)
	for proto := 2; proto <= 5; proto++ {
		out := python(t, fmt.Sprintf("import pickle, sys\nsys.stdout.write(pickle.dumps(%s, %d).hex())", pyRepr(v), proto))
		data, err := hex.DecodeString(string(out))
		require.NoError(t, err)
		got, err := readPickle(data)
		require.NoError(t, err, "protocol %d", proto)
		assert.Equal(t, v, got, "protocol %d", proto)
	}
}

func TestPickleRoundTrip(t *testing.T) {
	for i, v := range crossCheckValues() {
		got, err := readPickle(encode(t, v))
		require.NoError(t, err)
		assert.Equal(t, v, got, "value %d", i)
	}
}

func TestPickleDecoderRejectsBadInput(t *testing.T) {
	for name, h := range map[string]string{
		"empty":               "",
		"unknown opcode":      "8002" + "ff" + "2e",
		"protocol 6":          "8006" + "4e" + "2e",
		"stack underflow":     "8002" + "61" + "2e",
		"append to a dict":    "8002" + "7d" + "4b01" + "61" + "2e",
		"setitems on a list":  "8002" + "5d" + "28" + "4b01" + "4b02" + "75" + "2e",
		"odd setitems":        "8002" + "7d" + "28" + "4b01" + "75" + "2e",
		"unhashable key":      "8002" + "7d" + "5d" + "4b01" + "73" + "2e",
		"missing memo":        "8002" + "6807" + "2e",
		"pop below mark":      "8002" + "5d" + "28" + "61" + "2e",
		"no mark":             "8002" + "5d" + "65" + "2e",
		"long of 9 bytes":     "8002" + "8a09" + "000000000000000001" + "2e",
		"invalid utf-8":       "8002" + "5802000000" + "c328" + "2e",
		"string past the end": "8002" + "58ffffffff" + "61" + "2e",
		"two values at stop":  "8002" + "4e" + "4e" + "2e",
		"mark left at stop":   "8002" + "28" + "4e" + "2e",
		"no stop":             "8002" + "4e",
	} {
		data, err := hex.DecodeString(h)
		require.NoError(t, err)
		_, err = readPickle(data)
		var fe *FormatError
		if assert.True(t, errors.As(err, &fe), "%s: %v", name, err) {
			assert.True(t, errors.Is(err, ErrFormat), name)
			assert.Equal(t, "pickle", fe.Format, name)
		}
	}
	_, err := readPickle([]byte{0x80, 0x02, 'X', 9, 0})
	assert.True(t, errors.Is(err, io.ErrUnexpectedEOF), "truncated length: %v", err)
}

// TestReadPickleSchemaErrors feeds well-formed pickles that are not
// snapshots.
func TestReadPickleSchemaErrors(t *testing.T) {
	block := func(kv ...any) *pyDict {
		d := dict("address", int64(4096), "size", int64(512), "requested_size", int64(512), "state", "active_allocated",
			"frames", list(dict("filename", "fc1", "line", int64(3), "name", "linear")))
		return withItems(d, kv...)
	}
	segment := func(b *pyDict, kv ...any) *pyDict {
		d := dict("device", int64(0), "address", int64(4096), "total_size", int64(512), "segment_type", "small", "blocks", list(b))
		return withItems(d, kv...)
	}
	top := func(segs ...any) *pyDict { return dict("segments", list(segs...), "device_traces", list(list())) }
	event := func(kv ...any) *pyDict {
		return withItems(dict("action", "alloc", "addr", int64(4096), "size", int64(512), "frames", list()), kv...)
	}
	withTrace := func(e *pyDict) *pyDict { return dict("segments", list(), "device_traces", list(list(e))) }
	good := top(segment(block()))
	_, err := ReadPickle(bytes.NewReader(encode(t, good)))
	require.NoError(t, err, "the base case is valid")

	for name, c := range map[string]struct {
		v        any
		snapshot bool // also an ErrSnapshot
	}{
		"top is a list":          {v: list()},
		"no segments":            {v: dict("device_traces", list())},
		"segments not a list":    {v: dict("segments", dict())},
		"segment not a dict":     {v: top(int64(1))},
		"no total_size":          {v: top(withItems(dict("address", int64(0), "blocks", list())))},
		"negative size":          {v: top(segment(block(), "total_size", int64(-512)))},
		"size is a string":       {v: top(segment(block(), "total_size", "512"))},
		"unknown segment type":   {v: top(segment(block(), "segment_type", "medium"))},
		"blocks not a list":      {v: top(segment(block(), "blocks", dict()))},
		"block without state":    {v: top(segment(withItems(dict("size", int64(512)))))},
		"unknown state":          {v: top(segment(block("state", "bogus")))},
		"frames not a list":      {v: top(segment(block("frames", "x")))},
		"frame without name":     {v: top(segment(block("frames", list(dict("filename", "a", "line", int64(1))))))},
		"line out of range":      {v: top(segment(block("frames", list(dict("filename", "a", "line", int64(1)<<40, "name", "b")))))},
		"traces not a list":      {v: dict("segments", list(), "device_traces", dict())},
		"trace not a list":       {v: dict("segments", list(), "device_traces", list(int64(3)))},
		"entry not a dict":       {v: dict("segments", list(), "device_traces", list(list(nil)))},
		"unknown action":         {v: withTrace(event("action", "teleport"))},
		"alloc without addr":     {v: withTrace(dict("action", "alloc", "size", int64(512)))},
		"time is a string":       {v: withTrace(event("time_us", "now"))},
		"blocks overrun segment": {v: top(segment(block("size", int64(1024)))), snapshot: true},
		"segments overlap":       {v: top(segment(block()), segment(block())), snapshot: true},
	} {
		_, err := ReadPickle(bytes.NewReader(encode(t, c.v)))
		var fe *FormatError
		if assert.True(t, errors.As(err, &fe), "%s: %v", name, err) {
			assert.True(t, errors.Is(err, ErrFormat), name)
			assert.Equal(t, c.snapshot, errors.Is(err, ErrSnapshot), "%s: %v", name, err)
		}
	}
}

// withItems replaces or adds key/value pairs of d.
func withItems(d *pyDict, kv ...any) *pyDict {
	out := &pyDict{items: append([]pyItem(nil), d.items...)}
next:
	for i := 0; i < len(kv); i += 2 {
		for j := range out.items {
			if out.items[j].key == kv[i] {
				out.items[j].val = kv[i+1]
				continue next
			}
		}
		out.items = append(out.items, pyItem{kv[i], kv[i+1]})
	}
	return out
}
