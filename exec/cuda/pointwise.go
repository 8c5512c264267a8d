package cuda

import (
	"errors"
	"fmt"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/graph"
)

// Fused family: fused_pointwise runs a kernel generated from its
// expression and its inputs' layout (pwgen.go), compiled once per process
// and cached on disk as a cubin. The node giving the expression's first
// output also writes the outputs of its companions, the nodes giving the
// others (graph.FusedPointwiseProducer), in the same pass. An expression
// with column sums takes a workspace for their partials (colSumBytes),
// which reduce_splits then sums into the outputs.
var fusedKernels = family{
	graph.OpFusedPointwise: {run: fusedPointwise, ws: fusedPointwiseWorkspace},
}

// pwColSumGrid is the most blocks a kernel with column sums runs, and so
// the most rows of partials each sum takes.
const pwColSumGrid = 1024

// pwColSumShared is the most bytes of accumulators a block of a column-sum
// kernel keeps in shared memory (the static limit, no opt-in); more
// accumulate in the partials themselves.
const pwColSumShared = 48 << 10

// colSumBytes is the partials of ncs column sums over rows of cols values:
// float32 [ncs, pwColSumGrid, cols], whatever the chunk size.
func colSumBytes(ncs, cols int64) int64 { return ncs * pwColSumGrid * cols * 4 }

// fusedPointwiseWorkspace: the column sums' partials, for the node that
// launches the kernel (not a companion whose outputs its producer writes).
func fusedPointwiseWorkspace(g *graph.Graph, nd *graph.Node, _ int) int64 {
	p := nd.Attrs.Pointwise
	if p == nil || !p.HasColSum() || graph.FusedPointwiseProducer(g, nd.ID) >= 0 {
		return 0
	}
	var s []int
	for _, in := range nd.Inputs {
		var err error
		if s, err = graph.BroadcastShapes(s, g.Node(in).Type.Shape); err != nil {
			return 0 // the launch reports it
		}
	}
	if len(s) == 0 {
		return 0
	}
	return colSumBytes(int64(p.ColSums()), int64(s[len(s)-1]))
}

// pwKernel is a generated kernel's two entry points.
type pwKernel struct {
	src      *pwSource
	i32, i64 kernel
}

// pwCache holds the generated kernels of a kernel set, by expression
// text and layout.
type pwCache struct {
	mu sync.Mutex
	m  map[string]*pwEntry
}

// pwEntry is one generated kernel, nil until compiled; mu is held while it
// compiles.
type pwEntry struct {
	mu sync.Mutex
	kn *pwKernel
}

// forcePW64 makes every generated kernel run its 64-bit entry point
// (tests of the 64-bit indexing on small values).
var forcePW64 atomic.Bool

// pointwiseLaunchCompiles counts generated kernels compiled at their
// launch rather than before the step (tests read it).
var pointwiseLaunchCompiles atomic.Int64

// fusedPointwiseRuns counts generated-kernel launches that wrote
// companions' outputs too (tests read it).
var fusedPointwiseRuns atomic.Int64

