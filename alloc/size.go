package alloc

import (
	"errors"
	"fmt"
	"math/big"
	"strings"
)

// ErrSize is wrapped by every byte-size parsing error (ParseBytes).
var ErrSize = errors.New("invalid byte size")

// sizeUnits maps unit names, compared without case, to bytes: decimal for
// kB/MB/GB/TB as drive and cloud vendors count, binary for KiB/MiB/GiB/TiB
// as GPU memory is sold and as FormatBytes prints. Single letters (K, M, G)
// are left out because they are read both ways.
var sizeUnits = []struct {
	name  string
	bytes int64
}{
	{"b", 1},
	{"kb", 1e3}, {"mb", 1e6}, {"gb", 1e9}, {"tb", 1e12},
	{"kib", 1 << 10}, {"mib", 1 << 20}, {"gib", 1 << 30}, {"tib", 1 << 40},
}

// ParseBytes reads a byte count: "24GiB", "24 GiB", "8GB" (8·10⁹),
// "1.5GiB", "512MiB", or a plain integer of bytes. A fraction of a unit is
// rounded down to a whole byte; a fractional count of bytes is an error.
func ParseBytes(s string) (int64, error) {
	in := strings.TrimSpace(s)
	if in == "" {
		return 0, fmt.Errorf("%w: empty", ErrSize)
	}
	if in[0] == '-' {
		return 0, fmt.Errorf("%w: %q is negative", ErrSize, s)
	}
	i := 0
	digits, dot := 0, false
	for ; i < len(in); i++ {
		c := in[i]
		switch {
		case c >= '0' && c <= '9':
			digits++
			continue
		case c == '.' && !dot:
			dot = true
			continue
		}
		break
	}
	num, unit := in[:i], strings.TrimSpace(in[i:])
	if digits == 0 {
		return 0, fmt.Errorf("%w: %q does not start with a number", ErrSize, s)
	}
	mult := int64(0)
	if unit == "" {
		mult = 1
	}
	for _, u := range sizeUnits {
		if strings.EqualFold(unit, u.name) {
			mult = u.bytes
		}
	}
	if mult == 0 {
		return 0, fmt.Errorf("%w: %q has unknown unit %q (want B, kB, MB, GB, TB, KiB, MiB, GiB or TiB)", ErrSize, s, unit)
	}
	r, ok := new(big.Rat).SetString(num)
	if !ok {
		return 0, fmt.Errorf("%w: %q is not a number", ErrSize, s)
	}
	r.Mul(r, new(big.Rat).SetInt64(mult))
	if mult == 1 && !r.IsInt() {
		return 0, fmt.Errorf("%w: %q is not a whole number of bytes", ErrSize, s)
	}
	n := new(big.Int).Quo(r.Num(), r.Denom()) // rounds toward zero: down, for a non-negative r
	if !n.IsInt64() {
		return 0, fmt.Errorf("%w: %q overflows 63 bits of bytes", ErrSize, s)
	}
	return n.Int64(), nil
}
