// Package exec runs graphs. An Executor evaluates the nodes of a graph for
// a batch (or a chunk of it) and returns the requested outputs as
// gorgonia.org/tensor values. exec/cpu is the reference implementation and
// the default where there is no GPU.
package exec
