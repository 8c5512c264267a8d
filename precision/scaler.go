package precision

import (
	"errors"
	"fmt"
	"math"

	"gorgonia.org/tensor"
)

// LossScale configures dynamic loss scaling, with the semantics and
// defaults of PyTorch's torch.cuda.amp.GradScaler. A batchfit.Session
// scales the loss under fp16-mixed unless Off is set, and under no other
// policy (bfloat16 has float32's exponent range and needs none). The zero
// value is GradScaler's defaults.
//
// Each step the loss is multiplied by the scale S before the backward
// pass, so that small gradients stay representable in float16; the
// float32 parameter gradients are multiplied by 1/S once they are summed
// over the batch's chunks. If any of them is then inf or NaN, the
// optimizer step is skipped (parameters and optimizer state untouched,
// Adam's step count included) and S is multiplied by Backoff, but never
// below MinScale; otherwise the step runs, and after Interval consecutive
// good steps S is multiplied by Growth (if the product is finite). A step
// skipped with S already at MinScale is a collapse: the gradients overflow
// whatever the scale (the model diverged, or its data holds an inf or
// NaN), and Scaler.Update reports it with an error wrapping
// ErrScaleCollapse rather than skip every step from then on in silence.
type LossScale struct {
	// Off turns loss scaling off: fp16-mixed then trains without it, and
	// small gradients may underflow to zero in float16.
	Off bool
	// Init is the initial scale; 65536 (2¹⁶) when 0.
	Init float64
	// Growth multiplies the scale after Interval good steps in a row; 2
	// when 0. It must exceed 1.
	Growth float64
	// Backoff multiplies the scale after a step with an inf or NaN
	// gradient; 0.5 when 0. It must lie strictly between 0 and 1.
	Backoff float64
	// Interval is how many consecutive good steps grow the scale; 2000
	// when 0.
	Interval int
	// MinScale is the floor of the scale, DeepSpeed's min_loss_scale: 1
	// when 0, or Init when Init is below 1. It must lie between 2⁻¹²⁶
	// (float32's smallest normal value, whose reciprocal, the unscale
	// factor, is finite) and Init. PyTorch's GradScaler has no floor: its
	// scale sinks to float32's subnormals after some 150 bad steps in a
	// row, 1/S overflows, and every later step is skipped too.
	MinScale float64
}

// GradScaler's defaults, which the zero LossScale takes.
const (
	DefaultInitScale      = 1 << 16
	DefaultGrowth         = 2.0
	DefaultBackoff        = 0.5
	DefaultGrowthInterval = 2000
	DefaultMinScale       = 1
	// SmallestMinScale is the least MinScale: 2⁻¹²⁶, float32's smallest
	// normal value; 1/S is finite down to it.
	SmallestMinScale = 0x1p-126
)

// ErrLossScale is wrapped by the error a LossScale that is out of range
// gives.
var ErrLossScale = errors.New("invalid loss scale options")

// ErrScaleCollapse is wrapped by the error Scaler.Update (and so a
// Session's Step) returns for a step whose gradients hold an inf or NaN
// with the scale already at LossScale.MinScale: backing off further
// cannot help, so the collapse is reported rather than skipped in
// silence. The step updated nothing.
var ErrScaleCollapse = errors.New("loss scale collapsed")

// withDefaults fills the zero fields with GradScaler's defaults.
func (o LossScale) withDefaults() LossScale {
	if o.Init == 0 {
		o.Init = DefaultInitScale
	}
	if o.Growth == 0 {
		o.Growth = DefaultGrowth
	}
	if o.Backoff == 0 {
		o.Backoff = DefaultBackoff
	}
	if o.Interval == 0 {
		o.Interval = DefaultGrowthInterval
	}
	if o.MinScale == 0 {
		o.MinScale = min(DefaultMinScale, o.Init)
	}
	return o
}

// Validate refuses options out of range, with an error wrapping
// ErrLossScale; zero fields stand for the defaults.
func (o LossScale) Validate() error {
	d := o.withDefaults()
	switch {
	case !(d.Init > 0) || float32(d.Init) > math.MaxFloat32 || float32(d.Init) == 0:
		return fmt.Errorf("%w: Init %g is not a positive float32", ErrLossScale, o.Init)
	case !(d.MinScale >= SmallestMinScale && d.MinScale <= d.Init):
		return fmt.Errorf("%w: MinScale %g (Init %g) must lie between 2⁻¹²⁶ and Init", ErrLossScale, d.MinScale, d.Init)
	case !(d.Growth > 1) || math.IsInf(d.Growth, 0):
		return fmt.Errorf("%w: Growth %g must be finite and above 1", ErrLossScale, o.Growth)
	case !(d.Backoff > 0 && d.Backoff < 1):
		return fmt.Errorf("%w: Backoff %g must lie strictly between 0 and 1", ErrLossScale, o.Backoff)
	case d.Interval < 1:
		return fmt.Errorf("%w: Interval %d must be at least 1", ErrLossScale, o.Interval)
	}
	return nil
}

// Scaler is dynamic loss scaling's state across steps: the scale S, a
// float32 as GradScaler keeps it, and the run of good steps since it last
// changed. It is not safe for concurrent use.
type Scaler struct {
	o       LossScale
	scale   float32
	floor   float32 // o.MinScale as a float32
	bad     int     // consecutive steps with an inf or NaN
	good    int     // consecutive steps without inf or NaN since the scale last changed
	steps   int
	skipped int
	last    bool
	data    *tensor.Dense // the scale constant's data, made anew when scale changes
}

