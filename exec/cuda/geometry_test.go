package cuda

import (
	"math/rand/v2"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/internal/ref"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/models"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/planner"
)

// These tests need no GPU: they check the layouts the executor hands the
// kernels by emulating each kernel's index arithmetic (kernels/*.cu) on the
// host in float64 and comparing with plain loops over the shapes.

// offsetOf is common.cuh's offset_of: row-major position i of shape to
// Σ idx_d·stride_d.
func offsetOf(i int64, rank int64, shape, stride [MaxDims]int64) int64 {
	var off int64
	for d := rank - 1; d >= 0; d-- {
		q := i / shape[d]
		off += (i - q*shape[d]) * stride[d]
		i = q
	}
	return off
}

// multiIndex returns the row-major index of position i in shape.
func multiIndex(i int, shape []int) []int {
	idx := make([]int, len(shape))
	for d := len(shape) - 1; d >= 0; d-- {
		idx[d] = i % shape[d]
		i /= shape[d]
	}
	return idx
}

func flatIndex(idx, shape []int) int {
	f := 0
	for d, i := range idx {
		f = f*shape[d] + i
	}
	return f
}

func randShape(rng *rand.Rand, rank, maxDim int) []int {
	s := make([]int, rank)
	for i := range s {
		s[i] = 1 + rng.IntN(maxDim)
	}
	return s
}

func randData(rng *rand.Rand, n int) []float64 {
	x := make([]float64, n)
	for i := range x {
		x[i] = rng.Float64()*2 - 1
	}
	return x
}

func TestMergeAxes(t *testing.T) {
	dims, st := mergeAxes([]int{2, 1, 3, 4}, graph.ContiguousStrides([]int{2, 1, 3, 4}))
	assert.Equal(t, []int{24}, dims)
	assert.Equal(t, [][]int{{1}}, st)
	// A row broadcast [3] over [2, 3]: the operand's stride 0 keeps two axes.
	dims, st = mergeAxes([]int{2, 3}, []int{0, 1}, []int{3, 1})
	assert.Equal(t, []int{2, 3}, dims)
	assert.Equal(t, [][]int{{0, 1}, {3, 1}}, st)
	dims, _ = mergeAxes([]int{1, 1})
	assert.Empty(t, dims, "a single element has no axes")
}

// TestPlanReduceEmulated: for random shapes and axis sets, the kernel the
// layout picks (reduce_rows, reduce_mid or reduce_strided, emulated) sums
// what a plain loop sums, and the ReduceGeom that max_grad reads describes
// the same reduction whatever the kind.
func TestPlanReduceEmulated(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	kinds := map[reduceKind]int{}
	for trial := range 600 {
		rank := 1 + rng.IntN(5)
		shape := randShape(rng, rank, 4)
		var axes []int
		for ax := range rank {
			if rng.IntN(2) == 0 {
				axes = append(axes, ax)
			}
		}
		x := randData(rng, graph.Numel(shape))
		// Reference: plain loops over every position.
		keptShape := slices.Clone(shape)
		for _, ax := range axes {
			keptShape[ax] = 1
		}
		want := make([]float64, graph.Numel(keptShape))
		for i, v := range x {
			idx := multiIndex(i, shape)
			for _, ax := range axes {
				idx[ax] = 0
			}
			want[flatIndex(idx, keptShape)] += v
		}
		l, err := planReduce(shape, axes)
		require.NoError(t, err)
		require.Equal(t, int64(len(want)), l.nout, "trial %d: %v over %v", trial, shape, axes)
		require.Equal(t, int64(len(x))/l.nout, l.nred)
		kinds[l.kind]++
		got := make([]float64, l.nout)
		switch l.kind {
		case reduceRows:
			require.Equal(t, l.nout, l.outer)
			for r := range l.outer {
				for k := range l.n {
					got[r] += x[r*l.n+k]
				}
			}
		case reduceMid:
			require.Equal(t, l.nout, l.outer*l.inner)
			for o := range l.outer {
				for j := range l.inner {
					for k := range l.n {
						got[o*l.inner+j] += x[(o*l.n+k)*l.inner+j]
					}
				}
			}
		case reduceOuterInner: // rows of inner values, then the [outer, n] partials over outer
			require.Equal(t, l.nout, l.n)
			part := make([]float64, l.outer*l.n)
			for r := range l.outer * l.n {
				for j := range l.inner {
					part[r] += x[r*l.inner+j]
				}
			}
			for o := range l.outer {
				for c := range l.n {
					got[c] += part[o*l.n+c]
				}
			}
		default:
			for r := range l.nout {
				base := offsetOf(r, l.geom.KeptRank, l.geom.KeptShape, l.geom.KeptStride)
				for k := range l.nred {
					got[r] += x[base+offsetOf(k, l.geom.RedRank, l.geom.RedShape, l.geom.RedStride)]
				}
			}
		}
		viaGeom := make([]float64, l.nout)
		for r := range l.nout {
			base := offsetOf(r, l.geom.KeptRank, l.geom.KeptShape, l.geom.KeptStride)
			for k := range l.nred {
				viaGeom[r] += x[base+offsetOf(k, l.geom.RedRank, l.geom.RedShape, l.geom.RedStride)]
			}
		}
		for i := range want {
			require.InDelta(t, want[i], got[i], 1e-12, "trial %d: %v over %v, kind %d, output %d", trial, shape, axes, l.kind, i)
			require.InDelta(t, want[i], viaGeom[i], 1e-12, "trial %d: geom of %v over %v", trial, shape, axes)
		}
	}
	for _, k := range []reduceKind{reduceRows, reduceMid, reduceStrided, reduceOuterInner} {
		assert.Positive(t, kinds[k], "kind %d never chosen", k)
	}
}

