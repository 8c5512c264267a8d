package checkpoint

import (
	"fmt"
	"math"
	"strconv"

	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/data"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/hf"
	"github.com/batchfit/batchfit/models"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/optim"
)

// Training is the state of a training run that a checkpoint saves and
// restores. Save reads every field; Load restores into the model, the
// optimizer and the session, and sets Step, Data and Meta.
type Training struct {
	// Model is the model trained (required). Its Dropout modules'
	// counters and its buffers (nn.Buffers: batch norms' running
	// statistics) are saved with its parameters.
	Model nn.Module
	// Params are the parameters saved, nil for all of Model's
	// (Model.Params()). With all of them, a models.GPT or a Llama-family
	// model (a Config() models.LlamaConfig method) is saved as Hugging
	// Face saves it (hf.Save: model.safetensors and config.json, which
	// from_pretrained loads from the checkpoint's directory); any other
	// set of parameters under their own names.
	Params []*nn.Param
	// Optimizer, when set, is saved and restored: optim.Adam or optim.SGD,
	// its hyperparameters (the exported fields, Groups with their
	// parameters by name, Clip), the schedule's position (Steps) and each
	// parameter's step count and state slots. The Schedule is code: the
	// resumed program builds it again.
	Optimizer optim.Optimizer
	// Session, when set, is synced before a save (SyncParams, SyncState:
	// on CUDA the parameters and optimizer state live on the device), its
	// dynamic loss scale saved and restored (fp16-mixed), and after a load
	// its device copies are refreshed (UploadParams), so the next Step
	// runs from what was loaded.
	Session *batchfit.Session
	// Step is the steps done: the step a run resumed from the checkpoint
	// starts at (train.Config.Start).
	Step int
	// Data is the data loader's position after the last step
	// (data.Loader.Position), for data.Options.Start.
	Data data.Position
	// Meta is saved as it is, for the caller's own notes.
	Meta map[string]string
	// Keep is how many checkpoints Save keeps in a directory, the new one
	// included (0: 2).
	Keep int
}

// slotNames are an optimizer's state slots as PyTorch names them.
func slotNames(o optim.Optimizer) []string {
	switch o.(type) {
	case *optim.Adam:
		return []string{"exp_avg", "exp_avg_sq"}
	case *optim.SGD:
		return []string{"momentum_buffer"}
	}
	return nil
}

// common is o's per-parameter state, with its default group's
// hyperparameters, or ErrUnsupported.
func common(o optim.Optimizer) (*optim.Common, Hyper, error) {
	switch o := o.(type) {
	case *optim.Adam:
		if o != nil {
			return &o.Common, Hyper{LR: o.LR, WeightDecay: o.WeightDecay, Beta1: o.Beta1, Beta2: o.Beta2, Eps: o.Eps, Decoupled: o.Decoupled}, nil
		}
	case *optim.SGD:
		if o != nil {
			return &o.Common, Hyper{LR: o.LR, WeightDecay: o.WeightDecay, Momentum: o.Momentum, Dampening: o.Dampening, Nesterov: o.Nesterov}, nil
		}
	}
	return nil, Hyper{}, fmt.Errorf("%w: optimizer %T; checkpoints save optim.Adam and optim.SGD", ErrUnsupported, o)
}

// setHyper gives o's default group h.
func setHyper(o optim.Optimizer, h Hyper) {
	switch o := o.(type) {
	case *optim.Adam:
		o.LR, o.WeightDecay, o.Beta1, o.Beta2, o.Eps, o.Decoupled = h.LR, h.WeightDecay, h.Beta1, h.Beta2, h.Eps, h.Decoupled
	case *optim.SGD:
		o.LR, o.WeightDecay, o.Momentum, o.Dampening, o.Nesterov = h.LR, h.WeightDecay, h.Momentum, h.Dampening, h.Nesterov
	}
}

