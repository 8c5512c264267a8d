package cuda

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"math"
	"slices"
	"strings"

	"github.com/batchfit/batchfit/graph"
)

// Generated kernels of fused_pointwise (graph.Pointwise): the CUDA C
// source of one expression over one layout of its inputs, compiled by
// NVRTC at run time and cached by name (a hash of the expression's
// canonical text and the layout), on disk as every module's cubin is.
//
// A kernel computes in float32 and reads and writes float32, bfloat16 or
// float16. Without a reduction it is flat: a grid-stride loop over the
// elements, with a vector path (16-byte loads and stores of the inputs and
// outputs that are contiguous, when they are aligned and a pack stays in
// one row) and the scalar path for the rest. With row reductions it gives
// each row a block: every reduction is a loop over the row (vectorised
// alike) and a block reduction by warp shuffles and shared memory, the
// per-row values it feeds are computed once, and a last loop stores the
// per-element outputs. A column sum (graph.PWOut.ColSum) makes a row
// kernel too, on a fixed grid (pwColSumGrid blocks at most, whatever the
// rows): each thread adds its columns' terms of every row its block takes
// into the block's accumulators (shared memory when they fit in 48 KiB,
// else its rows of the partials), the block stores them as its row of the
// float32 partials [blocks, cols] in the node's workspace, and
// reduce_splits sums those into the output, in a fixed order: the same
// bits every run. Each kernel comes twice, name_i32 and name_i64:
// 32-bit index arithmetic while every index fits, 64-bit beyond 2³¹ − 1
// elements.

// pwKind is how a fused_pointwise input is read at element i of row r,
// column j of the iteration shape.
type pwKind uint8

const (
	pwFull    pwKind = iota // the iteration shape itself: x[i]
	pwRow                   // one value per row: x[r]
	pwCol                   // one row broadcast over the rows: x[j]
	pwScalar                // one value: x[0]
	pwStrided               // any other broadcast: x[Σ idx_d·stride_d] (a Strided argument)
)

var pwKindNames = [...]string{"full", "row", "col", "scalar", "strided"}

// pwLayout is what a generated kernel is specialised on besides its
// expression: each input's kind, dtype, and whether it is per row
// (graph.RowInputs).
type pwLayout struct {
	Kinds  []pwKind
	DTypes []graph.DType
	Rows   []bool
}

// layoutOf is the layout of inputs of shapes in and dtypes dts.
func layoutOf(in [][]int, dts []graph.DType) (pwLayout, []int, error) {
	var s []int
	for i, sh := range in {
		var err error
		if s, err = graph.BroadcastShapes(s, sh); err != nil {
			return pwLayout{}, nil, graph.Errorf(graph.ErrShape, "fused_pointwise: input %d: %v", i, err)
		}
	}
	l := pwLayout{Kinds: make([]pwKind, len(in)), DTypes: dts, Rows: graph.RowInputs(in, s)}
	for i, sh := range in {
		l.Kinds[i] = pwKindOf(sh, s)
	}
	return l, s, nil
}

func (l pwLayout) String() string {
	var b strings.Builder
	for i, k := range l.Kinds {
		fmt.Fprintf(&b, "%s:%s:%v;", pwKindNames[k], l.DTypes[i], l.Rows[i])
	}
	return b.String()
}

// pwKindOf classifies an input of shape sh against iteration shape s.
func pwKindOf(sh, s []int) pwKind {
	n, c := graph.Numel(s), 1
	if len(s) > 0 {
		c = s[len(s)-1]
	}
	m := graph.Numel(sh)
	// Right-aligned, sh's dims must equal s's wherever they are not 1.
	switch {
	case m == 1:
		return pwScalar
	case m == n:
		return pwFull
	case c > 0 && m == n/c && (len(sh) == 0 || sh[len(sh)-1] == 1) && suffixMatches(sh[:len(sh)-1], s[:len(s)-1]):
		return pwRow
	case m == c && len(sh) > 0 && sh[len(sh)-1] == c:
		return pwCol
	}
	return pwStrided
}

// suffixMatches reports whether sh (right-aligned) equals the trailing
// dims of s, ones in front allowed.
func suffixMatches(sh, s []int) bool {
	for len(sh) > 0 && sh[0] == 1 && len(sh) > len(s) {
		sh = sh[1:]
	}
	return len(sh) <= len(s) && slices.Equal(sh, s[len(s)-len(sh):])
}

