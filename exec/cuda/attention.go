package cuda

import "github.com/batchfit/batchfit/graph"

// Attention family. The fused kernels (FlashAttention-2-style tiles) are
// not written yet: the ops are refused with a typed error naming the
// shapes, never computed wrongly. Graphs keep the written-out form
// (models.GPTConfig.WrittenOutAttention) on the GPU meanwhile.
var attentionKernels = family{
	graph.OpAttention:       {run: attentionRefused},
	graph.OpAttentionLSE:    {run: attentionRefused},
	graph.OpAttentionGradQ:  {run: attentionRefused},
	graph.OpAttentionGradKV: {run: attentionRefused},
}

func attentionRefused(k *kctx, in []operand, _ operand) error {
	shapes := make([][]int, len(in))
	for i, o := range in {
		shapes[i] = o.shape
	}
	return graph.Errorf(graph.ErrAttr, "cuda executor has no kernel for %s yet (inputs %v): run the written-out attention or the CPU executor", k.nd.Op, shapes)
}
