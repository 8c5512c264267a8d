package layout

import (
	"slices"

	"github.com/batchfit/batchfit/graph"
)

// ChannelsLast rewrites forward graph g so that its conv nets store their
// 4-D activations channels last (see the package documentation). It
// returns the new graph and, for each node of g, the id of its value
// there: channels last (its type is graph.ToNHWC of the node's) where
// Last reports so, as it was otherwise. A graph holding gradient ops is
// refused (graph.ErrAttr): apply the pass before autodiff.
func ChannelsLast(g *graph.Graph) (*graph.Graph, []int, error) {
	r, err := Rewrite(g)
	if err != nil {
		return nil, nil, err
	}
	return r.Graph, r.IDs, nil
}

// Result is what Rewrite makes: the new graph, node i of the old one's id
// in it (IDs[i]), and whether that value is stored channels last (Last[i]).
type Result struct {
	Graph *graph.Graph
	IDs   []int
	Last  []bool
}

// Rewrite is ChannelsLast, reporting which values are channels last.
func Rewrite(g *graph.Graph) (*Result, error) {
	out := g.Clone()
	n := g.Len()
	res := &Result{Graph: out, IDs: make([]int, n), Last: make([]bool, n)}
	for i := range n {
		res.IDs[i] = i
	}
	for i := range n {
		if nd := g.Node(i); nd.Op.Category() == graph.CatGrad {
			return nil, &graph.OpError{Op: "layout channels_last", Site: nd.Site,
				Err: graph.Errorf(graph.ErrAttr, "node %d is a gradient op (%s): apply the pass to the forward graph, before autodiff", i, nd.Op)}
		}
	}
	if !slices.ContainsFunc(g.Nodes(), func(nd graph.Node) bool { return takes(g, &nd) }) {
		return res, nil
	}
	out = graph.New()
	res.Graph = out
	if g.Batch() != 0 {
		if err := out.SetBatch(g.Batch()); err != nil {
			return nil, err
		}
	}
	// other[i] is node i's value in the other layout, made on demand.
	other := make([]int, n)
	for i := range other {
		other[i] = -1
	}
	ids, last := res.IDs, res.Last
	// get is node i's value in the layout asked for.
	get := func(i int, cl bool, at *graph.Node) (int, error) {
		if last[i] == cl {
			return ids[i], nil
		}
		if other[i] >= 0 {
			return other[i], nil
		}
		perm := graph.PermNHWC
		if !cl {
			perm = graph.PermNCHW
		}
		id, err := out.Append(graph.Node{Op: graph.OpPermute, Inputs: []int{ids[i]},
			Attrs: graph.Attrs{Perm: slices.Clone(perm)}, Scope: at.Scope, Site: at.Site})
		if err != nil {
			return -1, &graph.OpError{Op: "layout " + graph.OpPermute.String(), Site: at.Site, Err: err}
		}
		other[i] = id
		return id, nil
	}
	for i := range n {
		nd := g.Node(i)
		nn := graph.Node{Op: nd.Op, Attrs: nd.Attrs.Clone(), Name: nd.Name, Scope: nd.Scope, Site: nd.Site, Value: nd.Value}
		if nd.Op.Category() == graph.CatSource {
			nn.Type = nd.Type
		}
		cl, axes := decide(g, nd, last)
		nn.Inputs = make([]int, len(nd.Inputs))
		for k, in := range nd.Inputs {
			want := cl && len(g.Node(in).Type.Shape) == 4
			if nd.Op == graph.OpConv2d && k > 0 {
				want = cl && k == 1 // the weight, KRSC; a bias stays as it is
			}
			id, err := get(in, want, nd)
			if err != nil {
				return nil, err
			}
			nn.Inputs[k] = id
		}
		if cl {
			switch nd.Op.Category() {
			case graph.CatConv, graph.CatNormalize:
				nn.Attrs.ChannelsLast = true
			case graph.CatReduce:
				nn.Attrs.Axes = axes
			}
		}
		id, err := out.Append(nn)
		if err != nil {
			return nil, &graph.OpError{Op: nd.Op.String(), Site: nd.Site, Err: err}
		}
		ids[i] = id
		last[i] = cl && len(nd.Type.Shape) == 4
	}
	return res, nil
}

