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
// Adam's step count included) and S is multiplied by Backoff; otherwise
// the step runs, and after Interval consecutive good steps S is multiplied
// by Growth (if the product is finite).
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
}

// GradScaler's defaults, which the zero LossScale takes.
const (
	DefaultInitScale      = 1 << 16
	DefaultGrowth         = 2.0
	DefaultBackoff        = 0.5
	DefaultGrowthInterval = 2000
)

// ErrLossScale is wrapped by the error a LossScale that is out of range
// gives.
var ErrLossScale = errors.New("invalid loss scale options")

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
	return o
}

// Validate refuses options out of range, with an error wrapping
// ErrLossScale; zero fields stand for the defaults.
func (o LossScale) Validate() error {
	d := o.withDefaults()
	switch {
	case !(d.Init > 0) || float32(d.Init) > math.MaxFloat32 || float32(d.Init) == 0:
		return fmt.Errorf("%w: Init %g is not a positive float32", ErrLossScale, o.Init)
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
	good    int // consecutive steps without inf or NaN since the scale last changed
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
	return &Scaler{o: o, scale: float32(o.Init)}, nil
}

// Scale is the current scale S, the loss's factor in the next step.
func (s *Scaler) Scale() float32 { return s.scale }

// Data is the current scale as a float32 scalar tensor, the data of the
// scale constant TrainWith appends. It is the same tensor until the scale
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
// ran). A skipped step multiplies the scale by Backoff (down to float32's
// smallest positive value, never 0) and restarts the run of good steps; the Interval-th good step in a row multiplies it by
// Growth, unless the product overflows float32.
func (s *Scaler) Update(finite bool) {
	s.steps++
	s.last = !finite
	if !finite {
		s.skipped++
		s.good = 0
		// A scale that underflowed to 0 would zero the gradients rather
		// than skip the steps; it stops at float32's smallest instead.
		s.scale = max(float32(float64(s.scale)*s.o.Backoff), math.SmallestNonzeroFloat32)
		return
	}
	s.good++
	if s.good == s.o.Interval {
		if grown := float32(float64(s.scale) * s.o.Growth); !math.IsInf(float64(grown), 0) {
			s.scale = grown
		}
		s.good = 0
	}
}

// Stats is what a Scaler has seen.
func (s *Scaler) Stats() ScalerStats {
	return ScalerStats{Scale: s.scale, Steps: s.steps, Skipped: s.skipped, GoodInARow: s.good, LastSkipped: s.last}
}

// SetStats restores a scaler's state from st, as a checkpoint saved it
// (Stats): the scale, the run of good steps and the counts, so the next
// step scales and grows exactly as it would have. A scale that is not a
// finite positive float32, a run of good steps outside [0, Interval) or
// counts that do not add up are refused with ErrLossScale, and nothing
// changes.
func (s *Scaler) SetStats(st ScalerStats) error {
	switch {
	case !(st.Scale > 0) || math.IsInf(float64(st.Scale), 0):
		return fmt.Errorf("%w: scale %g is not a finite positive float32", ErrLossScale, st.Scale)
	case st.GoodInARow < 0 || st.GoodInARow >= s.o.Interval:
		return fmt.Errorf("%w: %d good steps in a row, outside [0, %d)", ErrLossScale, st.GoodInARow, s.o.Interval)
	case st.Skipped < 0 || st.Steps < st.Skipped || st.LastSkipped && st.Skipped == 0:
		return fmt.Errorf("%w: %d steps with %d skipped (last skipped: %v) do not add up", ErrLossScale, st.Steps, st.Skipped, st.LastSkipped)
	}
	s.scale, s.good, s.steps, s.skipped, s.last = st.Scale, st.GoodInARow, st.Steps, st.Skipped, st.LastSkipped
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
	// LastSkipped reports that the latest step's update was skipped.
	LastSkipped bool
}