// NewScaler returns a scaler at o's initial scale; o.Off is ignored.
func NewScaler(o LossScale) (*Scaler, error) {
	if err := o.Validate(); err != nil {
		return nil, err
	}
	o = o.withDefaults()
	return &Scaler{o: o, scale: float32(o.Init), floor: max(float32(o.MinScale), SmallestMinScale)}, nil
}

// Scale is the current scale S, the loss's factor in the next step.
func (s *Scaler) Scale() float32 { return s.scale }

// Data is the current scale as a float32 scalar tensor, the data of the
// scale constant Step.ScaleLoss appends. It is the same tensor until the scale
// changes, so an executor that keeps constants resident uploads it once
// per scale rather than once per step.
func (s *Scaler) Data() *tensor.Dense {
	if s.data == nil || s.data.Data().(float32) != s.scale {
		s.data = tensor.New(tensor.FromScalar(s.scale))
	}
	return s.data
}

// Update records a step's outcome, as GradScaler.update does: finite
// reports that every unscaled gradient was finite (the optimizer step
// ran). A skipped step multiplies the scale by Backoff, down to MinScale,
// and restarts the run of good steps; the Interval-th good step in a row
// multiplies it by Growth, unless the product overflows float32. A step
// skipped at MinScale returns an error wrapping ErrScaleCollapse (the
// outcome is recorded all the same); every other update returns nil.
func (s *Scaler) Update(finite bool) error {
	s.steps++
	s.last = !finite
	if !finite {
		s.skipped++
		s.bad++
		s.good = 0
		if s.scale <= s.floor {
			return fmt.Errorf("%w: %d steps in a row had an inf or NaN gradient, the latest at the smallest scale %g (LossScale.MinScale): "+
				"the gradients overflow whatever the scale; the step updated nothing", ErrScaleCollapse, s.bad, s.scale)
		}
		s.scale = max(float32(float64(s.scale)*s.o.Backoff), s.floor)
		return nil
	}
	s.bad = 0
	s.good++
	if s.good == s.o.Interval {
		if grown := float32(float64(s.scale) * s.o.Growth); !math.IsInf(float64(grown), 0) {
			s.scale = grown
		}
		s.good = 0
	}
	return nil
}

// Stats is what a Scaler has seen.
func (s *Scaler) Stats() ScalerStats {
	return ScalerStats{Scale: s.scale, Steps: s.steps, Skipped: s.skipped, GoodInARow: s.good, SkippedInARow: s.bad, LastSkipped: s.last}
}

// SetStats restores a scaler's state from st, as a checkpoint saved it
// (Stats): the scale, the runs of good and skipped steps and the counts,
// so the next step scales, grows, backs off and collapses exactly as it
// would have. A scale that is not a finite float32 at or above
// LossScale.MinScale, a run of good steps outside [0, Interval), or runs
// and counts that do not add up are refused with ErrLossScale, and
// nothing changes.
func (s *Scaler) SetStats(st ScalerStats) error {
	switch {
	case !(st.Scale > 0) || math.IsInf(float64(st.Scale), 0):
		return fmt.Errorf("%w: scale %g is not a finite positive float32", ErrLossScale, st.Scale)
	case st.Scale < s.floor:
		return fmt.Errorf("%w: scale %g is below LossScale.MinScale %g", ErrLossScale, st.Scale, s.floor)
	case st.GoodInARow < 0 || st.GoodInARow >= s.o.Interval:
		return fmt.Errorf("%w: %d good steps in a row, outside [0, %d)", ErrLossScale, st.GoodInARow, s.o.Interval)
	case st.Skipped < 0 || st.Steps < st.Skipped || st.SkippedInARow < 0 || st.SkippedInARow > st.Skipped ||
		st.LastSkipped != (st.SkippedInARow > 0) || st.SkippedInARow > 0 && st.GoodInARow > 0:
		return fmt.Errorf("%w: %d steps with %d skipped, %d of them in a row with %d good after (last skipped: %v), do not add up",
			ErrLossScale, st.Steps, st.Skipped, st.SkippedInARow, st.GoodInARow, st.LastSkipped)
	}
	s.scale, s.good, s.bad, s.steps, s.skipped, s.last = st.Scale, st.GoodInARow, st.SkippedInARow, st.Steps, st.Skipped, st.LastSkipped
	return nil
}

// ScalerStats describes dynamic loss scaling after some steps
// (batchfit.Session.LossScale).
type ScalerStats struct {
	// Scale is the scale the next step multiplies its loss by; 0 when
	// loss scaling is off.
	Scale float32
	// Steps counts the steps scaled so far, Skipped those whose update was
	// skipped for an inf or NaN gradient.
	Steps, Skipped int
	// GoodInARow counts the steps without inf or NaN since the scale last
	// changed (GradScaler's growth tracker): at LossScale.Interval the
	// scale grows.
	GoodInARow int
	// SkippedInARow counts the latest steps skipped in a row (0 after a
	// good step); a collapse's error (ErrScaleCollapse) names it.
	SkippedInARow int
	// LastSkipped reports that the latest step's update was skipped.
	LastSkipped bool
}
