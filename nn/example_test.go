package nn_test

import (
	"errors"
	"fmt"

	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/nn"
)

// An MLP whose parameters carry PyTorch's state_dict names. The model is
// built shape-only (no data) over a placeholder, so the output shape is
// known without running anything; nn.ParamTensors lists the lazy tensors
// a training step trains.
func ExampleMLP() {
	model := nn.MLP(nn.Options{ShapeOnly: true}, []int{784, 512, 10}, nn.ReLU{})
	for _, p := range model.Params() {
		fmt.Println(p.Name(), p.Shape())
	}
	fmt.Println(nn.NumParams(model), "parameters;", len(nn.ParamTensors(model)), "tensors to train")

	x := lazy.Placeholder([]int{32, 784}, graph.Float32, 0)
	fmt.Println("logits", model.Forward(x).Shape())
	// Output:
	// 0.weight [512 784]
	// 0.bias [512]
	// 2.weight [10 512]
	// 2.bias [10]
	// 407050 parameters; 4 tensors to train
	// logits [32 10]
}

// Modules of one's own compose with the built-in ones. A bad size is no
// panic: Check reports it, and Forward returns it as the output's sticky
// error, naming the module.
func ExampleNewSequentialNamed() {
	opt := nn.Seed(1)
	model := nn.NewSequentialNamed(
		nn.Child{Name: "features", Module: nn.NewConv2d(opt, 3, 8, [2]int{3, 3}, true, lazy.ConvOptions{Padding: [2]int{1, 1}})},
		nn.Child{Name: "act", Module: nn.ReLU{}},
		nn.Child{Name: "flat", Module: nn.Flatten{}},
		nn.Child{Name: "head", Module: nn.NewLinear(opt, 8*4*4, 2, true)},
	)
	for _, p := range model.Params() {
		fmt.Println(p.Name())
	}
	bad := nn.NewLinear(opt, 0, 2, true)
	fmt.Println(errors.Is(nn.Check(bad), graph.ErrShape))
	// Output:
	// features.weight
	// features.bias
	// head.weight
	// head.bias
	// true
}

// LoRA adapters on the layers named q_proj, shape-only: the adapted
// layer's parameters are named as PEFT names them, and only the adapters
// are trained; the base is frozen in bfloat16.
func ExampleLoRA_Apply() {
	o := nn.Options{ShapeOnly: true}
	model := nn.NewSequentialNamed(
		nn.Child{Name: "q_proj", Module: nn.NewLinear(o, 64, 64, false)},
		nn.Child{Name: "act", Module: nn.ReLU{}},
		nn.Child{Name: "head", Module: nn.NewLinear(o, 64, 10, true)},
	)
	adapters, err := nn.LoRA{Rank: 8, Alpha: 16, Targets: []string{"q_proj"}}.Apply(o, model)
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println(adapters[0].Path, "scale", adapters[0].Layer.Scale())
	for _, p := range model.Params() {
		fmt.Println(p.Name(), p.Shape(), p.Tensor().DType(), "frozen:", p.Frozen())
	}
	// Output:
	// q_proj scale 2
	// q_proj.weight [64 64] bfloat16 frozen: true
	// q_proj.lora_A.weight [8 64] float32 frozen: false
	// q_proj.lora_B.weight [64 8] float32 frozen: false
	// head.weight [10 64] bfloat16 frozen: true
	// head.bias [10] bfloat16 frozen: true
}
