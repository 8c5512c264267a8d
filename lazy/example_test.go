package lazy_test

import (
	"errors"
	"fmt"

	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
)

// ramp is n float32s cycling through −3 … 3.
func ramp(n int) []float32 {
	d := make([]float32, n)
	for i := range d {
		d[i] = float32(i%7) - 3
	}
	return d
}

// Wrap marks axis 0 of a host tensor as the batch axis. Every op on the
// lazy tensor appends a typed node at once, so shapes, batch axes and
// bytes are known before anything runs, and a mistake is a typed error
// naming the op, the shapes and the caller's line.
func ExampleWrap() {
	x := lazy.Wrap(tensor.New(tensor.WithShape(32, 784), tensor.WithBacking(ramp(32*784))), 0)
	w := lazy.Param(tensor.New(tensor.WithShape(10, 784), tensor.WithBacking(ramp(10*784))), "w")
	logits := x.Linear(w, nil) // x·wᵀ
	fmt.Println("logits", logits.Shape(), "batch axis", logits.BatchAxis())

	bad := x.MatMul(w) // [32 784]·[10 784]: the inner dimensions differ
	fmt.Println("shape error:", errors.Is(bad.Err(), graph.ErrShape))
	// Output:
	// logits [32 10] batch axis 0
	// shape error: true
}
