//go:build !unix

package data

import (
	"io"
	"os"
)

// mapFile reads size bytes of f into memory where memory maps are not
// available (the unix build maps the file instead).
func mapFile(f *os.File, size int64) ([]byte, error) {
	b := make([]byte, size)
	if _, err := io.ReadFull(f, b); err != nil {
		return nil, err
	}
	return b, nil
}

func unmap([]byte) error { return nil }
