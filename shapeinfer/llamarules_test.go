package shapeinfer_test

import (
	"testing"

	"github.com/stretchr/testify/assert"

	"github.com/batchfit/batchfit/graph"
)

// The rules of the ops a Llama decoder adds: rms_norm and its gradients,
// rotary and rotary_grad, swiglu and swiglu_grad, and attention_qkv with
// grouped-query heads (qkv [B, T, (H + 2·Hkv)·d]).
func llamaValidCases() []ruleCase {
	x, w := fb(0, 4, 6, 16), f(16)
	rms := graph.Attrs{NormDims: 1, Eps: 1e-6}
	bf16 := graph.Attrs{NormDims: 1, Eps: 1e-6, Target: graph.Type{DType: graph.BFloat16}}
	q, cs := fb(0, 4, 6, 8, 16), f(6, 16)
	gate := fb(0, 4, 6, 32)
	return []ruleCase{
		{name: "weighted", op: graph.OpRMSNorm, attrs: rms, in: ts(x, w), want: x},
		{name: "no weight, two trailing dims", op: graph.OpRMSNorm, attrs: graph.Attrs{NormDims: 2, Eps: 1e-5}, in: ts(x), want: x},
		{name: "16-bit output of float32", op: graph.OpRMSNorm, attrs: bf16, in: ts(x, w), want: withDType(x, graph.BFloat16)},
		{name: "bfloat16 throughout", op: graph.OpRMSNorm, attrs: rms, in: ts(bf(x), bf(w)), want: bf(x)},
		{name: "dx", op: graph.OpRMSNormGradX, attrs: rms, in: ts(x, x, w), want: x},
		{name: "dx without weight", op: graph.OpRMSNormGradX, attrs: rms, in: ts(x, x), want: x},
		{name: "dx plus the stream's", op: graph.OpRMSNormGradXAdd, attrs: rms, in: ts(x, x, x, w), want: x},
		{name: "dw sums the batch", op: graph.OpRMSNormGradW, attrs: rms, in: ts(x, x), want: f(16)},
		{name: "every head", op: graph.OpRotary, in: ts(q, cs), want: q, check: func(t *testing.T, a graph.Attrs) { assert.Equal(t, 8, a.End) }},
		{name: "q and k of a packed projection", op: graph.OpRotary, attrs: graph.Attrs{End: 6}, in: ts(q, cs), want: q},
		{name: "bfloat16 x, float32 table", op: graph.OpRotary, in: ts(bf(q), cs), want: bf(q)},
		{name: "unbatched", op: graph.OpRotary, in: ts(f(2, 6, 3, 4), f(6, 4)), want: f(2, 6, 3, 4)},
		{name: "gradient", op: graph.OpRotaryGrad, attrs: graph.Attrs{End: 2}, in: ts(q, cs), want: q},
		{name: "batched", op: graph.OpSwiGLU, in: ts(gate, gate), want: gate},
		{name: "bfloat16", op: graph.OpSwiGLU, in: ts(bf(gate), bf(gate)), want: bf(gate)},
		{name: "d gate", op: graph.OpSwiGLUGrad, in: ts(gate, gate, gate), want: gate},
		{name: "d up", op: graph.OpSwiGLUGrad, attrs: graph.Attrs{Axis: 1}, in: ts(gate, gate, gate), want: gate},
		// 8 query heads over 2 key/value heads of 4: qkv [.., (8 + 4)·4].
		{name: "GQA", op: graph.OpAttentionQKV, attrs: graph.Attrs{Groups: 8, KVHeads: 2, Causal: true}, in: ts(fb(0, 2, 5, 48)), want: fb(0, 2, 5, 32), check: scalarIs(0.5)},
		{name: "multi-query", op: graph.OpAttentionQKV, attrs: graph.Attrs{Groups: 8, KVHeads: 1}, in: ts(fb(0, 2, 5, 40)), want: fb(0, 2, 5, 32)},
		{name: "KVHeads = Groups is multi-head", op: graph.OpAttentionQKV, attrs: graph.Attrs{Groups: 4, KVHeads: 4}, in: ts(fb(0, 2, 5, 96)), want: fb(0, 2, 5, 32)},
		{name: "GQA lse", op: graph.OpAttentionQKVLSE, attrs: graph.Attrs{Groups: 8, KVHeads: 2}, in: ts(fb(0, 2, 5, 48)), want: fb(0, 2, 8, 5)},
		{name: "GQA d qkv", op: graph.OpAttentionQKVGrad, attrs: graph.Attrs{Groups: 8, KVHeads: 2}, in: ts(fb(0, 2, 5, 32), fb(0, 2, 5, 48), fb(0, 2, 5, 32), fb(0, 2, 8, 5)), want: fb(0, 2, 5, 48)},
	}
}

