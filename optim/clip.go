package optim

import (
	"errors"
	"fmt"
	"math"
)

// Clip is global-norm gradient clipping, torch.nn.utils.clip_grad_norm_
// with error_if_nonfinite=False, applied by the optimizer before its
// update. The total norm is taken over every parameter's gradient
// together; when it exceeds MaxNorm every gradient is scaled by
// MaxNorm/(norm + 1e-6):
//
//	coef = min(1, MaxNorm · (1/(norm + 1e-6)))   (float32, as PyTorch's)
//	g ← g·coef                                    (float32 products)
//
// An infinite norm gives coef 0 and a NaN norm coef NaN, as in PyTorch
// (the update then zeroes or poisons the step; under fp16 loss scaling a
// non-finite gradient skips the step before clipping, as GradScaler's
// recipe does). The gradients themselves are left as they are: the
// update reads them scaled. LastGradNorm gives the norm afterwards.
type Clip struct {
	// MaxNorm is the largest norm kept; 0 turns clipping off.
	MaxNorm float64
	// NormType is 2 (the default when 0) or math.Inf(1).
	NormType float64
}

// On reports whether c clips.
func (c Clip) On() bool { return c.MaxNorm > 0 }

// check refuses a MaxNorm that is negative or not finite and a norm type
// other than 2 and +Inf; it returns c with NormType 2 for 0.
func (c Clip) check(opt string) (Clip, error) {
	if c.MaxNorm < 0 || math.IsNaN(c.MaxNorm) || math.IsInf(c.MaxNorm, 0) {
		return c, fmt.Errorf("%w: %s clip MaxNorm %g must be finite and non-negative", ErrOptim, opt, c.MaxNorm)
	}
	if c.NormType == 0 {
		c.NormType = 2
	}
	if c.NormType != 2 && !math.IsInf(c.NormType, 1) {
		return c, fmt.Errorf("%w: %s clip NormType %g: 2 and +Inf are supported", ErrOptim, opt, c.NormType)
	}
	return c, nil
}

// Inf reports whether c takes the largest magnitude rather than the
// 2-norm.
func (c Clip) Inf() bool { return math.IsInf(c.NormType, 1) }

// ClipEps is the 1e-6 that clip_grad_norm_ adds to the norm.
const ClipEps = 1e-6

// ClipCoef is the factor gradients of total norm norm are multiplied by
// under max norm maxNorm, computed as PyTorch computes it for float32
// gradients: the norm rounded to float32, 1/(norm + 1e-6) in float32,
// times maxNorm, clamped to at most 1 (a NaN stays NaN).
func ClipCoef(norm, maxNorm float64) float32 {
	r := 1 / (float32(norm) + float32(ClipEps))
	c := r * float32(maxNorm)
	if c > 1 {
		c = 1
	}
	return c
}

// GradNorm is the total norm of grads together: the 2-norm, the square
// root of the sum of squares in float64 in order, or with inf the largest
// magnitude; a NaN anywhere makes it NaN. Each slice counts once per
// appearance, as each parameter's gradient does.
func GradNorm(grads [][]float32, inf bool) float64 {
	var acc float64
	for _, g := range grads {
		for _, x := range g {
			v := float64(x)
			if inf {
				a := math.Abs(v)
				if a > acc || math.IsNaN(a) {
					acc = a
				}
				if math.IsNaN(acc) {
					return acc
				}
			} else {
				acc += v * v
			}
		}
	}
	if inf {
		return acc
	}
	return math.Sqrt(acc)
}

// gradNorm is the latest clipped step's norm: a value, or a function
// that reads it from a device (waiting for it) the first time it is
// asked for.
type gradNorm struct {
	set  bool
	v    float64
	read func() (float64, error)
	gen  uint64 // which step set it, so a read caches only its own step's value
}

// ErrNoGradNorm is returned by LastGradNorm before any step has clipped.
var ErrNoGradNorm = errors.New("optimizer: no step has clipped gradients yet")

// LastGradNorm is the total gradient norm of the latest step that clipped
// (Clip), before clipping, as clip_grad_norm_ returns it. When the step
// ran on a device it is read from there now, waiting for the step's
// kernels: the step itself never waits for it. It fails with
// ErrNoGradNorm before any step has clipped.
func (c *Common) LastGradNorm() (float64, error) {
	c.mu.Lock()
	n := c.norm
	c.mu.Unlock()
	switch {
	case !n.set:
		return 0, ErrNoGradNorm
	case n.read == nil:
		return n.v, nil
	}
	v, err := n.read()
	if err != nil {
		return 0, err
	}
	c.mu.Lock()
	if c.norm.gen == n.gen { // no later step has replaced the reader
		c.norm = gradNorm{set: true, v: v, gen: n.gen}
	}
	c.mu.Unlock()
	return v, nil
}

// SetGradNormReader is for executors that clip on their device: read
// returns the norm the step just queued computed, waiting for it, and
// LastGradNorm calls it only when asked.
func (c *Common) SetGradNormReader(read func() (float64, error)) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.setNorm(gradNorm{set: true, read: read})
}

// setNorm records the latest clipped step's norm. With c.mu held.
func (c *Common) setNorm(n gradNorm) {
	n.gen = c.norm.gen + 1
	c.norm = n
}
