package half

import (
	"math"
	"sort"
	"testing"
)

// decodeRef is an independent float64 decoding of a 16-bit float with the
// given exponent and mantissa widths, from the format's definition.
func decodeRef(bits uint16, expBits, manBits uint) float64 {
	sign := 1.0
	if bits>>(expBits+manBits)&1 == 1 {
		sign = -1
	}
	bias := 1<<(expBits-1) - 1
	e := int(bits>>manBits) & (1<<expBits - 1)
	m := float64(bits & (1<<manBits - 1))
	switch {
	case e == 1<<expBits-1 && m == 0:
		return sign * math.Inf(1)
	case e == 1<<expBits-1:
		return math.NaN()
	case e == 0:
		return sign * math.Ldexp(m, 1-bias-int(manBits))
	}
	return sign * math.Ldexp(1+m/float64(uint(1)<<manBits), e-bias)
}

type format struct {
	name             string
	expBits, manBits uint
	decode           func(uint16) float32
	encode           func(float32) uint16
}

var formats = []format{
	{"bfloat16", 8, 7, func(b uint16) float32 { return BF16(b).Float32() }, func(f float32) uint16 { return uint16(BF16From(f)) }},
	{"float16", 5, 10, func(b uint16) float32 { return F16(b).Float32() }, func(f float32) uint16 { return uint16(F16From(f)) }},
}

// TestDecodeExhaustive checks every one of the 2¹⁶ values of each format
// against the float64 reference, and that encoding the decoded value gives
// the same bits back (NaNs stay NaN).
func TestDecodeExhaustive(t *testing.T) {
	for _, f := range formats {
		for i := range 1 << 16 {
			b := uint16(i)
			got, want := f.decode(b), decodeRef(b, f.expBits, f.manBits)
			if math.IsNaN(want) {
				if !math.IsNaN(float64(got)) || !math.IsNaN(float64(f.decode(f.encode(got)))) {
					t.Fatalf("%s %#04x: NaN decodes to %v, re-encodes to %#04x", f.name, b, got, f.encode(got))
				}
				continue
			}
			if float64(got) != want || math.Signbit(float64(got)) != math.Signbit(want) {
				t.Fatalf("%s %#04x: decodes to %v, want %v", f.name, b, got, want)
			}
			if back := f.encode(got); back != b {
				t.Fatalf("%s %#04x: %v re-encodes to %#04x", f.name, b, got, back)
			}
		}
	}
}

// TestEncodeRoundsToNearestEven checks encoding at every rounding edge: the
// exact midpoint between each pair of neighbouring finite values goes to
// the one with an even mantissa, and the float32 just either side of it
// goes to the nearer one. The overflow edge (half an ulp past the largest
// finite value) goes to Inf, as IEEE rounding does.
func TestEncodeRoundsToNearestEven(t *testing.T) {
	for _, f := range formats {
		var vals []float64 // the non-negative finite values, ascending
		for i := range 1 << 16 {
			v := decodeRef(uint16(i), f.expBits, f.manBits)
			if v >= 0 && !math.IsInf(v, 0) && !math.Signbit(v) {
				vals = append(vals, v)
			}
		}
		sort.Float64s(vals)
		bitsOf := func(v float64) uint16 { return f.encode(float32(v)) }
		for i := 0; i+1 < len(vals); i++ {
			lo, hi := vals[i], vals[i+1]
			mid := (lo + hi) / 2
			if float64(float32(mid)) != mid {
				t.Fatalf("%s: midpoint %v of %v and %v is not a float32", f.name, mid, lo, hi)
			}
			even := lo
			if bitsOf(lo)&1 == 1 {
				even = hi
			}
			for _, s := range []float64{1, -1} {
				check := func(x float32, want float64, what string) {
					t.Helper()
					if got := f.decode(f.encode(x)); float64(got) != s*want {
						t.Fatalf("%s: %s %v (between %v and %v) encodes to %v, want %v", f.name, what, x, s*lo, s*hi, got, s*want)
					}
				}
				m := float32(s * mid)
				check(m, even, "midpoint")
				check(math.Nextafter32(m, float32(s*math.Inf(1))), hi, "just above the midpoint")
				check(math.Nextafter32(m, 0), lo, "just below the midpoint")
			}
		}
		top := vals[len(vals)-1]
		ulp := top - vals[len(vals)-2]
		edge := float32(top + ulp/2)
		if got := f.decode(f.encode(edge)); !math.IsInf(float64(got), 1) {
			t.Errorf("%s: %v (half an ulp past the largest %v) encodes to %v, want +Inf", f.name, edge, top, got)
		}
		if got := f.decode(f.encode(math.Nextafter32(edge, 0))); float64(got) != top {
			t.Errorf("%s: just below the overflow edge encodes to %v, want %v", f.name, got, top)
		}
		for _, x := range []float32{float32(math.Inf(1)), float32(math.Inf(-1)), math.MaxFloat32, -math.MaxFloat32} {
			want := math.Inf(int(math.Copysign(1, float64(x))))
			if got := f.decode(f.encode(x)); float64(got) != want {
				t.Errorf("%s: %v encodes to %v, want %v", f.name, x, got, want)
			}
		}
		nan := float32(math.NaN())
		if got := f.decode(f.encode(nan)); !math.IsNaN(float64(got)) {
			t.Errorf("%s: NaN encodes to %v", f.name, got)
		}
		// Below half the smallest positive value everything rounds to a zero
		// of the same sign.
		tiny := float32(vals[1] / 4)
		if got := f.encode(-tiny); got != 1<<15 {
			t.Errorf("%s: %v encodes to %#04x, want -0", f.name, -tiny, got)
		}
	}
}

func TestSliceHelpers(t *testing.T) {
	src := []float32{1, -2.5, 3.14159, 1e-6, 65520, -0.0001}
	bf, f16 := make([]BF16, len(src)), make([]F16, len(src))
	EncodeBF16(bf, src)
	EncodeF16(f16, src)
	back := make([]float32, len(src))
	DecodeBF16(back, bf)
	for i := range src {
		if back[i] != RoundBF16(src[i]) {
			t.Errorf("bf16 slice %d: %v, want %v", i, back[i], RoundBF16(src[i]))
		}
	}
	DecodeF16(back, f16)
	for i := range src {
		if back[i] != RoundF16(src[i]) {
			t.Errorf("f16 slice %d: %v, want %v", i, back[i], RoundF16(src[i]))
		}
	}
	// 3.14159 in bfloat16 is 3.140625 (0x4049), in binary16 3.140625 (0x4248).
	if bf[2] != 0x4049 || f16[2] != 0x4248 {
		t.Errorf("pi-ish encodes to %#04x / %#04x, want 0x4049 / 0x4248", bf[2], f16[2])
	}
}
