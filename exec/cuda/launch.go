package cuda

import (
	"fmt"
	"strings"
	"sync/atomic"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/exec"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/planner"
)

// Launch primitives: the context a kernel runs in, its operands and the
// launch shapes every family uses (kernels/README.md, "Launch shapes").

// kctx is what a node's kernels need, and no more of the executor: the
// device, the loaded kernels and cuBLAS, the graph (for the split rules,
// decided at the full batch) and the node with its chunk and workspace.
// Launches that belong to no node (accumulate, the optimizers) leave nd nil.
type kctx struct {
	d    *Device
	ks   *kernelSet
	blas *BLAS
	dnn  *DNN // nil without cuDNN
	g    *graph.Graph
	nd   *graph.Node
	c    planner.Chunk
	ws   *wsView // nil without a workspace
	// nchwRuns counts the channels-last convolutions run on NCHW copies
	// (convnchw.go); nil where nobody counts (the algorithm search).
	nchwRuns *atomic.Int64
	// co is the output of the node's companion (planner.Program.Companion)
	// when the kernel may compute it in the same pass, else nil; a kernel
	// that does sets coDone. more are the node's further companions
	// (planner.Program.Companions), each with its own done; companionOf
	// finds any of them by op.
	co     *operand
	coNode int       // co's node, when co is set
	coIn   []operand // co's inputs, when co is set
	coDone bool
	more   []coOut
}

// coOut is a companion's output handed to its producer's kernels: the
// companion's node, its output, its inputs, and whether the kernels
// computed it.
type coOut struct {
	node int
	v    operand
	in   []operand
	done bool
}

// coSet is which of a node's companions its kernels computed: bit i for
// the i-th (planner.Program.Companions' order).
type coSet uint64

func (s coSet) has(i int) bool { return i < 64 && s&(1<<i) != 0 }

// companionOf is the output of the node's companion of op (the first
// companion or a further one) and the flag its kernel sets when it
// computes it, or nil, nil when none was handed over.
func (k *kctx) companionOf(op graph.Op) (*operand, *bool) {
	c := k.companionWith(op)
	return c.v, c.done
}

// companion is a companion of op handed to the node's kernels: its node,
// output, inputs and done flag (v nil when there is none).
type companion struct {
	nd   *graph.Node
	v    *operand
	in   []operand
	done *bool
}

// companionWith is companionOf with the companion's node and inputs too.
func (k *kctx) companionWith(op graph.Op) companion {
	if k.co != nil && k.g.Node(k.coNode).Op == op {
		return companion{k.g.Node(k.coNode), k.co, k.coIn, &k.coDone}
	}
	for i := range k.more {
		if m := &k.more[i]; k.g.Node(m.node).Op == op {
			return companion{k.g.Node(m.node), &m.v, m.in, &m.done}
		}
	}
	return companion{}
}

// attrs is the node's attributes.
func (k *kctx) attrs() *graph.Attrs { return &k.nd.Attrs }

// kernels is the launch context of the executor's device, for launches of
// the host side.
func (r *runner) kernels() *kctx {
	return &kctx{d: r.e.d, ks: r.e.ks, blas: r.e.blas, dnn: r.e.dnn, g: r.p.Graph, nchwRuns: &r.e.nchwRuns}
}

// flat is kctx.flat for the host side (accumulate, the optimizers).
func (r *runner) flat(name string, work int64, args ...any) error {
	return r.kernels().flat(name, work, args...)
}

// operand is a value on the device: its address, shape (at the chunk's
// size) and dtype.
type operand struct {
	p     alloc.Ptr
	shape []int
	dt    graph.DType
}

func (o operand) n() int64 { return int64(graph.Numel(o.shape)) }

// at is the address of element i.
func (o operand) at(i int64) alloc.Ptr { return o.p + alloc.Ptr(i*int64(o.dt.Size())) }

func optional(in []operand, i int) *operand {
	if i < len(in) {
		return &in[i]
	}
	return nil
}

// ptrOf is an optional operand's address, 0 (a null pointer) when absent.
func ptrOf(o *operand) alloc.Ptr {
	if o == nil {
		return 0
	}
	return o.p
}

// floats fails unless every operand is float32.
func floats(ops ...operand) error {
	for _, o := range ops {
		if o.dt != graph.Float32 {
			return graph.Errorf(graph.ErrDType, "operand %v is %s, want float32", o.shape, o.dt)
		}
	}
	return nil
}

