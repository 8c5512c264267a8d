package recompute_test

import (
	"fmt"
	"strings"

	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/models"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/planner"
	"github.com/batchfit/batchfit/recompute"
)

// Search prices chunks-only and recomputation plans of a training step and
// picks the fastest whose replayed peak fits: for a six-layer GPT at batch
// 8 × 256 (AdamW), 32 MiB holds only a plan that checkpoints every block,
// in 4 chunks of 2; at 136 MiB the plain step runs whole. A Session does
// this with Options{Recompute: recompute.Auto}, and batchfit estimate with
// --recompute auto.
func ExampleSearch() {
	model := models.NewGPT(nn.Options{ShapeOnly: true}, models.GPTConfig{Vocab: 512, Context: 256, Layers: 6, Heads: 4, Dim: 128})
	tokens := lazy.Placeholder([]int{8, 256}, graph.Int64, 0)
	targets := tokens.Graph().Placeholder([]int{8, 256}, graph.Int64, 0)
	loss := models.Loss(model.Forward(tokens), targets)

	// The step as Session.Step compiles it: the forward graph up to the
	// loss, then the gradients, kept, of the parameters trained.
	params := nn.ParamTensors(model)
	st := recompute.Step{Boundary: loss.ID() + 1, Outputs: []int{loss.ID()}, Compile: planner.CompileOptions{StateSlots: 2}}
	for i, g := range lazy.Grad(loss, params...) {
		st.Outputs = append(st.Outputs, g.ID())
		st.Compile.Kept = append(st.Compile.Kept, g.ID())
		st.Compile.Trained = append(st.Compile.Trained, loss.Graph().NodeOf(params[i]))
	}
	st.Graph = loss.Graph().IR()

	var names []string
	for _, c := range recompute.Candidates(st.Graph, st.Boundary) {
		names = append(names, c.Name)
	}
	fmt.Println(strings.Join(names, ", "))
	for _, budget := range []int64{32 << 20, 136 << 20} {
		res, err := recompute.Search(st, recompute.Options{Planner: planner.Options{Budget: budget}})
		if err != nil {
			fmt.Println(err)
			return
		}
		fmt.Printf("%d MiB: %s as %s; chunks only fits: %v\n", budget>>20, res.Best.Name, res.Best.Plan.Split, res.Plain.Plan != nil)
	}
	// Output:
	// none, selective, blocks 3/6, blocks 4/6, blocks 6/6, blocks 6/6+selective
	// 32 MiB: blocks 6/6 as 4 × 2; chunks only fits: false
	// 136 MiB: none as 1 × 8; chunks only fits: true
}
