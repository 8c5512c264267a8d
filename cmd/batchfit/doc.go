// Command batchfit plans the memory of a training step without a GPU.
//
//	batchfit estimate --model gpt2-small --batch 32 --seq 1024 --budget 24GiB --optimizer adamw
//	batchfit estimate --hf-config Llama-3.2-1B/config.json --batch 4 --seq 2048 --gpu h100-80gb --precision bf16-mixed
//	batchfit snapshot --model gpt-tiny --batch 8 --budget 1GiB -o gpt-tiny.pickle
//	batchfit snapshot --model gpt2-small-written --batch 8 --budget 8GiB -o gpt2.html
//	batchfit report --model mlp --batch 2048 --budget 26MiB --profile --run
//	batchfit report gpt-tiny.pickle
//	batchfit report gpt-tiny.pickle -o gpt-tiny.html
//	batchfit compare before.pickle after.pickle
//	batchfit models
//	batchfit launch -n 2 -- ./train --steps 100
//
// estimate builds a model of the zoo (or the one a Hugging Face
// config.json describes, --hf-config: Llama, Mistral, Qwen2 or GPT-2, as
// hf.ReadConfig reads it) shape-only (nn.Options{ShapeOnly:
// true} over lazy.Placeholder inputs, so nothing is allocated), appends the
// loss and the backward pass, compiles the step with the optimizer's state
// and the CPU executor's declared workspaces, and asks the planner for the
// largest balanced chunk whose replay through the caching allocator fits
// the budget. With --gpu CARD or --gpu-memory SIZE instead of --budget it
// plans as a CUDA session on that card would: the card's total less the
// CUDA context and libraries and the cuBLAS workspace, with the CUDA
// executor's workspaces. It prints the parameter and optimizer-state bytes, whether
// the whole batch fits, the chunks, the predicted peak reserved and
// allocated bytes, the affine fit fixed + per-sample·chunk, and on request
// the per-op timeline of the first chunk (--table), the largest buffers
// (--top N) or all of it as JSON (--json). --micro-batch N caps the chunk
// at N samples (batchfit.Options.MaxChunk), for a fixed gradient
// accumulation micro-batch. A step that cannot run in
// chunks, as the ResNets' in training mode (their batch norms normalise
// with the batch's statistics; --mode infer uses the running ones), runs
// its batch whole: estimate names the node that prevents chunking and,
// when the whole batch does not fit, bisects for the largest batch that
// does.
//
// snapshot, report and compare explain memory with package memviz.
// snapshot writes the allocator state of the planned step (replayed on the
// simulated device) at its predicted peak or after it, as a memory_viz
// pickle, a pprof profile or folded stacks (told by -o FILE's ending, an
// unknown one refused), or (-o FILE.html) as
// memviz.WriteHTML's offline report page: timeline, live tensors, segments
// at the peak and the plan, in one file that fetches nothing (--run draws
// the step measured on the CPU executor over it). report lists the live tensors
// there, named, with totals that itemise the allocated bytes; --profile
// adds the per-op profile and --run measures it on the CPU executor. report
// FILE lists a pickle's blocks, and report FILE -o PAGE.html draws the
// pickle's trace, live blocks and segments as such a page. compare reads two snapshot files (the
// format from their content, else their name) and lists the segments only
// in one of two pickles, or the bytes under each stack that changed.
//
// launch starts N processes of a program on this machine with torchrun's
// variables (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and
// one GPU each (CUDA_VISIBLE_DEVICES), for data-parallel training with
// package dist; it prefixes their output with their rank, stops the
// others when one fails and exits with the first failure's code.
//
// Exit codes: 0 when the step fits (in one chunk or several) and the files
// were read and written, 1 when it does not fit even one sample at a time,
// or the whole batch of a step that cannot run in chunks does not fit
// (the planner's message names the largest buffers), the model does not
// build (a batch too large for the graph's tensors), or a file could not
// be read or written (unreadable, not a snapshot, truncated, past the
// readers' caps on size and work, or -o a directory: one line names the
// file and the reason), 2 for a usage mistake (one line naming it, one
// saying where the flags are). docs/cli.md describes every subcommand and
// flag; a test holds it to the flag definitions.
package main
