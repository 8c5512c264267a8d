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
