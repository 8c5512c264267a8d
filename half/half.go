package half

import "math"

// BF16 is a bfloat16 value's bits.
type BF16 uint16

// F16 is an IEEE 754 binary16 value's bits.
type F16 uint16

// BF16From rounds f to the nearest bfloat16, ties to even.
func BF16From(f float32) BF16 {
	b := math.Float32bits(f)
	if b&0x7fffffff > 0x7f800000 { // NaN: keep the sign and the top mantissa bits, force quiet
		return BF16(b>>16 | 0x0040)
	}
	// Adding 0x7fff plus the kept half's lowest bit rounds the dropped
	// half to nearest, ties to even; a carry into the exponent is the
	// correct result (up to Inf).
	b += 0x7fff + (b>>16)&1
	return BF16(b >> 16)
}

// Float32 widens h exactly.
func (h BF16) Float32() float32 { return math.Float32frombits(uint32(h) << 16) }

// F16From rounds f to the nearest binary16, ties to even.
func F16From(f float32) F16 {
	b := math.Float32bits(f)
	sign := uint16(b>>16) & 0x8000
	exp := int32(b>>23) & 0xff
	man := b & 0x7fffff
	switch {
	case exp == 0xff: // Inf or NaN
		if man != 0 {
			return F16(sign | 0x7e00 | uint16(man>>13))
		}
		return F16(sign | 0x7c00)
	case exp > 127+15: // beyond the largest finite binary16 exponent
		return F16(sign | 0x7c00)
	case exp >= 127-14: // normal binary16: rebias and round 13 bits away
		h := uint32(exp-127+15)<<10 | man>>13
		return F16(sign | uint16(roundShifted(h, man&0x1fff, 13)))
	case exp >= 127-25: // binary16 subnormal (or rounds up into the smallest normal)
		man |= 0x800000            // the implicit bit
		shift := uint32(126 - exp) // float32 units of 2⁻¹⁴⁹·2²³ down to binary16 units of 2⁻²⁴
		h := man >> shift
		return F16(sign | uint16(roundShifted(h, man&(1<<shift-1), shift)))
	}
	return F16(sign) // rounds to ±0
}

// roundShifted rounds h, the kept bits of a value whose dropped low n bits
// are rest, to nearest, ties to even. A carry out of the mantissa moves into
// the exponent, which is the right answer in binary16's layout too.
func roundShifted(h, rest uint32, n uint32) uint32 {
	half := uint32(1) << (n - 1)
	if rest > half || rest == half && h&1 == 1 {
		h++
	}
	return h
}

// Float32 widens h exactly.
func (h F16) Float32() float32 {
	sign := uint32(h&0x8000) << 16
	exp := uint32(h>>10) & 0x1f
	man := uint32(h) & 0x3ff
	switch {
	case exp == 0x1f: // Inf or NaN
		return math.Float32frombits(sign | 0x7f800000 | man<<13)
	case exp != 0:
		return math.Float32frombits(sign | (exp-15+127)<<23 | man<<13)
	case man == 0:
		return math.Float32frombits(sign)
	}
	// Subnormal: man · 2⁻²⁴, exact in float32.
	f := float32(man) * (1.0 / (1 << 24))
	return math.Float32frombits(math.Float32bits(f) | sign)
}

// EncodeBF16 rounds src into dst, which must be at least as long.
func EncodeBF16(dst []BF16, src []float32) {
	for i, f := range src {
		dst[i] = BF16From(f)
	}
}

// DecodeBF16 widens src into dst, which must be at least as long.
func DecodeBF16(dst []float32, src []BF16) {
	for i, h := range src {
		dst[i] = h.Float32()
	}
}

// EncodeF16 rounds src into dst, which must be at least as long.
func EncodeF16(dst []F16, src []float32) {
	for i, f := range src {
		dst[i] = F16From(f)
	}
}

// DecodeF16 widens src into dst, which must be at least as long.
func DecodeF16(dst []float32, src []F16) {
	for i, h := range src {
		dst[i] = h.Float32()
	}
}

// RoundBF16 rounds f to bfloat16 and back: the value a kernel that stores
// bfloat16 keeps. References use it to round where the kernel rounds.
func RoundBF16(f float32) float32 { return BF16From(f).Float32() }

// RoundF16 is RoundBF16 for binary16.
func RoundF16(f float32) float32 { return F16From(f).Float32() }
