package safetensors_test

import (
	"fmt"
	"os"
	"path/filepath"

	"github.com/batchfit/batchfit/safetensors"
)

// Write two tensors, one stored as bfloat16, and read them back into
// float32 slices.
func Example() {
	dir, err := os.MkdirTemp("", "safetensors-example")
	if err != nil {
		fmt.Println(err)
		return
	}
	defer os.RemoveAll(dir)
	path := filepath.Join(dir, "model.safetensors")
	err = safetensors.WriteFile(path, []safetensors.Tensor{
		{Name: "embed.weight", DType: safetensors.BF16, Shape: []int{2, 3}, Float32: []float32{1, 2, 3, 4, 5, 1.001}},
		{Name: "norm.weight", DType: safetensors.F32, Shape: []int{3}, Float32: []float32{1, 1, 0.5}},
	}, map[string]string{"format": "pt"})
	if err != nil {
		fmt.Println(err)
		return
	}

	f, err := safetensors.Open(path)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer f.Close()
	for _, t := range f.Tensors() {
		fmt.Println(t.Name, t.DType, t.Shape, t.Bytes(), "bytes")
	}
	embed := make([]float32, 6)
	if err := f.ReadFloat32("embed.weight", embed); err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println(embed, f.Metadata()["format"])
	// Output:
	// norm.weight F32 [3] 12 bytes
	// embed.weight BF16 [2 3] 12 bytes
	// [1 2 3 4 5 1] pt
}
