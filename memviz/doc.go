// Package memviz explains batchfit's device memory: which tensors are live,
// what each op of a step allocates, and how snapshots look in the tools
// PyTorch users already know.
//
// Inputs are the things batchfit already has: a compiled planner.Program,
// an allocator snapshot (alloc.Allocator.Snapshot, wrapped per device as a
// Snapshot), and planner timelines (planner.Replay with record, a Plan's
// Timeline, cpu.ExecOptions.Timeline).
//
//   - NewReport lists live tensors per device: parameters by their nn
//     names, gradients as "<param>.grad", optimizer state as
//     "<param>.exp_avg"/"exp_avg_sq" (Adam) or "<param>.momentum_buffer"
//     (SGD), activations by module path and op, with shape, dtype, and
//     requested and rounded bytes. Its totals add up exactly:
//     tensors + rounding to 512 B + workspace + blocks with no known owner
//     = the allocator's allocated bytes. As text, CSV or JSON.
//   - NewProfile gives, per node in program order, the bytes it allocated
//     and freed, the live bytes after it and the peak active and reserved
//     bytes during it, predicted and (when a measured timeline is given)
//     measured; as text, CSV or JSON. Simulate makes the predicted
//     timeline and the snapshots at the predicted peak and after the step.
//   - WritePprof, WriteFolded and WritePickle export a snapshot: a pprof
//     profile (go tool pprof -top, -http flame graphs), folded stacks
//     (flamegraph.pl, speedscope), and the pickle torch.cuda.memory
//     ._snapshot() returns (pytorch.org/memory_viz). Stacks are the module
//     path split on "." with the op as the leaf.
//   - WriteHTML draws a step as one self-contained HTML page that opens
//     from disk and fetches nothing (no URL in the file): the allocated
//     bytes over the program stacked by kind, with the reserved bytes,
//     chunks, budget and the peak (and a measured timeline overlaid); the
//     live tensors at any point as a treemap by kind and module path; the
//     segment map at the peak; the plan and its largest buffers. Names are
//     carried as escaped JSON and shown as text, never as markup. Past
//     DefaultMaxPoints points runs of points merge into their most
//     allocated one. In headless Chromium on two shared cores GPT-2
//     small's page (batch 8 in 3 chunks, 6,586 points) is 418 KiB and
//     first paints, whole, in 230–330 ms; the ConvNet's (batch 256 in 2
//     chunks) is 43 KiB and paints in 140–260 ms. WriteHTMLSnapshot draws
//     a snapshot read from a file the same way, over its allocator trace.
//   - ReadPickle, ReadFolded and ReadPprof load them back; Compare lists
//     the segments only before and only after, as _memory_viz.compare does.
//
// Rules: blocks are matched to program buffers through their allocator tags
// (node, op, module path), never through addresses; a block no buffer
// explains is reported, not dropped. Readers never panic on bad input: they
// return a *FormatError wrapping ErrFormat (and io.ErrUnexpectedEOF when
// the input ends early); a snapshot whose blocks do not tile their segments
// is refused with ErrSnapshot. Readers bound their time and memory by a
// stated multiple of their input, and refuse what would pass it with
// ErrTooLarge (as well as ErrFormat): every input at most 1 GiB; a pickle
// at most one segment, block or trace entry per 4 bytes, counting memo
// references each time they repeat one, and 2²⁰ in all, with its decoded
// values (tuples, memo entries, marks: each one-byte opcode's) within
// 256 MiB; a pprof profile decompressed to at most 16 times its size and
// 128 MiB, one record per 8 of those bytes and 2²⁰ in all, and stacks of
// at most 64 bytes of frame names per byte; folded stacks in lines of at
// most 1 MiB; at most 2¹⁹ distinct stacks of 2²² frames. Besides the
// linear bounds, these absolute caps keep a command that reads a file, or
// compares two, within about a gigabyte whatever the file. ReadPickle,
// ReadPprof and ReadFolded name the caps; ReadFolded streams its input.
package memviz