func fusedPointwise(k *kctx, in []operand, out operand) error {
	nd := k.nd
	p := nd.Attrs.Pointwise
	if p == nil {
		return graph.Errorf(graph.ErrAttr, "fused_pointwise node %d has no expression", nd.ID)
	}
	shapes, dts := make([][]int, len(in)), make([]graph.DType, len(in))
	for i, o := range in {
		shapes[i], dts[i] = o.shape, o.dt
	}
	l, s, err := layoutOf(shapes, dts)
	if err != nil {
		return err
	}
	if len(s) > MaxDims {
		return graph.Errorf(graph.ErrShape, "fused_pointwise node %d: rank %d over %d", nd.ID, len(s), MaxDims)
	}
	var args []any
	kn, err := k.ks.pointwise(k.d, p, l, true)
	if err != nil {
		return err
	}
	for i, o := range in {
		args = append(args, o.p)
		if l.Kinds[i] == pwStrided {
			st, err := graph.BroadcastStrides(o.shape, s)
			if err != nil {
				return err
			}
			v := Strided{Rank: int64(len(s))}
			for d := range s {
				v.Shape[d], v.Stride[d] = int64(s[d]), int64(st[d])
			}
			args = append(args, v)
		}
	}
	outs := make([]alloc.Ptr, len(p.Outs))
	ax := nd.Attrs.Axis
	if ax < 0 || ax >= len(outs) {
		return graph.Errorf(graph.ErrAttr, "fused_pointwise node %d gives output %d of %d", nd.ID, ax, len(outs))
	}
	if out.dt != p.Outs[ax].DType {
		return graph.Errorf(graph.ErrDType, "fused_pointwise node %d: output is %s, the expression stores %s", nd.ID, out.dt, p.Outs[ax].DType)
	}
	outs[ax] = out.p
	// The companions: the nodes giving the other outputs (same expression
	// and inputs), handed over by the planner.
	var done []*bool
	take := func(node int, v *operand, d *bool) {
		m := k.g.Node(node)
		if m.Op != graph.OpFusedPointwise || m.Attrs.Pointwise != p || m.Attrs.Axis == ax ||
			m.Attrs.Axis < 0 || m.Attrs.Axis >= len(outs) || v.dt != p.Outs[m.Attrs.Axis].DType {
			return
		}
		outs[m.Attrs.Axis] = v.p
		done = append(done, d)
	}
	if k.co != nil {
		take(k.coNode, k.co, &k.coDone)
	}
	for i := range k.more {
		take(k.more[i].node, &k.more[i].v, &k.more[i].done)
	}
	for _, o := range outs {
		args = append(args, o)
	}
	c := int64(1)
	if len(s) > 0 {
		c = int64(s[len(s)-1])
	}
	n := int64(graph.Numel(s))
	if n == 0 || c == 0 {
		for o, po := range p.Outs {
			if po.ColSum && outs[o] != 0 { // a sum over no rows
				if err := k.memzero(outs[o], c*int64(po.DType.Size())); err != nil {
					return err
				}
			}
		}
		return nil
	}
	rows := n / c
	ncs := int64(kn.src.ColSums)
	var cs alloc.Ptr // the column sums' partials
	grid, shared, csShared := min(rows, maxGridX), int64(0), int32(0)
	if ncs > 0 {
		if cs, err = k.workspace(colSumBytes(ncs, c)); err != nil {
			return err
		}
		grid = min(rows, pwColSumGrid)
		if b := ncs * c * 4; b <= pwColSumShared {
			shared, csShared = b, 1
		}
		args = append(args, cs, csShared)
	}
	fn := kn.i32
	if n > 1<<31-1 || forcePW64.Load() {
		fn = kn.i64
	}
	nargs := len(args) + 2
	if fn.params >= 0 && nargs != fn.params {
		return fmt.Errorf("%w: %s takes %d, launched with %d", ErrKernelArgs, kn.src.Name, fn.params, nargs)
	}
	if kn.src.Rows {
		threads := min(max(ceilDiv(ceilDiv(c, int64(kn.src.Vec)), 32)*32, 64), 1024)
		args = append(args, rows, c)
		err = fn.m.Launch(fn.f, [3]uint32{uint32(grid), 1, 1}, [3]uint32{uint32(threads), 1, 1}, uint32(shared), args...)
	} else {
		args = append(args, n, c)
		grid := min(ceilDiv(ceilDiv(n, int64(kn.src.Vec)), flatBlock), 1<<20)
		err = fn.m.Launch(fn.f, [3]uint32{uint32(grid), 1, 1}, flatBlockDim, 0, args...)
	}
	if err != nil {
		return err
	}
	q := int64(0)
	for o, po := range p.Outs {
		if !po.ColSum {
			continue
		}
		if outs[o] != 0 {
			part := cs + alloc.Ptr(q*grid*c*4)
			if err := k.combineSplits(po.DType, part, outs[o], grid, c, rSum, 1); err != nil {
				return err
			}
		}
		q++
	}
	for _, d := range done {
		*d = true
	}
	if len(done) > 0 {
		fusedPointwiseRuns.Add(1)
	}
	return nil
}

