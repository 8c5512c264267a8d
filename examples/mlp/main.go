// Command mlp builds a FashionMNIST-shaped classifier (784 → 512 → 512 → 10
// with ReLU) over generated data, prints what shape inference knows about
// every node of the forward pass and its loss, evaluates logits and mean
// cross-entropy, then trains with Adam and prints the loss going down.
//
// The data are Gaussian blobs, one per class, standing in for normalised
// 28×28 images so the example needs no download. With random initial
// weights the loss is close to ln 10 ≈ 2.303.
//
//	go run ./examples/mlp -batch 64 -steps 200 -seed 1
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"text/tabwriter"

	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/exec/cpu"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/optim"
	"github.com/batchfit/batchfit/shapeinfer"
)

const (
	features = 28 * 28
	classes  = 10
	meanStd  = 0.1 // spread of the class means
)

type options struct {
	batch  int    // samples in the batch
	seed   uint64 // seeds both the data and the initial weights
	rows   int    // rows of logits to print
	steps  int    // training steps
	lr     float64
	budget int64  // device memory a step may reserve; 0: no limit
	device string // batchfit.Options.Device: "" (auto), "cpu" or "cuda"
}

func main() {
	var o options
	flag.IntVar(&o.batch, "batch", 64, "batch size")
	flag.Uint64Var(&o.seed, "seed", 1, "seed for data and initial weights")
	flag.IntVar(&o.rows, "rows", 4, "rows of logits to print")
	flag.IntVar(&o.steps, "steps", 200, "training steps")
	flag.Float64Var(&o.lr, "lr", 1e-3, "Adam learning rate")
	flag.StringVar(&o.device, "device", "auto", "auto (CUDA when a GPU is usable), cpu or cuda")
	budget := flag.String("budget", "0", "memory a training step may reserve, e.g. 48MiB (0: no limit); the planner splits the batch into chunks to fit")
	flag.Parse()
	var err error
	if o.budget, err = batchfit.ParseSize(*budget); err != nil {
		fmt.Fprintln(os.Stderr, "mlp: -budget:", err)
		os.Exit(2)
	}
	if err := run(os.Stdout, o); err != nil {
		fmt.Fprintln(os.Stderr, "mlp:", err)
		os.Exit(1)
	}
}

func run(w io.Writer, o options) error {
	switch {
	case o.batch < 1:
		return fmt.Errorf("-batch must be at least 1, got %d", o.batch)
	case o.steps < 0:
		return fmt.Errorf("-steps must be at least 0, got %d", o.steps)
	}
	images, labels := blobs(o.seed, o.batch)
	model := nn.MLP(nn.Seed(o.seed), []int{features, 512, 512, classes}, nn.ReLU{})

	x := lazy.Wrap(images, 0)
	y := x.Graph().Wrap(labels, 0)
	logits := model.Forward(x)
	loss := logits.CrossEntropy(y, lazy.Mean)
	if err := loss.Err(); err != nil {
		return err
	}
	g := x.Graph().IR()
	info, err := shapeinfer.Analyze(g, logits.ID(), loss.ID())
	if err != nil {
		return err
	}
	fmt.Fprintf(w, "MLP %d→512→512→%d, %d parameters, batch %d\n\n", features, classes, nn.NumParams(model), o.batch)
	if err := printNodes(w, g, info); err != nil {
		return err
	}

	out, err := cpu.New().Run(context.Background(), g, logits.ID(), loss.ID())
	if err != nil {
		return err
	}
	if err := printResults(w, out[0], out[1], o.rows); err != nil {
		return err
	}
	if o.steps == 0 {
		return nil
	}
	_, err = train(w, o, model)
	return err
}

// train runs o.steps Adam steps over fresh batches from the same blobs,
// rebuilding the graph every step as a training loop does; the session
// reuses its analysis because the graph's signature does not change.
// It returns the loss of every step.
func train(w io.Writer, o options, model nn.Module) ([]float32, error) {
	sess := batchfit.NewSession(batchfit.Options{Budget: o.budget, Device: o.device})
	if err := sess.Err(); err != nil {
		return nil, err
	}
	defer sess.Close() // a failed Close of an example's GPU has nothing left to lose
	opt := optim.NewAdam(o.lr)
	fmt.Fprintf(w, "\ntraining on %s, Adam lr %g\n", sess.Device(), o.lr)
	ctx := context.Background()
	losses := make([]float32, 0, o.steps)
	for step := range o.steps {
		images, labels := blobsFrom(o.seed, uint64(step+1), o.batch)
		x := lazy.Wrap(images, 0)
		loss := model.Forward(x).CrossEntropy(x.Graph().Wrap(labels, 0), lazy.Mean)
		l, err := sess.Step(ctx, loss, nn.ParamTensors(model), opt)
		if err != nil {
			return losses, fmt.Errorf("step %d: %w", step, err)
		}
		losses = append(losses, l)
		if step == 0 {
			printPlan(w, sess, o.budget)
		}
		if step == 0 || (step+1)%max(o.steps/10, 1) == 0 {
			fmt.Fprintf(w, "step %4d  loss %.6f\n", step+1, l)
		}
	}
	return losses, nil
}

