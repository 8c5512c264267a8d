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
// per sample, and nothing otherwise in 16 bits; attention_grad_q declares
// cuDNN's backward pass (sdpaBwdBytes) on those shapes, these grouped
// heads included, and none otherwise in 16 bits. float32 takes the cuBLAS
// path's two score arrays for both (TestAttnF32Workspace).
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
			// attention_grad_q: cuDNN's backward pass where it takes the
			// shape (grouped heads included), none otherwise.
			wantQ := int64(0)
			if c.want {
				wantQ = sdpaBwdBytes(sdpaDims{b: int64(b), h: 4, hkv: 2, t: 10, s: 7, d: int64(c.d)})
			}
			require.Equal(t, wantQ, Workspace(g, &nds[0], b), "attention_grad_q %s d=%d", c.dt, c.d)
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
// (16-bit, d 64 or 128, no mask, Hkv dividing H: grouped-query and
// multi-query heads too), affine in the chunk size as the planner needs;
// other 16-bit shapes declare none, and float32 keeps its cuBLAS path's
// score blocks. Grouped heads add sdpaGroupedBytes to the backward pass's
// bound and nothing to the forward pass's.
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
		{graph.BFloat16, 4, 2, 64, false, true},  // grouped-query heads
		{graph.Float16, 6, 1, 128, false, true},  // multi-query
		{graph.BFloat16, 4, 2, 64, true, false},  // grouped, masked
		{graph.BFloat16, 4, 2, 96, false, false}, // grouped, head dim 96
		{graph.BFloat16, 4, 4, 64, true, false},
		{graph.BFloat16, 4, 4, 32, false, false},
		{graph.Float32, 4, 4, 64, false, false},
		{graph.Float32, 4, 2, 64, false, false},
	} {
		g, nds := build(c.dt, c.h, c.hkv, c.d, c.masked)
		for i, nd := range nds {
			w0, w1 := Workspace(g, &nd, 0), Workspace(g, &nd, 1)
			for _, b := range []int{0, 1, 2, 5} {
				got := Workspace(g, &nd, b)
				require.Equal(t, w0+int64(b)*(w1-w0), got, "%s %v affine at b = %d", nd.Op, c, b)
				want := attnF32Workspace(g, &nd, b)
				if c.eligible {
					x := sdpaDims{b: int64(b), h: int64(c.h), hkv: int64(c.hkv), t: 10, s: 7, d: int64(c.d)}
					if i == 0 {
						want = 4*x.b*x.h*x.t + 256 + sdpaPlanFixed // Stats, slack, the plan's bound
						require.Equal(t, want, sdpaFwdBytes(x))
					} else {
						want = 4*x.b*x.h*x.t*(x.d+1) + 256 + sdpaPlanFixed // dQ accumulator, softmax_sum, slack, bound
						if c.hkv != c.h {
							want += 8 * x.b * x.h * x.s * x.d // float32 dk and dv of every query head
						}
						require.Equal(t, want, sdpaBwdBytes(x))
					}
				}
				require.Equal(t, want, got, "%s %+v at b = %d", nd.Op, c, b)
			}
		}
	}
	// The plan's workspace goes after the arrays at a 256-byte boundary,
	// within the 256 bytes of slack the declaration adds; what the launch
	// takes (sdpaLayoutAt's arrays, then the plan's bound) is what the node
	// declares.
	for _, b := range []int64{1, 3, 7} {
		for _, hkv := range []int64{3, 1} {
			x := sdpaDims{b: b, h: 3, hkv: hkv, t: 17, s: 17, d: 64}
			for _, pass := range []sdpaPass{sdpaForward, sdpaBackward} {
				l, off := sdpaLayoutAt(4096, pass, b, 3, 17, 64)
				require.Zero(t, off%256)
				require.Equal(t, alloc.Ptr(4096+off), l.plan)
				declared := sdpaFwdBytes(x)
				if pass == sdpaBackward {
					declared = sdpaBwdBytes(x)
					require.Equal(t, l.dqAcc+alloc.Ptr(4*b*3*17*64), l.sum)
					require.Equal(t, int64(l.sum-4096)+4*b*3*17, 4*b*3*17*65)
				}
				require.GreaterOrEqual(t, declared-off, sdpaPlanBytes(pass, x))
				require.Less(t, declared-off-sdpaPlanBytes(pass, x), int64(256))
			}
		}
	}
}