// pointwise is the generated kernel of p over layout l, compiled (or
// loaded from the cubin cache) the first time it is asked for. Calls for
// different kernels compile side by side; a second call for one being
// compiled waits for it. A failed compile is not kept: the next call
// tries again. atLaunch counts a compile in pointwiseLaunchCompiles: one the launch
// waits for, which warmPointwise was to have done before the step.
func (ks *kernelSet) pointwise(d *Device, p *graph.Pointwise, l pwLayout, atLaunch bool) (*pwKernel, error) {
	key := pwKey(p, l)
	ks.pw.mu.Lock()
	e, ok := ks.pw.m[key]
	if !ok {
		if ks.pw.m == nil {
			ks.pw.m = map[string]*pwEntry{}
		}
		e = &pwEntry{}
		ks.pw.m[key] = e
	}
	ks.pw.mu.Unlock()
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.kn != nil {
		return e.kn, nil
	}
	kn, err := ks.compilePointwise(d, p, l)
	if err != nil {
		return nil, err
	}
	if atLaunch {
		pointwiseLaunchCompiles.Add(1)
	}
	e.kn = kn
	return kn, nil
}

// pwKey names the generated kernel of p over layout l in pwCache.
func pwKey(p *graph.Pointwise, l pwLayout) string { return p.Text() + "|" + l.String() }

// compilePointwise generates, compiles and loads the kernel of p over l.
func (ks *kernelSet) compilePointwise(d *Device, p *graph.Pointwise, l pwLayout) (*pwKernel, error) {
	src, err := generatePointwise(p, l)
	if err != nil {
		return nil, err
	}
	full, err := pointwiseModuleSource(src)
	if err != nil {
		return nil, err
	}
	m, err := d.Compile(src.Name+".cu", full)
	if err != nil {
		return nil, err
	}
	kn := &pwKernel{src: src}
	for _, e := range []struct {
		suffix string
		k      *kernel
	}{{"_i32", &kn.i32}, {"_i64", &kn.i64}} {
		f, err := m.Function(src.Name + e.suffix)
		if err != nil {
			return nil, errors.Join(err, m.Close())
		}
		params, err := m.ParamCount(f)
		if err != nil {
			return nil, errors.Join(err, m.Close())
		}
		*e.k = kernel{m, f, params}
	}
	ks.mu.Lock()
	ks.mods = append(ks.mods, m)
	ks.mu.Unlock()
	return kn, nil
}

// warmPointwise compiles the generated kernels that g's fused_pointwise
// nodes launch at chunk sizes sizes, side by side on the host's cores, so
// that a first step on an empty cubin cache waits for its slowest kernel
// rather than for the sum of them. It must not run inside the device
// goroutine's work (Device.do or doHere), whose loads it waits for. Best
// effort: a kernel that fails here fails again at its launch, where the
// error names the node.
func (ks *kernelSet) warmPointwise(d *Device, g *graph.Graph, sizes []int) {
	type want struct {
		p *graph.Pointwise
		l pwLayout
	}
	var wants []want
	seen := map[string]bool{}
	nodes := g.Nodes()
	for j := range nodes {
		nd := &nodes[j]
		if nd.Op != graph.OpFusedPointwise || nd.Attrs.Pointwise == nil {
			continue
		}
		for _, b := range sizes {
			shapes, dts := make([][]int, len(nd.Inputs)), make([]graph.DType, len(nd.Inputs))
			for i, in := range nd.Inputs {
				t := g.Node(in).Type
				shapes[i], dts[i] = t.AtBatch(b), t.DType
			}
			l, _, err := layoutOf(shapes, dts)
			if err != nil {
				continue
			}
			key := pwKey(nd.Attrs.Pointwise, l)
			if !seen[key] {
				seen[key] = true
				wants = append(wants, want{nd.Attrs.Pointwise, l})
			}
		}
	}
	forEach(runtime.NumCPU(), len(wants), func(i int) {
		_, _ = ks.pointwise(d, wants[i].p, wants[i].l, false)
	})
}

// pointwiseModuleSource is a generated kernel's source as NVRTC compiles
// it: common.cuh's text in place of its include line.
func pointwiseModuleSource(src *pwSource) (string, error) {
	common, err := Source("common.cuh")
	if err != nil {
		return "", err
	}
	return replaceInclude(src.Source, common), nil
}

// replaceInclude puts text in place of src's line #include "common.cuh".
func replaceInclude(src, text string) string {
	lines := strings.SplitAfter(src, "\n")
	for i, l := range lines {
		if m := localInclude.FindStringSubmatch(l); m != nil && m[1] == "common.cuh" {
			lines[i] = text
		}
	}
	return strings.Join(lines, "")
}
