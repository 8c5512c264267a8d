package exec

import (
	"context"

	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/graph"
)

// Executor evaluates graphs.
type Executor interface {
	// Run evaluates g with the data held by its source nodes and returns the
	// values of outputs, in order.
	Run(ctx context.Context, g *graph.Graph, outputs ...int) ([]*tensor.Dense, error)
}

// Yielder is an executor that can hand its device memory back between
// steps and take it again (pytorch_memlab's Courtesy). Yield keeps host
// copies of everything that must survive (parameters, constants, optimizer
// state held on the device), frees every block the executor keeps resident
// and empties its allocator's cache. Restore allocates those blocks again,
// in the order they were first allocated, and refills them, so the next
// step runs as if Yield had never happened: the same values, and the
// allocator in the state a first step's persistent allocations leave, so
// planned peaks are measured again. A resident run while yielded restores
// first.
type Yielder interface {
	Yield() error
	Restore() error
	Yielded() bool
}
