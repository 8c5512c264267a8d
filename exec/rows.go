package exec

import (
	"fmt"
	"slices"

	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/planner"
)

// RowError is a kernel's refusal of one value of an index or label input:
// Value, at row-major position Pos of input Input, lies outside
// [0, Limit). It wraps graph.ErrAttr.
//
// A kernel sees one chunk of the batch and fills Shape and Pos as it saw
// them, with Row −1; the executor then locates the value in the caller's
// batch (Locate), so Shape is the input's whole-batch shape, Pos the
// value's position in it and Row its index along the input's batch axis:
// the caller's row, counting every chunk before it (PerSample rows per
// sample where a reshape folded axes into the batch axis). Row stays −1
// when the input has no batch axis.
type RowError struct {
	Op    string // the op whose kernel refused the value: "cross_entropy", "embedding"
	What  string // what the value is: "label", "index"
	Value int64
	Limit int // values must lie in [0, Limit)
	Input int // the node's input that holds the value
	Shape []int
	Pos   int
	Row   int
}

func (e *RowError) Error() string {
	at := fmt.Sprintf("position %d", e.Pos)
	switch {
	case e.Row >= 0 && len(e.Shape) == 1:
		at = fmt.Sprintf("row %d", e.Row)
	case e.Row >= 0:
		at = fmt.Sprintf("position %d (row %d along the batch axis)", e.Pos, e.Row)
	}
	return fmt.Sprintf("%v: %s %s %d at %s outside [0, %d)", graph.ErrAttr, e.Op, e.What, e.Value, at, e.Limit)
}

func (e *RowError) Unwrap() error { return graph.ErrAttr }

// Locate moves e from chunk c, in which node nd's kernel raised it, to the
// caller's batch of p (see RowError). An input whose chunk shape is not
// the one the plan gives it is left as the kernel saw it.
func (e *RowError) Locate(p *planner.Program, nd *graph.Node, c planner.Chunk) {
	if e.Input < 0 || e.Input >= len(nd.Inputs) {
		return
	}
	t := p.Graph.Node(nd.Inputs[e.Input]).Type
	ax := t.BatchAxis
	if ax < 0 || !slices.Equal(e.Shape, t.AtBatch(c.Size)) || e.Pos < 0 || e.Pos >= graph.Numel(e.Shape) {
		return
	}
	idx := make([]int, len(e.Shape))
	for d, rest := len(e.Shape)-1, e.Pos; d >= 0; d-- {
		idx[d], rest = rest%e.Shape[d], rest/e.Shape[d]
	}
	idx[ax] += c.Start * t.PerSample
	whole := t.AtBatch(p.Batch)
	pos := 0
	for d, i := range idx {
		pos = pos*whole[d] + i
	}
	e.Shape, e.Pos, e.Row = whole, pos, idx[ax]
}

// BadValue is the RowError of a kernel that found value at row-major
// position pos of its input input, of shape shape in the chunk it ran,
// outside [0, limit); the executor locates it (Locate).
func BadValue(op, what string, input int, shape []int, pos int, value int64, limit int) *RowError {
	return &RowError{Op: op, What: what, Value: value, Limit: limit, Input: input, Shape: slices.Clone(shape), Pos: pos, Row: -1}
}