// pwSource is a generated kernel: its base name (the two entry points add
// _i32 and _i64) and CUDA C source.
type pwSource struct {
	Name    string
	Source  string
	Rows    bool // a row kernel: a block per row
	Vec     int  // elements per 16-byte pack
	ColSums int  // outputs summed over the rows (their partials follow the outputs)
}

var cTypes = map[graph.DType]string{graph.Float32: "float", graph.BFloat16: "bf16", graph.Float16: "f16"}

// generatePointwise writes the kernel of p over layout l.
func generatePointwise(p *graph.Pointwise, l pwLayout) (*pwSource, error) {
	if p.NumInputs() > len(l.Kinds) {
		return nil, graph.Errorf(graph.ErrArity, "fused_pointwise: the expression reads %d inputs, the layout has %d", p.NumInputs(), len(l.Kinds))
	}
	widest := 0
	for i, dt := range l.DTypes {
		if _, ok := cTypes[dt]; !ok {
			return nil, graph.Errorf(graph.ErrDType, "fused_pointwise: input %d is %s", i, dt)
		}
		if l.Kinds[i] == pwFull || l.Kinds[i] == pwCol {
			widest = max(widest, dt.Size())
		}
	}
	for i, o := range p.Outs {
		if _, ok := cTypes[o.DType]; !ok {
			return nil, graph.Errorf(graph.ErrDType, "fused_pointwise: output %d is %s", i, o.DType)
		}
		widest = max(widest, o.DType.Size())
	}
	row, err := p.Rows(l.Rows)
	if err != nil {
		return nil, err
	}
	h := sha256.Sum256([]byte(p.Text() + "|" + l.String()))
	gen := &pwGen{p: p, l: l, row: row, rows: p.HasReduce() || p.HasColSum(), vec: 16 / widest,
		name: "pw_" + hex.EncodeToString(h[:10])}
	return gen.source(), nil
}

type pwGen struct {
	p    *graph.Pointwise
	l    pwLayout
	row  []bool
	rows bool // a row kernel: row reductions or column sums
	vec  int
	name string
	b    strings.Builder
}

func (g *pwGen) line(format string, a ...any) { fmt.Fprintf(&g.b, format+"\n", a...) }

// params is the kernel's parameter list: each input (and its Strided),
// each output, then the sizes.
func (g *pwGen) params() (decl, call string) {
	var d, c []string
	for i, k := range g.l.Kinds {
		d = append(d, fmt.Sprintf("const %s* __restrict__ in%d", cTypes[g.l.DTypes[i]], i))
		c = append(c, fmt.Sprintf("in%d", i))
		if k == pwStrided {
			d = append(d, fmt.Sprintf("const Strided s%d", i))
			c = append(c, fmt.Sprintf("s%d", i))
		}
	}
	for i, o := range g.p.Outs {
		d = append(d, fmt.Sprintf("%s* __restrict__ out%d", cTypes[o.DType], i))
		c = append(c, fmt.Sprintf("out%d", i))
	}
	if g.p.HasColSum() {
		// The column sums' float32 partials [ColSums, blocks, cols], and
		// whether the block accumulates in shared memory (else in them).
		d = append(d, "float* __restrict__ cs", "const int cs_sh")
		c = append(c, "cs", "cs_sh")
	}
	return strings.Join(d, ", "), strings.Join(c, ", ")
}

func (g *pwGen) source() *pwSource {
	g.line("// fused_pointwise: %s", g.p.Text())
	g.line("// inputs: %s", g.l)
	g.line(`#include "common.cuh"`)
	g.line("")
	g.line("#ifndef BATCHFIT_PW_HELPERS")
	g.line("#define BATCHFIT_PW_HELPERS")
	g.b.WriteString(pwHelpers + "\n")
	g.line("#endif")
	g.line("")
	decl, call := g.params()
	sizes := "n, cols"
	if g.rows {
		sizes = "rows, cols"
	}
	g.line("template <typename I>")
	g.line("__device__ __forceinline__ void %s_body(%s, const I %s) {", g.name, decl, strings.ReplaceAll(sizes, ", ", ", const I "))
	if g.rows {
		g.rowBody()
	} else {
		g.flatBody()
	}
	g.line("}")
	for _, v := range []struct{ suffix, typ string }{{"i32", "unsigned"}, {"i64", "i64"}} {
		a, _, _ := strings.Cut(sizes, ", ")
		g.line(`extern "C" __global__ void %s_%s(%s, const i64 %s, const i64 cols) {`, g.name, v.suffix, decl, a)
		g.line("  %s_body<%s>(%s, (%s)%s, (%s)cols);", g.name, v.typ, call, v.typ, a, v.typ)
		g.line("}")
	}
	return &pwSource{Name: g.name, Source: g.b.String(), Rows: g.rows, Vec: g.vec, ColSums: g.p.ColSums()}
}

