package cuda

import (
	"embed"
	"io/fs"
)

//go:embed kernels/*.cu
var kernelFiles embed.FS

// KernelSource returns the embedded CUDA C source kernels/<file>, e.g.
// "smoke.cu", for Device.Compile.
func KernelSource(file string) (string, error) {
	b, err := fs.ReadFile(kernelFiles, "kernels/"+file)
	return string(b), err
}
