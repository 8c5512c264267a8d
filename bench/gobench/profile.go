package main

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime/pprof"
	"slices"
	"strings"
	"time"

	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/exec/cuda"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/optim"
	"github.com/batchfit/batchfit/planner"
)

// opTotal is one op's time over a profiled step.
type opTotal struct {
	op    string
	calls int
	total time.Duration
}

// nodeTime is one node's time in one chunk.
type nodeTime struct {
	op    string
	shape string // the inputs' shapes → the output's, at the chunk's size
	flops float64
	d     time.Duration
}

// describe is a node's op signature at chunk size b, and its GEMM
// floating-point operations (0 for other ops): 2·m·n·k for a matmul or
// linear, from the output's size and the contracted axis.
func describe(g *graph.Graph, nd *graph.Node, b int) (string, float64) {
	ins := make([]string, len(nd.Inputs))
	for i, in := range nd.Inputs {
		ins[i] = shapeString(g.Node(in).Type.AtBatch(b))
	}
	out := nd.Type.AtBatch(b)
	sig := strings.Join(ins, ",") + "→" + shapeString(out)
	var k int
	switch nd.Op {
	case graph.OpLinear: // x [..., in] · w [out, in]ᵀ
		k = g.Node(nd.Inputs[1]).Type.Shape[1]
	case graph.OpMatMul, graph.OpMatMulGeluGrad:
		xs := g.Node(nd.Inputs[0]).Type.AtBatch(b)
		k = xs[len(xs)-1]
		if nd.Attrs.TransA {
			k = xs[len(xs)-2]
		}
	default:
		return sig, 0
	}
	return sig, 2 * float64(graph.Numel(out)) * float64(k)
}

func shapeString(s []int) string { return strings.ReplaceAll(fmt.Sprint(s), " ", "×") }

// profileStep runs steps more training steps with ExecOptions.OpTime (each
// node's device time, from CUDA events around its launches) and writes the
// time per op and the slowest kinds of node to w. The step's wall time is
// printed beside the sum over nodes and the update's device time (the
// optimizer, ExecOptions.UpdateTime); the rest is the work outside nodes
// (chunk combines, accumulation) and any time the device waited for the
// host.
func profileStep(w io.Writer, e *cuda.Executor, p *planner.Program, chunks []planner.Chunk, feed func(int) tensor.Tensor,
	opt optim.Optimizer, name string, steps int) error {
	var nodes []nodeTime
	var wall, update time.Duration
	for range steps {
		o := cuda.ExecOptions{Feed: feed, Resident: true, KeptOnDevice: true, Optimizer: opt,
			OpTime: func(nd *graph.Node, c planner.Chunk, d time.Duration) {
				sig, flops := describe(p.Graph, nd, c.Size)
				nodes = append(nodes, nodeTime{nd.Op.String(), sig, flops, d})
			},
			UpdateTime: func(d time.Duration) { update += d }}
		t0 := time.Now()
		if _, err := e.Execute(context.Background(), p, chunks, o); err != nil {
			return err
		}
		wall += time.Since(t0)
	}
	byOp := map[string]*opTotal{}
	var sum time.Duration
	for _, n := range nodes {
		t := byOp[n.op]
		if t == nil {
			t = &opTotal{op: n.op}
			byOp[n.op] = t
		}
		t.calls++
		t.total += n.d
		sum += n.d
	}
	ops := make([]*opTotal, 0, len(byOp))
	for _, t := range byOp {
		ops = append(ops, t)
	}
	slices.SortFunc(ops, func(a, b *opTotal) int { return cmp.Compare(b.total, a.total) })
	per := func(d time.Duration) float64 { return float64(d) / float64(steps) / 1e6 }
	fmt.Fprintf(w, "== profile %s: %d steps, %d chunks; wall %.3f ms/step, nodes on the device %.3f ms/step, the update (optimizer) %.3f ms/step, the rest %.3f ms/step\n",
		name, steps, len(chunks), per(wall), per(sum), per(update), per(wall-sum-update))
	fmt.Fprintf(w, "%-22s %7s %12s %8s %10s\n", "op", "calls", "ms/step", "share", "µs/call")
	for _, t := range ops {
		fmt.Fprintf(w, "%-22s %7d %12.3f %7.1f%% %10.1f\n", t.op, t.calls/steps, per(t.total),
			100*float64(t.total)/float64(sum), float64(t.total)/float64(t.calls)/1e3)
	}
	// Nodes grouped by op and shapes: where a kind of node is slow, and
	// how close each GEMM shape comes to the card's rate.
	type group struct {
		op, sig string
		calls   int
		flops   float64
		total   time.Duration
	}
	groups := map[string]*group{}
	var order []*group
	for _, n := range nodes {
		k := n.op + " " + n.shape
		gr := groups[k]
		if gr == nil {
			gr = &group{op: n.op, sig: n.shape}
			groups[k] = gr
			order = append(order, gr)
		}
		gr.calls++
		gr.flops += n.flops
		gr.total += n.d
	}
	slices.SortFunc(order, func(a, b *group) int { return cmp.Compare(b.total, a.total) })
	fmt.Fprintf(w, "slowest node kinds (op, input shapes → output shape), TFLOP/s for GEMMs:\n")
	for _, gr := range order[:min(40, len(order))] {
		rate := ""
		if gr.flops > 0 {
			rate = fmt.Sprintf("%6.1f TFLOP/s", gr.flops/gr.total.Seconds()/1e12)
		}
		fmt.Fprintf(w, "  %-20s %5d/step %9.3f ms/step %8.1f µs/call %s  %s\n", gr.op, gr.calls/steps, per(gr.total),
			float64(gr.total)/float64(gr.calls)/1e3, rate, gr.sig)
	}
	return nil
}