// pwHelpers are the device functions every generated kernel shares.
const pwHelpers = `// pw_off is the offset of row-major position i of s.shape in a strided
// operand.
__device__ __forceinline__ i64 pw_off(const Strided& s, i64 i) {
  i64 off = 0;
  for (int d = (int)s.rank - 1; d >= 0; --d) {
    const i64 k = i % s.shape[d];
    i /= s.shape[d];
    off += k * s.stride[d];
  }
  return off;
}
// pw_sigmoid is elementwise.cu's sigmoid_f: 1/(1 + e^−v) for v ≥ 0,
// e^v/(1 + e^v) below, one exp and the numerator selected, no branch.
__device__ __forceinline__ float pw_sigmoid(float v) {
  const float t = expf(-fabsf(v));
  return (v >= 0.f ? 1.f : t) / (1.f + t);
}
__device__ __forceinline__ float pw_gelu(float v) { return 0.5f * v * (1.f + erff(v * 0.70710678118654752f)); }
__device__ __forceinline__ float pw_gelu_tanh(float v) {
  return 0.5f * v * (1.f + tanhf(0.79788456080286536f * (v + 0.044715f * v * v * v)));
}
__device__ __forceinline__ float pw_gelu_d(float x) {
  const float cdf = 0.5f * (1.f + erff(x * 0.70710678118654752f));
  return cdf + x * expf(-0.5f * x * x) * 0.39894228040143268f;
}
__device__ __forceinline__ float pw_gelu_tanh_d(float x) {
  const float k = 0.79788456080286536f, c = 0.044715f;
  const float t = tanhf(k * (x + c * x * x * x));
  return 0.5f * (1.f + t) + 0.5f * x * (1.f - t * t) * k * (1.f + 3.f * c * x * x);
}
__device__ __forceinline__ float pw_sign(float v) { return v > 0.f ? 1.f : (v < 0.f ? -1.f : v); }
__device__ __forceinline__ float pw_round_bf16(float v) { bf16 t; t = v; return (float)t; }
__device__ __forceinline__ float pw_round_f16(float v) { f16 t; t = v; return (float)t; }
// Block reductions over blockDim.x threads (a multiple of 32): warp
// shuffles, then one value per warp through sh[32]; every thread gets the
// result.
__device__ __forceinline__ float pw_block_sum(float v, float* sh) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = v;
  __syncthreads();
  v = (int)(threadIdx.x & 31) < (int)((blockDim.x + 31) >> 5) ? sh[threadIdx.x & 31] : 0.f;
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
  return v;
}
// pw_acc adds a pack of N (a multiple of 4) column sums' terms to the
// accumulators at p (16-byte aligned, shared or global): one 16-byte
// access for every four, which a warp's lanes make to consecutive
// addresses, free of bank conflicts.
template <int N>
__device__ __forceinline__ void pw_acc(float* p, const float (&a)[N]) {
#pragma unroll
  for (int e = 0; e < N; e += 4) {
    float4 v = *reinterpret_cast<float4*>(p + e);
    v.x += a[e];
    v.y += a[e + 1];
    v.z += a[e + 2];
    v.w += a[e + 3];
    *reinterpret_cast<float4*>(p + e) = v;
  }
}
__device__ __forceinline__ float pw_block_max(float v, float* sh) {
  for (int o = 16; o > 0; o >>= 1) v = go_max(v, __shfl_xor_sync(FULL_MASK, v, o));
  __syncthreads();
  if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = v;
  __syncthreads();
  v = (int)(threadIdx.x & 31) < (int)((blockDim.x + 31) >> 5) ? sh[threadIdx.x & 31] : neg_inf_f();
  for (int o = 16; o > 0; o >>= 1) v = go_max(v, __shfl_xor_sync(FULL_MASK, v, o));
  return v;
}`

