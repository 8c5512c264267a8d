// Package precision is batchfit's mixed-precision policy: a graph pass
// that gives a forward graph the dtypes PyTorch's autocast gives the same
// model, before autodiff appends its backward pass, and the rewrites of a
// training step (Step) that the policy asks for after it. Package compile
// runs them, in the pipeline's order, as its autocast, loss-scale and
// fold-casts passes.
//
// Rules, stated up front:
//   - A Policy is one of fp32 (the default: nothing changes), tf32 (nothing
//     changes in the graph; CUDA runs float32 matrix products on TF32
//     tensor cores), bf16-mixed and fp16-mixed. Parse refuses any other
//     name with an error wrapping ErrUnknown.
//   - Apply rewrites a graph into a new one; ids[i] is old node i's id in
//     the new graph. Sources are copied with their data (shared, not
//     copied); every other node is appended again, with Cast nodes
//     inserted before it as its op's class asks:
//     – GEMM class (matmul, linear, conv2d, attention, whose mask is cast too,
//     attention_qkv):
//     every float input is cast to the policy's 16-bit dtype, so the op
//     computes from 16-bit inputs, accumulates in float32 and stores a
//     16-bit result;
//     – float32 class (softmax, log_softmax, layer_norm, mse, sum, mean,
//     exp, log, pow, pow_scalar, rdiv_scalar): every 16-bit input is cast
//     to float32;
//     – batch_norm reads x as it is and its weight, bias and running
//     statistics in float32 (casting any that are not), computes in
//     float32 and gives x's dtype, as autocast's call of cuDNN's batch
//     norm does: a ResNet's activations stay 16-bit from the stem's
//     convolution to the global pool, with no float32 copy of any;
//     – cross_entropy takes 16-bit logits as they are: it reads them
//     widened, computes in float32 and returns a float32 loss, the values
//     autocast's float32 cross-entropy gives (widening is exact), and its
//     gradient comes back in the logits' dtype, rounded once, as
//     autocast's float32 gradient is rounded by the cast's backward. No
//     float32 copy of the logits or of their gradient exists: for GPT-2
//     small at seq 1024 that is 412 MB a sequence (about 6 bytes per
//     logit) at the step's peak;
//     – concat: inputs of mixed float dtypes are cast to float32 (autocast's
//     promote class);
//     – everything else (elementwise, movement, max, pooling, dropout,
//     embedding) runs in its input's dtype: an elementwise op on a
//     bfloat16 tensor computes a bfloat16 result, and binary ops of two
//     float dtypes promote as PyTorch's do (graph.Promote: bfloat16 ⊕
//     float32 → float32).
//   - Cast cache: a parameter is cast once per step per dtype, however many
//     ops read it (autocast's cast cache, which keeps one copy per weight
//     until the autocast region ends); any other value is cast at each use,
//     as autocast casts activations. The cached copy is one node, so the
//     planner counts its 2 bytes per element once and frees it after its
//     last reader, backward included; its gradient is cast back to float32
//     once (Cast's VJP) and accumulates into the parameter's.
//   - Aligned wide linears: a 16-bit linear with at least 1024 outputs,
//     not a multiple of 8 (GPT-2's tied head, 50,257), has its weight (and
//     bias) padded with zero rows to a multiple of 64 (a concat with a
//     zero fill) and its output sliced back to the real columns. Rows of
//     an odd count of 16-bit values are not whole 16-byte vectors, and
//     cuBLAS runs such products and both their gradients on slow kernels;
//     torch.compile pads them the same way (inductor's pad_mm), llm.c by
//     padding the vocabulary. The real outputs are the same dot products,
//     and the padded rows get zero gradient and are sliced off. The
//     planner counts the padded weight, the wider output and the slice.
//   - Fused padded loss: when nothing but a cross_entropy reads such a
//     linear's output (alone, or through a reshape to [M, V]: the GPT
//     head's models.Loss), the cross_entropy reads the padded logits
//     with Attrs.End = V instead of their slice, so the slice's [M, V]
//     copy and its gradient's scatter into zeros never run; the padded
//     columns take no part in the loss and get zero gradient, as the
//     slice's gradient gave them. The slice stays in the graph, read by
//     nothing, so Apply's ids keep naming values of their original
//     shapes (an Eval of the logits runs it).
//   - 16-bit layer norms (off by default: no faster measured, and a
//     higher peak reserved at most batches; see foldNorms): a layer norm
//     that only GEMM-class ops read (each of which would read a 16-bit
//     cast of it: GPT's ln_1, ln_2 and ln_f before their linears), when
//     on, gets a twin that writes the 16-bit dtype
//     itself (graph.OpLayerNorm's Attrs.Target; float32 x, weight and bias
//     in, rounded once where the cast rounded), and the GEMMs read the
//     twin. The float32 layer norm stays in the graph read by nothing, so
//     Apply's ids keep naming float32 values. Its gradient comes back in
//     16 bits and the layer norm's VJP casts it to float32 for the
//     layer-norm backward, a cast that the fold below removes. RMS norms
//     (graph.OpRMSNorm) get the same twin, on by default (foldRMSNorms):
//     a Llama block's two norms are each read by two or more GEMMs, each
//     of which would cast the float32 norm itself.
//   - Folded widening casts: after autodiff, Step.FoldWideningCasts (the
//     pipeline's fold-casts pass, under a mixed policy) gives a 16-bit
//     matmul whose only reader is a cast to float32 (directly, or through
//     reshapes and slices each read once, none of them an output of the
//     step) a float32 output (graph.OpMatMul's Attrs.Target) and drops the
//     cast: cuBLAS accumulates in float32 and stores float32 (cublasGemmEx
//     with 16-bit A and B and a float32 C), with no 16-bit result and no
//     cast kernel. That is every weight gradient (Cast's VJP back to the
//     float32 master weight), the tied head's padded weight gradient
//     (slice, then cast) and the linear input gradient a layer norm's
//     backward reads. The folded values are more accurate than PyTorch's
//     (one rounding, to float32, instead of a 16-bit rounding widened
//     again). GPT-2 small's bf16-mixed step (batch 8, seq 1024) runs 194
//     casts of 432 M elements, 268 of 713 M without, 169 of 275 M with
//     16-bit layer norms too (TestCastCountGPT2Small).
//   - Fused GELU gradients: after the fold, the pipeline runs
//     graph.FuseGeluGrad (Step.Rewrite), so the backward product that reaches a GELU and
//     the GELU's derivative are one matmul_gelu_grad node (one GEMM with
//     cuBLASLt's DGELU epilogue on CUDA): the product is never stored.
//   - Fused layer-norm gradients, under every policy (a Session's plain
//     fp32 and tf32 steps aside: compile.Options.Plain): the pipeline then
//     runs graph.FuseLayerNormGradAdd, so a layer norm's input gradient that
//     meets another gradient (a residual stream's) is one
//     layer_norm_grad_x_add node, the add done in the layer norm's
//     backward pass; the values are bit for bit the unfused step's.
//   - Parameters, their gradients and optimizer state stay float32 (master
//     weights); so do the loss and every value of the float32 class.
//     Gradients have their value's dtype (autodiff casts a contribution of
//     another float dtype), as PyTorch's autograd keeps them.
//   - The pass runs on a forward graph, before autodiff (compile.Train
//     does both).
//     A graph that already holds gradient ops is not rewritten correctly
//     (their dtypes are fixed by their forward nodes): Apply refuses it.
//
// Executors: the CPU executor and the reference (internal/ref) store
// float16 and bfloat16 values as float32 (float64) holding the rounded
// value, rounding (half.RoundBF16, RoundF16) at exactly the points a CUDA
// kernel stores a 16-bit result: every op producing such a value rounds
// its output once, after computing in float32 from rounded inputs. Host
// data enters and leaves as float32 tensors: a 16-bit input or parameter
// node's float32 data is rounded as it enters, and a 16-bit output comes
// back as a float32 tensor holding the rounded values. The CUDA executor
// stores 16-bit values in 2 bytes and has a 16-bit instantiation of every
// kernel, computing in float32 and rounding each result once, as the CPU
// does; its GEMMs take 16-bit operands and accumulate in float32
// (cublasGemmEx), as autocast's do.
//
// compile.Options.ChannelsLast runs package layout's pass between the
// policy's rewrite and the backward pass: bf16-mixed conv nets' 4-D
// activations stored channels last, for cuDNN's NHWC convolutions.
//
// Dynamic loss scaling (LossScale, Scaler), torch.cuda.amp.GradScaler's
// semantics, which a Session applies under fp16-mixed by default:
//   - S lives in the graph as a float32 scalar constant ("loss_scale")
//     that Step.ScaleLoss appends with the product loss × S, from which the
//     backward pass starts. A constant, not an attribute: the graph's
//     signature does not depend on S, so a change of S recompiles and
//     replans nothing. Its data is one tensor per value of S
//     (Scaler.Data), so executors keep it resident and upload it once per
//     value. The reported loss is the unscaled one, a node before the
//     product.
//   - After the last chunk the executor multiplies the summed float32
//     gradients by float32(1/S) and checks them for inf and NaN
//     (exec.Options.LossScale): on CUDA one grad_unscale_f32 launch per
//     64 gradients sets a flag on the device, read once per step; the
//     CPU does the same on the host. Its 4 bytes (exec.UnscaleBytes) are
//     the program's finish workspace (planner.CompileOptions.
//     FinishWorkspace), allocated after the last chunk and planned like
//     any buffer. A non-finite gradient skips the optimizer step (weights,
//     optimizer state and step count untouched; exec.Result.Skipped).
//   - Scaler.Update then halves S after a skipped step and doubles it
//     after 2000 good steps in a row (the defaults; LossScale sets them).
//     With S a power of two (the defaults keep it one) unscaling is exact,
//     and scaled gradients equal unscaled ones wherever float16 neither
//     overflows nor underflows.
package precision
