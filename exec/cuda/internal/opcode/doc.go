// Package opcode declares the op codes the CUDA kernels switch on, once:
// exec/cuda passes them to the kernels, and the generator (../gen, run by
// go generate in exec/cuda) writes them into kernels/opcodes.cuh as C enums.
// A test in exec/cuda fails when that file drifts from this table.
package opcode