func TestPlanReduceKinds(t *testing.T) {
	for _, c := range []struct {
		shape, axes []int
		kind        reduceKind
		outer, n    int64
		inner       int64
	}{
		{[]int{2, 3, 4}, []int{2}, reduceRows, 6, 4, 1},
		{[]int{2, 3, 4}, []int{0, 1, 2}, reduceRows, 1, 24, 1},
		{[]int{2, 3, 4}, []int{1}, reduceMid, 2, 3, 4},
		{[]int{2, 3, 4}, []int{0}, reduceMid, 1, 2, 12},
		{[]int{2, 1, 4}, []int{1}, reduceRows, 8, 1, 1}, // nothing to combine
		{[]int{5, 1, 3}, []int{0, 1}, reduceMid, 1, 5, 3},
	} {
		l, err := planReduce(c.shape, c.axes)
		require.NoError(t, err)
		assert.Equal(t, c.kind, l.kind, "%v over %v", c.shape, c.axes)
		assert.Equal(t, [3]int64{c.outer, c.n, c.inner}, [3]int64{l.outer, l.n, l.inner}, "%v over %v", c.shape, c.axes)
	}
	l, err := planReduce([]int{2, 3, 4}, []int{0, 2})
	require.NoError(t, err)
	assert.Equal(t, reduceOuterInner, l.kind)
	assert.Equal(t, [3]int64{2, 3, 4}, [3]int64{l.outer, l.n, l.inner})
	l, err = planReduce([]int{2, 3, 4, 5}, []int{0, 2})
	require.NoError(t, err)
	assert.Equal(t, reduceStrided, l.kind)
	_, err = planReduce([]int{2, 3}, []int{2})
	assert.ErrorIs(t, err, graph.ErrAttr)
}

// TestOuterInnerWorkspace: the partials of a [N, C, H, W] reduction over
// (0, 2, 3) are counted per chunk, affine in it, and cover the layout each
// chunk runs; another layout declares none.
func TestOuterInnerWorkspace(t *testing.T) {
	full, axes := []int{8, 5, 3, 4}, []int{0, 2, 3}
	for _, b := range []int{0, 1, 2, 8} {
		x := []int{b, 5, 3, 4}
		got := outerInnerBytes(full, x, axes)
		assert.Equal(t, int64(4*b*5), got, "chunk of %d", b)
		if l, err := planReduce(x, axes); err == nil && l.kind == reduceOuterInner {
			assert.LessOrEqual(t, splitBytes(l.outer, l.n), got, "chunk of %d", b)
		}
	}
	assert.Zero(t, outerInnerBytes([]int{8, 5}, []int{8, 5}, []int{0}))
	assert.Zero(t, outerInnerBytes([]int{2, 3, 4, 5}, []int{2, 3, 4, 5}, []int{0, 2}))
}