func llamaRejectCases() []rejectCase {
	x, w := fb(0, 4, 6, 16), f(16)
	rms := graph.Attrs{NormDims: 1, Eps: 1e-6}
	q, cs := fb(0, 4, 6, 8, 16), f(6, 16)
	gate := fb(0, 4, 6, 32)
	return []rejectCase{
		{name: "eps 0", op: graph.OpRMSNorm, attrs: graph.Attrs{NormDims: 1}, in: ts(x), want: graph.ErrAttr},
		{name: "no norm dims", op: graph.OpRMSNorm, attrs: graph.Attrs{Eps: 1e-6}, in: ts(x), want: graph.ErrAttr},
		{name: "weight shape", op: graph.OpRMSNorm, attrs: rms, in: ts(x, f(6, 16)), want: graph.ErrShape},
		{name: "bfloat16 weight of float32 x", op: graph.OpRMSNorm, attrs: rms, in: ts(x, bf(w)), want: graph.ErrDType},
		{name: "batched weight", op: graph.OpRMSNorm, attrs: rms, in: ts(x, fb(0, 16)), want: graph.ErrShape},
		{name: "float16 to bfloat16", op: graph.OpRMSNorm, attrs: graph.Attrs{NormDims: 1, Eps: 1e-6, Target: graph.Type{DType: graph.BFloat16}},
			in: ts(withDType(x, graph.Float16)), want: graph.ErrDType},
		{name: "bias", op: graph.OpRMSNorm, attrs: rms, in: ts(x, w, w), want: graph.ErrArity},
		{name: "int64", op: graph.OpRMSNorm, attrs: rms, in: ts(ib(0, 4, 16)), want: graph.ErrDType},
		{name: "g shape", op: graph.OpRMSNormGradX, attrs: rms, in: ts(fb(0, 4, 6, 8), x, w), want: graph.ErrShape},
		{name: "g shape", op: graph.OpRMSNormGradW, attrs: rms, in: ts(fb(0, 4, 6, 8), x), want: graph.ErrShape},
		{name: "g dtype", op: graph.OpRMSNormGradW, attrs: rms, in: ts(bf(x), x), want: graph.ErrDType},
		{name: "added gradient shape", op: graph.OpRMSNormGradXAdd, attrs: rms, in: ts(x, x, fb(0, 4, 16), w), want: graph.ErrShape},
		{name: "odd head dim", op: graph.OpRotary, in: ts(fb(0, 4, 6, 8, 15), f(6, 15)), want: graph.ErrShape},
		{name: "rank 3", op: graph.OpRotary, in: ts(fb(0, 4, 6, 128), f(6, 128)), want: graph.ErrShape},
		{name: "table length", op: graph.OpRotary, in: ts(q, f(7, 16)), want: graph.ErrShape},
		{name: "bfloat16 table", op: graph.OpRotary, in: ts(q, bf(cs)), want: graph.ErrDType},
		{name: "batched table", op: graph.OpRotary, in: ts(q, fb(0, 4, 16)), want: graph.ErrShape},
		{name: "more rotated heads than heads", op: graph.OpRotary, attrs: graph.Attrs{End: 9}, in: ts(q, cs), want: graph.ErrAttr},
		{name: "batch on the head axis", op: graph.OpRotary, in: ts(fb(2, 2, 6, 8, 16), cs), want: graph.ErrShape},
		{name: "int64", op: graph.OpRotary, in: ts(ib(0, 4, 6, 8, 16), cs), want: graph.ErrDType},
		{name: "the table's gradient", op: graph.OpRotaryGrad, attrs: graph.Attrs{Axis: 1}, in: ts(q, cs), want: graph.ErrAttr},
		{name: "gradient table", op: graph.OpRotaryGrad, in: ts(q, f(5, 16)), want: graph.ErrShape},
		{name: "broadcast up", op: graph.OpSwiGLU, in: ts(gate, f(32)), want: graph.ErrShape},
		{name: "dtypes differ", op: graph.OpSwiGLU, in: ts(gate, bf(gate)), want: graph.ErrDType},
		{name: "int64", op: graph.OpSwiGLU, in: ts(ib(0, 4, 3), ib(0, 4, 3)), want: graph.ErrDType},
		{name: "operand 2", op: graph.OpSwiGLUGrad, attrs: graph.Attrs{Axis: 2}, in: ts(gate, gate, gate), want: graph.ErrAttr},
		{name: "g shape", op: graph.OpSwiGLUGrad, in: ts(fb(0, 4, 6, 16), gate, gate), want: graph.ErrShape},
		{name: "kv heads do not divide heads", op: graph.OpAttentionQKV, attrs: graph.Attrs{Groups: 8, KVHeads: 3}, in: ts(fb(0, 2, 5, 56)), want: graph.ErrAttr},
		{name: "kv heads do not split qkv", op: graph.OpAttentionQKV, attrs: graph.Attrs{Groups: 8, KVHeads: 2}, in: ts(fb(0, 2, 5, 50)), want: graph.ErrAttr},
		{name: "GQA g shape", op: graph.OpAttentionQKVGrad, attrs: graph.Attrs{Groups: 8, KVHeads: 2}, in: ts(fb(0, 2, 5, 48), fb(0, 2, 5, 48), fb(0, 2, 5, 32), fb(0, 2, 8, 5)), want: graph.ErrShape},
	}
}
