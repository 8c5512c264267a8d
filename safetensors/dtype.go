package safetensors

import "fmt"

// DType is a tensor's element type, spelled in files as the constant's
// name ("F32", "BF16").
type DType uint8

// The element types this package reads and writes. Their order is the
// reference implementation's alignment order, which WriteFile sorts by
// (largest first) so every tensor's data is aligned to its element size.
const (
	InvalidDType DType = iota
	BOOL
	U8
	I8
	F8_E5M2
	F8_E4M3
	I16
	U16
	F16
	BF16
	I32
	U32
	F32
	F64
	I64
	U64
)

var dtypeNames = [...]string{
	InvalidDType: "invalid", BOOL: "BOOL", U8: "U8", I8: "I8", F8_E5M2: "F8_E5M2", F8_E4M3: "F8_E4M3",
	I16: "I16", U16: "U16", F16: "F16", BF16: "BF16", I32: "I32", U32: "U32",
	F32: "F32", F64: "F64", I64: "I64", U64: "U64",
}

var dtypeSizes = [...]int64{
	BOOL: 1, U8: 1, I8: 1, F8_E5M2: 1, F8_E4M3: 1, I16: 2, U16: 2, F16: 2, BF16: 2,
	I32: 4, U32: 4, F32: 4, F64: 8, I64: 8, U64: 8,
}

// String is the dtype's name as files spell it.
func (d DType) String() string {
	if int(d) < len(dtypeNames) {
		return dtypeNames[d]
	}
	return fmt.Sprintf("DType(%d)", uint8(d))
}

// Size is the bytes of one element, 0 for an invalid dtype.
func (d DType) Size() int64 {
	if int(d) < len(dtypeSizes) {
		return dtypeSizes[d]
	}
	return 0
}

// IsFloat reports whether d is one of the floating-point types the float
// reads convert from (F32, F64, BF16, F16).
func (d DType) IsFloat() bool { return d == F32 || d == F64 || d == BF16 || d == F16 }

// ParseDType maps a file's spelling to a DType. Sub-byte types (F4, F6_*)
// and others this package does not know give an error wrapping ErrDType.
func ParseDType(s string) (DType, error) {
	for d := BOOL; d <= U64; d++ {
		if dtypeNames[d] == s {
			return d, nil
		}
	}
	return InvalidDType, fmt.Errorf("%w %q", ErrDType, s)
}
