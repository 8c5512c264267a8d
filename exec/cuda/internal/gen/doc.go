// Command gen writes kernels/opcodes.cuh from package opcode's table. It is
// run by go generate in exec/cuda (see kernels.go), from that directory.
package main
