// Package models is batchfit's model zoo: reference architectures built from
// package nn, shared by the examples, the CLI's dry runs and the benchmarks.
//
//   - GPT: a GPT-2-style decoder (token and position embeddings, pre-norm
//     blocks of causal self-attention and a GELU MLP, tied output head),
//     with GPT-2 small's configuration in GPT2Small.
//   - ConvNet: a small CIFAR-shaped convolutional classifier.
//
// Parameter names follow the PyTorch/Hugging Face layouts ("h.3.attn.c_attn.weight")
// so memory reports read the way their users expect. With nn.Options{ShapeOnly:
// true} a model has shapes but no data, for dry runs of models that would not
// fit in host memory.
package models
