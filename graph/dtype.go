package graph

import "fmt"

// DType is an element type. The zero value is invalid so that a forgotten
// dtype is caught rather than silently read as float32.
type DType uint8

const (
	InvalidDType DType = iota
	Float32
	Int64
	Float16
	BFloat16
)

var dtypeInfo = [...]struct {
	name  string
	size  int
	float bool
}{
	InvalidDType: {"invalid", 0, false},
	Float32:      {"float32", 4, true},
	Int64:        {"int64", 8, false},
	Float16:      {"float16", 2, true},
	BFloat16:     {"bfloat16", 2, true},
}

func (d DType) valid() bool { return d > InvalidDType && int(d) < len(dtypeInfo) }

// Size is the number of bytes of one element.
func (d DType) Size() int {
	if !d.valid() {
		return 0
	}
	return dtypeInfo[d].size
}

// IsFloat reports whether d is a floating-point type.
func (d DType) IsFloat() bool { return d.valid() && dtypeInfo[d].float }

func (d DType) String() string {
	if !d.valid() {
		return fmt.Sprintf("DType(%d)", uint8(d))
	}
	return dtypeInfo[d].name
}

// ParseDType maps a name such as "float32" to its DType.
func ParseDType(name string) (DType, error) {
	for d := Float32; int(d) < len(dtypeInfo); d++ {
		if dtypeInfo[d].name == name {
			return d, nil
		}
	}
	return InvalidDType, fmt.Errorf("%w: unknown dtype %q", ErrDType, name)
}

// Promote is the dtype of an elementwise binary op (add, sub, mul, div,
// pow, maximum) over operands of dtypes a and b, as PyTorch's type
// promotion gives it for tensors of floating-point dtypes: equal dtypes
// stay; float32 with a 16-bit float is float32; bfloat16 with float16 is
// float32 (neither holds the other). Any other pair (an int64 operand)
// has no rule here: an ErrDType error naming op and both dtypes.
func Promote(op Op, a, b DType) (DType, error) {
	switch {
	case a == b && a.IsFloat():
		return a, nil
	case a.IsFloat() && b.IsFloat():
		return Float32, nil
	}
	return InvalidDType, Errorf(ErrDType, "%s of %s and %s: no promotion rule applies", op, a, b)
}

// IsHalf reports the 16-bit floating-point dtypes (float16, bfloat16),
// whose values executors round after every op that produces one.
func (d DType) IsHalf() bool { return d == Float16 || d == BFloat16 }
