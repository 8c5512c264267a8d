package cpu

import (
	"gonum.org/v1/gonum/blas"

	"github.com/batchfit/batchfit/graph"
)

// col2im is the adjoint of im2col: it adds each entry of col, a
// [c·kh·kw, ho·wo] matrix, into the input position that kernel tap saw.
func (wd *window) col2im(col []float32, c int, dst []float32) {
	hw, howo := wd.h*wd.w, wd.ho*wd.wo
	row := 0
	for ci := range c {
		plane := dst[ci*hw : (ci+1)*hw]
		for ki := range wd.kh {
			ohLo, ohHi := span(ki*wd.dh, wd.sh, wd.ph, wd.h, wd.ho)
			for kj := range wd.kw {
				src := col[row*howo : (row+1)*howo]
				row++
				owLo, owHi := span(kj*wd.dw, wd.sw, wd.pw, wd.w, wd.wo)
				for oh := ohLo; oh < ohHi; oh++ {
					ih := oh*wd.sh - wd.ph + ki*wd.dh
					iw := owLo*wd.sw - wd.pw + kj*wd.dw
					p := plane[ih*wd.w:]
					for ow := owLo; ow < owHi; ow++ {
						p[iw] += src[oh*wd.wo+ow]
						iw += wd.sw
					}
				}
			}
		}
	}
}

// convGradGeometry validates a conv gradient's buffers: x is the forward
// input (or its gradient), w the weight (or its gradient), g the upstream
// gradient shaped like the forward output.
func convGradGeometry(op string, a *graph.Attrs, x, w, g *buf) (window, int, error) {
	if err := checkLen(op+" weight", w); err != nil {
		return window{}, 0, err
	}
	if len(w.shape) != 4 {
		return window{}, 0, graph.Errorf(graph.ErrShape, "%s weight must be [out, in/groups, kh, kw], got %v", op, w.shape)
	}
	wd, err := newWindow(op, x, g, w.shape[2], w.shape[3], a, w.shape[0])
	if err != nil {
		return window{}, 0, err
	}
	if a.Groups < 1 || wd.c%a.Groups != 0 || w.shape[0]%a.Groups != 0 || wd.c/a.Groups != w.shape[1] {
		return window{}, 0, graph.Errorf(graph.ErrShape, "%s weight %v does not fit input %v in %d groups", op, w.shape, x.shape, a.Groups)
	}
	return wd, a.Groups, nil
}

// conv2dGradInputKernel: per sample and group, dcol = W_gᵀ·g_g, folded back
// into the input gradient by col2im.
func conv2dGradInputKernel(a *graph.Attrs, g, w, out *buf) error {
	wd, groups, err := convGradGeometry("conv2d_grad_input", a, out, w, g)
	if err != nil {
		return err
	}
	clear(out.f)
	o, cg := w.shape[0], w.shape[1]
	og, kk, howo := o/groups, cg*wd.kh*wd.kw, wd.ho*wd.wo
	col := make([]float32, kk*howo)
	chw, cghw := wd.c*wd.h*wd.w, cg*wd.h*wd.w
	for ni := range wd.n {
		for gi := range groups {
			gg := g.f[(ni*o+gi*og)*howo : (ni*o+(gi+1)*og)*howo]
			gemm(blas.Trans, blas.NoTrans, kk, howo, og, w.f[gi*og*kk:(gi+1)*og*kk], max(kk, 1), gg, max(howo, 1), 0, col, max(howo, 1))
			wd.col2im(col, cg, out.f[ni*chw+gi*cghw:ni*chw+(gi+1)*cghw])
		}
	}
	return nil
}

// conv2dGradWeightKernel: dW_g = Σ over samples of g_g·colᵀ, with col the
// unfolded patches of the forward input.
func conv2dGradWeightKernel(a *graph.Attrs, g, x, out *buf) error {
	wd, groups, err := convGradGeometry("conv2d_grad_weight", a, x, out, g)
	if err != nil {
		return err
	}
	clear(out.f)
	o, cg := out.shape[0], out.shape[1]
	og, kk, howo := o/groups, cg*wd.kh*wd.kw, wd.ho*wd.wo
	col := make([]float32, kk*howo)
	chw, cghw := wd.c*wd.h*wd.w, cg*wd.h*wd.w
	for ni := range wd.n {
		for gi := range groups {
			wd.im2col(x.f[ni*chw+gi*cghw:ni*chw+(gi+1)*cghw], cg, col)
			gg := g.f[(ni*o+gi*og)*howo : (ni*o+(gi+1)*og)*howo]
			gemm(blas.NoTrans, blas.Trans, og, kk, howo, gg, max(howo, 1), col, max(howo, 1), 1, out.f[gi*og*kk:(gi+1)*og*kk], max(kk, 1))
		}
	}
	return nil
}
