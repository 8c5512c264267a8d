// Package optim holds the optimizers, SGD (momentum, Nesterov, weight
// decay), Adam and AdamW, following PyTorch's update rules, with what a
// training run needs around them: parameter groups, learning-rate
// schedules, global-norm gradient clipping, and per-parameter state that a
// checkpoint can save and restore exactly.
//
// Rules:
//   - State is per parameter, as PyTorch's state[p], kept under the
//     parameter's Param.Key (in a batchfit.Session the parameter's host
//     tensor, lazy.Tensor.Value()): StateSlots() parameter-sized float32
//     tensors (SGD: the momentum buffer; Adam: the first and second
//     moments) and the parameter's own step count (ParamStep). Adam's bias
//     correction uses that count, so a parameter first trained at the
//     optimizer's fifth step gets the update of a first step. Steps() is
//     the optimizer's own step count: the schedule's position.
//   - A checkpoint saves Keys, and for each key ParamStep and State, plus
//     Steps and the hyperparameters (the exported fields and Groups);
//     SetState and SetSteps restore them, and the next step continues bit
//     for bit. Where an executor keeps the state on its device (CUDA), the
//     host copies are current only after a sync
//     (batchfit.Session.SyncState); a restored state is uploaded by the
//     next device step.
//   - Groups (PyTorch's param_groups) give parameters, by key, their own
//     learning rate, weight decay, betas or momentum; a parameter in none
//     follows the optimizer's own fields. AddGroup copies those to start
//     from; SplitDecay and NoDecay pick out what the usual recipe keeps
//     weight decay off: parameters of fewer than two dimensions, biases
//     and norms.
//   - A Schedule sets every group's rate at each step from the group's LR:
//     Constant, Linear (torch's LinearLR: warmups and linear decays),
//     WarmupLinear, Cosine (warmup, cosine and floor: torch's
//     CosineAnnealingLR and SequentialLR, transformers' cosine schedules)
//     and StepDecay (StepLR). They match torch.optim.lr_scheduler and
//     transformers to float64 rounding (testdata/torch_reference.json).
//   - Clip (torch.nn.utils.clip_grad_norm_, norm 2 or ∞) scales every
//     gradient by one factor from their global norm before the update,
//     inside the update: the gradients are not changed. LastGradNorm gives
//     the norm, read from the device only when asked.
//   - Updates run in float64 per element and are written back as float32.
//     A step that fails changes nothing. Executors that run the update on
//     their device (exec/cuda) take a DevicePlan, with every value their
//     kernels read, and CommitDevice it; the arithmetic there is the host's
//     to the bit.
//   - An optimizer is safe for use by several goroutines, but a parameter
//     must be stepped by one at a time (batchfit.Session enforces it: a
//     parameter belongs to the session that first trains it).
//
// Users pick an optimizer and hand it to batchfit.Session.Step with
// nn.ParamTensors(model); Step builds the Param views (a parameter's
// values, gradient and the key its state is kept under) and calls Step
// itself, or on CUDA runs SGD and Adam on the device. Param is what an
// optimizer written from scratch, or a caller of Step by hand, works with.
package optim
