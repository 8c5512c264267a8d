// Package optim holds the optimizers: SGD (momentum, Nesterov, weight decay),
// Adam and AdamW, following PyTorch's update rules.
//
// An optimizer owns its state (moment buffers, step count). Its state is
// StateSlots() parameter-sized float32 tensors per parameter, created on the
// first step; planners count it as fixed memory from the very first plan,
// since the first step needs it before anything else is freed.
//
// Users pick an optimizer and hand it to batchfit.Session.Step with
// nn.ParamTensors(model); Step builds the Param views (a parameter's
// values, gradient and the key its state is kept under) and calls Step
// itself, or on CUDA runs SGD and Adam on the device. Param is what an
// optimizer written from scratch, or a caller of Step by hand, works with.
//
// Updates run in float64 per element and are written back as float32, on
// parameter slices the executor owns.
package optim
