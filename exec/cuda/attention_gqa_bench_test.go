package cuda_test

import (
	"fmt"
	"math"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/exec/cuda"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/half"
)

// BenchmarkAttentionGQA times bfloat16 grouped-query attention at Llama
// 3's shape, q [4, 32, 2048, 64] over k and v [4, 8, 2048, 64], causal,
// against which bench/torch_attention.py --gqa times PyTorch's
// F.scaled_dot_product_attention(enable_gqa=True) (bench/attention-gqa
// runs both and prints the ratios):
//
//   - fwd_cudnn, bwd_cudnn, fwdbwd_cudnn: cuDNN's fused attention on
//     contiguous q [B, H, T, d], k and v [B, Hkv, T, d], the executor's
//     path for attention of this shape: the forward pass (o and the
//     log-sum-exp), the backward pass (dq, and dk|dv summed over each
//     group) from that o and log-sum-exp, and both in turn, as a training
//     step runs them;
//   - fwdbwd_cudnn_packed: the same on attention_qkv's layout, q, k and v
//     read in place from qkv [B, T, (H + 2·Hkv)·d], d qkv written so;
//   - fwdbwd_mma: the tensor-core kernels (cuDNN's attention off): o, the
//     log-sum-exp recomputed, D, dq, then dk|dv with each block summing
//     its group's query heads.
//
// TFLOP/s counts FlashAttention's matrix products over the query heads,
// halved under causal: 4·B·H·T²·d forward, 10·B·H·T²·d backward (the
// count of BenchmarkAttentionBackward and torch_attention.py).
func BenchmarkAttentionGQA(b *testing.B) {
	const B, H, Hkv, T, hd = 4, 32, 8, 2048, 64
	d, a, m := attentionModule(b)
	dnn := benchDNN(b)
	r := newRand(41)
	rnd := func(n int) *alloc.Block {
		x := make([]uint16, n)
		for i := range x {
			x[i] = uint16(half.BF16From(float32(r.Float64()*2 - 1)))
		}
		return upload(b, d, a, x)
	}
	nq, nkv := B*H*T*hd, B*Hkv*T*hd
	q, k, v, g := rnd(nq), rnd(nkv), rnd(nkv), rnd(nq)
	o, dq, o2 := rnd(nq), rnd(nq), rnd(nq)
	dkv := upload(b, d, a, make([]uint16, 2*nkv))
	lse := upload(b, d, a, make([]float32, B*H*T))
	lse2 := upload(b, d, a, make([]float32, B*H*T))
	qkv, dqkv := rnd(nq+2*nkv), upload(b, d, a, make([]uint16, nq+2*nkv))
	scale := float32(1 / math.Sqrt(hd))
	sh := cuda.SDPAShape{DT: graph.BFloat16, B: B, H: H, Hkv: Hkv, T: T, S: T, D: hd, Causal: true, Scale: scale}
	fws, fn := benchWorkspace(b, a, false, sh)
	bws, bn := benchWorkspace(b, a, true, sh)
	taken := func(done bool, err error) error {
		if err == nil && !done {
			err = fmt.Errorf("cuDNN did not take it: %s", dnn.AttnStats())
		}
		return err
	}
	fwd := func(o, lse alloc.Ptr) func() error {
		return func() error { return taken(dnn.SDPAForward(sh, q.Ptr(), k.Ptr(), v.Ptr(), o, lse, fws, fn)) }
	}
	bwd := func() error {
		return taken(dnn.SDPABackward(sh, g.Ptr(), q.Ptr(), k.Ptr(), v.Ptr(), o.Ptr(), lse.Ptr(), dq.Ptr(), dkv.Ptr(), bws, bn))
	}
	// o and lse of the real forward pass, so that the backward pass's p =
	// exp(s − lse) is what training sees; the timed forward passes write
	// spare blocks.
	require.NoError(b, fwd(o.Ptr(), lse.Ptr())())
	packedFwd := func() error { return taken(dnn.SDPAForwardPacked(sh, qkv.Ptr(), o2.Ptr(), lse2.Ptr(), fws, fn)) }
	require.NoError(b, packedFwd())
	require.NoError(b, d.Synchronize())

	fn1 := func(name string) cuda.CUfunction {
		f, err := m.Function(name)
		require.NoError(b, err)
		return f
	}
	type launch struct {
		f           cuda.CUfunction
		grid, block uint32
		args        []any
	}
	dot := upload(b, d, a, make([]float32, B*H*T))
	geom := []any{int64(H), int64(Hkv), int64(T), int64(T), scale, int64(1)}
	mma := []launch{
		{fn1(fmt.Sprintf("attention_fwd_mma_d%d_bf16", hd)), B * H * T / 64, 128, append([]any{q.Ptr(), k.Ptr(), v.Ptr(), o2.Ptr(), alloc.Ptr(0)}, geom...)},
		{fn1(fmt.Sprintf("attention_fwd_mma_d%d_bf16", hd)), B * H * T / 64, 128, append([]any{q.Ptr(), k.Ptr(), v.Ptr(), alloc.Ptr(0), lse2.Ptr()}, geom...)},
		{fn1("attention_grad_dot_bf16"), B * H * T * 8 / 256, 256, []any{g.Ptr(), o.Ptr(), dot.Ptr(), int64(B * H * T), int64(hd)}},
		{fn1(fmt.Sprintf("attention_grad_q_mma_d%d_bf16", hd)), B * H * T / 64, 128,
			append([]any{g.Ptr(), q.Ptr(), k.Ptr(), v.Ptr(), o.Ptr(), lse.Ptr(), dq.Ptr()}, geom...)},
		{fn1(fmt.Sprintf("attention_grad_kv_mma_d%d_bf16", hd)), B * Hkv * T / 64, 128,
			append([]any{g.Ptr(), q.Ptr(), k.Ptr(), v.Ptr(), lse.Ptr(), dot.Ptr(), dkv.Ptr()}, geom...)},
	}
	runMMA := func() error {
		for _, l := range mma {
			if err := m.Launch(l.f, [3]uint32{l.grid, 1, 1}, [3]uint32{l.block, 1, 1}, 0, l.args...); err != nil {
				return err
			}
		}
		return nil
	}

	fwdFlops, bwdFlops := 4.0*B*H*float64(T*T)*hd/2, 10.0*B*H*float64(T*T)*hd/2
	for _, c := range []struct {
		name  string
		fn    func() error
		flops float64
	}{
		{"fwd_cudnn", fwd(o2.Ptr(), lse2.Ptr()), fwdFlops},
		{"bwd_cudnn", bwd, bwdFlops},
		{"fwdbwd_cudnn", func() error {
			if err := fwd(o2.Ptr(), lse2.Ptr())(); err != nil {
				return err
			}
			return bwd()
		}, fwdFlops + bwdFlops},
		{"fwdbwd_cudnn_packed", func() error {
			if err := packedFwd(); err != nil {
				return err
			}
			return taken(dnn.SDPABackwardPacked(sh, g.Ptr(), qkv.Ptr(), o2.Ptr(), lse2.Ptr(), dqkv.Ptr(), bws, bn))
		}, fwdFlops + bwdFlops},
		{"fwdbwd_mma", runMMA, fwdFlops + bwdFlops},
	} {
		b.Run(c.name, func(b *testing.B) {
			require.NoError(b, c.fn())
			require.NoError(b, d.Synchronize())
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				if err := c.fn(); err != nil {
					b.Fatal(err)
				}
			}
			require.NoError(b, d.Synchronize())
			b.ReportMetric(c.flops*float64(b.N)/b.Elapsed().Seconds()/1e12, "TFLOP/s")
			b.ReportMetric(b.Elapsed().Seconds()*1e3/float64(b.N), "ms/op")
		})
	}
}
