// Package opcode renders the op codes the CUDA kernels switch on as the C
// header kernels/opcodes.cuh. The codes themselves are declared once, in
// exec/cuda's family files beside the launches that pass them (an op's code
// is its position in its family's list); the generator (../gen, run by go
// generate in exec/cuda) writes the header from them, and a test in
// exec/cuda fails when the committed header drifts.
package opcode
