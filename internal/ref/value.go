package ref

import (
	"slices"

	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/graph"
)

// Value is a dense row-major float64 array. A scalar has Shape [] and one
// element. Integer tensors hold their values as integral float64s.
type Value struct {
	Shape []int
	Data  []float64
}

// Zeros returns a zero Value of the given shape.
func Zeros(shape ...int) Value {
	s := slices.Clone(shape)
	if s == nil {
		s = []int{}
	}
	return Value{Shape: s, Data: make([]float64, graph.Numel(s))}
}

// Clone returns a deep copy of v.
func (v Value) Clone() Value {
	s := slices.Clone(v.Shape)
	if s == nil {
		s = []int{}
	}
	return Value{Shape: s, Data: slices.Clone(v.Data)}
}

// FromTensor converts a float32, float64 or int64 tensor to a Value, reading
// views (slices, transposes) in their logical order.
func FromTensor(t tensor.Tensor) (Value, error) {
	if t == nil {
		return Value{}, graph.Errorf(graph.ErrNilTensor, "nil tensor.Tensor")
	}
	var conv func(any) (float64, bool)
	switch t.Dtype() {
	case tensor.Float32:
		conv = func(x any) (float64, bool) { f, ok := x.(float32); return float64(f), ok }
	case tensor.Float64:
		conv = func(x any) (float64, bool) { f, ok := x.(float64); return f, ok }
	case tensor.Int64:
		conv = func(x any) (float64, bool) { i, ok := x.(int64); return float64(i), ok }
	default:
		return Value{}, graph.Errorf(graph.ErrDType, "unsupported dtype %v (want float32, float64 or int64)", t.Dtype())
	}
	if t.IsScalar() {
		f, ok := conv(t.ScalarValue())
		if !ok {
			return Value{}, graph.Errorf(graph.ErrNoData, "scalar tensor holds %T", t.ScalarValue())
		}
		return Value{Shape: []int{}, Data: []float64{f}}, nil
	}
	v := Zeros([]int(t.Shape())...)
	idx := make([]int, len(v.Shape))
	for i := range v.Data {
		unravel(i, v.Shape, idx)
		x, err := t.At(idx...)
		if err != nil {
			return Value{}, graph.Errorf(graph.ErrNoData, "reading element %v: %v", idx, err)
		}
		f, ok := conv(x)
		if !ok {
			return Value{}, graph.Errorf(graph.ErrNoData, "element %v is %T", idx, x)
		}
		v.Data[i] = f
	}
	return v, nil
}

// unravel writes the row-major multi-index of flat position i into idx.
func unravel(i int, shape, idx []int) {
	for d := len(shape) - 1; d >= 0; d-- {
		idx[d] = i % shape[d]
		i /= shape[d]
	}
}

// ravel is the flat row-major position of multi-index idx.
func ravel(idx, shape []int) int {
	p := 0
	for d, n := range shape {
		p = p*n + idx[d]
	}
	return p
}

// broadcastPos is the flat position in an array of shape in of the element
// that NumPy broadcasting sends to output multi-index idx (in is aligned to
// the right of idx; its size-1 axes repeat).
func broadcastPos(idx, in []int) int {
	off := len(idx) - len(in)
	p := 0
	for d, n := range in {
		i := idx[off+d]
		if n == 1 {
			i = 0
		}
		p = p*n + i
	}
	return p
}