// decide says whether node nd of g runs channels last given which of its
// inputs are (last), and for a reduction the axes it then takes.
func decide(g *graph.Graph, nd *graph.Node, last []bool) (bool, []int) {
	in := nd.Inputs
	if len(in) == 0 || !nd.Type.DType.IsFloat() {
		return false, nil
	}
	x := g.Node(in[0]).Type
	switch nd.Op {
	case graph.OpConv2d:
		return takes(g, nd), nil
	case graph.OpMaxPool2d, graph.OpAvgPool2d, graph.OpBatchNorm:
		return last[in[0]] && len(x.Shape) == 4, nil
	case graph.OpDropout, graph.OpCausalMask: // their values depend on the element's position
		return false, nil
	}
	switch nd.Op.Category() {
	case graph.CatUnary, graph.CatScalar:
		return last[in[0]], nil
	case graph.CatBinary:
		any := false
		for _, id := range in {
			t := g.Node(id).Type
			switch {
			case len(t.Shape) == 0:
			case len(t.Shape) == 4 && slices.Equal(t.Shape, nd.Type.Shape):
				any = any || last[id]
			default:
				return false, nil // broadcasting: NCHW
			}
		}
		return any, nil
	case graph.CatReduce:
		if !last[in[0]] {
			return false, nil
		}
		return reduceAxes(nd.Attrs)
	}
	return false, nil
}

// nhwcAxis is where NCHW axis a sits in NHWC.
var nhwcAxis = [4]int{0, 3, 1, 2}

// reduceAxes maps a reduction's NCHW axes to NHWC when its result keeps
// its remaining axes in the same order either way: with KeepDim, or when
// the channels do not remain beside H or W.
func reduceAxes(a graph.Attrs) (bool, []int) {
	red := [4]bool{}
	for _, ax := range a.Axes {
		if ax < 0 || ax > 3 {
			return false, nil
		}
		red[ax] = true
	}
	if !a.KeepDim && !red[1] && (!red[2] || !red[3]) {
		return false, nil // C stays beside H or W: NHWC order would differ
	}
	axes := make([]int, 0, len(a.Axes))
	for _, ax := range a.Axes {
		axes = append(axes, nhwcAxis[ax])
	}
	slices.Sort(axes)
	return true, axes
}

// takes reports whether node nd of g is a convolution that runs channels
// last.
func takes(g *graph.Graph, nd *graph.Node) bool {
	if nd.Op != graph.OpConv2d {
		return false
	}
	x, w := g.Node(nd.Inputs[0]).Type, g.Node(nd.Inputs[1]).Type
	return len(x.Shape) == 4 && len(w.Shape) == 4 && convTakes(nd.Type.DType, w.Shape[0], nd.Attrs.Groups, x.Shape[1])
}

// convTakes is ConvTakes; tests widen it to float32 to check the pass
// against the float64 reference.
var convTakes = ConvTakes

// ConvTakes reports whether a convolution of dtype dt with out output
// channels and in input channels in groups groups runs channels last:
// bfloat16 ones, every shape of which cuDNN 9's NHWC kernels took, forward
// and both gradients, on the H100 (exec/cuda's
// TestCuDNNConvChannelsLastMatchesRef). float16 ones stay NCHW: cuDNN
// 9.14 answers BAD_PARAM for a depthwise input gradient (it took the
// test's other float16 shapes on the H100 on 2026-11-27, 4 and 7
// output channels included, which earlier versions refused), and a
// chunked float16 ConvNet step strayed 0.5 % from the CPU's loss. float32
// ones stay NCHW too: cuDNN 9.14 took every float32 shape of the test, but
// no float32 net has been measured faster channels last. The CUDA executor
// runs a channels-last convolution cuDNN refuses as its NCHW twin on
// transposed copies, which its planned workspace holds: right, but slower
// than NCHW throughout.
func ConvTakes(dt graph.DType, out, groups, in int) bool {
	return dt == graph.BFloat16
}
