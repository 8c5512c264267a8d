package compile_test

import (
	"fmt"

	"github.com/batchfit/batchfit/compile"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/precision"
)

// A bf16-mixed training step of a small MLP through the pipeline: each
// pass's report says whether it ran (or why not) and what it did to the
// graph. fuse-gelu-grad removes the [4, 32] bfloat16 product that only
// the GELU's gradient read: one node and 256 bytes.
func ExampleTrain() {
	x := lazy.Placeholder([]int{4, 16}, graph.Float32, 0)
	w1 := lazy.ParamSpec([]int{32, 16}, graph.Float32, "w1")
	w2 := lazy.ParamSpec([]int{8, 32}, graph.Float32, "w2")
	y := x.Graph().Placeholder([]int{4}, graph.Int64, 0)
	loss := x.Linear(w1, nil).Gelu().Linear(w2, nil).CrossEntropy(y, graph.ReduceMean)
	wrt, err := lazy.ParamIDs(loss, w1, w2)
	if err != nil {
		fmt.Println(err)
		return
	}
	st, err := compile.Train(loss.Graph().IR(), loss.ID(), wrt, compile.Options{Policy: precision.BF16Mixed})
	if err != nil {
		fmt.Println(err)
		return
	}
	for _, r := range st.Passes {
		if !r.Ran {
			fmt.Printf("%-26s skipped: %s\n", r.Name, r.Why)
			continue
		}
		fmt.Printf("%-26s %2d → %2d nodes, %5d → %5d bytes\n", r.Name, r.NodesBefore, r.NodesAfter, r.BytesBefore, r.BytesAfter)
	}
	_, err = compile.Train(loss.Graph().IR(), loss.ID(), wrt, compile.Options{Disable: []string{"fuse-all"}})
	fmt.Println(err)
	// Output:
	// offload-params             skipped: needs Options.OffloadParams (an offloaded optimizer)
	// fuse-attention-qkv          8 →  8 nodes,  1156 →  1156 bytes
	// autocast                    8 → 11 nodes,  1156 →  2244 bytes
	// channels-last              skipped: needs Options.ChannelsLast
	// fuse-linear-cross-entropy  11 → 11 nodes,  2244 →  2180 bytes
	// loss-scale                 skipped: needs Options.LossScale (fp16-mixed's dynamic loss scaling)
	// autodiff                   11 → 18 nodes,  2180 →  7304 bytes
	// fold-casts                 18 → 17 nodes,  7304 →  6280 bytes
	// fuse-gelu-grad             17 → 17 nodes,  6280 →  6280 bytes
	// fuse-layer-norm-grad-add   17 → 17 nodes,  6280 →  6280 bytes
	// fuse-embedding-grad-add    17 → 17 nodes,  6280 →  6280 bytes
	// fuse-pointwise             17 → 17 nodes,  6280 →  6280 bytes
	// compile: unknown pass "fuse-all" (passes: offload-params, fuse-attention-qkv, autocast, channels-last, fuse-linear-cross-entropy, loss-scale, autodiff, fold-casts, fuse-gelu-grad, fuse-layer-norm-grad-add, fuse-embedding-grad-add, fuse-pointwise, recompute)
}
