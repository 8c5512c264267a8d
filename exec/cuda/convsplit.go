package cuda

import (
	"math"
	"sync/atomic"

	"github.com/batchfit/batchfit/graph"
)

// Convolutions too large for cuDNN's descriptors.
//
// cuDNN's legacy 4-D descriptors take int32 sizes, and
// cudnnSetTensor4dDescriptor refuses a tensor of 2³¹ or more elements
// (cuDNN 9.14 on the H100: CUDNN_STATUS_NOT_SUPPORTED, 3000; others have
// answered BAD_PARAM): ResNet-50's stem output [N, 64, 112, 112] from N = 2,675, the
// ConvNet's first [N, 32, 32, 32] from N = 65,536. Such a convolution runs
// on cuDNN in slices along N of the largest size the descriptors take, as
// ATen splits a batch for cuDNN (split_batch_dim_to_32bit_out): forward
// and grad_input slice by slice (a slice's y, or dx, depends on its own
// images alone; the forward pass's bias is broadcast into the whole y
// first and every slice adds to it, beta = 1), grad_weight accumulating
// into dw with beta = 1 after the first slice (in the output's dtype: a
// 16-bit dw is rounded once per slice, where the unsplit call rounds
// once). Every slice but the last holds the same number of images; the
// last holds the rest.
//
// The plans, algorithms and workspace are the slices' own: the timed
// search times the full slice's shape (at most) and declares, at each
// chunk size, the chosen algorithm's largest workspace over the two slice
// shapes (convfind.go); cuDNN's heuristics rank algorithms on the slices'
// descriptors within the node's block. A convolution one image (or whose
// weight) the descriptors cannot take runs on the im2col kernels (NCHW),
// whose index arithmetic is 64-bit where it must be; a channels-last one
// on NCHW copies (convnchw.go).
//
// cuDNN's batch norm (dnn_bn.go) is left to batchnorm.cu's kernels beyond
// the same limit.

// cudnnMaxElems is the most elements a cuDNN tensor descriptor describes
// (2³¹ − 1). Tests lower it (SetCuDNNMaxElems in export_test.go) so that
// small convolutions run in several slices.
var cudnnMaxElems atomic.Int64

func init() { cudnnMaxElems.Store(math.MaxInt32) }

// convSlice is how many images of key's batch one cuDNN call takes: the
// whole batch when the descriptors describe x, y and w whole; else the
// largest count whose x and y they describe, made a multiple of what
// starts every slice's operands on a 16-byte boundary (cuDNN's
// tensor-core kernels want aligned operands; at most 16 images); 0 when
// not one image (or the weight, or no image at all) can be described.
func convSlice(key convKey) int64 {
	lim := cudnnMaxElems.Load()
	n := key.x[0]
	xi, yi := key.x[1]*key.x[2]*key.x[3], key.y[1]*key.y[2]*key.y[3]
	img := max(xi, yi)
	if n < 1 || img < 1 || img > lim || key.w[0]*key.w[1]*key.w[2]*key.w[3] > lim {
		return 0
	}
	s := lim / img
	if n <= s {
		return n
	}
	size := elemSize(key.dt)
	m := lcm(16/gcd(16, xi*size), 16/gcd(16, yi*size))
	return s - s%m
}

// sliceKey is key over m of its images.
func sliceKey(key convKey, m int64) convKey {
	key.x[0], key.y[0] = m, m
	return key
}

// sliceSizes are the slice sizes a convolution of n images in slices of s
// runs: s, and the rest when there is one.
func sliceSizes(n, s int64) []int64 {
	if r := n % s; r > 0 && n > s {
		return []int64{s, r}
	}
	return []int64{min(n, s)}
}

func gcd(a, b int64) int64 {
	for b != 0 {
		a, b = b, a%b
	}
	return a
}

func lcm(a, b int64) int64 { return a / gcd(a, b) * b }

// errTooLarge is the error for a convolution the descriptors cannot take
// even one image of.
func errTooLarge(key convKey) error {
	return graph.Errorf(graph.ErrShape, "conv2d %s of input %v, weight %v, output %v: an image or the weight beyond cuDNN's %d-element descriptors",
		key.pass, key.x, key.w, key.y, cudnnMaxElems.Load())
}