// floatsOf is the one float dtype of ops (float32, bfloat16 or float16),
// for kernels instantiated per storage type (typed); it fails unless every
// operand has that dtype.
func floatsOf(ops ...operand) (graph.DType, error) {
	dt := ops[0].dt
	for _, o := range ops {
		if !o.dt.IsFloat() || o.dt != dt {
			return 0, graph.Errorf(graph.ErrDType, "operand %v is %s, want %s (one float dtype)", o.shape, o.dt, floatName(dt))
		}
	}
	return dt, nil
}

func floatName(dt graph.DType) string {
	if dt.IsFloat() {
		return dt.String()
	}
	return "float32, bfloat16 or float16"
}

// suffixes are the kernel-name suffixes of the float storage types
// (kernels/common.cuh's FOR_FLOATS).
var suffixes = map[graph.DType]string{graph.Float32: "f32", graph.BFloat16: "bf16", graph.Float16: "f16"}

// floatDTypes are the float storage types, in FOR_FLOATS's order.
var floatDTypes = []graph.DType{graph.Float32, graph.BFloat16, graph.Float16}

// typed is the instantiation of kernel name (spelled with its float32
// suffix, as the k* constants are) for operands of dtypes dts: unary_f32
// for bfloat16 is unary_bf16, and binary_f32 for float32 and bfloat16
// operands is binary_f32_bf16 (kernels/common.cuh, FOR_FLOATS and
// MIXED_FLOATS).
func typed(name string, dts ...graph.DType) string {
	base := strings.TrimSuffix(name, "_f32")
	for _, dt := range dts {
		base += "_" + suffixes[dt]
	}
	return base
}

// allTyped lists every float instantiation of the named kernels.
func allTyped(names ...string) []string {
	var out []string
	for _, n := range names {
		for _, dt := range floatDTypes {
			out = append(out, typed(n, dt))
		}
	}
	return out
}

// perPack is how many elements of the widest of dts a vector path's thread
// handles at once (kernels/common.cuh, PackOf): 16 bytes' worth.
func perPack(dts ...graph.DType) int64 {
	size := 1
	for _, dt := range dts {
		size = max(size, dt.Size())
	}
	return int64(16 / size)
}

// sameN fails unless every operand has out's element count; callers check
// dtypes (floats, floatsOf).
func sameN(op graph.Op, out operand, ops ...operand) error {
	for _, o := range ops {
		if o.n() != out.n() {
			return graph.Errorf(graph.ErrShape, "%s: operand %v, output %v", op, o.shape, out.shape)
		}
	}
	return nil
}

// sameDType fails unless the inputs have out's dtype.
func sameDType(out operand, in ...operand) error {
	for _, x := range in {
		if x.dt != out.dt {
			return graph.Errorf(graph.ErrDType, "input %v is %s, output %v is %s", x.shape, x.dt, out.shape, out.dt)
		}
	}
	return nil
}

// moving is the instantiation of movement kernel name (spelled with its
// float32 suffix) for elements of dt. Movement kernels only move bits, so
// they go by element size: name_f32 for float32, name_b16 for bfloat16 and
// float16 alike, name_i64 for int64 (kernels/movement.cu).
func moving(name string, dt graph.DType) (string, error) {
	base := strings.TrimSuffix(name, "_f32")
	switch dt {
	case graph.Float32:
		return base + "_f32", nil
	case graph.BFloat16, graph.Float16:
		return base + "_b16", nil
	case graph.Int64:
		return base + "_i64", nil
	}
	return "", graph.Errorf(graph.ErrDType, "cuda: %s of %s elements (float32, bfloat16, float16 or int64)", base, dt)
}

// allMoving lists the instantiations of the movement kernels named (for
// float32) by names: _f32, _b16 and _i64.
func allMoving(names ...string) []string {
	var out []string
	for _, n := range names {
		for _, dt := range []graph.DType{graph.Float32, graph.BFloat16, graph.Int64} {
			m, _ := moving(n, dt)
			out = append(out, m)
		}
	}
	return out
}

func boolInt(b bool) int64 {
	if b {
		return 1
	}
	return 0
}

