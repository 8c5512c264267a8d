package planner_test

import (
	"fmt"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/exec/cpu"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/planner"
	"github.com/batchfit/batchfit/shapeinfer"
)

// A dry run: will a training step of this MLP at batch 65,536 fit in
// 256 MiB? The model is built shape-only over placeholders (no data, no
// device), the step compiled into the program an executor would follow,
// and Make replays it through the caching allocator on a simulated device
// to pick the largest balanced chunk whose peak fits.
func ExampleMake() {
	const n = 65536
	model := nn.MLP(nn.Options{ShapeOnly: true}, []int{784, 1024, 1024, 10}, nn.ReLU{})
	x := lazy.Placeholder([]int{n, 784}, graph.Float32, 0)
	y := x.Graph().Placeholder([]int{n}, graph.Int64, 0)
	loss := model.Forward(x).CrossEntropy(y, graph.ReduceMean)
	params := nn.ParamTensors(model)
	outputs := []int{loss.ID()}
	var kept, trained []int
	for i, g := range lazy.Grad(loss, params...) {
		outputs = append(outputs, g.ID())
		kept = append(kept, g.ID())
		trained = append(trained, loss.Graph().NodeOf(params[i]))
	}
	g := loss.Graph().IR()
	info, err := shapeinfer.Analyze(g, outputs...)
	if err != nil {
		fmt.Println(err)
		return
	}
	p, err := planner.Compile(g, info, outputs, planner.CompileOptions{Kept: kept, Trained: trained,
		StateSlots: 2, Workspace: cpu.Workspace}) // Adam: two state tensors per parameter
	if err != nil {
		fmt.Println(err)
		return
	}
	pl, err := planner.Make(p, planner.Options{Budget: 256 << 20})
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println("runs as", pl.Split, "with a peak of", alloc.FormatBytes(pl.PeakReserved), "reserved")
	// Output:
	// runs as 4 × 10923 + 2 × 10922 with a peak of 252.00 MiB reserved
}
