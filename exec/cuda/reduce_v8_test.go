package cuda_test

import (
	"fmt"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/internal/ref"
)

// TestReduceMidMatchesRef runs sums and means over the leading axes of
// 16-bit x, the bias gradients' reductions (reduce_mid_v8_* where inner is
// a multiple of 8: split, unsplit, several outer rows; reduce_mid_* where
// it is not), against the float64 reference on the same rounded inputs.
// The reference rounds the exact sum once to the dtype; the kernel sums in
// float and double first, so an output may land one 16-bit ulp away:
// tolerance 2⁻⁷·|want| (bfloat16; 2⁻¹⁰ in float16) plus 2⁻¹⁴ of the
// largest |want|.
func TestReduceMidMatchesRef(t *testing.T) {
	cases := []struct {
		shape []int
		axes  []int
		mean  bool
	}{
		{[]int{8192, 768}, []int{0}, false},      // 32 splits of 256 rows
		{[]int{4, 96, 3072}, []int{0, 1}, false}, // one split, 384 rows
		{[]int{3, 50, 16}, []int{1}, false},      // outer 3
		{[]int{5000, 24}, []int{0}, true},        // a mean, splits of 264 rows
		{[]int{2, 40, 12}, []int{1}, false},      // inner 12: reduce_mid_*
		{[]int{4, 4096, 64}, []int{0, 1}, false}, // 16384 rows, 32 splits of 512
		{[]int{40000, 8}, []int{0}, false},       // 1250 rows a split
		{[]int{300000, 16}, []int{0}, false},     // 9375 rows a split: reduce_mid_*
	}
	gpu := runOn(executor(t))
	rng := rand.New(rand.NewPCG(21, 8))
	for _, dt := range []graph.DType{graph.BFloat16, graph.Float16} {
		rel := math.Ldexp(1, -7)
		if dt == graph.Float16 {
			rel = math.Ldexp(1, -10)
		}
		for _, c := range cases {
			t.Run(fmt.Sprintf("%s/%v/%v", dt, c.shape, c.axes), func(t *testing.T) {
				h := &halfGraph{t: t, g: graph.New(), dt: dt}
				x := h.input(c.shape...)
				op := graph.OpSum
				a := graph.Attrs{Axes: c.axes}
				if c.mean {
					op = graph.OpMean
				}
				y := h.op(op, a, x)
				feeds := feedsFor(h, rng, x)
				for i, v := range feeds[x].Data { // an offset per column, as gradients have
					feeds[x].Data[i] = v + float64(i%7)/4
				}
				want, err := ref.Eval(h.g, feeds, y)
				require.NoError(t, err)
				got, err := gpu(h.g, feeds, y)
				require.NoError(t, err)
				big := 0.0
				for _, v := range want[0].Data {
					big = math.Max(big, math.Abs(v))
				}
				require.Positive(t, big)
				for i, w := range want[0].Data {
					require.InDelta(t, w, got[0].Data[i], rel*math.Abs(w)+math.Ldexp(big, -14), "output %d", i)
				}
			})
		}
	}
}
