package alloc_test

import (
	"math"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/alloc"
)

func TestParseBytes(t *testing.T) {
	valid := []struct {
		in   string
		want int64
	}{
		{"24GiB", 24 << 30},
		{"24 GiB", 24 << 30},
		{" 24gib ", 24 << 30},
		{"8GB", 8_000_000_000},
		{"8 gb", 8_000_000_000},
		{"512MiB", 512 << 20},
		{"1.5GiB", 3 << 29},
		{".5KiB", 512},
		{"2.KiB", 2048},
		{"1.3KiB", 1331}, // 1331.2 rounds down
		{"3kB", 3000},
		{"2TB", 2e12},
		{"1TiB", 1 << 40},
		{"1024", 1024},
		{"1024B", 1024},
		{"0", 0},
		{"0.000GiB", 0},
		{"9223372036854775807", math.MaxInt64},
		{"8388607.999999999TiB", 9223372036854774708}, // 2^63 − 10⁻⁹·2^40 = 2^63 − 1099.5…, rounded down
	}
	for _, c := range valid {
		got, err := alloc.ParseBytes(c.in)
		require.NoError(t, err, "%q", c.in)
		assert.Equal(t, c.want, got, "%q", c.in)
	}
	invalid := []string{
		"", "   ", // empty
		"-1GiB", "-0", "- 5", // negative
		"GiB", ".", "+5", "abc", // no number
		"1.5", "1.5B", // fractional bytes
		"1K", "1 M", "1G", "12x", "1 GB B", "1e9", "1..5GiB", "5/2GiB", "0x10", "1,5GiB", // unknown units
		"8388608TiB", "9223372036854775808", "99999999999999999999999GB", // overflow
	}
	for _, in := range invalid {
		_, err := alloc.ParseBytes(in)
		assert.ErrorIs(t, err, alloc.ErrSize, "%q", in)
	}
}