// TestSDPASelection: which calls cuDNN's fused attention takes (sdpaShape)
// and the reason AttnStats counts for the others (sdpaRefusal).
func TestSDPASelection(t *testing.T) {
	for _, c := range []struct {
		dt     graph.DType
		d      int
		masked bool
		h, hkv int
		why    string // "" when cuDNN takes it
	}{
		{graph.BFloat16, 64, false, 32, 8, ""},
		{graph.BFloat16, 64, false, 32, 32, ""},
		{graph.Float16, 128, false, 16, 1, ""},
		{graph.BFloat16, 128, false, 12, 4, ""},
		{graph.Float32, 64, false, 32, 8, "dtype float32"},
		{graph.BFloat16, 64, true, 32, 8, "mask"},
		{graph.BFloat16, 80, false, 32, 8, "head dim 80"},
		{graph.BFloat16, 64, false, 12, 5, "5 key/value heads for 12 heads"},
		{graph.BFloat16, 64, false, 12, 0, "0 key/value heads for 12 heads"},
	} {
		ok := sdpaShape(c.dt, c.d, c.masked, c.h, c.hkv)
		require.Equal(t, c.why == "", ok, "%+v", c)
		if !ok {
			require.Equal(t, c.why, sdpaRefusal(c.dt, c.d, c.masked, c.h, c.hkv), "%+v", c)
		}
	}
	// Grouped heads that sdpaShape takes, left to the kernels at run time
	// in two cases: the backward pass at T = S = 1, causal with T ≠ S.
	for _, c := range []struct {
		pass         sdpaPass
		h, hkv, t, s int
		causal       bool
		why          string
	}{
		{sdpaForward, 32, 8, 2048, 2048, true, ""},
		{sdpaBackward, 32, 8, 2048, 2048, true, ""},
		{sdpaForward, 4, 2, 1, 1, false, ""},
		{sdpaBackward, 4, 2, 1, 1, false, "grouped heads, backward at T = S = 1"},
		{sdpaBackward, 4, 4, 1, 1, false, ""},
		{sdpaForward, 4, 1, 1, 100, true, "grouped heads, causal with T ≠ S"},
		{sdpaBackward, 4, 1, 100, 17, true, "grouped heads, causal with T ≠ S"},
		{sdpaForward, 4, 1, 17, 100, false, ""},
		{sdpaForward, 4, 4, 17, 100, true, ""},
	} {
		sh := attnShape{b: 2, h: c.h, hkv: c.hkv, t: c.t, s: c.s, d: 64, causal: c.causal}
		require.Equal(t, c.why, sdpaGroupedRefusal(c.pass, sh), "%+v", c)
	}
}

// The packed ops declare cuDNN's workspace for grouped-query qkv [B, T,
// (H + 2·Hkv)·d] too, alongside the fallback's copies (q, k, v and o
// forward; o, g, dq and dk|dv backward) and affine in the chunk size; the
// fallback's copies fit what is declared.
func TestQKVWorkspaceGrouped(t *testing.T) {
	for _, c := range []struct {
		dt        graph.DType
		h, hkv, d int
		cudnn     bool
	}{
		{graph.BFloat16, 4, 2, 64, true},
		{graph.Float16, 4, 1, 128, true},
		{graph.BFloat16, 4, 4, 64, true},
		{graph.BFloat16, 4, 2, 32, false},
		{graph.Float32, 4, 2, 64, false},
	} {
		const T = 9
		g := graph.New()
		in := func(dt graph.DType, shape ...int) int {
			id, err := g.Append(graph.Node{Op: graph.OpInput, Type: graph.Type{Shape: shape, DType: dt, BatchAxis: 0, PerSample: 1}})
			require.NoError(t, err)
			return id
		}
		w := (c.h + 2*c.hkv) * c.d
		a := graph.Attrs{Groups: c.h, KVHeads: c.hkv, Causal: true}
		qkv := in(c.dt, 3, T, w)
		o, err := g.Append(graph.Node{Op: graph.OpAttentionQKV, Inputs: []int{qkv}, Attrs: a})
		require.NoError(t, err)
		gr, lse := in(c.dt, 3, T, c.h*c.d), in(graph.Float32, 3, c.h, T)
		d, err := g.Append(graph.Node{Op: graph.OpAttentionQKVGrad, Inputs: []int{gr, qkv, o, lse}, Attrs: a})
		require.NoError(t, err)
		for _, id := range []int{o, d} {
			nd := g.Node(id)
			w0, w1 := Workspace(g, nd, 0), Workspace(g, nd, 1)
			for _, b := range []int{1, 2, 5} {
				got := Workspace(g, nd, b)
				require.Equal(t, w0+int64(b)*(w1-w0), got, "%s %+v affine at b = %d", nd.Op, c, b)
				s := graph.QKVShape{B: b, H: c.h, Hkv: c.hkv, T: T, D: c.d}
				require.GreaterOrEqual(t, got, attnQKVFallbackBytes(nd.Op, c.dt, s), "%s %+v", nd.Op, c)
				nq, nkv := int64(b*T*c.h*c.d), int64(b*T*c.hkv*c.d)
				copies := map[graph.Op]int64{graph.OpAttentionQKV: 2*nq + 2*nkv, graph.OpAttentionQKVGrad: 3*nq + 2*nkv}[nd.Op]
				require.Equal(t, copies, attnQKVCopies(nd.Op, s))
				if c.cudnn {
					x := qkvDims(s)
					want := sdpaFwdBytes(x)
					if nd.Op == graph.OpAttentionQKVGrad {
						want = sdpaBwdBytes(x)
					}
					require.GreaterOrEqual(t, got, want, "%s %+v", nd.Op, c)
				}
			}
		}
	}
}
