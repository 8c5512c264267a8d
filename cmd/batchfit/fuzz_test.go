package main

import (
	"bytes"
	"errors"
	"runtime"
	"testing"

	"github.com/batchfit/batchfit/memviz"
)

// FuzzReadSnapshotFile feeds readSnapshotFile, which report and compare
// read files with, any bytes (as standard input: the content picks the
// reader): it returns a file or a *fileError wrapping memviz.ErrFormat,
// never panics, and allocates within a linear bound of the input, the
// loosest of the readers' (ReadPprof's: 128 bytes per decompressed byte, at
// most 16 of those per input byte), Stacks of a pickle included.
// Run with: go test -run '^$' -fuzz FuzzReadSnapshotFile ./cmd/batchfit
func FuzzReadSnapshotFile(f *testing.F) {
	f.Add([]byte("a;b 12\n"))
	f.Add(repeatedSegments(100))
	f.Add([]byte("\x80\x02]q\x00."))
	f.Add([]byte{0x1f, 0x8b, 0x08, 0x00})
	f.Fuzz(func(t *testing.T, data []byte) {
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		_, err := readSnapshotFile("-", bytes.NewReader(data), "", "")
		runtime.ReadMemStats(&after)
		if used, bound := after.TotalAlloc-before.TotalAlloc, 128*16*uint64(len(data))+4<<20; used > bound {
			t.Fatalf("allocated %d bytes reading %d (bound %d)", used, len(data), bound)
		}
		if err == nil {
			return
		}
		var fe *fileError
		if !errors.As(err, &fe) || !errors.Is(err, memviz.ErrFormat) {
			t.Fatalf("untyped error: %v", err)
		}
	})
}
