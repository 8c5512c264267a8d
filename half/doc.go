// Package half converts between float32 and the two 16-bit floating-point
// formats batchfit stores: bfloat16 (8 exponent bits, 7 mantissa bits, the
// upper half of a float32) and IEEE 754 binary16 (5 exponent bits, 10
// mantissa bits).
//
// Conversions from float32 round to nearest, ties to even, as CUDA's
// __float2bfloat16_rn and __float2half_rn do, so the CPU executor rounds
// where the kernels round. Overflow gives ±Inf; NaN stays NaN (quiet, sign
// kept); binary16 subnormals are produced and read exactly. Conversions to
// float32 are exact.
//
// A 16-bit value travels as its bits in a uint16. gorgonia.org/tensor has
// no 16-bit float type, so host data enters and leaves batchfit as float32
// tensors and is converted at the device boundary with the slice helpers
// here.
package half
