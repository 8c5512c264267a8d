// Package batchfit is the front door: a Session that runs training steps and
// evaluations of graphs built with package lazy.
//
//	sess := batchfit.NewSession(batchfit.Options{})
//	for step := range steps {
//		x := lazy.Wrap(images, 0)
//		loss := model.Forward(x).CrossEntropy(x.Graph().Wrap(labels, 0), graph.ReduceMean)
//		l, err := sess.Step(ctx, loss, model.Parameters(), opt)
//		…
//	}
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
// Between steps a session can lend its device memory to another job:
// Yield frees the parameters' and optimizer state's device blocks and
// empties the cache (reserved bytes drop to zero, or on CUDA to the cuBLAS
// workspace's segment, Overhead); Restore, or simply the
// next Step or Eval, takes them back, and training continues bit for bit
// as if nothing had happened.
package batchfit
