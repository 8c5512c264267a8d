// Package compile is batchfit's pass pipeline: the one ordered table of
// the graph passes that turn a forward graph into the step that is
// planned and run, each a named entry with its preconditions, and the
// entry points that run it. A Session's Step, Plan, Eval and PlanEval
// (and so MaxBatch and the CLI's estimate, which plan through a Session)
// build every step here, so what is planned is what runs, and the order
// of the passes is written in one place.
//
// The pipeline, in order (Passes; docs/ARCHITECTURE.md shows the same
// table, and a test holds the two alike):
//
//   - offload-params (forward; training and evaluation,
//     Options.OffloadParams): float32 parameters held in bfloat16, an
//     offloaded optimizer's device copies.
//   - fuse-attention-qkv (forward; training, mixed policy): attention
//     over q, k and v sliced from one projection, or from linears of one
//     input (packed into one linear), q and k rotated by one table
//     (rotary ops, or rotary written out), is one attention_qkv that
//     reads them in place (graph.FuseAttentionQKV).
//   - autocast (forward; training and evaluation, mixed policy): the
//     policy's dtypes, autocast's semantics (precision.Apply).
//   - channels-last (forward; training, Options.ChannelsLast): conv nets'
//     activations NHWC (layout.ChannelsLast).
//   - fuse-linear-cross-entropy (forward; training, always):
//     graph.FuseLinearCrossEntropy, the head and loss over token chunks
//     (Options.LossChunk tokens each).
//   - loss-scale (backward; training, Options.LossScale): the scaled loss
//     the backward pass starts from (precision.Step.ScaleLoss).
//   - autodiff (backward; training, always, required): the gradients
//     (autodiff.Backward).
//   - fold-casts (backward; training, mixed policy): widening casts
//     folded into the matmuls they read (precision.Step.FoldWideningCasts).
//   - fuse-gelu-grad (backward; training, mixed policy):
//     graph.FuseGeluGrad.
//   - fuse-layer-norm-grad-add (backward; training, a rewritten step):
//     graph.FuseLayerNormGradAdd.
//   - fuse-embedding-grad-add (backward; training, always):
//     graph.FuseEmbeddingGradAdd, a tied embedding's gradient added in
//     its scatter.
//   - fuse-pointwise (backward; training, always): graph.FusePointwise,
//     chains of elementwise ops as one generated kernel each.
//   - recompute (program; training, a recompute set chosen when the step
//     is planned): recompute.Apply, run by the Session at its budget
//     through RunRecompute.
//
// Train runs the training entries of the forward and backward stages,
// Eval the evaluation ones; each returns a Report per entry, in table
// order: whether the pass ran, and why not (the wrong mode, its
// precondition, Options.Disable), the node count before and after, and
// the bytes the pass saved, measured with shapeinfer at the graph's full
// batch (the sum of the values the outputs need, and their live peak in
// node order, before the allocator's rounding). A Session's
// StepPlan.Passes is these reports with the recompute pass's after them,
// and `batchfit estimate --passes` prints them.
//
// Preconditions are code (Pass.Applies, a Condition per entry) and words
// (Condition.Text, in the docs and in skip reasons). No pass depends on
// the device: what a device changes (workspaces, kernels) is the
// planner's and the executors'. Options.Disable leaves passes out by name;
// a name that is no pass is a *PassNameError wrapping ErrUnknownPass, and
// autodiff, which a training step cannot do without, ErrRequiredPass.
//
// A plain step (Options.Plain: fp32 or tf32 in NCHW, as a Session's
// steps set it) is the backward pass appended to a copy of the forward
// graph, with no backward fusion; without Plain, layer-norm gradients
// fuse under every policy.
//
// Adding a pass is one entry in the table (passes.go): a forward-graph
// rewrite func(*graph.Graph) (*graph.Graph, []int, error) wrapped in
// forward, before loss-scale; a rewrite of the training graph that keeps
// the step's outputs, func(*graph.Graph, []int) (*graph.Graph, []int,
// error), wrapped in backward, after autodiff; with its modes and
// precondition. Every caller then runs it, and reports it.
package compile