// lit is v as a float literal (bits for the non-finite).
func lit(v float64) string {
	f := float32(v)
	if math.IsInf(float64(f), 0) || math.IsNaN(float64(f)) {
		return fmt.Sprintf("__int_as_float(0x%08x)", math.Float32bits(f))
	}
	s := fmt.Sprintf("%.9g", f)
	if !strings.ContainsAny(s, ".e") {
		s += ".0"
	}
	return s + "f"
}

// expr is node k's value from its arguments' variables.
func (g *pwGen) expr(k int, a, b string) string {
	n := g.p.Nodes[k]
	switch n.Op {
	case graph.PWConst:
		return lit(n.Scalar)
	case graph.PWNeg:
		return "-" + a
	case graph.PWExp:
		return "expf(" + a + ")"
	case graph.PWLog:
		return "logf(" + a + ")"
	case graph.PWSqrt:
		return "sqrtf(" + a + ")"
	case graph.PWRsqrt:
		return "1.f / sqrtf(" + a + ")"
	case graph.PWAbs:
		return "fabsf(" + a + ")"
	case graph.PWTanh:
		return "tanhf(" + a + ")"
	case graph.PWSigmoid:
		return "pw_sigmoid(" + a + ")"
	case graph.PWRelu:
		return fmt.Sprintf("(%s > 0.f ? %s : 0.f)", a, a)
	case graph.PWGelu:
		return "pw_gelu(" + a + ")"
	case graph.PWGeluTanh:
		return "pw_gelu_tanh(" + a + ")"
	case graph.PWSign:
		return "pw_sign(" + a + ")"
	case graph.PWSilu:
		return fmt.Sprintf("(%s * pw_sigmoid(%s))", a, a)
	case graph.PWCast:
		switch n.DType {
		case graph.BFloat16:
			return "pw_round_bf16(" + a + ")"
		case graph.Float16:
			return "pw_round_f16(" + a + ")"
		}
		return a
	case graph.PWExpand:
		return a
	case graph.PWAdd:
		return a + " + " + b
	case graph.PWSub:
		return a + " - " + b
	case graph.PWMul:
		return a + " * " + b
	case graph.PWDiv:
		return a + " / " + b
	case graph.PWPow:
		return "powf(" + a + ", " + b + ")"
	case graph.PWMax:
		return "go_max(" + a + ", " + b + ")"
	case graph.PWSiluGrad:
		return fmt.Sprintf("(%s * pw_sigmoid(%s) * (1.f + %s * (1.f - pw_sigmoid(%s))))", a, b, b, b)
	case graph.PWGeluGrad:
		return fmt.Sprintf("(%s * pw_gelu_d(%s))", a, b)
	case graph.PWGeluTanhGrad:
		return fmt.Sprintf("(%s * pw_gelu_tanh_d(%s))", a, b)
	case graph.PWReluGrad:
		return fmt.Sprintf("(%s > 0.f ? %s : 0.f)", b, a)
	}
	return "nan_f()"
}

// load is input in's value at element index i, row r, column j.
func (g *pwGen) load(in int, i, r, j string) string {
	x := fmt.Sprintf("in%d", in)
	switch g.l.Kinds[in] {
	case pwFull:
		return fmt.Sprintf("(float)%s[%s]", x, i)
	case pwRow:
		return fmt.Sprintf("(float)%s[%s]", x, r)
	case pwCol:
		return fmt.Sprintf("(float)%s[%s]", x, j)
	case pwScalar:
		return fmt.Sprintf("(float)%s[0]", x)
	}
	return fmt.Sprintf("(float)%s[pw_off(s%d, (i64)(%s))]", x, in, i)
}

// cone lists the per-element nodes the targets need, ascending (per-row
// nodes are variables computed before).
func (g *pwGen) cone(targets []int, rowVars bool) []int {
	need := make([]bool, len(g.p.Nodes))
	for _, t := range targets {
		need[t] = true
	}
	var out []int
	for k := len(g.p.Nodes) - 1; k >= 0; k-- {
		if !need[k] || (rowVars && g.row[k]) {
			continue
		}
		n := g.p.Nodes[k]
		if a := n.Op.Args(); a >= 1 && !n.Op.IsReduce() {
			need[n.A] = true
			if a == 2 {
				need[n.B] = true
			}
		}
		out = append(out, k)
	}
	slices.Reverse(out)
	return out
}

