package precision_test

import (
	"errors"
	"fmt"

	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/precision"
)

// bf16-mixed rewrites a forward graph before autodiff, as autocast runs
// it: the linear layer reads bfloat16 copies of its input and weight
// (cast nodes the planner counts, 2 bytes an element) and stores a
// bfloat16 result; the loss computes in float32. Parameters stay float32.
func ExampleApply() {
	x := lazy.Placeholder([]int{32, 64}, graph.Float32, 0)
	w := lazy.ParamSpec([]int{10, 64}, graph.Float32, "w")
	y := x.Graph().Placeholder([]int{32}, graph.Int64, 0)
	logits := x.Linear(w, nil)
	loss := logits.CrossEntropy(y, lazy.Mean)

	g, ids, err := precision.Apply(loss.Graph().IR(), precision.BF16Mixed)
	if err != nil {
		fmt.Println(err)
		return
	}
	casts := 0
	for _, nd := range g.Nodes() {
		if nd.Op == graph.OpCast {
			casts++
		}
	}
	fmt.Println("casts:", casts)
	fmt.Println("logits:", g.Node(ids[logits.ID()]).Type.DType, "loss:", g.Node(ids[loss.ID()]).Type.DType)
	fmt.Println("weight:", g.Node(ids[loss.Graph().NodeOf(w)]).Type.DType)

	_, err = precision.Parse("bf16")
	fmt.Println(errors.Is(err, precision.ErrUnknown))
	// Output:
	// casts: 2
	// logits: bfloat16 loss: float32
	// weight: float32
	// true
}

// Dynamic loss scaling as torch.cuda.amp.GradScaler does it: a step with
// an inf or NaN gradient halves the scale (and is skipped), and Interval
// good steps in a row double it.
func ExampleNewScaler() {
	s, err := precision.NewScaler(precision.LossScale{Interval: 3})
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println("start:", s.Scale())
	s.Update(false) // an overflow
	fmt.Println("after an overflow:", s.Scale())
	for range 3 {
		s.Update(true)
	}
	st := s.Stats()
	fmt.Println("after 3 good steps:", st.Scale, "skipped", st.Skipped, "of", st.Steps)
	// Output:
	// start: 65536
	// after an overflow: 32768
	// after 3 good steps: 65536 skipped 1 of 4
}
