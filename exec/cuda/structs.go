package cuda

// Go mirrors of the structs the kernels take by value (kernels/common.cuh):
// every field is an int64, so the layouts have no padding and match the C
// structs byte for byte. Launch passes them as kernel arguments. Unused
// trailing axes have shape 1 and stride 0.

// MaxDims is the most axes a Strided, Strided2 or ReduceGeom describes.
const MaxDims = 8

// Strided is common.cuh's Strided (136 bytes): the element at row-major
// position i of Shape[:Rank] lies at Σ idx_d·Stride_d of the source.
type Strided struct {
	Rank          int64
	Shape, Stride [MaxDims]int64
}

// Strided2 is common.cuh's Strided2 (200 bytes): Strided for two operands
// read at the same position.
type Strided2 struct {
	Rank          int64
	Shape, SA, SB [MaxDims]int64
}

// ReduceGeom is common.cuh's ReduceGeom (272 bytes): a reduction's kept and
// reduced axes with the input's strides.
type ReduceGeom struct {
	KeptRank              int64
	KeptShape, KeptStride [MaxDims]int64
	RedRank               int64
	RedShape, RedStride   [MaxDims]int64
}

// Window is common.cuh's Window (112 bytes): a 2-D convolution or pooling
// over N images of C channels of H×W, a KH×KW kernel with stride, zero
// padding and dilation, and the HO×WO output.
type Window struct {
	N, C, H, W int64
	KH, KW     int64
	SH, SW     int64
	PH, PW     int64
	DH, DW     int64
	HO, WO     int64
}
