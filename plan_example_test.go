package batchfit_test

import (
	"fmt"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/models"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/optim"
)

// Plan a training step without running it: the chunks a budget forces
// and the predicted peak, from a shape-only model over placeholder
// inputs, as Step would run the same step with data.
func ExampleSession_Plan() {
	model := nn.MLP(nn.Options{ShapeOnly: true}, []int{784, 512, 512, 10}, nn.ReLU{})
	x := lazy.Placeholder([]int{4096, 784}, graph.Float32, 0)
	y := x.Graph().Placeholder([]int{4096}, graph.Int64, 0)
	loss := model.Forward(x).CrossEntropy(y, graph.ReduceMean)

	sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, Budget: 32 << 20})
	defer sess.Close()
	sp, err := sess.Plan(loss, nn.ParamTensors(model), optim.NewAdamW(1e-3))
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Printf("%d samples run as %s within %s\n", sp.Plan.Batch, sp.Plan.Split, alloc.FormatBytes(sp.Plan.Budget))
	fmt.Printf("predicted peak %s, of which %s parameters and AdamW's state\n",
		alloc.FormatBytes(sp.Plan.PeakReserved), alloc.FormatBytes(sp.Plan.Persistent))
	// Output:
	// 4096 samples run as 4 × 1024 within 32.00 MiB
	// predicted peak 26.00 MiB, of which 7.66 MiB parameters and AdamW's state
}

// The largest batch that runs in one chunk, and the chunks of a larger
// target batch, for an MLP on a simulated 80 MiB device: a dry-run
// session plans for a device without running on it.
func ExampleSession_MaxBatch() {
	model := nn.MLP(nn.Options{ShapeOnly: true}, []int{784, 512, 512, 10}, nn.ReLU{})
	params := nn.ParamTensors(model)
	build := func(n int) (*lazy.Tensor, []*lazy.Tensor) {
		x := lazy.Placeholder([]int{n, 784}, graph.Float32, 0)
		y := x.Graph().Placeholder([]int{n}, graph.Int64, 0)
		return model.Forward(x).CrossEntropy(y, graph.ReduceMean), params
	}
	sess := batchfit.NewSession(batchfit.Options{Budget: 80 << 20, DryRun: &batchfit.DryRun{}})
	defer sess.Close()
	fit, err := sess.MaxBatch(build, optim.NewAdamW(1e-3), batchfit.MaxBatchOptions{Target: 65536})
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Printf("largest batch in one chunk: %d (peak %s)\n", fit.Batch, alloc.FormatBytes(fit.Plan.Plan.PeakReserved))
	fmt.Printf("a batch of 65536 runs as %s\n", fit.Target.Plan.Split)
	// Output:
	// largest batch in one chunk: 6018 (peak 80.00 MiB)
	// a batch of 65536 runs as 1 × 4370 + 14 × 4369
}

// The memory levers a session weighed for a language model's step in a
// dry run: each token chunk of the fused head and loss, with the optimizer
// on the device and offloaded (Options.Offload OffloadAuto), each planned
// with its batch chunks (* the one planned). Within 40 MiB only the
// offloaded optimizer fits.
func ExampleStepPlan_levers() {
	cfg := models.LlamaTiny()
	cfg.Vocab, cfg.Hidden, cfg.Intermediate = 2048, 256, 512
	model := models.NewLlama(nn.Options{ShapeOnly: true}, cfg)
	tokens := lazy.Placeholder([]int{8, 64}, graph.Int64, 0)
	labels := tokens.Graph().Placeholder([]int{8, 64}, graph.Int64, 0)
	loss := models.CausalLMLoss(model.Forward(tokens), labels)

	sess := batchfit.NewSession(batchfit.Options{Precision: "bf16-mixed", Offload: batchfit.OffloadAuto,
		Budget: 40 << 20, DryRun: &batchfit.DryRun{}})
	defer sess.Close()
	sp, err := sess.Plan(loss, nn.ParamTensors(model), optim.NewAdamW(1e-3))
	if err != nil {
		fmt.Println(err)
		return
	}
	for _, l := range sp.Levers {
		mark, where, how := "-", "device", "does not fit"
		if l.Chosen {
			mark = "*"
		}
		if l.Offload == batchfit.OffloadOptimizer {
			where = "host"
		}
		switch {
		case l.Plan != nil:
			how = fmt.Sprintf("%s, peak %s", l.Plan.Split, alloc.FormatBytes(l.Plan.PeakReserved))
		case l.Skipped:
			how = "not planned"
		}
		fmt.Printf("%s loss chunk %d, optimizer on the %s: %s\n", mark, l.LossChunk, where, how)
	}
	fmt.Println("the session offloads:", sess.Offload() == batchfit.OffloadOptimizer)
	// Output:
	// - loss chunk 512, optimizer on the device: does not fit
	// - loss chunk 256, optimizer on the device: does not fit
	// * loss chunk 512, optimizer on the host: 1 × 8, peak 36.00 MiB
	// - loss chunk 256, optimizer on the host: 1 × 8, peak 36.00 MiB
	// the session offloads: true
}