// TestBroadcastGeomEmulated: binary_bcast_f32's offset_of2 through the
// geometry reads the operands NumPy broadcasting pairs.
func TestBroadcastGeomEmulated(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 8))
	for trial := range 300 {
		out := randShape(rng, 1+rng.IntN(5), 4)
		operand := func() []int {
			r := rng.IntN(len(out) + 1)
			s := slices.Clone(out[len(out)-r:])
			for i := range s {
				if rng.IntN(3) == 0 {
					s[i] = 1
				}
			}
			return s
		}
		as, bs := operand(), operand()
		a, b := randData(rng, graph.Numel(as)), randData(rng, graph.Numel(bs))
		geo, err := broadcastGeom(as, bs, out)
		require.NoError(t, err)
		at := func(v []float64, s []int, idx []int) float64 {
			lead := len(idx) - len(s)
			sub := make([]int, len(s))
			for d := range s {
				if s[d] != 1 {
					sub[d] = idx[lead+d]
				}
			}
			return v[flatIndex(sub, s)]
		}
		for i := range graph.Numel(out) {
			idx := multiIndex(i, out)
			var oa, ob int64
			j := int64(i)
			for d := geo.Rank - 1; d >= 0; d-- {
				q := j / geo.Shape[d]
				oa += (j - q*geo.Shape[d]) * geo.SA[d]
				ob += (j - q*geo.Shape[d]) * geo.SB[d]
				j = q
			}
			require.Equal(t, at(a, as, idx), a[oa], "trial %d: a %v, b %v, out %v, position %d", trial, as, bs, out, i)
			require.Equal(t, at(b, bs, idx), b[ob], "trial %d: b", trial)
		}
	}
	_, err := broadcastGeom([]int{2, 3}, []int{4}, []int{2, 3})
	assert.ErrorIs(t, err, graph.ErrShape)
}

// TestPlanPermuteEmulated: copy, transpose_* and gather_* (emulated) move
// every element where a plain permute does.
func TestPlanPermuteEmulated(t *testing.T) {
	rng := rand.New(rand.NewPCG(9, 10))
	kinds := map[permuteKind]int{}
	for trial := range 400 {
		shape := randShape(rng, 1+rng.IntN(5), 4)
		perm := rng.Perm(len(shape))
		out := make([]int, len(shape))
		for k, p := range perm {
			out[k] = shape[p]
		}
		x := randData(rng, graph.Numel(shape))
		want := make([]float64, len(x))
		for i := range want {
			idx := multiIndex(i, out)
			src := make([]int, len(shape))
			for k, p := range perm {
				src[p] = idx[k]
			}
			want[i] = x[flatIndex(src, shape)]
		}
		pl, err := planPermute(perm, shape, out)
		require.NoError(t, err)
		kinds[pl.kind]++
		got := make([]float64, len(x))
		switch pl.kind {
		case permuteCopy:
			copy(got, x)
		case permuteTranspose: // dst[b, j, i] = src[b, i, j]
			require.Equal(t, int64(len(x)), pl.batch*pl.rows*pl.cols)
			for b := range pl.batch {
				for i := range pl.rows {
					for j := range pl.cols {
						got[(b*pl.cols+j)*pl.rows+i] = x[(b*pl.rows+i)*pl.cols+j]
					}
				}
			}
		default:
			geom := newStrided(pl.dims, pl.strides)
			for i := range got {
				got[i] = x[offsetOf(int64(i), geom.Rank, geom.Shape, geom.Stride)]
			}
		}
		require.Equal(t, want, got, "trial %d: permute %v of %v (kind %d)", trial, perm, shape, pl.kind)
	}
	for _, k := range []permuteKind{permuteCopy, permuteTranspose, permuteGather} {
		assert.Positive(t, kinds[k], "kind %d never chosen", k)
	}
}

