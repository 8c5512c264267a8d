package graph

// Channels-last (NHWC) storage of conv nets' 4-D values.
//
// A node with Attrs.ChannelsLast (conv2d, max_pool2d, avg_pool2d,
// batch_norm and their gradients) reads and writes its 4-D operands
// channels last: activations [N, H, W, C] rather than [N, C, H, W], and a
// convolution's weight [O, kh, kw, C/g] (cuDNN's KRSC) rather than [O,
// C/g, kh, kw]. Its rule types it by the NCHW rule applied to the NCHW
// views of its operands (ToNCHW), the result viewed channels last again
// (ToNHWC): the same checks, the same byte counts. Package layout
// rewrites conv nets into this form, with explicit permute nodes where
// values enter and leave it; every executor runs these nodes (cuDNN's NHWC
// kernels on CUDA; the CPU and the reference convert to NCHW and back).

// PermNHWC permutes an NCHW value to NHWC (and a [O, C/g, kh, kw] weight
// to [O, kh, kw, C/g]); PermNCHW is its inverse.
var (
	PermNHWC = []int{0, 2, 3, 1}
	PermNCHW = []int{0, 3, 1, 2}
)

// ToNCHW is the NCHW view of a channels-last 4-D type (t itself for other
// ranks): its shape permuted by PermNCHW, its batch axis following.
func ToNCHW(t Type) Type { return permuteType(t, PermNCHW) }

// ToNHWC is the channels-last view of an NCHW 4-D type (t itself for
// other ranks).
func ToNHWC(t Type) Type { return permuteType(t, PermNHWC) }

func permuteType(t Type, perm []int) Type {
	if len(t.Shape) != 4 {
		return t
	}
	out := t
	out.Shape = make([]int, 4)
	for i, p := range perm {
		out.Shape[i] = t.Shape[p]
		if p == t.BatchAxis {
			out.BatchAxis = i
		}
	}
	return out
}

// channelsLast applies rule to the NCHW views of in when attrs asks for
// channels last, returning the result's channels-last view; it calls rule
// on in as they are otherwise. Every 4-D operand of these ops is an
// activation or a convolution weight, so each is viewed the same way.
func channelsLast(attrs *Attrs, in []Type, rule func([]Type) (Type, error)) (Type, error) {
	if !attrs.ChannelsLast {
		return rule(in)
	}
	v := make([]Type, len(in))
	for i, t := range in {
		v[i] = ToNCHW(t)
	}
	t, err := rule(v)
	if err != nil {
		return t, err
	}
	return ToNHWC(t), nil
}
