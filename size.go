package batchfit

import "github.com/batchfit/batchfit/alloc"

// ParseSize reads a memory size as Options.Budget and Options.Headroom
// take it, in bytes: "24GiB", "24 GiB", "1.5GiB", "512MiB", "8GB" (decimal:
// 8·10⁹ bytes), or a plain number of bytes. Units are read without case; a
// fraction of a unit is rounded down to a whole byte. Every error wraps
// alloc.ErrSize. It is alloc.ParseBytes, which stays.
func ParseSize(s string) (int64, error) { return alloc.ParseBytes(s) }

// FormatSize prints a byte count with a binary unit and two decimals,
// "26.00 MiB" (plain bytes below 1 KiB: "512 B"). It is alloc.FormatBytes.
func FormatSize(n int64) string { return alloc.FormatBytes(n) }
