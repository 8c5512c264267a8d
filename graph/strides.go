package graph

// ContiguousStrides returns the row-major element strides of shape.
func ContiguousStrides(shape []int) []int {
	s := make([]int, len(shape))
	acc := 1
	for i := len(shape) - 1; i >= 0; i-- {
		s[i] = acc
		acc *= shape[i]
	}
	return s
}

// BroadcastStrides returns the strides that read a value of shape from
// positions of the broadcast shape out: leading axes it lacks and its size-1
// axes get stride 0. It fails when shape does not broadcast to out.
// Executors use it to walk broadcast operands without copying them.
func BroadcastStrides(shape, out []int) ([]int, error) {
	if len(shape) > len(out) {
		return nil, Errorf(ErrShape, "operand %v has higher rank than the result %v", shape, out)
	}
	own := ContiguousStrides(shape)
	s := make([]int, len(out))
	lead := len(out) - len(shape)
	for i, d := range shape {
		switch {
		case d == out[lead+i]:
			s[lead+i] = own[i]
		case d == 1:
			s[lead+i] = 0
		default:
			return nil, Errorf(ErrShape, "operand %v does not broadcast to %v", shape, out)
		}
	}
	return s, nil
}
