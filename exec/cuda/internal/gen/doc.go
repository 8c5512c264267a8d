// Command gen writes kernels/opcodes.cuh from the op codes declared in exec/cuda's family files (cuda.OpcodeHeader). It is
// run by go generate in exec/cuda (see kernels.go), from that directory.
package main
