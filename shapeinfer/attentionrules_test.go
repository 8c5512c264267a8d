package shapeinfer_test

import (
	"math"

	"github.com/batchfit/batchfit/graph"
)

// Attention's rules: q [B, H, T, d], k and v [B, Hkv, S, d], an optional
// additive mask broadcasting to [B, H, T, S]; batch on axis 0.
// bf is t in bfloat16.
func bf(t graph.Type) graph.Type {
	t.DType = graph.BFloat16
	return t
}

func attentionValidCases() []ruleCase {
	q, kv := fb(0, 4, 8, 5, 16), fb(0, 4, 2, 7, 16)
	causal := graph.Attrs{Causal: true}
	lse, dkv := fb(0, 4, 8, 5), fb(0, 4, 2, 7, 32)
	return []ruleCase{
		{name: "GQA, default scale 1/√d", op: graph.OpAttention, in: ts(q, kv, kv), want: q, check: scalarIs(0.25)},
		{name: "causal, given scale", op: graph.OpAttention, attrs: graph.Attrs{Causal: true, Scalar: 0.5}, in: ts(q, q, q), want: q, check: scalarIs(0.5)},
		{name: "unbatched", op: graph.OpAttention, in: ts(f(2, 3, 5, 4), f(2, 1, 6, 4), f(2, 1, 6, 4)), want: f(2, 3, 5, 4)},
		{name: "mask [T, S]", op: graph.OpAttention, in: ts(q, kv, kv, f(5, 7)), want: q},
		{name: "mask [B, 1, 1, S] batched", op: graph.OpAttention, in: ts(q, kv, kv, fb(0, 4, 1, 1, 7)), want: q},
		{name: "mask [1, H, T, S]", op: graph.OpAttention, in: ts(q, kv, kv, f(1, 8, 5, 7)), want: q},
		{name: "float32 mask, bfloat16 q", op: graph.OpAttention, in: ts(bf(q), bf(kv), bf(kv), f(5, 7)), want: bf(q)},
		{name: "float32 lse", op: graph.OpAttentionLSE, attrs: causal, in: ts(q, kv), want: lse},
		{name: "with mask", op: graph.OpAttentionLSE, in: ts(q, kv, f(5, 7)), want: lse},
		{name: "dq", op: graph.OpAttentionGradQ, in: ts(q, q, kv, kv, q, lse), want: q},
		{name: "dq with mask", op: graph.OpAttentionGradQ, in: ts(q, q, kv, kv, q, lse, f(5, 7)), want: q},
		{name: "dk|dv packed", op: graph.OpAttentionGradKV, attrs: causal, in: ts(q, q, kv, kv, q, lse), want: dkv},
		// qkv [B, T, 3C] with 4 heads of 8: C = 32.
		{name: "attention_qkv, default scale", op: graph.OpAttentionQKV, attrs: graph.Attrs{Groups: 4, Causal: true}, in: ts(fb(0, 2, 5, 96)), want: fb(0, 2, 5, 32), check: scalarIs(1 / math.Sqrt(8))},
		{name: "attention_qkv unbatched", op: graph.OpAttentionQKV, attrs: graph.Attrs{Groups: 4, Scalar: 0.5}, in: ts(f(2, 5, 96)), want: f(2, 5, 32), check: scalarIs(0.5)},
		{name: "attention_qkv_lse", op: graph.OpAttentionQKVLSE, attrs: graph.Attrs{Groups: 4}, in: ts(fb(0, 2, 5, 96)), want: fb(0, 2, 4, 5)},
		{name: "attention_qkv_grad", op: graph.OpAttentionQKVGrad, attrs: graph.Attrs{Groups: 4}, in: ts(fb(0, 2, 5, 32), fb(0, 2, 5, 96), fb(0, 2, 5, 32), fb(0, 2, 4, 5)), want: fb(0, 2, 5, 96)},
		// Grouped-query qkv [B, T, (H + 2·Hkv)·d]: 4 query heads and 2
		// key/value heads of 8 (64 columns), or 1 (48): C = 32 either way.
		{name: "attention_qkv GQA", op: graph.OpAttentionQKV, attrs: graph.Attrs{Groups: 4, KVHeads: 2, Causal: true}, in: ts(fb(0, 2, 5, 64)), want: fb(0, 2, 5, 32), check: scalarIs(1 / math.Sqrt(8))},
		{name: "attention_qkv MQA", op: graph.OpAttentionQKV, attrs: graph.Attrs{Groups: 4, KVHeads: 1}, in: ts(fb(0, 2, 5, 48)), want: fb(0, 2, 5, 32)},
		{name: "attention_qkv KVHeads = Groups", op: graph.OpAttentionQKV, attrs: graph.Attrs{Groups: 4, KVHeads: 4}, in: ts(fb(0, 2, 5, 96)), want: fb(0, 2, 5, 32)},
		{name: "attention_qkv_lse GQA", op: graph.OpAttentionQKVLSE, attrs: graph.Attrs{Groups: 4, KVHeads: 2}, in: ts(fb(0, 2, 5, 64)), want: fb(0, 2, 4, 5)},
		{name: "attention_qkv_grad GQA", op: graph.OpAttentionQKVGrad, attrs: graph.Attrs{Groups: 4, KVHeads: 2}, in: ts(fb(0, 2, 5, 32), fb(0, 2, 5, 64), fb(0, 2, 5, 32), fb(0, 2, 4, 5)), want: fb(0, 2, 5, 64)},
	}
}

