package cuda

import (
	"errors"
	"fmt"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/graph"
)

// A channels-last convolution (x, y NHWC, w KRSC) that cuDNN does not take
// (ErrChannelsLast: a shape or dtype its NHWC kernels refuse, such as
// cuDNN 9.14's float16 depthwise input gradient, no cuDNN at all, or no
// algorithm within the workspace) runs as its NCHW twin on copies: its
// operands are transposed into NCHW copies at the start of its workspace,
// the NCHW path runs on them (cuDNN, else im2col) with the rest of the
// workspace as its own, and the result is transposed back into the
// node's output. Every convolution's declared workspace holds the copies:
// convDNNBytes counts one x, one y and one w, and convCopySlack their
// alignment, so the fallback needs no memory the plan did not count.

// convCopySlack is the alignment the three NCHW copies may add to their
// sizes: each starts on a 256-byte boundary, as cuDNN and cuBLAS want
// their operands and workspaces.
const convCopySlack = 3 * 256

// nchwCopyLayout is where convThroughNCHW puts the NCHW copies of a
// convolution's nx-element x, ny-element y and nw-element w, of size-byte
// elements, in its workspace: at xAt, yAt and wAt, with the NCHW path's
// own workspace from rest on.
func nchwCopyLayout(nx, ny, nw, size int64) (xAt, yAt, wAt, rest int64) {
	yAt = align256(xAt + size*nx)
	wAt = align256(yAt + size*ny)
	rest = align256(wAt + size*nw)
	return xAt, yAt, wAt, rest
}

// convThroughNCHW runs pass of the channels-last convolution whose
// attributes are a as its NCHW twin on copies (see above): for the
// forward pass in0, in1 are x, w (with bias b) and out is y; for
// grad_input dy, w and dx; for grad_weight dy, x and dw. refused is the
// error cuDNN's channels-last path gave, returned (with the reason) if
// the workspace cannot hold the copies.
func (k *kctx) convThroughNCHW(pass convPass, a *graph.Attrs, in0, in1 operand, b *operand, out operand, refused error) error {
	var x, y, w operand // the channels-last operands, as the pass names them
	switch pass {
	case convForward:
		x, w, y = in0, in1, out
	case convGradInput:
		y, w, x = in0, in1, out
	default:
		y, x, w = in0, in1, out
	}
	if len(x.shape) != 4 || len(y.shape) != 4 || len(w.shape) != 4 {
		return refused
	}
	dt := out.dt
	xAt, yAt, wAt, rest := nchwCopyLayout(x.n(), y.n(), w.n(), int64(dt.Size()))
	ws := k.ws
	if ws == nil || ws.Requested() < rest {
		var got int64
		if ws != nil {
			got = ws.Requested()
		}
		return fmt.Errorf("%w; its NCHW copies need %d bytes of workspace, the plan gave %d: %w", refused, rest, got, ErrWorkspace)
	}
	nchw := func(o operand, at int64) operand {
		return operand{p: ws.Ptr() + alloc.Ptr(at), shape: graph.ToNCHW(graph.Type{Shape: o.shape, BatchAxis: -1}).Shape, dt: o.dt}
	}
	xc, yc, wc := nchw(x, xAt), nchw(y, yAt), nchw(w, wAt)
	// [n, h·w, c] ↔ [n, c, h·w]: an NHWC tensor and its NCHW copy, the
	// weight's KRSC and KCRS alike ([o, kh·kw, c/g]).
	toNCHW := func(o operand, c operand) error {
		n, hw, ch := int64(o.shape[0]), int64(o.shape[1]*o.shape[2]), int64(o.shape[3])
		return k.transpose(dt, o.p, c.p, n, hw, ch)
	}
	fromNCHW := func(c operand, o operand) error {
		n, hw, ch := int64(o.shape[0]), int64(o.shape[1]*o.shape[2]), int64(o.shape[3])
		return k.transpose(dt, c.p, o.p, n, ch, hw)
	}
	at := *a
	at.ChannelsLast = false
	// The NCHW path's workspace is what follows the copies.
	k.ws = &wsView{p: ws.Ptr() + alloc.Ptr(rest), n: ws.Requested() - rest}
	defer func() { k.ws = ws }()
	var err error
	switch pass {
	case convForward:
		if err = errors.Join(toNCHW(x, xc), toNCHW(w, wc)); err == nil {
			err = k.conv2d(&at, xc, wc, b, yc)
		}
		if err == nil {
			err = fromNCHW(yc, y)
		}
	case convGradInput:
		if err = errors.Join(toNCHW(y, yc), toNCHW(w, wc)); err == nil {
			err = k.conv2dGradInput(&at, yc, wc, xc)
		}
		if err == nil {
			err = fromNCHW(xc, x)
		}
	default:
		if err = errors.Join(toNCHW(y, yc), toNCHW(x, xc)); err == nil {
			err = k.conv2dGradWeight(&at, yc, xc, wc)
		}
		if err == nil {
			err = fromNCHW(wc, w)
		}
	}
	if err != nil {
		return err
	}
	if k.nchwRuns != nil {
		k.nchwRuns.Add(1)
	}
	return nil
}
