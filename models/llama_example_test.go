package models_test

import (
	"fmt"

	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/models"
	"github.com/batchfit/batchfit/nn"
)

// A shape-only Llama 3.2 1B: its size, a few of its Hugging Face names,
// and the logits of a batch of token ids, planned without any data.
func ExampleNewLlama() {
	m := models.NewLlama(nn.Options{ShapeOnly: true}, models.Llama32_1B())
	fmt.Println(nn.NumParams(m))
	ps := m.Params()
	fmt.Println(ps[0].Name(), ps[0].Shape())
	fmt.Println(ps[2].Name(), ps[2].Shape())
	tokens := lazy.Placeholder([]int{4, 2048}, graph.Int64, 0)
	logits := m.Forward(tokens)
	fmt.Println(logits.Shape(), logits.Err())
	// Output:
	// 1235814400
	// model.embed_tokens.weight [128256 2048]
	// model.layers.0.self_attn.k_proj.weight [512 2048]
	// [4 2048 128256] <nil>
}

// Llama 3.2's rotary frequencies: llama3 scaling keeps the fastest, divides
// the slowest by 32 and interpolates between.
func ExampleRopeConfig_InvFreq() {
	f, err := models.Llama32_1B().Rope.InvFreq(64)
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Printf("%.4g %.4g %.4g\n", f[0], f[16], f[31])
	// Output:
	// 1 0.0004296 9.418e-08
}
