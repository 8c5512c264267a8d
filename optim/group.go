package optim

import (
	"fmt"
	"math"
	"strings"

	"gorgonia.org/tensor"
)

// Group is a parameter group (one of PyTorch's param_groups): parameters,
// by key, with hyperparameters of their own. Each optimizer reads the
// fields it has (SGD: LR, WeightDecay, Momentum, Dampening, Nesterov;
// Adam: LR, WeightDecay, Beta1, Beta2, Eps). AddGroup makes one with the
// optimizer's own values, to change from there.
type Group struct {
	// Name is for messages and checkpoints ("no_decay").
	Name string
	// Keys are the parameters' keys (Param.Key; in a batchfit.Session
	// each parameter's host tensor, lazy.Tensor.Value(): see Keys).
	Keys []any
	// LR is the group's base learning rate, which Schedule scales.
	LR, WeightDecay float64
	// Adam's.
	Beta1, Beta2, Eps float64
	// SGD's.
	Momentum, Dampening float64
	Nesterov            bool
}

// Hyper is one group's hyperparameters at one step, the schedule applied:
// what an update reads.
type Hyper struct {
	LR, WeightDecay   float64
	Beta1, Beta2, Eps float64
	Momentum          float64
	Dampening         float64
	Nesterov          bool
	// Decay is AdamW's factor 1 − LR·WeightDecay, computed once per step
	// in float64 (the kernels read it rather than compute it, so host and
	// device agree bit for bit).
	Decay float64
}

func (h Hyper) check(opt, group string) error {
	for _, f := range []struct {
		name string
		v    float64
	}{{"lr", h.LR}, {"weight_decay", h.WeightDecay}, {"eps", h.Eps}, {"momentum", h.Momentum}, {"dampening", h.Dampening}} {
		if f.v < 0 || math.IsNaN(f.v) || math.IsInf(f.v, 0) {
			return fmt.Errorf("%w: %s group %q: %s = %g must be finite and non-negative", ErrOptim, opt, group, f.name, f.v)
		}
	}
	return nil
}

// Named is a parameter as the grouping helpers see it: *lazy.Tensor and
// *nn.Param satisfy it.
type Named interface {
	Name() string
	Shape() []int
	Value() tensor.Tensor
}

// NoDecay reports whether the usual recipe keeps weight decay off a
// parameter of this name and shape: every parameter of fewer than two
// dimensions (biases, norms' scales and shifts, scalars), and any whose
// name's last part is "bias" or has a part naming a norm ("ln_1",
// "layernorm", "input_layernorm", "norm", "rmsnorm", "bn1"), as
// nanoGPT's and Hugging Face Trainer's rules do between them. Embeddings
// and weight matrices decay.
func NoDecay(name string, shape []int) bool {
	if len(shape) < 2 {
		return true
	}
	parts := strings.Split(strings.ToLower(name), ".")
	if parts[len(parts)-1] == "bias" {
		return true
	}
	for _, p := range parts {
		if strings.Contains(p, "norm") || p == "ln" || strings.HasPrefix(p, "ln_") || strings.HasPrefix(p, "bn") && len(p) <= 3 {
			return true
		}
	}
	return false
}

// SplitDecay splits params by NoDecay, keeping their order: those that
// take weight decay and those that do not.
func SplitDecay[P Named](params []P) (decay, noDecay []P) {
	for _, p := range params {
		if NoDecay(p.Name(), p.Shape()) {
			noDecay = append(noDecay, p)
		} else {
			decay = append(decay, p)
		}
	}
	return decay, noDecay
}

// Keys are params' keys as a batchfit.Session gives them to the
// optimizer: each parameter's host tensor.
func Keys[P Named](params []P) []any {
	keys := make([]any, len(params))
	for i, p := range params {
		keys[i] = p.Value()
	}
	return keys
}

// groupIndex maps each key of groups to its group's index + 1 (0 is the
// default group), or fails when a key is in two groups.
func groupIndex(opt string, groups []*Group) (map[any]int, error) {
	if len(groups) == 0 {
		return nil, nil
	}
	idx := map[any]int{}
	for gi, g := range groups {
		if g == nil {
			return nil, fmt.Errorf("%w: %s group %d is nil", ErrOptim, opt, gi)
		}
		for _, k := range g.Keys {
			if k == nil {
				return nil, fmt.Errorf("%w: %s group %q lists a nil key", ErrOptim, opt, g.Name)
			}
			if was, dup := idx[k]; dup && was != gi+1 {
				return nil, fmt.Errorf("%w: %s: a parameter is in groups %q and %q", ErrOptim, opt, groups[was-1].Name, g.Name)
			}
			idx[k] = gi + 1
		}
	}
	return idx, nil
}
