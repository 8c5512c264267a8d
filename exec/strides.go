package exec

import "github.com/batchfit/batchfit/graph"

// LeadStrides gives, for each axis of lead, the element stride of an
// operand whose leading axes are s (right-aligned to lead, as
// graph.BroadcastStrides aligns them) above an inner block of inner
// elements; broadcast axes get stride 0. Matmul walks its batch of
// matrices with it.
func LeadStrides(s, lead []int, inner int) ([]int, error) {
	st, err := graph.BroadcastStrides(s, lead)
	if err != nil {
		return nil, err
	}
	for d := range st {
		st[d] *= inner
	}
	return st, nil
}