// startCPUProfile starts a Go CPU profile into path with the model's name
// inserted before the extension; stop ends it.
func startCPUProfile(path, model string) (stop func(), err error) {
	ext := filepath.Ext(path)
	f, err := os.Create(strings.TrimSuffix(path, ext) + "-" + model + ext)
	if err != nil {
		return nil, err
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		return nil, errors.Join(err, f.Close())
	}
	return func() {
		pprof.StopCPUProfile()
		_ = f.Close()
	}, nil
}

// printChoices writes the timed search's choices (cuda.DNN.Choices) to w:
// per convolution, the chosen algorithm and its time at the searched
// batch, the workspace declared at the whole batch, and the fastest result
// of any kind, for comparison (non-deterministic and FFT algorithms, which
// the choice leaves out, included).
func printChoices(w io.Writer, e *cuda.Executor, name string) {
	dnn := e.DNN()
	if dnn == nil {
		return
	}
	cs := dnn.Choices()
	st := dnn.SearchStats()
	fmt.Fprintf(w, "== cuDNN algorithms %s: %d shapes searched, %d from the disk cache, %d from this process, heuristics %v, cache errors %d, largest search %s\n",
		name, st.Searched, st.FromDisk, st.FromProcess, st.Heuristics, st.CacheErrors, alloc.FormatBytes(st.MaxBytes))
	var chosen, fastest float64
	for _, c := range cs {
		chosen += c.TimeMS
		fastest += c.FastestTimeMS
		mark := ""
		if !c.FastestAllowed {
			mark = fmt.Sprintf("  (fastest of any kind: algo %d, %.3f ms)", c.FastestAlgo, c.FastestTimeMS)
		}
		fmt.Fprintf(w, "  algo %d math %d %8.3f ms at batch %d, workspace %s (%d + %d·b), %s: %s%s\n", c.Algo, c.Math, c.TimeMS,
			c.SearchBatch, alloc.FormatBytes(c.Workspace), c.DeclaredFixed, c.DeclaredPerBatch, c.Source, c.Conv, mark)
	}
	fmt.Fprintf(w, "  sum over shapes (each once): chosen %.3f ms, fastest of any kind %.3f ms\n", chosen, fastest)
}