func attentionRejectCases() []rejectCase {
	q, kv := fb(0, 4, 8, 5, 16), fb(0, 4, 2, 7, 16)
	lse := fb(0, 4, 8, 5)
	return []rejectCase{
		{name: "head dims differ", op: graph.OpAttention, in: ts(q, fb(0, 4, 2, 7, 8), fb(0, 4, 2, 7, 8)), want: graph.ErrShape},
		{name: "k and v lengths differ", op: graph.OpAttention, in: ts(q, kv, fb(0, 4, 2, 6, 16)), want: graph.ErrShape},
		{name: "kv heads do not divide q heads", op: graph.OpAttention, in: ts(q, fb(0, 4, 3, 7, 16), fb(0, 4, 3, 7, 16)), want: graph.ErrShape},
		{name: "rank 3", op: graph.OpAttention, in: ts(fb(0, 4, 5, 16), fb(0, 4, 7, 16), fb(0, 4, 7, 16)), want: graph.ErrShape},
		{name: "mask does not broadcast", op: graph.OpAttention, in: ts(q, kv, kv, f(5, 6)), want: graph.ErrShape},
		{name: "mask rank 5", op: graph.OpAttention, in: ts(q, kv, kv, f(1, 1, 1, 5, 7)), want: graph.ErrShape},
		{name: "unbatched k beside batched q", op: graph.OpAttention, in: ts(q, f(4, 2, 7, 16), f(4, 2, 7, 16)), want: graph.ErrShape},
		{name: "batch on axis 1", op: graph.OpAttention, in: ts(fb(1, 2, 8, 5, 16), fb(1, 2, 8, 7, 16), fb(1, 2, 8, 7, 16)), want: graph.ErrShape},
		{name: "int64", op: graph.OpAttention, in: ts(ib(0, 4, 8, 5, 16), kv, kv), want: graph.ErrDType},
		{name: "k's dtype differs", op: graph.OpAttention, in: ts(q, graph.Type{Shape: []int{4, 2, 7, 16}, DType: graph.BFloat16, BatchAxis: 0, PerSample: 1}, kv), want: graph.ErrDType},
		{name: "NaN scale", op: graph.OpAttention, attrs: graph.Attrs{Scalar: math.NaN()}, in: ts(q, kv, kv), want: graph.ErrAttr},
		{name: "head dims differ", op: graph.OpAttentionLSE, in: ts(q, fb(0, 4, 2, 7, 8)), want: graph.ErrShape},
		{name: "lse shape", op: graph.OpAttentionGradQ, in: ts(q, q, kv, kv, q, fb(0, 4, 8, 7)), want: graph.ErrShape},
		{name: "g shape", op: graph.OpAttentionGradKV, in: ts(kv, q, kv, kv, q, lse), want: graph.ErrShape},
		{name: "qkv rank 4", op: graph.OpAttentionQKV, attrs: graph.Attrs{Groups: 4}, in: ts(fb(0, 2, 5, 3, 32)), want: graph.ErrShape},
		{name: "heads do not split qkv", op: graph.OpAttentionQKV, attrs: graph.Attrs{Groups: 5}, in: ts(fb(0, 2, 5, 96)), want: graph.ErrAttr},
		{name: "no heads", op: graph.OpAttentionQKV, in: ts(fb(0, 2, 5, 96)), want: graph.ErrAttr},
		{name: "qkv batch on axis 1", op: graph.OpAttentionQKV, attrs: graph.Attrs{Groups: 4}, in: ts(fb(1, 2, 5, 96)), want: graph.ErrShape},
		{name: "int64 qkv", op: graph.OpAttentionQKVLSE, attrs: graph.Attrs{Groups: 4}, in: ts(ib(0, 2, 5, 96)), want: graph.ErrDType},
		{name: "g shape", op: graph.OpAttentionQKVGrad, attrs: graph.Attrs{Groups: 4}, in: ts(fb(0, 2, 5, 96), fb(0, 2, 5, 96), fb(0, 2, 5, 32), fb(0, 2, 4, 5)), want: graph.ErrShape},
		{name: "lse shape", op: graph.OpAttentionQKVGrad, attrs: graph.Attrs{Groups: 4}, in: ts(fb(0, 2, 5, 32), fb(0, 2, 5, 96), fb(0, 2, 5, 32), fb(0, 2, 5, 4)), want: graph.ErrShape},
		{name: "kv heads do not divide heads", op: graph.OpAttentionQKV, attrs: graph.Attrs{Groups: 4, KVHeads: 3}, in: ts(fb(0, 2, 5, 80)), want: graph.ErrAttr},
		{name: "negative kv heads", op: graph.OpAttentionQKV, attrs: graph.Attrs{Groups: 4, KVHeads: -2}, in: ts(fb(0, 2, 5, 64)), want: graph.ErrAttr},
		{name: "GQA heads do not split qkv", op: graph.OpAttentionQKV, attrs: graph.Attrs{Groups: 4, KVHeads: 2}, in: ts(fb(0, 2, 5, 100)), want: graph.ErrAttr},
		{name: "GQA g of the MHA width", op: graph.OpAttentionQKVGrad, attrs: graph.Attrs{Groups: 4, KVHeads: 2}, in: ts(fb(0, 2, 5, 64), fb(0, 2, 5, 64), fb(0, 2, 5, 32), fb(0, 2, 4, 5)), want: graph.ErrShape},
		{name: "GQA lse of the key/value heads", op: graph.OpAttentionQKVGrad, attrs: graph.Attrs{Groups: 4, KVHeads: 2}, in: ts(fb(0, 2, 5, 32), fb(0, 2, 5, 64), fb(0, 2, 5, 32), fb(0, 2, 2, 5)), want: graph.ErrShape},
		{name: "mask gradient", op: graph.OpAttentionGradQ, attrs: graph.Attrs{Axis: 1}, in: ts(q, q, kv, kv, q, q), want: graph.ErrAttr},
	}
}
