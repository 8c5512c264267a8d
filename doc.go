// Package batchfit is the front door: a Session that runs training steps and
// evaluations of graphs built with package lazy.
//
//	model := nn.MLP(nn.Seed(1), []int{784, 512, 10}, nn.ReLU{})
//	sess := batchfit.NewSession(batchfit.Options{})
//	defer sess.Close()
//	opt := optim.NewAdam(1e-3)
//	for step := range steps {
//		x := lazy.Wrap(images, 0) // axis 0 of images is the batch
//		loss := model.Forward(x).CrossEntropy(x.Graph().Wrap(labels, 0), lazy.Mean)
//		l, err := sess.Step(ctx, loss, nn.ParamTensors(model), opt)
//		…
//	}
//
// Parameters: an nn module holds nn.Param values (a name and a lazy
// tensor over a host tensor); nn.ParamTensors(model) lists those tensors,
// which is what Step trains. optim.Param is the optimizer's view of one
// (its values, gradient and state) that Step builds; only an optimizer
// written from scratch sees it.
//
// The graph is rebuilt every step, as in eager frameworks, but everything
// derivable from its signature (shapes, liveness, byte counts) is computed
// once and cached. Parameters persist in the executor across steps, and the
// optimizer's state with them.
//
// A session runs on CUDA when a GPU is usable and on the CPU reference
// executor otherwise (Options.Device forces one); Device says which and
// why. On CUDA, SGD and Adam update parameters on the device, which holds
// their current values: the parameters' host tensors are brought up to date
// only by SyncParams (and Close), as a PyTorch model's are by .cpu().
//
// Options.Budget caps what a session may hold (ParseSize reads "24GiB");
// a batch that does not fit runs in chunks whose gradients add up to the
// whole batch's. docs/training.md is the guide.
//
// Between steps a session can lend its device memory to another job:
// Yield frees the parameters' and optimizer state's device blocks and
// empties the cache (reserved bytes drop to zero, or on CUDA to the cuBLAS
// workspace's segment, Overhead); Restore, or simply the
// next Step or Eval, takes them back, and training continues bit for bit
// as if nothing had happened.
package batchfit