// varOf is node k's variable in an element loop: e<k> (per element) or
// r<k> (per row, in a row kernel).
func (g *pwGen) varOf(k int, rowVars bool) string {
	if rowVars && g.row[k] {
		return fmt.Sprintf("r%d", k)
	}
	return fmt.Sprintf("e%d", k)
}

// elems writes the computation of nodes (a cone) for one element; loads
// of the vector-path inputs come from the packs' variables.
func (g *pwGen) elems(nodes []int, rowVars bool, ind string, i, r, j string, packed func(in int) string) {
	for _, k := range nodes {
		n := g.p.Nodes[k]
		var v string
		switch {
		case n.Op == graph.PWInput:
			if packed != nil {
				if s := packed(n.In); s != "" {
					v = s
					break
				}
			}
			v = g.load(n.In, i, r, j)
		case n.Op.IsReduce():
			v = fmt.Sprintf("r%d", k) // a reduction is per row; only flat kernels lack them
		default:
			a, b := "", ""
			if n.Op.Args() >= 1 {
				a = g.varOf(n.A, rowVars)
			}
			if n.Op.Args() == 2 {
				b = g.varOf(n.B, rowVars)
			}
			v = g.expr(k, a, b)
		}
		g.line("%sconst float e%d = %s;", ind, k, v)
	}
}

// packInputs lists the inputs a vector path loads as packs: the full and
// column ones the nodes read.
func (g *pwGen) packInputs(nodes []int) []int {
	var ins []int
	for _, k := range nodes {
		n := g.p.Nodes[k]
		if n.Op == graph.PWInput && (g.l.Kinds[n.In] == pwFull || g.l.Kinds[n.In] == pwCol) && !slices.Contains(ins, n.In) {
			ins = append(ins, n.In)
		}
	}
	return ins
}

// needsRowCol reports whether loads need the row and column of an index.
func (g *pwGen) needsRowCol() bool {
	for _, k := range g.l.Kinds {
		if k == pwRow || k == pwCol {
			return true
		}
	}
	return false
}

// alignedExpr is the kernel's test that every packed pointer is 16-byte
// aligned.
func (g *pwGen) alignedExpr(ins []int, outs bool) string {
	var ps []string
	for _, in := range ins {
		ps = append(ps, fmt.Sprintf("(u64)in%d", in))
	}
	if outs {
		for o := range g.p.Outs {
			ps = append(ps, fmt.Sprintf("(u64)out%d", o))
		}
	}
	if len(ps) == 0 {
		return "true"
	}
	return "((" + strings.Join(ps, " | ") + ") & 15) == 0"
}

func (g *pwGen) flatBody() {
	var targets []int
	rowOut := false // an output per row (of row-kind inputs only): stored at j = 0
	for _, o := range g.p.Outs {
		targets = append(targets, o.Node)
		rowOut = rowOut || g.row[o.Node]
	}
	nodes := g.cone(targets, false)
	N := g.vec
	packs := g.packInputs(nodes)
	rc := g.needsRowCol() || rowOut
	g.line("  const I stride = (I)gridDim.x * blockDim.x;")
	g.line("  constexpr int N = %d;", N)
	cond := g.alignedExpr(packs, true)
	if rc {
		cond += " && cols % N == 0"
	}
	g.line("  I done = 0;")
	g.line("  if (%s) {", cond)
	g.line("    for (I q = (I)blockIdx.x * blockDim.x + threadIdx.x; q < n / N; q += stride) {")
	g.line("      const I i0 = q * N;")
	if rc {
		g.line("      const I r = i0 / cols, j0 = i0 - r * cols;")
	}
	for _, in := range packs {
		if g.l.Kinds[in] == pwFull {
			g.line("      const Vec<%s, N> p%d = ldv<N>(in%d, q);", cTypes[g.l.DTypes[in]], in, in)
		} else {
			g.line("      const Vec<%s, N> p%d = ldv<N>(in%d, j0 / N);", cTypes[g.l.DTypes[in]], in, in)
		}
	}
	for o, out := range g.p.Outs {
		if !g.row[out.Node] {
			g.line("      Vec<%s, N> o%d;", cTypes[out.DType], o)
		}
	}
	g.line("#pragma unroll")
	g.line("      for (int e = 0; e < N; ++e) {")
	g.line("        const I i = i0 + e;")
	if rc {
		g.line("        const I j = j0 + e;")
	}
	g.elems(nodes, false, "        ", "i", "r", "j", func(in int) string {
		if slices.Contains(packs, in) {
			return fmt.Sprintf("(float)p%d.v[e]", in)
		}
		return ""
	})
	for o, out := range g.p.Outs {
		if g.row[out.Node] {
			g.line("        if (out%d && j == 0) out%d[r] = e%d;", o, o, out.Node)
		} else {
			g.line("        o%d.v[e] = e%d;", o, out.Node)
		}
	}
	g.line("      }")
	for o, out := range g.p.Outs {
		if !g.row[out.Node] {
			g.line("      if (out%d) stv<N>(out%d, q, o%d);", o, o, o)
		}
	}
	g.line("    }")
	g.line("    done = n - n %% N;")
	g.line("  }")
	g.line("  for (I i = done + (I)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {")
	if rc {
		g.line("    const I r = i / cols, j = i - r * cols;")
	}
	g.elems(nodes, false, "    ", "i", "r", "j", nil)
	for o, out := range g.p.Outs {
		if g.row[out.Node] {
			g.line("    if (out%d && j == 0) out%d[r] = e%d;", o, o, out.Node)
		} else {
			g.line("    if (out%d) out%d[i] = e%d;", o, o, out.Node)
		}
	}
	g.line("  }")
}

