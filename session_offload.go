package batchfit

import (
	"errors"
	"fmt"
	"math"

	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/optim"
	"github.com/batchfit/batchfit/planner"
	"github.com/batchfit/batchfit/precision"
)

// Offload names what a Session keeps in host memory rather than on the
// device (Options.Offload).
type Offload string

// The offload modes.
const (
	// OffloadNone keeps parameters, gradients and optimizer state on the
	// device (the default).
	OffloadNone Offload = ""
	// OffloadOptimizer is ZeRO-Offload's split: the float32 master
	// weights and Adam's moments live in page-locked host memory, updated
	// there by a multi-threaded AdamW (optim.Adam.StepOffload); the device
	// holds bfloat16 weights and gradients only, 4 bytes a parameter
	// instead of 16. It needs Precision "bf16-mixed" and an *optim.Adam.
	OffloadOptimizer Offload = "optimizer"
	// OffloadAuto lets the session choose between the two: the first
	// training step it plans (Plan or Step) is planned both ways, each
	// with its loss chunk, recompute set and batch chunks, and the
	// session offloads when that step's predicted time is the shorter of
	// the plans that fit (recompute's cost model, Options.Profile, whose
	// host bandwidth and host update rate price the optimizer's trip;
	// StepPlan.Levers lists both). A MaxBatch before any plan compares
	// the two places' largest batches by predicted samples a second. The session keeps that
	// choice for its life: the optimizer state lives where it started. It
	// offloads nothing under a policy other than "bf16-mixed", for an
	// optimizer other than Adam and AdamW, without a budget (everything
	// fits), or when an Eval has made parameters resident already.
	OffloadAuto Offload = "auto"
)

// ErrOffload is wrapped by the errors of an offload the session cannot
// run: an unknown mode, a policy other than bf16-mixed, an optimizer
// other than Adam and AdamW.
var ErrOffload = errors.New("offload")

// ParseOffload maps a name ("", "none", "optimizer", "auto") to its mode.
func ParseOffload(name string) (Offload, error) {
	switch name {
	case "", "none":
		return OffloadNone, nil
	case string(OffloadOptimizer):
		return OffloadOptimizer, nil
	case string(OffloadAuto):
		return OffloadAuto, nil
	}
	return "", fmt.Errorf("%w: unknown mode %q (want none, optimizer or auto)", ErrOffload, name)
}

// checkOffload is NewSession's check of Options.Offload under policy p.
func checkOffload(o Offload, p precision.Policy) error {
	if _, err := ParseOffload(string(o)); err != nil {
		return fmt.Errorf("Options.Offload: %w", err)
	}
	if o == OffloadOptimizer && p != precision.BF16Mixed {
		return fmt.Errorf("Options.Offload: %w: %q keeps bfloat16 weights and gradients on the device; it runs under Precision %q, not %q",
			ErrOffload, o, precision.BF16Mixed, p)
	}
	return nil
}

// offloading reports whether the session offloads its optimizer:
// Options.Offload says so, or OffloadAuto chose it (decideOffload).
func (s *Session) offloading() bool {
	return s.opts.Offload == OffloadOptimizer || s.offloadChosen.Load() == offloadOn
}

// Offload is where the session's optimizer runs: Options.Offload, or
// under OffloadAuto its choice once the first training step has been
// planned (OffloadNone or OffloadOptimizer; OffloadAuto until then).
func (s *Session) Offload() Offload {
	switch {
	case s.opts.Offload != OffloadAuto:
		return s.opts.Offload
	case s.offloadChosen.Load() == offloadOn:
		return OffloadOptimizer
	case s.offloadChosen.Load() == offloadOff:
		return OffloadNone
	}
	return OffloadAuto
}

// The states of an OffloadAuto session's choice (Session.offloadChosen).
const (
	offloadUndecided int32 = iota
	offloadOff
	offloadOn
)

// decideOffload makes an OffloadAuto session's choice at its first
// training step (OffloadAuto's rule) and returns the settings it weighed,
// or nil when there was nothing to decide. Both placements are planned on
// probe sessions (chooseOffload), so that this session's caches hold
// programs of the chosen placement only.
func (s *Session) decideOffload(loss *lazy.Tensor, params []*lazy.Tensor, opt optim.Optimizer) ([]LeverChoice, error) {
	var alts []LeverChoice
	err := s.chooseOffload(opt, func(probe func(Offload) *Session) (int32, error) {
		var (
			best int32
			err  error
		)
		alts, best, err = s.weighOffload(probe, loss, params, opt)
		return best, err
	})
	return alts, err
}

