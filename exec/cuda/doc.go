// Package cuda is batchfit's CUDA backend: the driver API, NVRTC and cuBLAS
// called from pure Go through purego, so that CGO_ENABLED=0 builds.
//
// The rules:
//   - No library is opened in init(). Open dlopens libcuda.so.1 on first use
//     and returns an error wrapping ErrNoGPU when it is missing, cuInit fails
//     or there is no device, so CPU-only machines import the package and
//     pass every test. NVRTC and cuBLAS are opened when first needed.
//   - A CUDA context is current per OS thread. Each Device owns one
//     goroutine locked to its OS thread with the device's primary context
//     current, and every driver and cuBLAS call runs there.
//   - Every byte of device memory goes through the caching allocator in
//     package alloc: Backend serves it segments, and cuBLAS takes its
//     workspace from it (cublasSetWorkspace_v2), so the planner's replay of
//     the same allocator predicts what the executor reserves. cuBLASLt,
//     for GEMMs with fused epilogues (a linear's bias, a tanh GELU with
//     its input kept, GELU's derivative: cublaslt.go), runs with that same
//     workspace on the same stream; each shape's algorithm is timed once
//     per process among the heuristic's first eight.
//   - cuDNN 9, when it loads, runs convolutions, batch norm and 16-bit fused
//     attention (dnn.go, dnn_bn.go, dnn_sdpa.go: the legacy API, and the
//     backend graph API for attention), each workspace declared per node
//     and carved from the allocator, the handle's own memory measured once
//     as overhead; what cuDNN refuses runs on the kernels, counted. A
//     convolution with tensors of 2³¹ or more elements, beyond the
//     descriptors' int32 sizes, runs on cuDNN in slices along N
//     (convsplit.go); such a batch norm runs on the kernels.
//   - Plain float32 convolution algorithms (all with
//     ExecutorOptions.ConvSearchAll) are chosen at compile time by a timed search
//     (convfind.go: cuDNN's algorithms and the im2col path, timed on
//     memory of the search's own allocator, the results cached on disk
//     beside the cubins, algocache.go), and the executor's Workspace
//     declares the chosen one's exact workspace; the package's Workspace
//     keeps the static formula and cuDNN's heuristics
//     (ExecutorOptions.ConvHeuristics).
//   - Channels-last nodes (graph.Attrs.ChannelsLast, package layout):
//     convolutions on cuDNN's NHWC descriptors with KRSC weights, or where
//     cuDNN refuses one (or is absent) as its NCHW twin on transposed
//     copies in its workspace (convnchw.go); batch norm and pooling on
//     their own channels-last kernels.
//   - Kernels are CUDA C sources embedded in the binary (kernels/*.cu),
//     compiled by NVRTC for the device's sm_XY and cached on disk as cubins.
//
// Executor runs planner programs on a device, as exec/cpu's executor does on
// the host: Execute walks the same planner.Replay the planner simulates,
// with hooks that upload parameters and each chunk's input rows (large
// ones through two pinned buffers, staging.go, the DMA of one piece beside
// the host's copy of the next), launch
// each op's kernels (kernels/README.md) or cuBLAS GEMMs, add kept outputs
// into their accumulators on the device, download and combine the other
// outputs on the host, and run SGD or Adam on the device. Workspace
// declares every kernel's scratch memory to the planner, so a plan's peaks
// are the peaks Execute measures (plus Overhead, the cuBLAS workspace's
// segment). A whole step runs in one call on the device thread, the
// caller's own with the context made current there: do, called there,
// runs its function at once, so the allocator's backend, copies and
// launches need no hop each. A resident step returns once its host
// outputs are read, its last kernels still queued (readback.go).
//
// Unless ExecutorOptions.NoCUDAGraphs, the launches between two host steps
// (uploads, downloads, nodes that read a device flag on the host, the
// chunk's and the step's end) are captured as a CUDA graph the second time
// they come, and replayed with cuGraphLaunch on stream 0 while the
// program's signature, the chunk and every block address the launches use
// stay the same; anything else gets a new capture. Graphs hold no
// allocator memory; the driver's own for their instantiation, measured, is
// part of Reserve (graphs.go).
//
// Kernels are organised by family, mirroring kernels/*.cu: launch.go holds
// the launch context (kctx: device, kernels, cuBLAS, the node, its chunk
// and workspace, and nothing else of the executor) with the launch
// primitives; elementwise.go, matmul.go, reduce.go, norm.go, movement.go,
// conv.go, attention.go, attention_qkv.go (attention reading q, k, v in
// place from a packed projection) and loss.go each hold their ops' entries of the kernel table
// (table.go), their launches and their workspace rules; optimizer.go holds
// the SGD and Adam launches (multi-tensor kernels: one launch per 64
// parameters, reading each step's learning rates, bias corrections and
// clip factor from device scalars, replayed as one CUDA graph), the
// gradient norm of clipping, the optimizers' ownership of their state
// buffers, and loss scaling's unscale.
// The host side reaches the kernels through runner.eval, one table lookup
// per node; Workspace is derived from the same table. A test ranges over
// every op and fails when one has no kernel.
//
// The op codes the kernels switch on are declared once, in the family
// files beside their launches (an opcode.Enum per kernel family); go
// generate writes them into kernels/opcodes.cuh (internal/gen,
// OpcodeHeader), and a test fails when that file drifts from them.
//
// C status codes become typed errors: *CUDAError (CUresult), *NVRTCError
// and *CUBLASError carry the function, the code and its name. An
// out-of-memory CUresult also matches alloc.ErrDeviceOOM, which is what lets
// the caching allocator release its cache and retry.
package cuda
