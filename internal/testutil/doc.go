// Package testutil holds the test scaffolding that the tests of two or
// more packages share, so that it is written once: Go does not let one
// package's tests import another package's _test.go helpers, which is why
// copies of these used to exist.
//
// What lives here:
//   - the fit fixture (fit.go): TrainModel and the model builders
//     (MLPModel, GPTModel, ConvModel), the random data they draw
//     (RandFloats, UniformF32, Classes), StepProgram, which compiles a
//     training step as batchfit.Session.Step does, and TightBudgets and
//     Counts, which find the budgets at which the planner picks each chunk
//     count;
//   - small readers of results, Float32s and Bits, and SkipWithoutGPU,
//     the one rule for GPU tests on a machine without a GPU (results.go).
//   - graph builders: Chain, the Linear/Add/Relu chain the planner's and
//     shape inference's benchmarks time, and ParamNames (graphs.go).
//
// The rule: only scaffolding used by the tests of two or more packages
// comes here; a helper one package's tests use stays in its _test.go
// files. The package is imported by tests only. It must not import
// exec/cuda or the root package batchfit (their tests import it, and it
// would make a cycle): what depends on an executor, as the workspace rule
// of StepProgram or the no-GPU error of SkipWithoutGPU, is passed in.
package testutil