func (k *kctx) launch(name string, grid, block [3]uint32, args ...any) error {
	kn, err := k.ks.get(name)
	if err != nil {
		return err
	}
	if kn.params >= 0 && len(args) != kn.params {
		return fmt.Errorf("%w: %s takes %d, launched with %d", ErrKernelArgs, name, kn.params, len(args))
	}
	return kn.m.Launch(kn.f, grid, block, 0, args...)
}

// flat launches a kernel of the flat layout over work elements; no work, no
// launch.
func (k *kctx) flat(name string, work int64, args ...any) error {
	if work <= 0 {
		return nil
	}
	return k.launch(name, flatGrid(work), flatBlockDim, args...)
}

// packs launches a kernel with a vector path (kernels/common.cuh,
// VEC_LOOP) over n elements with one thread per pack of per; no work, no
// launch.
func (k *kctx) packs(name string, n, per int64, args ...any) error {
	if n <= 0 {
		return nil
	}
	return k.launch(name, flatGrid(ceilDiv(n, per)), flatBlockDim, args...)
}

// workspace is the first bytes of the node's workspace block.
func (k *kctx) workspace(bytes int64) (alloc.Ptr, error) {
	if bytes == 0 {
		return 0, nil
	}
	ws := k.ws
	if ws == nil || ws.Requested() < bytes {
		var got int64
		if ws != nil {
			got = ws.Requested()
		}
		return 0, graph.Errorf(ErrWorkspace, "%d bytes planned, the kernels need %d", got, bytes)
	}
	return ws.Ptr(), nil
}

// flagBytes is the workspace of the bad-index flag: one int64.
const flagBytes = 8

// Indices and labels are data, so the kernels report the first bad position
// in a device flag; badFlag arms it at byte off of the workspace.
func (k *kctx) badFlag(off int64) (alloc.Ptr, error) {
	w, err := k.workspace(off + flagBytes)
	if err != nil {
		return 0, err
	}
	bad := w + alloc.Ptr(off)
	return bad, k.d.memset(bad, 0xFF, flagBytes)
}

// firstBad reads the flag after the kernels before it: nil when every
// value of idx, input input of op's node, was in [0, limit), else the
// exec.RowError of the first bad position (which the kernels found with
// atomicMin) and the value there.
func (k *kctx) firstBad(bad alloc.Ptr, idx operand, op, what string, input int, limit int64) error {
	var got [1]int64
	if err := CopyDtoH(k.d, got[:], bad); err != nil {
		return err
	}
	if got[0] == -1 {
		return nil
	}
	pos := got[0]
	if err := CopyDtoH(k.d, got[:], idx.at(pos)); err != nil {
		return err
	}
	return exec.BadValue(op, what, input, idx.shape, int(pos), got[0], int(limit))
}

// Launch shapes (kernels/README.md, "Launch shapes").
const (
	flatBlock = 256
	maxGridX  = 1 << 20
	maxGridYZ = 65535
)

func ceilDiv(a, b int64) int64 { return (a + b - 1) / b }

// flatGrid is the 1-D grid for work elements with flatBlock threads a block.
func flatGrid(work int64) [3]uint32 {
	return [3]uint32{uint32(min(ceilDiv(work, flatBlock), maxGridX)), 1, 1}
}

var flatBlockDim = [3]uint32{flatBlock, 1, 1}

// rowBlock is the row layout's block for rows of n elements: each
// threadIdx.y group of bx threads owns a row, and rows of up to 8·bx
// elements stay in registers.
func rowBlock(n int64) [3]uint32 {
	switch {
	case n <= 256:
		return [3]uint32{32, 8, 1}
	case n <= 1024:
		return [3]uint32{128, 2, 1}
	case n <= 2048:
		return [3]uint32{256, 1, 1}
	case n <= 4096:
		return [3]uint32{512, 1, 1}
	}
	return [3]uint32{1024, 1, 1}
}

// rowGrid covers rows rows with block's row groups, y = splits.
func rowGrid(rows int64, block [3]uint32, splits int64) [3]uint32 {
	return [3]uint32{uint32(min(max(ceilDiv(rows, int64(block[1])), 1), maxGridX)), uint32(splits), 1}
}

// tileBlock is the tile layout's block: x along a contiguous inner axis,
// y striding over the reduced axis.
var tileBlock = [3]uint32{32, 8, 1}

// tileGridX covers inner elements in tiles of 32.
func tileGridX(inner int64) uint32 { return uint32(min(max(ceilDiv(inner, 32), 1), maxGridX)) }
