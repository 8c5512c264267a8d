package testutil

import (
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/nn"
)

// Chain grows h to about nodes nodes through the lazy API: Linear, Add and
// Relu in turn, sharing the one weight w and the one bias, and returns the
// last.
func Chain(h *lazy.Tensor, nodes int, w, bias *lazy.Tensor) *lazy.Tensor {
	ir := h.Graph().IR()
	for k := 0; ir.Len() < nodes; k++ {
		switch k % 3 {
		case 0:
			h = h.Linear(w, nil)
		case 1:
			h = h.Add(bias)
		default:
			h = h.Relu()
		}
	}
	return h
}

// ParamNames lists the names of m's parameters, in m's order.
func ParamNames(m nn.Module) []string {
	var s []string
	for _, p := range m.Params() {
		s = append(s, p.Name())
	}
	return s
}
