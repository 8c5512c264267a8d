// Package cpu is batchfit's CPU executor, the default where there is no
// GPU: it evaluates every op of the graph on the CPU in float32 (int64 for
// indices) with gonum's BLAS for matrix products and convolutions (as GEMM
// over unfolded patches). gonum skips a product term whose factor is zero;
// a GEMM whose operands hold a NaN or an infinity (a cheap scan finds
// them) computes the entries they reach with every term, so 0·NaN is NaN
// here as on CUDA.
//
// It and the CUDA executor are both checked against the float64 reference
// interpreter (internal/ref) by the conformance suite; CUDA's elementwise
// kernels are also compared with this executor bit for bit where both
// compute the same IEEE operations. Kernels favour plain, obviously correct
// loops with float64 accumulation in reductions; only matmul, linear and
// conv go through BLAS.
//
// Kernels sit in a table indexed by op (kernels.go), each entry in the
// file of its family (elementwise.go, matmul.go, reduce.go, normalize.go,
// movement.go, index.go, conv.go with convgrad.go, pool.go, loss.go) with
// its workspace rule; eval, the host side's one call, looks a node up
// there, Workspace reads the rules from it, and a test fails when an op
// has no kernel.
//
// Every kernel writes into an output buffer allocated before it runs, sized
// from the node's type at the running batch size, and buffers are dropped
// after their last consumer, mirroring the program the planner replays.
//
// With exec.Options.Resident, parameters, constants and the optimizer
// state's accounting stay allocated across calls, keyed by their data.
// Yield frees those blocks and empties the allocator's cache (the values
// are host memory already) and Restore allocates them again; this is the
// exec.Yielder contract the CUDA executor implements with real copies.
package cpu
