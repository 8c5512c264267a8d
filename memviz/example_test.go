package memviz_test

import (
	"bytes"
	"fmt"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/exec/cpu"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/memviz"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/planner"
	"github.com/batchfit/batchfit/shapeinfer"
)

// A planned training step replayed on a simulated device: the allocator's
// state at the peak of allocated bytes, named by the program (parameters,
// their gradients, Adam's exp_avg and exp_avg_sq, activations by module
// path), itemised, and written as the pickle pytorch.org/memory_viz reads.
// batchfit snapshot and report do this for the zoo's models.
func ExampleSimulate() {
	const n = 8192
	model := nn.MLP(nn.Options{ShapeOnly: true}, []int{784, 512, 10}, nn.ReLU{})
	x := lazy.Placeholder([]int{n, 784}, graph.Float32, 0)
	y := x.Graph().Placeholder([]int{n}, graph.Int64, 0)
	loss := model.Forward(x).CrossEntropy(y, lazy.Mean)
	params := nn.ParamTensors(model)
	outputs := []int{loss.ID()}
	var trained []int
	for i, g := range lazy.Grad(loss, params...) {
		outputs = append(outputs, g.ID())
		trained = append(trained, loss.Graph().NodeOf(params[i]))
	}
	g := loss.Graph().IR()
	info, err := shapeinfer.Analyze(g, outputs...)
	if err != nil {
		fmt.Println(err)
		return
	}
	p, err := planner.Compile(g, info, outputs, planner.CompileOptions{Kept: outputs[1:], Trained: trained,
		StateSlots: 2, Workspace: cpu.Workspace})
	if err != nil {
		fmt.Println(err)
		return
	}
	pl, err := planner.Make(p, planner.Options{Budget: 64 << 20})
	if err != nil {
		fmt.Println(err)
		return
	}
	sim, err := memviz.Simulate(p, pl.Chunks, memviz.SimOptions{Capacity: pl.Available(), TraceEntries: 1000})
	if err != nil {
		fmt.Println(err)
		return
	}
	snap := memviz.NewSnapshot(0, sim.Snapshot)
	r, err := memviz.NewReport(p, snap, memviz.Options{})
	if err != nil {
		fmt.Println(err)
		return
	}
	d := r.Devices[0]
	fmt.Println("plan:", pl.Split, "peak allocated", alloc.FormatBytes(d.Totals.Allocated), "of", alloc.FormatBytes(pl.PeakAllocated))
	for _, k := range []memviz.Kind{memviz.KindParam, memviz.KindState} {
		fmt.Println(k, alloc.FormatBytes(d.Totals.ByKind[k]))
	}
	fmt.Println("first tensor:", d.Tensors[0].Name, d.Tensors[0].Shape)

	var buf bytes.Buffer
	if err := memviz.WritePickle(&buf, snap); err != nil {
		fmt.Println(err)
		return
	}
	back, err := memviz.ReadPickle(&buf)
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println("pickle read back:", len(back.Devices[0].Segments) == len(snap.Devices[0].Segments), "segments,", len(back.Devices[0].Trace) > 0, "trace")
	// Output:
	// plan: 2 × 4096 peak allocated 42.48 MiB of 42.48 MiB
	// param 1.55 MiB
	// optimizer_state 3.11 MiB
	// first tensor: 0.weight [512 784]
	// pickle read back: true segments, true trace
}