// printPlan reports the planner's decision for the training step and the
// peak the executor measured running it.
func printPlan(w io.Writer, sess *batchfit.Session, budget int64) {
	pl, u := sess.LastPlan(), sess.LastUsage()
	limit := "no budget"
	if budget > 0 {
		limit = "budget " + batchfit.FormatSize(budget)
	}
	split := "the whole batch in one chunk"
	if len(pl.Chunks) > 1 {
		split = fmt.Sprintf("%d chunks of at most %d", len(pl.Chunks), pl.Chunk)
	}
	// Measured peaks include the executor's Overhead (CUDA's cuBLAS
	// workspace), which no plan counts.
	extra := ""
	if oh := sess.Overhead(); oh > 0 {
		extra = fmt.Sprintf(" + %s cuBLAS workspace", batchfit.FormatSize(oh))
	}
	fmt.Fprintf(w, "plan (%s): batch %d runs as %s; peak reserved predicted %s, measured %s%s\n",
		limit, pl.Batch, split, batchfit.FormatSize(pl.PeakReserved), batchfit.FormatSize(u.PeakReserved-sess.Overhead()), extra)
}

// blobs draws batch samples from ten Gaussian blobs: class c has a mean
// drawn from N(0, meanStd²) per feature and unit noise around it. With
// meanStd = 0.1 the classes overlap enough that learning takes many steps.
func blobs(seed uint64, batch int) (images, labels *tensor.Dense) {
	return blobsFrom(seed, 0, batch)
}

// blobsFrom draws batch samples of the blobs fixed by seed, using stream to
// pick which samples: each training step draws a fresh batch.
func blobsFrom(seed, stream uint64, batch int) (images, labels *tensor.Dense) {
	mr := rand.New(rand.NewPCG(seed, 0xda7a))
	means := make([]float64, classes*features)
	for i := range means {
		means[i] = meanStd * mr.NormFloat64()
	}
	r := mr
	if stream > 0 {
		r = rand.New(rand.NewPCG(seed^stream*0x9e3779b97f4a7c15, 0x5a3b1e))
	}
	x := make([]float32, batch*features)
	y := make([]int64, batch)
	for n := range batch {
		c := r.IntN(classes)
		y[n] = int64(c)
		for f := range features {
			x[n*features+f] = float32(means[c*features+f] + r.NormFloat64())
		}
	}
	return tensor.New(tensor.WithShape(batch, features), tensor.WithBacking(x)),
		tensor.New(tensor.WithShape(batch), tensor.WithBacking(y))
}

// printNodes writes one row per node: what it is, where in the model it
// was made, and what shape inference and liveness say about it. The last
// row sums every node's bytes, an upper bound on the peak: liveness frees
// buffers after their last use.
func printNodes(w io.Writer, g *graph.Graph, info *shapeinfer.Result) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "id\top\tname\tmodule\tshape\tbatch axis\tclass\tbytes\tlast use\t")
	var total int64
	for _, nd := range g.Nodes() {
		last := fmt.Sprint(info.LastUse[nd.ID])
		switch info.LastUse[nd.ID] {
		case shapeinfer.End:
			last = "output"
		case -1:
			last = "unused"
		}
		b := info.Bytes(nd.ID, info.Batch)
		total += b
		fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%v\t%d\t%s\t%d\t%s\t\n", nd.ID, nd.Op, orDash(nd.Name), orDash(nd.Scope),
			nd.Type.Shape, nd.Type.BatchAxis, info.Class[nd.ID], b, last)
	}
	fmt.Fprintf(tw, "\t\t\t\t\t\tsum\t%d\t\t\n", total)
	return tw.Flush()
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// printResults writes the loss and the first rows of logits.
func printResults(w io.Writer, logits, loss *tensor.Dense, rows int) error {
	var l float32
	switch v := loss.Data().(type) {
	case float32: // a scalar Dense holds its value directly
		l = v
	case []float32:
		if len(v) != 1 {
			return fmt.Errorf("loss has %d elements, want 1", len(v))
		}
		l = v[0]
	default:
		return fmt.Errorf("loss is %T, want float32", v)
	}
	fmt.Fprintf(w, "\nloss: %.6f\n", l)
	data, ok := logits.Data().([]float32)
	if !ok {
		return fmt.Errorf("logits are %T, want []float32", logits.Data())
	}
	n := min(rows, logits.Shape()[0])
	fmt.Fprintf(w, "logits, first %d of %d rows:\n", n, logits.Shape()[0])
	for i := range n {
		for j := range classes {
			fmt.Fprintf(w, " %8.4f", data[i*classes+j])
		}
		fmt.Fprintln(w)
	}
	return nil
}