// rowBody is the row kernel: a block per row (a grid-stride loop over
// rows), each reduction a pass over the row, then the outputs.
func (g *pwGen) rowBody() {
	N := g.vec
	g.line("  __shared__ float sh[32];")
	g.line("  constexpr int N = %d;", N)
	// colSums are the output indices of the column sums; csa<q> is the
	// block's accumulators of the q-th.
	var colSums []int
	for o, out := range g.p.Outs {
		if out.ColSum {
			colSums = append(colSums, o)
		}
	}
	if len(colSums) > 0 {
		g.line("  extern __shared__ __align__(16) float pw_cs_sh[];")
		for q := range colSums {
			g.line("  float* const csa%d = cs_sh ? pw_cs_sh + (i64)%d * cols : cs + ((i64)%d * gridDim.x + blockIdx.x) * (i64)cols;", q, q, q)
		}
		g.line("  for (I j = threadIdx.x; j < cols; j += blockDim.x) {")
		for q := range colSums {
			g.line("    csa%d[j] = 0.f;", q)
		}
		g.line("  }")
		g.line("  __syncthreads();")
	}
	g.line("  for (I r = blockIdx.x; r < rows; r += gridDim.x) {")
	g.line("    const I base = r * cols;")
	done := make([]bool, len(g.p.Nodes))
	// emitRow computes every per-row node whose arguments are ready.
	emitRow := func() {
		for k, n := range g.p.Nodes {
			if done[k] || !g.row[k] || n.Op.IsReduce() {
				continue
			}
			ready := true
			if a := n.Op.Args(); a >= 1 {
				ready = done[n.A]
				if a == 2 {
					ready = ready && done[n.B]
				}
			}
			if !ready {
				continue
			}
			var v string
			switch {
			case n.Op == graph.PWInput:
				v = g.load(n.In, "base", "r", "0")
			default:
				a, b := "", ""
				if n.Op.Args() >= 1 {
					a = fmt.Sprintf("r%d", n.A)
				}
				if n.Op.Args() == 2 {
					b = fmt.Sprintf("r%d", n.B)
				}
				v = g.expr(k, a, b)
			}
			g.line("    const float r%d = %s;", k, v)
			done[k] = true
		}
	}
	// loop writes a pass over the row computing nodes for each element
	// and then body(per-element code), or stores outputs outs (output
	// indices) and adds the column sums sums (output indices, the q-th
	// into csa<q>) — on the vector path when aligned, outs by 16-byte
	// packs, sums a pack at a time (pw_acc).
	loop := func(nodes []int, body func(ind string), outs, sums []int) {
		packs := g.packInputs(nodes)
		aligned := g.alignedExpr(packs, false)
		if len(outs) > 0 {
			var ps []string
			for _, o := range outs {
				ps = append(ps, fmt.Sprintf("(u64)out%d", o))
			}
			aligned += " && ((" + strings.Join(ps, " | ") + ") & 15) == 0"
		}
		g.line("    if (%s && cols %% N == 0) {", aligned)
		g.line("      for (I jq = threadIdx.x; jq < cols / N; jq += blockDim.x) {")
		g.line("        const I j0 = jq * N;")
		for _, in := range packs {
			if g.l.Kinds[in] == pwFull {
				g.line("        const Vec<%s, N> p%d = ldv<N>(in%d + base, jq);", cTypes[g.l.DTypes[in]], in, in)
			} else {
				g.line("        const Vec<%s, N> p%d = ldv<N>(in%d, jq);", cTypes[g.l.DTypes[in]], in, in)
			}
		}
		for _, o := range outs {
			g.line("        Vec<%s, N> o%d;", cTypes[g.p.Outs[o].DType], o)
		}
		for q := range sums {
			g.line("        float a%d[N];", q)
		}
		g.line("#pragma unroll")
		g.line("        for (int e = 0; e < N; ++e) {")
		g.line("          const I j = j0 + e, i = base + j;")
		g.elems(nodes, true, "          ", "i", "r", "j", func(in int) string {
			if slices.Contains(packs, in) {
				return fmt.Sprintf("(float)p%d.v[e]", in)
			}
			return ""
		})
		if body != nil {
			body("          ")
		}
		for _, o := range outs {
			g.line("          o%d.v[e] = %s;", o, g.varOf(g.p.Outs[o].Node, true))
		}
		for q, o := range sums {
			g.line("          a%d[e] = e%d;", q, g.p.Outs[o].Node)
		}
		g.line("        }")
		for _, o := range outs {
			g.line("        if (out%d) stv<N>(out%d + base, jq, o%d);", o, o, o)
		}
		for q := range sums {
			g.line("        pw_acc<N>(csa%d + j0, a%d);", q, q)
		}
		g.line("      }")
		g.line("    } else {")
		g.line("      for (I j = threadIdx.x; j < cols; j += blockDim.x) {")
		g.line("        const I i = base + j;")
		g.elems(nodes, true, "        ", "i", "r", "j", nil)
		if body != nil {
			body("        ")
		}
		for _, o := range outs {
			g.line("        if (out%d) out%d[i] = %s;", o, o, g.varOf(g.p.Outs[o].Node, true))
		}
		for q, o := range sums {
			g.line("        csa%d[j] += e%d;", q, g.p.Outs[o].Node)
		}
		g.line("      }")
		g.line("    }")
	}
	emitRow()
	for k, n := range g.p.Nodes {
		if !n.Op.IsReduce() {
			continue
		}
		id := "0.f"
		acc := fmt.Sprintf("acc%d += e%d;", k, n.A)
		if n.Op == graph.PWRowMax {
			id, acc = "neg_inf_f()", fmt.Sprintf("acc%d = go_max(acc%d, e%d);", k, k, n.A)
		}
		g.line("    float acc%d = %s;", k, id)
		loop(g.cone([]int{n.A}, true), func(ind string) { g.line("%s%s", ind, acc) }, nil, nil)
		if n.Op == graph.PWRowMax {
			g.line("    const float r%d = pw_block_max(acc%d, sh);", k, k)
		} else {
			g.line("    const float r%d = pw_block_sum(acc%d, sh) * %s;", k, k, lit(n.Scalar))
		}
		done[k] = true
		emitRow()
	}
	var elemOuts []int
	for o, out := range g.p.Outs {
		if !g.row[out.Node] && !out.ColSum {
			elemOuts = append(elemOuts, o)
		}
	}
	if len(elemOuts)+len(colSums) > 0 {
		var targets []int
		for _, o := range slices.Concat(elemOuts, colSums) {
			targets = append(targets, g.p.Outs[o].Node)
		}
		// Each thread takes the same columns of every row (the path is
		// the same for every row: it tests pointers and cols only), so
		// its accumulators are its own.
		loop(g.cone(targets, true), nil, elemOuts, colSums)
	}
	g.line("    if (threadIdx.x == 0) {")
	for o, out := range g.p.Outs {
		if g.row[out.Node] {
			g.line("      if (out%d) out%d[r] = r%d;", o, o, out.Node)
		}
	}
	g.line("    }")
	g.line("  }")
	if len(colSums) > 0 {
		g.line("  if (cs_sh) {")
		g.line("    __syncthreads();")
		g.line("    for (I j = threadIdx.x; j < cols; j += blockDim.x) {")
		for q := range colSums {
			g.line("      cs[((i64)%d * gridDim.x + blockIdx.x) * (i64)cols + j] = csa%d[j];", q, q)
		}
		g.line("    }")
		g.line("  }")
	}
}
