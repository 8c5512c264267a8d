package memviz_test

import (
	"bytes"
	"errors"
	"os"
	"testing"

	"github.com/batchfit/batchfit/memviz"
)

// The readers take files from anywhere: whatever the bytes, they return a
// snapshot or stacks, or an error wrapping ErrFormat, and never panic.
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
	f.Fuzz(func(t *testing.T, data []byte) {
		s, err := memviz.ReadPickle(bytes.NewReader(data))
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
	f.Fuzz(func(t *testing.T, data []byte) {
		stacks, err := memviz.ReadFolded(bytes.NewReader(data))
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
	f.Fuzz(func(t *testing.T, data []byte) {
		if _, err := memviz.ReadPprof(bytes.NewReader(data)); err != nil && !errors.Is(err, memviz.ErrFormat) {
			t.Fatalf("untyped error: %v", err)
		}
	})
}
