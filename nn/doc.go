// Package nn builds models from modules whose parameters have stable dotted
// names, on top of package lazy.
//
//	opt := nn.Seed(1)                                  // or nn.Options{ShapeOnly: true}
//	mlp := nn.MLP(opt, []int{784, 512, 512, 10}, nn.ReLU{})
//	logits := mlp.Forward(lazy.Wrap(images, 0))
//	for _, p := range mlp.Params() { fmt.Println(p.Name()) } // 0.weight 0.bias 2.weight …
//
// Parameters come in one kind a user handles, seen from two sides: a
// module's *Param is a name and a lazy tensor over the values (Value, a
// host tensor); nn.ParamTensors(m) lists those lazy tensors, which graphs
// read and batchfit.Session.Step trains. optim.Param is not a third kind to
// manage: it is the optimizer's view of one parameter during an update
// (values, gradient, key of its state), built by the executor; only code
// that implements or calls an optim.Optimizer by hand meets it.
//
// Rules:
//   - A Module turns one lazy tensor into another and lists its parameters,
//     its own first, then its children's, in a stable order. Names are
//     PyTorch's state_dict keys: a container prefixes each child's names with
//     the child's name when the child is added ("layers.3.bias"), so build
//     bottom-up and give each module one parent.
//   - Containers run a child under the child's name as graph scope, so every
//     node (parameters included) records its module path in graph.Node.Scope.
//   - Initial values are drawn from Options.Rand in construction order: one
//     seed gives bit-identical parameters. Defaults follow PyTorch (Linear and
//     Conv2d: uniform in ±1/√fan_in; Embedding: N(0, 1); LayerNorm: ones and
//     zeros). Options.ShapeOnly makes shape-only parameters (lazy.ParamSpec)
//     for dry runs of models too big to allocate.
//   - Bad sizes or options never panic: the module keeps a typed error
//     (wrapping graph's sentinels) that Check reports and Forward returns as
//     the output tensor's sticky error.
//   - BatchNorm2d keeps its running statistics as buffers outside Params
//     (Buffers lists them under their state_dict keys), and graphs have no
//     side effects: a training-mode Forward leaves them
//     alone, and BatchStats plus UpdateRunning apply PyTorch's momentum
//     update as an explicit step. With PerChunkStats (Options.PerChunkStats
//     for every layer of a model) the layer opts in to per-chunk batch
//     statistics: a batch the planner splits is normalised chunk by chunk,
//     as gradient accumulation normalises micro-batches, so the model
//     trains at any batch under a budget; the training step then updates
//     the running statistics itself, once, with the whole batch's mean and
//     unbiased variance merged exactly from the chunks' (lazy.Graph.OnStep).
//   - Dropout is the identity in evaluation mode; in training mode each
//     Forward draws a fresh counter-based mask, identical across the
//     chunks of one step. SetTraining switches every Dropout and
//     BatchNorm2d of a model at once, like PyTorch's train() and eval().
//   - LoRA.Apply adapts a model's linear layers by name with low-rank
//     adapters (LoRALinear, named as PEFT names them) and freezes the rest,
//     linear weights and embeddings in 16 bits; MergeLoRA folds trained
//     adapters into the weights for export.
package nn
