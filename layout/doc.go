// Package layout rewrites conv nets to store their 4-D activations
// channels last (NHWC), the layout cuDNN's 16-bit tensor-core
// convolutions run fastest in (on NCHW they pay transposes inside cuDNN).
//
// Rules, stated up front:
//   - Logical shapes stay NCHW in the user's graph; ChannelsLast returns a
//     new graph. In it a channels-last value has the NHWC shape
//     (graph.ToNHWC of its NCHW type): the same elements, the same bytes,
//     so the planner's accounting is unchanged but for the conversions.
//   - A region starts at a bfloat16 conv2d (ConvTakes: the convolutions
//     cuDNN's NHWC kernels take; float16 and float32 ones stay NCHW, so
//     only bf16-mixed graphs change): its input and weight are permuted to
//     channels last (graph.PermNHWC; the weight becomes cuDNN's KRSC
//     [O, kh, kw, C/g]) by explicit permute nodes, which the planner sizes
//     like any node. Each of these consumers of a channels-last value
//     stays channels last (graph.Attrs.ChannelsLast on the layout ops):
//     conv2d (as ConvTakes), max_pool2d, avg_pool2d, batch_norm;
//     elementwise ops of one
//     input (but dropout and causal_mask, whose values depend on the
//     element's position); elementwise binary ops whose operands have one
//     4-D shape, or are scalars; sum, mean and max over axes whose result
//     keeps its axes in NCHW order (the global average pool's mean over
//     H and W, a bias gradient's sum over N, H and W). Any other consumer
//     (flatten's reshape, linear, concat, …) reads the value permuted back
//     to NCHW (graph.PermNCHW), one permute per value however many such
//     consumers it has.
//   - The pass runs on a forward graph, before autodiff (as the precision
//     pass does, and after it): the backward pass then follows the layout
//     by the ops' VJPs, and the permutes' gradients are permutes.
//   - Graphs without such a conv2d come back unchanged (a copy).
package layout
