package graph

import (
	"fmt"
	"slices"
)

const (
	OpConv2d    Op = endIndexOps + iota // inputs x[N,C,H,W], w[O,C/g,kh,kw][, b[O]]; Stride, Padding, Dilation, Groups
	OpMaxPool2d                         // Kernel, Stride, Padding, Dilation
	OpAvgPool2d                         // Kernel, Stride, Padding (zero padding counted in the divisor)
	endConvOps
)

// Convolution and pooling over NCHW inputs, or NHWC ones with
// Attrs.ChannelsLast (graph/layout.go). The batch must be the N axis.
var convOps = []OpInfo{
	OpConv2d: {Name: "conv2d", Category: CatConv, MinArity: 2, Arity: 2, MaxArity: 3, Attrs: []string{"stride", "padding", "dilation", "groups", "channels_last"},
		Rule: conv2dRule, Chunk: &Chunk{PerSample: onN, Weights: true}, Saves: SavesInput(0, 1), VJP: conv2dVJP},
	OpMaxPool2d: {Name: "max_pool2d", Category: CatConv, MinArity: 1, Arity: 1, Attrs: []string{"kernel", "stride", "padding", "dilation", "channels_last"},
		Rule: pool2dRule, Chunk: &Chunk{PerSample: onN}, Saves: SavesInput(0),
		VJP: func(b VJPBuilder, n *Node, g int) {
			x, a := n.Inputs[0], n.Attrs
			b.Accumulate(x, b.Emit(OpMaxPool2dGrad, Attrs{Kernel: a.Kernel, Stride: a.Stride, Padding: a.Padding, Dilation: a.Dilation,
				ChannelsLast: a.ChannelsLast}, g, x))
		}},
	OpAvgPool2d: {Name: "avg_pool2d", Category: CatConv, MinArity: 1, Arity: 1, Attrs: []string{"kernel", "stride", "padding", "channels_last"},
		Rule: pool2dRule, Chunk: &Chunk{PerSample: onN},
		VJP: func(b VJPBuilder, n *Node, g int) {
			x, a := n.Inputs[0], n.Attrs
			b.Accumulate(x, b.Emit(OpAvgPool2dGrad, Attrs{Kernel: a.Kernel, Stride: a.Stride, Padding: a.Padding, Target: b.Type(x),
				ChannelsLast: a.ChannelsLast}, g))
		}},
}

func onN(n *Node, _ []Type) string {
	if g := n.Type.BatchAxis; g != 0 {
		return fmt.Sprintf("batch axis %d is not the N axis of NCHW", g)
	}
	return ""
}

func conv2dVJP(b VJPBuilder, n *Node, g int) {
	in, a := n.Inputs, n.Attrs
	conv := Attrs{Stride: a.Stride, Padding: a.Padding, Dilation: a.Dilation, Groups: a.Groups, ChannelsLast: a.ChannelsLast}
	if b.Wants(0) {
		c := conv
		c.Target = b.Type(in[0])
		b.Accumulate(in[0], b.Emit(OpConv2dGradInput, c, g, in[1]))
	}
	if b.Wants(1) {
		c := conv
		c.Target = b.Type(in[1])
		b.Accumulate(in[1], b.Emit(OpConv2dGradWeight, c, g, in[0]))
	}
	if b.Wants(2) {
		axes := []int{0, 2, 3} // every axis but the channels
		if a.ChannelsLast {
			axes = []int{0, 1, 2}
		}
		b.Accumulate(in[2], b.Emit(OpSum, Attrs{Axes: axes}, g))
	}
}

// ConvOut is the output extent of a convolution or pooling window along one axis.
func ConvOut(in, kernel, stride, pad, dil int) int {
	return (in+2*pad-dil*(kernel-1)-1)/stride + 1
}

func normWindow(attrs *Attrs) error {
	for i := range 2 {
		if attrs.Stride[i] == 0 {
			attrs.Stride[i] = 1
		}
		if attrs.Dilation[i] == 0 {
			attrs.Dilation[i] = 1
		}
		if attrs.Stride[i] < 0 || attrs.Dilation[i] < 0 || attrs.Padding[i] < 0 {
			return Errorf(ErrAttr, "stride %v, padding %v, dilation %v must not be negative", attrs.Stride, attrs.Padding, attrs.Dilation)
		}
	}
	return nil
}

func windowOut(op Op, attrs *Attrs, h, w, kh, kw int) (int, int, error) {
	if kh < 1 || kw < 1 {
		return 0, 0, Errorf(ErrShape, "%s kernel %dx%d is empty", op, kh, kw)
	}
	// Compare extents directly: ConvOut's division truncates toward zero, so
	// a kernel wider than the input by less than the stride would give 1.
	ph, pw := h+2*attrs.Padding[0], w+2*attrs.Padding[1]
	if attrs.Dilation[0]*(kh-1)+1 > ph || attrs.Dilation[1]*(kw-1)+1 > pw {
		return 0, 0, Errorf(ErrShape, "%s kernel %dx%d (dilation %v) is larger than the padded input %dx%d",
			op, kh, kw, attrs.Dilation, ph, pw)
	}
	ho := ConvOut(h, kh, attrs.Stride[0], attrs.Padding[0], attrs.Dilation[0])
	wo := ConvOut(w, kw, attrs.Stride[1], attrs.Padding[1], attrs.Dilation[1])
	return ho, wo, nil
}

