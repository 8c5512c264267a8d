package models_test

import (
	"fmt"

	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/models"
	"github.com/batchfit/batchfit/nn"
)

// GPT-2 small, shape-only: parameters with shapes and no data, tokens as
// a placeholder, so the whole model's graph (and a planner's estimate of
// it) costs milliseconds and no memory. Loss is the mean next-token
// cross-entropy.
func ExampleGPT2Small() {
	cfg := models.GPT2Small()
	gpt := models.NewGPT(nn.Options{ShapeOnly: true}, cfg)
	tokens := lazy.Placeholder([]int{8, cfg.Context}, graph.Int64, 0)
	targets := tokens.Graph().Placeholder([]int{8, cfg.Context}, graph.Int64, 0)
	logits := gpt.Forward(tokens)
	loss := models.Loss(logits, targets)
	if err := loss.Err(); err != nil {
		fmt.Println(err)
		return
	}
	fmt.Printf("%d layers, width %d: %d parameters\n", cfg.Layers, cfg.Dim, nn.NumParams(gpt))
	fmt.Println("logits", logits.Shape(), "loss", loss.Shape())
	// Output:
	// 12 layers, width 768: 124439808 parameters
	// logits [8 1024 50257] loss []
}

// ResNet-50 in torchvision's layout and state_dict names. Its batch norms
// start in training mode, as PyTorch's modules do.
func ExampleResNet50() {
	m := models.NewResNet(nn.Options{ShapeOnly: true}, models.ResNet50(1000))
	x := lazy.Placeholder([]int{64, 3, 224, 224}, graph.Float32, 0)
	ps := m.Params()
	fmt.Println(nn.NumParams(m), "parameters, from", ps[0].Name(), "to", ps[len(ps)-1].Name())
	fmt.Println("logits", m.Forward(x).Shape(), "buffers", len(nn.Buffers(m)))
	// Output:
	// 25557032 parameters, from conv1.weight to fc.bias
	// logits [64 1000] buffers 106
}