// gemmHost is BLAS.Gemm's row-major contract: C = op(A)·op(B) + beta·C with
// op(A) m×k stored k×m when ta (lda its row stride), op(B) k×n stored n×k
// when tb.
func gemmHost(ta, tb bool, m, n, k int, a []float64, lda int, b []float64, ldb int, c []float64, ldc int) {
	for i := range m {
		for j := range n {
			var s float64
			for p := range k {
				var av, bv float64
				if ta {
					av = a[p*lda+i]
				} else {
					av = a[i*lda+p]
				}
				if tb {
					bv = b[j*ldb+p]
				} else {
					bv = b[p*ldb+j]
				}
				s += av * bv
			}
			c[i*ldc+j] = s
		}
	}
}

// TestPlanMatmulEmulated: the GEMMs of planMatmul, run on the host,
// compute every broadcast batched product.
func TestPlanMatmulEmulated(t *testing.T) {
	rng := rand.New(rand.NewPCG(11, 12))
	tall, batched := 0, 0
	for trial := range 300 {
		lead := randShape(rng, rng.IntN(4), 3)
		sub := func() []int {
			r := rng.IntN(len(lead) + 1)
			s := slices.Clone(lead[len(lead)-r:])
			for i := range s {
				if rng.IntN(3) == 0 {
					s[i] = 1
				}
			}
			return s
		}
		m, n, k := 1+rng.IntN(4), 1+rng.IntN(4), 1+rng.IntN(4)
		ta, tb := rng.IntN(2) == 0, rng.IntN(2) == 0
		xl, yl := sub(), sub()
		xs := append(slices.Clone(xl), m, k)
		if ta {
			xs = append(slices.Clone(xl), k, m)
		}
		ys := append(slices.Clone(yl), k, n)
		if tb {
			ys = append(slices.Clone(yl), n, k)
		}
		// The output's leading shape broadcasts xl and yl.
		ol := make([]int, max(len(xl), len(yl)))
		for i := range ol {
			ol[i] = 1
			for _, s := range [][]int{xl, yl} {
				if j := i - (len(ol) - len(s)); j >= 0 && s[j] != 1 {
					ol[i] = s[j]
				}
			}
		}
		os := append(slices.Clone(ol), m, n)
		x, y := randData(rng, graph.Numel(xs)), randData(rng, graph.Numel(ys))
		want := make([]float64, graph.Numel(os))
		for b := range graph.Numel(ol) {
			idx := multiIndex(b, ol)
			pick := func(s []int) int {
				sub := make([]int, len(s))
				for d := range s {
					if s[d] != 1 {
						sub[d] = idx[len(idx)-len(s)+d]
					}
				}
				return flatIndex(sub, s)
			}
			xo, yo := pick(xl)*m*k, pick(yl)*k*n
			lda, ldb := k, n
			if ta {
				lda = m
			}
			if tb {
				ldb = k
			}
			gemmHost(ta, tb, m, n, k, x[xo:], lda, y[yo:], ldb, want[b*m*n:], n)
		}
		pl, err := planMatmul(ta, tb, xs, ys, os)
		require.NoError(t, err, "trial %d", trial)
		got := make([]float64, len(want))
		if pl.tall {
			tall++
			gemmHost(false, tb, pl.rows, pl.n, pl.k, x, pl.lda, y, pl.ldb, got, pl.n)
		} else {
			batched++
			for _, c := range pl.calls {
				for i := range c.count {
					gemmHost(ta, tb, pl.m, pl.n, pl.k, x[c.x+i*c.sx:], pl.lda, y[c.y+i*c.sy:], pl.ldb, got[c.out+i*c.so:], pl.n)
				}
			}
		}
		for i := range want {
			require.InDelta(t, want[i], got[i], 1e-12, "trial %d: %v·%v → %v (ta %t, tb %t), element %d", trial, xs, ys, os, ta, tb, i)
		}
	}
	assert.Positive(t, tall)
	assert.Positive(t, batched)
	_, err := planMatmul(false, false, []int{2, 3}, []int{4, 2}, []int{2, 2})
	assert.ErrorIs(t, err, graph.ErrShape)
}

