package ref

import (
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/internal/optable"
)

// kernel computes a non-source node's value into out, a zeroed value of the
// node's shape; a holds the attributes as normalise left them.
type kernel func(nd *graph.Node, a *graph.Attrs, in []Value, out Value) error

// family is one file's table entries (elementwise.go, reduce.go, …).
type family map[graph.Op]kernel

// kernelTable is every op's kernel, indexed by op; source ops have none
// (Eval reads their data). TestKernelTableComplete fails when an op has no
// entry or sits in two families.
var kernelTable = optable.Build(families...)

// families is every family of the table.
var families = []family{elementwiseKernels, contractionKernels, reduceKernels, normKernels,
	movementKernels, indexKernels, convKernels, attentionKernels, attentionQKVKernels, rotaryKernels, lossKernels, linearCrossEntropyKernels, fusedKernels}