func conv2dRule(_ Op, attrs *Attrs, in []Type, _ int) (Type, error) { return conv2d(attrs, in) }

// conv2d types a convolution of in (x, w[, b]), channels last when attrs
// says so.
func conv2d(attrs *Attrs, in []Type) (Type, error) {
	return channelsLast(attrs, in, func(in []Type) (Type, error) { return conv2dNCHW(attrs, in) })
}

func conv2dNCHW(attrs *Attrs, in []Type) (Type, error) {
	x, w := in[0], in[1]
	if err := needFloat(OpConv2d, in...); err != nil {
		return Type{}, err
	}
	if len(x.Shape) != 4 || len(w.Shape) != 4 {
		return Type{}, Errorf(ErrShape, "conv2d needs NCHW input and [out, in/groups, kh, kw] weight, got ranks %d and %d", len(x.Shape), len(w.Shape))
	}
	if err := normWindow(attrs); err != nil {
		return Type{}, err
	}
	if attrs.Groups == 0 {
		attrs.Groups = 1
	}
	g, c, o := attrs.Groups, x.Shape[1], w.Shape[0]
	if g < 0 || c%g != 0 || o%g != 0 {
		return Type{}, Errorf(ErrAttr, "conv2d groups %d must divide input channels %d and output channels %d", g, c, o)
	}
	if w.Shape[1] != c/g {
		return Type{}, Errorf(ErrShape, "conv2d weight has %d input channels per group, input has %d channels in %d groups", w.Shape[1], c, g)
	}
	if len(in) == 3 && !slices.Equal(in[2].Shape, []int{o}) {
		return Type{}, Errorf(ErrShape, "conv2d bias shape %v, want [%d]", in[2].Shape, o)
	}
	for _, t := range in[1:] {
		if t.DType != x.DType {
			return Type{}, Errorf(ErrDType, "conv2d of %s with %s", x.DType, t.DType)
		}
	}
	ho, wo, err := windowOut(OpConv2d, attrs, x.Shape[2], x.Shape[3], w.Shape[2], w.Shape[3])
	if err != nil {
		return Type{}, err
	}
	t := Type{Shape: []int{x.Shape[0], o, ho, wo}, DType: x.DType, BatchAxis: -1, PerSample: 1}
	if x.BatchAxis == 0 {
		t.BatchAxis, t.PerSample = 0, x.PerSample
	}
	return t, nil
}

func pool2dRule(op Op, attrs *Attrs, in []Type, _ int) (Type, error) { return pool2d(op, attrs, in[0]) }

// pool2d types a pooling of x, channels last when attrs says so.
func pool2d(op Op, attrs *Attrs, x Type) (Type, error) {
	return channelsLast(attrs, []Type{x}, func(in []Type) (Type, error) { return pool2dNCHW(op, attrs, in[0]) })
}

func pool2dNCHW(op Op, attrs *Attrs, x Type) (Type, error) {
	if err := needFloat(op, x); err != nil {
		return Type{}, err
	}
	if len(x.Shape) != 4 {
		return Type{}, Errorf(ErrShape, "%s needs an NCHW input, got rank %d", op, len(x.Shape))
	}
	if attrs.Kernel[0] < 1 || attrs.Kernel[1] < 1 {
		return Type{}, Errorf(ErrAttr, "%s kernel %v must be positive", op, attrs.Kernel)
	}
	if attrs.Stride == [2]int{} {
		attrs.Stride = attrs.Kernel // PyTorch's default
	}
	if op == OpAvgPool2d && attrs.Dilation != [2]int{} && attrs.Dilation != [2]int{1, 1} {
		return Type{}, Errorf(ErrAttr, "avg_pool2d has no dilation, got %v", attrs.Dilation)
	}
	if err := normWindow(attrs); err != nil {
		return Type{}, err
	}
	for i := range 2 {
		if 2*attrs.Padding[i] > attrs.Kernel[i] {
			return Type{}, Errorf(ErrAttr, "%s padding %v must be at most half the kernel %v", op, attrs.Padding, attrs.Kernel)
		}
	}
	ho, wo, err := windowOut(op, attrs, x.Shape[2], x.Shape[3], attrs.Kernel[0], attrs.Kernel[1])
	if err != nil {
		return Type{}, err
	}
	t := x
	t.Shape = []int{x.Shape[0], x.Shape[1], ho, wo}
	if x.BatchAxis > 1 {
		t.BatchAxis, t.PerSample = -1, 1
	}
	return t, nil
}
