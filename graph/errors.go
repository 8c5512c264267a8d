package graph

import (
	"errors"
	"fmt"
	"strings"
)

// Sentinel errors. Every error batchfit returns for bad input wraps one of
// these, so callers branch with errors.Is and never on message text.
var (
	ErrShape        = errors.New("shape mismatch")
	ErrDType        = errors.New("dtype mismatch")
	ErrAttr         = errors.New("invalid attribute")
	ErrArity        = errors.New("wrong number of inputs")
	ErrMixedGraphs  = errors.New("tensors belong to different graphs")
	ErrNilTensor    = errors.New("nil tensor")
	ErrNoData       = errors.New("source has no data")
	ErrNotChunkable = errors.New("graph is not chunkable along its batch")
	ErrNotParam     = errors.New("not a parameter")
)

// OpError describes a rejected op: which op, the shapes of its inputs, where
// the caller asked for it, and why.
type OpError struct {
	Op     string
	Shapes [][]int // input shapes, in input order
	Site   string  // caller's file:line, when known
	Err    error   // wraps one of the sentinel errors
}

func (e *OpError) Error() string {
	var b strings.Builder
	b.WriteString("batchfit: ")
	b.WriteString(e.Op)
	if e.Site != "" {
		b.WriteString(" at ")
		b.WriteString(e.Site)
	}
	if len(e.Shapes) > 0 {
		b.WriteString(": inputs ")
		for i, s := range e.Shapes {
			if i > 0 {
				b.WriteString(", ")
			}
			b.WriteString(FormatShape(s))
		}
	}
	b.WriteString(": ")
	b.WriteString(e.Err.Error())
	return b.String()
}

func (e *OpError) Unwrap() error { return e.Err }

// Errorf builds an error wrapping sentinel with a formatted detail.
func Errorf(sentinel error, format string, args ...any) error {
	return fmt.Errorf("%w: %s", sentinel, fmt.Sprintf(format, args...))
}

// FormatShape renders a shape as [2 3 4]; a scalar is [].
func FormatShape(s []int) string { return fmt.Sprint(s) }
