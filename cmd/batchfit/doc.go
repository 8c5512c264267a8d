// Command batchfit plans the memory of a training step without a GPU.
//
//	batchfit estimate --model gpt2-small --batch 32 --seq 1024 --budget 24GiB --optimizer adamw
//	batchfit models
//
// estimate builds a model of the zoo shape-only (nn.Options{ShapeOnly:
// true} over lazy.Placeholder inputs, so nothing is allocated), appends the
// loss and the backward pass, compiles the step with the optimizer's state
// and the CPU executor's declared workspaces, and asks the planner for the
// largest balanced chunk whose replay through the caching allocator fits
// the budget. It prints the parameter and optimizer-state bytes, whether
// the whole batch fits, the chunks, the predicted peak reserved and
// allocated bytes, the affine fit fixed + per-sample·chunk, and on request
// the per-op timeline of the first chunk (--table), the largest buffers
// (--top N) or all of it as JSON (--json).
//
// Exit codes: 0 when the step fits (in one chunk or several), 1 when it
// does not fit even one sample at a time (the planner's message names the
// largest buffers), 2 for a usage mistake.
package main
