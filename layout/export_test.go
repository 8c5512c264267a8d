package layout

import "github.com/batchfit/batchfit/graph"

// TakeAllConvs makes every 4-D convolution run channels last until the
// returned function restores the rule (ConvTakes), so tests can check the
// pass on float32 graphs against the float64 reference.
func TakeAllConvs() (restore func()) {
	convTakes = func(graph.DType, int, int, int) bool { return true }
	return func() { convTakes = ConvTakes }
}