// TestKernelTable: kernelFiles lists every kernel file but the smoke test's,
// every extern "C" kernel of each, and nothing else. A kernel declared in a
// macro K(T, S) is instantiated with the suffixes of the FOR_FLOATS,
// FOR_HALVES or MIXED_FLOATS expansions of K before its #undef K (kernels/common.cuh),
// and attention.cu's name_d##D##_##S with those of ATT_MMA_INSTANCES.
func TestKernelTable(t *testing.T) {
	decl := regexp.MustCompile(`extern "C" __global__ void(?: __launch_bounds__\([^)]*\))?\s+([a-z0-9_]+)\(`)
	typedDecl := regexp.MustCompile(`extern "C" __global__ void(?: __launch_bounds__\([^)]*\))?\s+([a-z0-9_]+)_##S\(`)
	castDecl := regexp.MustCompile(`extern "C" __global__ void(?: __launch_bounds__\([^)]*\))?\s+([a-z0-9_]+)_##SX##_##SY\(`)
	mmaDecl := regexp.MustCompile(`extern "C" __global__ void(?: __launch_bounds__\([^)]*\))?\s+([a-z0-9_]+)_d##D##_##S\(`)
	mmaSfx := []string{"d64_bf16", "d128_bf16", "d64_f16", "d128_f16"} // attention.cu's ATT_MMA_INSTANCES
	lineComment := regexp.MustCompile(`(?m)//.*$`)
	floatsSfx := []string{"f32", "bf16", "f16"}
	mixedSfx := []string{"f32_bf16", "bf16_f32", "f32_f16", "f16_f32", "bf16_f16", "f16_bf16"}
	files := 0
	for _, name := range Names() {
		src, err := Source(name)
		require.NoError(t, err)
		listed, ok := kernelFiles[name]
		if name == "smoke.cu" {
			assert.False(t, ok)
			continue
		}
		require.True(t, ok, "%s is not in kernelFiles", name)
		files++
		var found []string
		src = lineComment.ReplaceAllString(src, "")
		for _, seg := range strings.SplitAfter(src, "#undef K\n") {
			for _, m := range decl.FindAllStringSubmatch(seg, -1) {
				if m[1] != "__launch_bounds__" { // a macro's name_##S(, below
					found = append(found, m[1])
				}
			}
			for _, m := range typedDecl.FindAllStringSubmatch(seg, -1) {
				if strings.Contains(seg, "FOR_FLOATS(K") {
					for _, sfx := range floatsSfx {
						found = append(found, m[1]+"_"+sfx)
					}
				}
				if strings.Contains(seg, "FOR_HALVES(K)") {
					for _, sfx := range floatsSfx[1:] {
						found = append(found, m[1]+"_"+sfx)
					}
				}
				if strings.Contains(seg, "MIXED_FLOATS(K)") {
					for _, sfx := range mixedSfx {
						found = append(found, m[1]+"_"+sfx)
					}
				}
			}
			for _, m := range mmaDecl.FindAllStringSubmatch(seg, -1) {
				if strings.Contains(seg, "ATT_MMA_INSTANCES(K)") {
					for _, sfx := range mmaSfx {
						found = append(found, m[1]+"_"+sfx)
					}
				}
			}
			for _, m := range castDecl.FindAllStringSubmatch(seg, -1) {
				for _, a := range floatsSfx {
					for _, b := range floatsSfx {
						found = append(found, m[1]+"_"+a+"_"+b)
					}
				}
			}
		}
		assert.ElementsMatch(t, found, listed, "%s", name)
	}
	assert.Len(t, kernelFiles, files)
}

func TestKeptOutputs(t *testing.T) {
	p := &planner.Program{Outputs: []int{7, 3, 5, 3}, Kept: []int{3, 5, 3}}
	got, err := keptOutputs(p)
	require.NoError(t, err)
	assert.Equal(t, []int{-1, 0, 1, 2}, got)
	p.Kept = []int{5, 3}
	got, err = keptOutputs(p)
	require.NoError(t, err)
	assert.Equal(t, []int{-1, 1, 0, -1}, got, "kept entries need not follow the outputs' order")
	p.Kept = []int{4}
	_, err = keptOutputs(p)
	assert.ErrorIs(t, err, graph.ErrArity)
	p.Kept = []int{5, 5}
	_, err = keptOutputs(p)
	assert.ErrorIs(t, err, graph.ErrArity, "one output carries one kept entry")
}

