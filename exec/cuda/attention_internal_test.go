package cuda

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/graph"
)

// The plain attention kernels are loaded in the 16-bit storage types
// (float32 runs on cuBLAS with its row kernels: attention32.go), and the
// mask's dtype travels as its position in floatDTypes.
func TestAttentionTyped(t *testing.T) {
	loaded := map[string]bool{}
	for _, n := range kernelFiles["attention.cu"] {
		loaded[n] = true
	}
	for _, dt := range floatDTypes {
		for _, k := range []string{kAttentionFwd, kAttentionGradQ, kAttentionGradKV} {
			require.Equal(t, dt.IsHalf(), loaded[typed(k, dt)], typed(k, dt))
		}
	}
	require.True(t, loaded[kAttnRowsFwd])
	require.True(t, loaded[kAttnRowsBwd])
	for i, dt := range floatDTypes {
		code, err := attnMaskCode(graph.OpAttention, &operand{shape: []int{2, 3}, dt: dt})
		require.NoError(t, err)
		require.Equal(t, int64(i), code)
	}
	code, err := attnMaskCode(graph.OpAttention, nil)
	require.NoError(t, err)
	require.Zero(t, code)
	_, err = attnMaskCode(graph.OpAttention, &operand{shape: []int{2, 3}, dt: graph.Int64})
	require.ErrorIs(t, err, graph.ErrDType)
}

// The tensor-core forward takes 16-bit values at head dim 64 or 128, with
// no mask and 16-byte aligned arrays; anything else runs on the plain-FMA
// kernels.
func TestAttentionMMAChoice(t *testing.T) {
	mask := &operand{shape: []int{4, 4}, dt: graph.BFloat16}
	for _, c := range []struct {
		dt   graph.DType
		d    int
		mask *operand
		p    alloc.Ptr
		want bool
	}{
		{graph.BFloat16, 64, nil, 256, true},
		{graph.Float16, 128, nil, 4096, true},
		{graph.Float32, 64, nil, 256, false},
		{graph.BFloat16, 32, nil, 256, false},
		{graph.BFloat16, 96, nil, 256, false},
		{graph.BFloat16, 64, mask, 256, false},
		{graph.Float16, 64, nil, 264, false},
	} {
		require.Equal(t, c.want, attnMMA(c.dt, c.d, c.mask, 0, c.p), "%s d=%d mask=%v ptr=%d", c.dt, c.d, c.mask != nil, c.p)
	}
	loaded := map[string]bool{}
	for _, n := range kernelFiles["attention.cu"] {
		loaded[n] = true
	}
	for _, dt := range []graph.DType{graph.BFloat16, graph.Float16} {
		for _, d := range []int{64, 128} {
			for _, pass := range []string{attnPassFwd, attnPassGradQ, attnPassGradKV} {
				require.True(t, loaded[attnMMAKernel(pass, d, dt)], attnMMAKernel(pass, d, dt))
			}
		}
		require.True(t, loaded[attnDotKernel(dt)], attnDotKernel(dt))
	}
}

// attention_grad_kv declares the float32 D of every query row as its
// workspace when it runs on tensor cores (16-bit, d 64 or 128, no mask),
// per sample, and nothing otherwise in 16 bits; attention_grad_q needs
// none in 16 bits. float32 takes the cuBLAS path's two score arrays for
// both (TestAttnF32Workspace).
func TestAttentionGradWorkspace(t *testing.T) {
	build := func(dt graph.DType, d int, masked bool) (*graph.Graph, []graph.Node) {
		g := graph.New()
		in := func(dt graph.DType, batch int, shape ...int) int {
			id, err := g.Append(graph.Node{Op: graph.OpInput, Type: graph.Type{Shape: shape, DType: dt, BatchAxis: batch}})
			require.NoError(t, err)
			return id
		}
		q, k, v := in(dt, 0, 3, 4, 10, d), in(dt, 0, 3, 2, 7, d), in(dt, 0, 3, 2, 7, d)
		grad, o, lse := in(dt, 0, 3, 4, 10, d), in(dt, 0, 3, 4, 10, d), in(graph.Float32, 0, 3, 4, 10)
		args := []int{grad, q, k, v, o, lse}
		if masked {
			args = append(args, in(dt, 0, 3, 1, 10, 7))
		}
		var nds []graph.Node
		for _, op := range []graph.Op{graph.OpAttentionGradQ, graph.OpAttentionGradKV} {
			id, err := g.Append(graph.Node{Op: op, Inputs: args})
			require.NoError(t, err)
			nds = append(nds, *g.Node(id))
		}
		return g, nds
	}
	for _, c := range []struct {
		dt     graph.DType
		d      int
		masked bool
		want   bool
	}{
		{graph.BFloat16, 64, false, true},
		{graph.Float16, 128, false, true},
		{graph.BFloat16, 32, false, false},
		{graph.BFloat16, 64, true, false},
	} {
		g, nds := build(c.dt, c.d, c.masked)
		for _, b := range []int{0, 1, 3} {
			require.Zero(t, Workspace(g, &nds[0], b), "attention_grad_q %s d=%d", c.dt, c.d)
			want := int64(0)
			if c.want {
				want = int64(4 * b * 4 * 10) // float32 D of b·H·T rows
			}
			require.Equal(t, want, Workspace(g, &nds[1], b), "attention_grad_kv %s d=%d mask=%v b=%d", c.dt, c.d, c.masked, b)
		}
	}
}

