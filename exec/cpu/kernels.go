package cpu

import (
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/internal/optable"
)

// opKernel is one op's entry in the kernel table: run computes the node's
// output from its inputs (chunkStart is the chunk's first global sample,
// for dropout's keys); ws, when set, declares the scratch memory the kernel
// takes (see Workspace).
type opKernel struct {
	run func(nd *graph.Node, in []*buf, out *buf, chunkStart int) error
	ws  func(g *graph.Graph, nd *graph.Node, b int) int64
}

// family is one file's table entries (elementwise.go, reduce.go, …).
type family map[graph.Op]opKernel

// kernelTable is every op's kernel, indexed by op; source ops have none
// (the host side fills their buffers). TestKernelTableComplete fails when
// an op has no entry or sits in two families.
var kernelTable = optable.Build(families...)

// families is every family of the table.
var families = []family{elementwiseKernels, matmulKernels, reduceKernels, normKernels,
	movementKernels, indexKernels, convKernels, poolKernels, attentionKernels, lossKernels, linearCrossEntropyKernels, fusedKernels}

// eval runs one node's kernel: the entry point of the host side
// (runner.Run).
func eval(nd *graph.Node, in []*buf, out *buf, chunkStart int) error {
	if nd.Attrs.ChannelsLast {
		return evalChannelsLast(nd, in, out, chunkStart)
	}
	if int(nd.Op) < graph.NumOps {
		if run := kernelTable[nd.Op].run; run != nil {
			return run(nd, in, out, chunkStart)
		}
	}
	return graph.Errorf(graph.ErrAttr, "cpu executor has no kernel for op %s", nd.Op)
}

// Workspace declares the scratch memory of the CPU kernels when b samples
// run at once, so the planner allocates it like any buffer: the unfolded
// patches of a convolution or of its gradients (conv.go), [C/groups·kh·kw,
// Ho·Wo] elements, made once per call and reused across samples and groups
// (a 1×1 convolution with unit stride and no padding reads its input
// directly). Elements take the node's dtype size, so shape-only
// half-precision graphs plan with the same declaration; the kernels
// themselves run float32.
func Workspace(g *graph.Graph, nd *graph.Node, b int) int64 {
	if int(nd.Op) >= graph.NumOps || kernelTable[nd.Op].ws == nil {
		return 0
	}
	return kernelTable[nd.Op].ws(g, nd, b)
}

// evalChannelsLast runs a channels-last node (graph.Attrs.ChannelsLast)
// by its NCHW kernel: its 4-D inputs permuted to NCHW (graph.PermNCHW, a
// KRSC weight to KCRS alike), the result permuted back into out. The
// copies are the kernel's own scratch, as its unfolded patches are.
func evalChannelsLast(nd *graph.Node, in []*buf, out *buf, chunkStart int) error {
	v := *nd
	v.Attrs.ChannelsLast = false
	v.Attrs.Target = graph.ToNCHW(v.Attrs.Target)
	v.Type = graph.ToNCHW(v.Type)
	ins := make([]*buf, len(in))
	for i, b := range in {
		ins[i] = b
		if b != nil && len(b.shape) == 4 {
			p, err := permuted(b, graph.PermNCHW)
			if err != nil {
				return err
			}
			ins[i] = p
		}
	}
	o := out
	if len(out.shape) == 4 {
		o = &buf{shape: permShape(out.shape, graph.PermNCHW), f: make([]float32, len(out.f))}
	}
	if err := eval(&v, ins, o, chunkStart); err != nil {
		return err
	}
	if o != out {
		return permuteKernel(graph.PermNHWC, o, out)
	}
	return nil
}

// permuted is a copy of b permuted by perm.
func permuted(b *buf, perm []int) (*buf, error) {
	p := &buf{shape: permShape(b.shape, perm)}
	if b.i != nil {
		p.i = make([]int64, len(b.i))
	} else {
		p.f = make([]float32, len(b.f))
	}
	return p, permuteKernel(perm, b, p)
}

func permShape(s, perm []int) []int {
	out := make([]int, len(perm))
	for i, p := range perm {
		out[i] = s[p]
	}
	return out
}

// nchw is shape as its node's NCHW kernel sees it: permuted to NCHW when
// the node is channels last and the shape 4-D.
func nchw(nd *graph.Node, shape []int) []int {
	if !nd.Attrs.ChannelsLast || len(shape) != 4 {
		return shape
	}
	return permShape(shape, graph.PermNCHW)
}

func optional(in []*buf, i int) *buf {
	if i < len(in) {
		return in[i]
	}
	return nil
}
