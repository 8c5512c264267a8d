// Package exec is the seam between a Session and its executors, and the
// host side they share. An Executor runs compiled programs (planner.Replay
// with hooks that compute) through its caching allocator; exec/cpu is the
// reference implementation and the default where there is no GPU, and
// exec/cuda runs on a CUDA device. Each supplies device memory and
// kernels; this package holds the rest once: the options and results of a
// run, the residents kept across runs (Residents: keys, Yield and Restore,
// the release of constants no run reads any more), reading source data
// (FromTensor, ChunkOf) and combining chunk outputs (Call.ChunkDone,
// Combine: concatenated, summed, maxed, or per-channel statistics merged
// exactly, MergeMoments).
package exec