// attention and attention_grad_q declare cuDNN's workspace (sdpaFwdBytes,
// sdpaBwdBytes) exactly for the shapes cuDNN's fused attention takes
// (16-bit, d 64 or 128, no mask, H = Hkv), affine in the chunk size as
// the planner needs; other 16-bit shapes declare none, and float32 keeps
// its cuBLAS path's score blocks.
func TestSDPAWorkspace(t *testing.T) {
	build := func(dt graph.DType, h, hkv, d int, masked bool) (*graph.Graph, []graph.Node) {
		g := graph.New()
		in := func(dt graph.DType, shape ...int) int {
			id, err := g.Append(graph.Node{Op: graph.OpInput, Type: graph.Type{Shape: shape, DType: dt, BatchAxis: 0, PerSample: 1}})
			require.NoError(t, err)
			return id
		}
		q, k, v := in(dt, 3, h, 10, d), in(dt, 3, hkv, 7, d), in(dt, 3, hkv, 7, d)
		var mask []int
		if masked {
			mask = []int{in(dt, 3, 1, 10, 7)}
		}
		a := graph.Attrs{Causal: true}
		o, err := g.Append(graph.Node{Op: graph.OpAttention, Inputs: append([]int{q, k, v}, mask...), Attrs: a})
		require.NoError(t, err)
		grad, lse := in(dt, 3, h, 10, d), in(graph.Float32, 3, h, 10)
		dq, err := g.Append(graph.Node{Op: graph.OpAttentionGradQ, Inputs: append([]int{grad, q, k, v, o, lse}, mask...), Attrs: a})
		require.NoError(t, err)
		return g, []graph.Node{*g.Node(o), *g.Node(dq)}
	}
	for _, c := range []struct {
		dt       graph.DType
		h, hkv   int
		d        int
		masked   bool
		eligible bool
	}{
		{graph.BFloat16, 4, 4, 64, false, true},
		{graph.Float16, 2, 2, 128, false, true},
		{graph.BFloat16, 4, 2, 64, false, false}, // grouped-query heads
		{graph.BFloat16, 4, 4, 64, true, false},
		{graph.BFloat16, 4, 4, 32, false, false},
		{graph.Float32, 4, 4, 64, false, false},
	} {
		g, nds := build(c.dt, c.h, c.hkv, c.d, c.masked)
		for i, nd := range nds {
			w0, w1 := Workspace(g, &nd, 0), Workspace(g, &nd, 1)
			for _, b := range []int{0, 1, 2, 5} {
				got := Workspace(g, &nd, b)
				require.Equal(t, w0+int64(b)*(w1-w0), got, "%s %v affine at b = %d", nd.Op, c, b)
				want := attnF32Workspace(g, &nd, b)
				if c.eligible {
					bb, h, d := int64(b), int64(c.h), int64(c.d)
					if i == 0 {
						want = sdpaFwdBytes(bb, h, 10, 7, d)
					} else {
						want = sdpaBwdBytes(bb, h, 10, 7, d)
					}
				}
				require.Equal(t, want, got, "%s %+v at b = %d", nd.Op, c, b)
			}
		}
	}
	// The plan's workspace goes after the arrays at a 256-byte boundary,
	// within the 256 bytes of slack the declaration adds.
	for _, b := range []int64{1, 3, 7} {
		for _, pass := range []sdpaPass{sdpaForward, sdpaBackward} {
			l, off := sdpaLayoutAt(4096, pass, b, 3, 17, 64)
			require.Zero(t, off%256)
			require.Equal(t, alloc.Ptr(4096+off), l.plan)
			declared := sdpaFwdBytes(b, 3, 17, 17, 64)
			if pass == sdpaBackward {
				declared = sdpaBwdBytes(b, 3, 17, 17, 64)
				require.Equal(t, l.dqAcc+alloc.Ptr(4*b*3*17*64), l.sum)
			}
			require.GreaterOrEqual(t, declared-off, sdpaPlanBytes(pass, b, 3, 17, 17, 64))
		}
	}
}