func groupHyper(g *optim.Group) Hyper {
	return Hyper{LR: g.LR, WeightDecay: g.WeightDecay, Beta1: g.Beta1, Beta2: g.Beta2, Eps: g.Eps,
		Momentum: g.Momentum, Dampening: g.Dampening, Nesterov: g.Nesterov}
}

func setGroupHyper(g *optim.Group, h Hyper) {
	g.LR, g.WeightDecay, g.Beta1, g.Beta2, g.Eps = h.LR, h.WeightDecay, h.Beta1, h.Beta2, h.Eps
	g.Momentum, g.Dampening, g.Nesterov = h.Momentum, h.Dampening, h.Nesterov
}

func normTypeName(c optim.Clip) string {
	if c.Inf() {
		return "inf"
	}
	return "2"
}

func normType(s string) (float64, error) {
	switch s {
	case "2":
		return 2, nil
	case "inf":
		return math.Inf(1), nil
	}
	return 0, fmt.Errorf("%w: clip norm type %q; \"2\" and \"inf\" are known", ErrCorrupt, s)
}

// param is one parameter to save or load: its name, shape and float32
// storage.
type param struct {
	p     *nn.Param
	name  string
	shape []int
	data  []float32
}

// params checks and lists what t saves or loads.
func (t *Training) params() ([]param, error) {
	if t.Model == nil {
		return nil, fmt.Errorf("%w: Training.Model is nil", ErrTraining)
	}
	if err := nn.Check(t.Model); err != nil {
		return nil, fmt.Errorf("%w: the model: %w", ErrTraining, err)
	}
	ps := t.Params
	if ps == nil {
		ps = t.Model.Params()
	}
	out := make([]param, 0, len(ps))
	seen := make(map[string]bool, len(ps))
	for i, p := range ps {
		if p == nil {
			return nil, fmt.Errorf("%w: parameter %d is nil", ErrTraining, i)
		}
		name := p.Name()
		if seen[name] {
			return nil, fmt.Errorf("%w: two parameters are named %q", ErrTraining, name)
		}
		seen[name] = true
		d, err := floats(name, p.Value(), p.Shape())
		if err != nil {
			return nil, err
		}
		out = append(out, param{p: p, name: name, shape: p.Shape(), data: d})
	}
	return out, nil
}

// floats is the float32 row-major storage of a parameter's or buffer's
// host tensor.
func floats(name string, v tensor.Tensor, shape []int) ([]float32, error) {
	if v == nil {
		return nil, fmt.Errorf("%w: %q is shape-only (nn.Options.ShapeOnly): it has no values", ErrTraining, name)
	}
	d, ok := v.(*tensor.Dense)
	if !ok || d.Dtype() != tensor.Float32 || d.RequiresIterator() {
		return nil, fmt.Errorf("%w: %q holds %T of %v, not row-major float32", ErrTraining, name, v, v.Dtype())
	}
	f := d.Float32s()
	if len(f) != graph.Numel(shape) {
		return nil, fmt.Errorf("%w: %q holds %d values for shape %v", ErrTraining, name, len(f), shape)
	}
	return f, nil
}

// hfConfig is the Hugging Face config of t's model, when it is a GPT or a
// Llama-family model (Save uses it when Params is nil: all of them).
func (t *Training) hfConfig() (hf.Config, bool) {
	switch m := t.Model.(type) {
	case interface{ Config() models.GPTConfig }:
		c := m.Config()
		return hf.Config{Architecture: hf.GPT2, GPT: &c, BOS: -1}, true
	case interface{ Config() models.LlamaConfig }:
		c := m.Config()
		arch := hf.Llama
		if c.QKVBias && !c.OutBias && !c.MLPBias {
			arch = hf.Qwen2
		}
		return hf.Config{Architecture: arch, Llama: &c, BOS: -1}, true
	}
	return hf.Config{}, false
}

// dropoutPath is d's path for messages.
func dropoutPath(p string) string {
	if p == "" {
		return "the model itself"
	}
	return strconv.Quote(p)
}
