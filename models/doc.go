// Package models is batchfit's model zoo: reference architectures built from
// package nn, shared by the examples, the CLI's dry runs and the benchmarks.
//
//   - GPT: a GPT-2-style decoder (token and position embeddings, pre-norm
//     blocks of causal self-attention and a GELU MLP, tied output head),
//     with GPT-2 small's configuration in GPT2Small.
//   - ConvNet: a small CIFAR-shaped convolutional classifier.
//   - ResNet: torchvision's ResNet-18/34/50/101/152 (BasicBlock or
//     Bottleneck v1.5, batch norm, projection shortcuts), with a CIFAR stem
//     as an option; ResNet18, ResNet50 and ResNet18CIFAR configure it.
//   - Llama: Hugging Face's LlamaForCausalLM (RMS norms, rotary embeddings
//     with default, linear or llama3 scaling, grouped-query attention,
//     SwiGLU, a tied or separate head, Qwen2's q/k/v biases), sized by a
//     LlamaConfig (Llama32_1B, Llama3_8B, LlamaTiny); CausalLMLoss is its
//     labels= loss.
//
// Parameter names follow the PyTorch/Hugging Face/torchvision layouts
// ("h.3.attn.c_attn.weight", "layer2.0.downsample.0.weight",
// "model.layers.0.self_attn.q_proj.weight") so memory
// reports read the way their users expect. With nn.Options{ShapeOnly: true}
// a model has shapes but no data, for dry runs of models that would not fit
// in host memory.
package models
