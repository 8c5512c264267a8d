package batchfit

import (
	"errors"
	"fmt"

	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/optim"
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
)

// ErrOffload is wrapped by the errors of an offload the session cannot
// run: an unknown mode, a policy other than bf16-mixed, an optimizer
// other than Adam and AdamW.
var ErrOffload = errors.New("offload")

// ParseOffload maps a name ("", "none", "optimizer") to its mode.
func ParseOffload(name string) (Offload, error) {
	switch name {
	case "", "none":
		return OffloadNone, nil
	case string(OffloadOptimizer):
		return OffloadOptimizer, nil
	}
	return "", fmt.Errorf("%w: unknown mode %q (want none or optimizer)", ErrOffload, name)
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

// offloading reports whether the session offloads its optimizer.
func (s *Session) offloading() bool { return s.opts.Offload == OffloadOptimizer }

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
