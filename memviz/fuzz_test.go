package memviz_test

import (
	"bytes"
	"errors"
	"os"
	"strings"
	"testing"

	"github.com/batchfit/batchfit/memviz"
)

// The readers take files from anywhere: whatever the bytes, they return a
// snapshot or stacks, or an error wrapping ErrFormat, never panic, and
// allocate within linearBound (pprofBound) of the input: the caps that keep
// them there give ErrTooLarge. The seeds include crafted files that pass each cap.
// Run one with: go test -run '^$' -fuzz FuzzReadPickle ./memviz

func FuzzReadPickle(f *testing.F) {
	if golden, err := os.ReadFile(tinyGolden); err == nil {
		f.Add(golden)
	}
	var b bytes.Buffer
	if err := memviz.WritePickle(&b, memviz.Snapshot{}); err == nil {
		f.Add(b.Bytes())
	}
	f.Add([]byte("\x80\x02}q\x00(X\x08\x00\x00\x00segmentsq\x01]q\x02h\x02u."))
	for _, data := range hostilePickles(100) {
		f.Add(data)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		var s memviz.Snapshot
		var err error
		if used := allocatedBy(func() { s, err = memviz.ReadPickle(bytes.NewReader(data)) }); used > linearBound(len(data)) {
			t.Fatalf("allocated %d bytes reading %d", used, len(data))
		}
		if err != nil {
			if !errors.Is(err, memviz.ErrFormat) {
				t.Fatalf("untyped error: %v", err)
			}
			return
		}
		// What was read is a valid snapshot, and reads back the same.
		if err := s.Validate(); err != nil {
			t.Fatalf("accepted an invalid snapshot: %v", err)
		}
		var out bytes.Buffer
		if err := memviz.WritePickle(&out, s); err != nil {
			t.Fatalf("write back: %v", err)
		}
		again, err := memviz.ReadPickle(&out)
		if err != nil {
			t.Fatalf("read back: %v", err)
		}
		if len(again.Devices) != len(s.Devices) || again.Allocated() != s.Allocated() || again.Reserved() != s.Reserved() {
			t.Fatalf("round trip changed the snapshot: %d devices, %d/%d bytes → %d devices, %d/%d bytes",
				len(s.Devices), s.Allocated(), s.Reserved(), len(again.Devices), again.Allocated(), again.Reserved())
		}
	})
}

func FuzzReadFolded(f *testing.F) {
	f.Add([]byte("fc1;weight;param 512\nfc1;weight;exp_avg 512\n"))
	f.Add([]byte("a;b 1\r\n\n a 2\n"))
	f.Add([]byte("x -1\n"))
	f.Add([]byte(strings.Repeat("a;", 1<<12) + "a 1\n"))
	f.Fuzz(func(t *testing.T, data []byte) {
		var stacks []memviz.StackBytes
		var err error
		if used := allocatedBy(func() { stacks, err = memviz.ReadFolded(bytes.NewReader(data)) }); used > linearBound(len(data)) {
			t.Fatalf("allocated %d bytes reading %d", used, len(data))
		}
		if err != nil {
			if !errors.Is(err, memviz.ErrFormat) {
				t.Fatalf("untyped error: %v", err)
			}
			return
		}
		for _, s := range stacks {
			if s.Bytes < 0 || len(s.Stack) == 0 {
				t.Fatalf("accepted %+v", s)
			}
		}
	})
}

func FuzzReadPprof(f *testing.F) {
	var b bytes.Buffer
	if err := memviz.WritePprof(&b, tinySnapshot(), nil); err == nil {
		f.Add(b.Bytes())
	}
	f.Add([]byte{0x1f, 0x8b, 0x08, 0x00})
	f.Add(gzipped(f, bytes.Repeat([]byte{0x12, 0x00}, 1<<16)))
	f.Add(gzipped(f, make([]byte, 1<<20)))
	f.Fuzz(func(t *testing.T, data []byte) {
		var err error
		if used := allocatedBy(func() { _, err = memviz.ReadPprof(bytes.NewReader(data)) }); used > pprofBound(len(data)) {
			t.Fatalf("allocated %d bytes reading %d", used, len(data))
		}
		if err != nil && !errors.Is(err, memviz.ErrFormat) {
			t.Fatalf("untyped error: %v", err)
		}
	})
}
