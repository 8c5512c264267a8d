// Package planner turns a graph into the program the executor follows and
// picks the largest batch chunk whose replay of that program fits a memory
// budget.
//
// The invariant (docs/ARCHITECTURE.md): prediction and execution share one schedule
// and one allocator. Compile lists the steps (allocate a node's output and
// workspace, run it, free the workspace and every buffer whose last consumer
// it was); Replay walks them through an alloc.Allocator. Plan calls Replay on
// a simulated device, executors call the very same Replay with hooks that
// run kernels, so the planned peak reserved bytes are the executor's,
// rounding, segment sizes and splits included.
//
// Memory outside the chunk loop: persistent buffers, which outlive a step
// (parameters and constants, and optimizer state: StateSlots
// parameter-sized tensors per trained parameter, present from the first
// step), then, when a batch runs in more than one chunk, one gradient
// accumulator per kept output for the step. They are allocated first, in a
// fixed order, before any chunk runs.
//
// A reshape is a view: it shares its input's buffer.
//
// Plan bisects the chunk size with full replays, starting from the affine
// model bytes(B) = fixed + perSample·B, and returns balanced chunks: a
// batch of 100 with room for 30 runs as 25, 25, 25, 25. A Split describes
// them in constant memory, and replays without hooks run each distinct
// chunk size until the allocator's state repeats, so planning a batch of
// 10⁹ takes a few dozen replays of a few chunks each, and no memory per
// chunk.
package planner