func TestWindowDirect(t *testing.T) {
	a := graph.Attrs{Stride: [2]int{1, 1}, Dilation: [2]int{2, 2}}
	w, err := newWindow("conv2d", []int{2, 3, 5, 5}, []int{2, 4, 5, 5}, 1, 1, &a, 4)
	require.NoError(t, err)
	assert.True(t, w.direct(), "dilation does not matter for a 1×1 kernel")
	assert.Equal(t, Window{N: 2, C: 3, H: 5, W: 5, KH: 1, KW: 1, SH: 1, SW: 1, DH: 2, DW: 2, HO: 5, WO: 5}, w)
	a.Padding = [2]int{1, 0}
	_, err = newWindow("conv2d", []int{2, 3, 5, 5}, []int{2, 4, 5, 5}, 1, 1, &a, 4)
	assert.ErrorIs(t, err, graph.ErrShape, "padding changes the output size")
	a.Stride = [2]int{0, 1}
	_, err = newWindow("conv2d", []int{2, 3, 5, 5}, []int{2, 4, 5, 5}, 1, 1, &a, 4)
	assert.ErrorIs(t, err, graph.ErrAttr)
}

func TestRowBlock(t *testing.T) {
	for _, n := range []int64{0, 1, 256, 257, 1024, 2048, 4096, 1 << 20} {
		b := rowBlock(n)
		assert.Zero(t, b[0]%32, "n %d", n)
		assert.LessOrEqual(t, b[0]*b[1], uint32(1024), "n %d", n)
	}
	assert.Equal(t, [3]uint32{7, 1, 1}, rowGrid(50, rowBlock(10), 1), "(32, 8) blocks cover 8 rows each")
	assert.Equal(t, [3]uint32{maxGridX, 1, 1}, flatGrid(1<<40))
	assert.Equal(t, [3]uint32{1, 1, 1}, flatGrid(1))
}

// TestWorkspaceAffine: the planner takes a workspace as Fixed + PerSample·b
// from b = 0 and 1 (bounded by its value at planner.WorkspaceBound for a
// fused loss's nodes), so Workspace must be that in b for every node of
// the conformance cases and of small GPT and ConvNet training graphs.
func TestWorkspaceAffine(t *testing.T) {
	rng := rand.New(rand.NewPCG(13, 14))
	var graphs []*graph.Graph
	for _, c := range ref.Cases {
		b, err := c.Build(rng)
		require.NoError(t, err, c.Name)
		graphs = append(graphs, b.Graph)
	}
	gpt := models.NewGPT(nn.Seed(1), models.GPTConfig{Vocab: 32, Context: 8, Layers: 1, Heads: 2, Dim: 8})
	tokens := lazy.Placeholder([]int{4, 8}, graph.Int64, 0)
	loss := models.Loss(gpt.Forward(tokens), tokens.Graph().Placeholder([]int{4, 8}, graph.Int64, 0))
	lazy.Grad(loss, nn.ParamTensors(gpt)...)
	require.NoError(t, loss.Err())
	graphs = append(graphs, loss.Graph().IR())
	cnn := models.NewConvNet(nn.Seed(2), models.ConvNetConfig{Channels: 3, Size: 8, Widths: []int{4, 4}, Classes: 3})
	x := lazy.Placeholder([]int{4, 3, 8, 8}, graph.Float32, 0)
	closs := cnn.Forward(x).CrossEntropy(x.Graph().Placeholder([]int{4}, graph.Int64, 0), graph.ReduceMean)
	lazy.Grad(closs, nn.ParamTensors(cnn)...)
	require.NoError(t, closs.Err())
	graphs = append(graphs, closs.Graph().IR())
	nonzero := 0
	for _, g := range graphs {
		for _, nd := range g.Nodes() {
			if nd.Op.Category() == graph.CatSource {
				continue
			}
			w0, w1 := Workspace(g, &nd, 0), Workspace(g, &nd, 1)
			if w1 > 0 {
				nonzero++
			}
			buf := planner.Buffer{Fixed: w0, PerSample: w1 - w0}
			if graph.IsLinearCrossEntropy(nd.Op) {
				buf.Max = Workspace(g, &nd, planner.WorkspaceBound)
			}
			for _, b := range []int{2, 5, 16} {
				assert.Equal(t, buf.Bytes(b), Workspace(g, &nd, b), "node %d (%s) at b = %d", nd.ID, nd.Op, b)
			}
		}
	}
	assert.Positive(t, nonzero)
}