// chooseOffload runs weigh once, for an OffloadAuto session that has not
// chosen yet and may offload (bf16-mixed, an *optim.Adam, a budget, and
// nothing resident: an Eval before the first step keeps the device's),
// and stores its answer, offloadOff or offloadOn. weigh gets probe(o), a
// dry-run session of this one's options with Offload o, its device's
// workspace rule and overhead, and its budget now: with nothing
// resident, a probe's plan is the plan this session makes.
func (s *Session) chooseOffload(opt optim.Optimizer, weigh func(probe func(Offload) *Session) (int32, error)) error {
	if s.opts.Offload != OffloadAuto || s.offloadChosen.Load() != offloadUndecided {
		return nil
	}
	s.offloadMu.Lock()
	defer s.offloadMu.Unlock()
	if s.offloadChosen.Load() != offloadUndecided {
		return nil
	}
	budget, err := s.budget()
	if err != nil {
		return err
	}
	if _, adam := opt.(*optim.Adam); !adam || s.policy != precision.BF16Mixed || budget >= planner.Unlimited || len(s.be.Held()) > 0 {
		s.offloadChosen.Store(offloadOff)
		return nil
	}
	var probes []*Session
	defer func() {
		for _, p := range probes {
			p.Close()
		}
	}()
	best, err := weigh(func(o Offload) *Session {
		opts := s.opts
		opts.Offload, opts.Budget, opts.Device = o, budget+s.be.Overhead(), DeviceCPU
		opts.DryRun = &DryRun{Workspace: s.be.Workspace(), Overhead: s.be.Overhead()}
		p := NewSession(opts)
		probes = append(probes, p)
		return p
	})
	if err != nil {
		return err
	}
	s.offloadChosen.Store(best)
	return nil
}

// weighOffload plans the step both ways on probe sessions and returns
// every setting weighed and the placement of the shortest predicted step
// that fits; a tie, or nothing fitting, keeps the device's.
func (s *Session) weighOffload(probe func(Offload) *Session, loss *lazy.Tensor, params []*lazy.Tensor, opt optim.Optimizer) ([]LeverChoice, int32, error) {
	var alts []LeverChoice
	best, bestSeconds := offloadOff, math.Inf(1)
	for _, o := range []Offload{OffloadNone, OffloadOptimizer} {
		sp, err := probe(o).Plan(loss, params, opt)
		var dnf *planner.DoesNotFitError
		if sp == nil || err != nil && !errors.As(err, &dnf) {
			if o == OffloadNone {
				return nil, 0, err
			}
			// A step the offloaded optimizer cannot run: the device's it is.
			alts = append(alts, LeverChoice{Offload: o, Err: err})
			continue
		}
		tried := sp.Levers
		if len(tried) == 0 { // no fused loss: one setting
			c := LeverChoice{Offload: o, Recompute: sp.Recompute.Strategy, Plan: sp.Plan, Err: err, Chosen: sp.Plan != nil}
			if sp.Plan != nil {
				c.Seconds, c.OffloadSeconds = s.predicted(sp.Program, sp.Plan)
			}
			tried = []LeverChoice{c}
		}
		for _, c := range tried {
			if c.Chosen && c.Plan != nil && c.Seconds < bestSeconds { // a tie keeps the device's
				best, bestSeconds = offloadOff, c.Seconds
				if o == OffloadOptimizer {
					best = offloadOn
				}
			}
		}
		alts = append(alts, tried...)
	}
	for i := range alts {
		alts[i].Chosen = alts[i].Chosen && (alts[i].Offload == OffloadOptimizer) == (best == offloadOn)
	}
	return alts, best, nil
}

// offloadOptimizer refuses an optimizer an offloaded step cannot run.
func offloadOptimizer(opt optim.Optimizer) error {
	if _, ok := opt.(*optim.Adam); !ok {
		return &graph.OpError{Op: "step", Err: fmt.Errorf("%w: Options.Offload %q runs Adam and AdamW (*optim.Adam), not %T",
			ErrOffload, OffloadOptimizer, opt)}
	}
	return nil
}

// HostPinned is the host memory the session's executor holds for an
// offloaded optimizer (Options.Offload): every trained parameter's float32
// master, its optimizer state and its bfloat16 staging buffer, page-locked
// on CUDA. LastPlan().HostPinned predicts it, to the byte.
func (s *Session) HostPinned() int64 {
	if p, ok := s.be.(interface{ OffloadPinned() int64 }); ok {
		return p.OffloadPinned()
	}
	return 0
}
