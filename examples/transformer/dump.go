package main

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/models"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/optim"
)

// dumpFormat names the layout of a -dump directory (see the package
// documentation); bench/torch_losses.py refuses any other.
const dumpFormat = "batchfit-gpt-dump/1"

// dumpManifest is config.json.
type dumpManifest struct {
	Format    string       `json:"format"`
	Model     dumpModel    `json:"model"`
	Precision string       `json:"precision"`
	Device    string       `json:"device"`
	Seed      uint64       `json:"seed"`
	Steps     int          `json:"steps"`
	Batch     int          `json:"batch"`
	Seq       int          `json:"seq"`
	Loss      string       `json:"loss"`
	Optimizer dumpOptim    `json:"optimizer"`
	Params    []dumpParam  `json:"params"`
	Tokens    string       `json:"tokens"`
	Targets   string       `json:"targets"`
	Losses    dumpLossList `json:"losses"`
}

// dumpModel is the GPT's configuration and the architectural constants
// models.GPT fixes, read from the built model where it holds them.
type dumpModel struct {
	Vocab          int     `json:"vocab"`
	Context        int     `json:"context"`
	Layers         int     `json:"layers"`
	Heads          int     `json:"heads"`
	Dim            int     `json:"dim"`
	FusedAttention bool    `json:"fused_attention"`
	LayerNormEps   float64 `json:"layer_norm_eps"`
	GELU           string  `json:"gelu"`          // "tanh" (GELU's tanh approximation) or "erf" (exact)
	TiedHead       bool    `json:"tied_head"`     // logits = ln_f(x)·wteᵀ, no bias
	AttnScale      string  `json:"attn_scale"`    // q·kᵀ is multiplied by this
	LinearLayout   string  `json:"linear_layout"` // layout of the Linear weights' files
}

// dumpOptim is the optimizer as optim.Adam holds it.
type dumpOptim struct {
	Name           string  `json:"name"`
	LR             float64 `json:"lr"`
	Beta1          float64 `json:"beta1"`
	Beta2          float64 `json:"beta2"`
	Eps            float64 `json:"eps"`
	WeightDecay    float64 `json:"weight_decay"`
	Decoupled      bool    `json:"decoupled"`        // AdamW's p ← p·(1 − lr·wd), not L2 in the gradient
	DecayAllParams bool    `json:"decay_all_params"` // biases, norms and embeddings decay too
}

// dumpParam is one parameter's file.
type dumpParam struct {
	Name  string `json:"name"`
	Shape []int  `json:"shape"`
	File  string `json:"file"`
}

// dumpLossList is the per-step losses: the .npy file and the values.
type dumpLossList struct {
	File   string    `json:"file"`
	Values []float64 `json:"values"` // each a float32, widened exactly
}

// recorder writes a -dump directory: the initial parameters when it is
// made, the batches as they are drawn, and the manifest and losses when
// training has ended. config.json is written last, so a directory without
// it is a run that did not finish.
type recorder struct {
	dir             string
	man             dumpManifest
	tokens, targets []int64
}

// newRecorder creates dir (and its parents), removes a config.json left
// there by an earlier run, and writes the model's current, initial,
// parameters.
func newRecorder(dir string, model *models.GPT, opt *optim.Adam, o options, device string) (*recorder, error) {
	arch, err := architecture(model)
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(filepath.Join(dir, "params"), 0o755); err != nil {
		return nil, err
	}
	if err := os.Remove(filepath.Join(dir, "config.json")); err != nil && !os.IsNotExist(err) {
		return nil, err
	}
	r := &recorder{dir: dir, man: dumpManifest{
		Format: dumpFormat, Model: arch, Precision: policy(o), Device: device,
		Seed: o.seed, Steps: o.steps, Batch: o.batch, Seq: o.seq,
		Loss: "mean next-token cross-entropy over batch×seq positions",
		Optimizer: dumpOptim{Name: opt.Name(), LR: opt.LR, Beta1: opt.Beta1, Beta2: opt.Beta2, Eps: opt.Eps,
			WeightDecay: opt.WeightDecay, Decoupled: opt.Decoupled, DecayAllParams: true},
		Tokens: "tokens.npy", Targets: "targets.npy",
		Losses: dumpLossList{File: "losses.npy"},
	}}
	for _, p := range model.Params() {
		data, ok := p.Value().Data().([]float32)
		if !ok {
			return nil, fmt.Errorf("-dump: parameter %q holds %T, not []float32", p.Name(), p.Value().Data())
		}
		file := "params/" + p.Name() + ".npy"
		if err := writeNPY(filepath.Join(dir, file), p.Shape(), data); err != nil {
			return nil, err
		}
		r.man.Params = append(r.man.Params, dumpParam{Name: p.Name(), Shape: p.Shape(), File: file})
	}
	return r, nil
}

// batch records one step's tokens and targets.
func (r *recorder) batch(tokens, targets *tensor.Dense) {
	r.tokens = append(r.tokens, tokens.Data().([]int64)...)
	r.targets = append(r.targets, targets.Data().([]int64)...)
}

// finish writes the batches, the losses and config.json.
func (r *recorder) finish(losses []float32) error {
	m := &r.man
	shape := []int{len(losses), m.Batch, m.Seq}
	if err := writeNPY(filepath.Join(r.dir, m.Tokens), shape, r.tokens); err != nil {
		return err
	}
	if err := writeNPY(filepath.Join(r.dir, m.Targets), shape, r.targets); err != nil {
		return err
	}
	if err := writeNPY(filepath.Join(r.dir, m.Losses.File), []int{len(losses)}, losses); err != nil {
		return err
	}
	m.Steps = len(losses)
	m.Losses.Values = make([]float64, len(losses))
	for i, l := range losses {
		m.Losses.Values[i] = float64(l)
	}
	b, err := json.MarshalIndent(m, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(r.dir, "config.json"), append(b, '\n'), 0o644)
}

// architecture reads the GPT's configuration and the constants models.GPT
// builds in (layer-norm epsilon, GELU variant) from the model itself, so a
// change there changes the dump rather than silently breaking the replay.
func architecture(model *models.GPT) (dumpModel, error) {
	cfg := model.Config()
	d := dumpModel{Vocab: cfg.Vocab, Context: cfg.Context, Layers: cfg.Layers, Heads: cfg.Heads, Dim: cfg.Dim,
		FusedAttention: !cfg.WrittenOutAttention, TiedHead: true, AttnScale: "1/sqrt(dim/heads)",
		LinearLayout: "[out, in] (torch.nn.Linear's; Hugging Face's Conv1D stores the transpose)"}
	type getter interface{ Get(string) nn.Module }
	get := func(m nn.Module, path ...string) nn.Module {
		for _, name := range path {
			g, ok := m.(getter)
			if !ok {
				return nil
			}
			m = g.Get(name)
		}
		return m
	}
	lnf, ok := get(model, "ln_f").(*nn.LayerNorm)
	if !ok {
		return d, fmt.Errorf("-dump: models.GPT has no ln_f layer norm")
	}
	d.LayerNormEps = lnf.Eps
	for i := range cfg.Layers {
		layer := fmt.Sprint(i)
		for _, ln := range []string{"ln_1", "ln_2"} {
			if n, ok := get(model, "h", layer, ln).(*nn.LayerNorm); !ok || n.Eps != d.LayerNormEps {
				return d, fmt.Errorf("-dump: h.%s.%s is not a layer norm with ln_f's eps %g", layer, ln, d.LayerNormEps)
			}
		}
		g, ok := get(model, "h", layer, "mlp", "gelu").(nn.GELU)
		if !ok {
			return d, fmt.Errorf("-dump: h.%s.mlp.gelu is not an nn.GELU", layer)
		}
		gelu := "erf"
		if g.Approx {
			gelu = "tanh"
		}
		if i > 0 && gelu != d.GELU {
			return d, fmt.Errorf("-dump: blocks mix GELU variants")
		}
		d.GELU = gelu
	}
	return d, nil
}

// writeNPY writes data (float32 or int64, row-major) with the given shape
// as a NumPy .npy file, format version 1.0, little-endian.
func writeNPY(path string, shape []int, data any) error {
	var descr string
	n := 0
	switch v := data.(type) {
	case []float32:
		descr, n = "<f4", len(v)
	case []int64:
		descr, n = "<i8", len(v)
	default:
		return fmt.Errorf("writeNPY: %T", data)
	}
	size := 1
	dims := make([]string, len(shape))
	for i, s := range shape {
		size *= s
		dims[i] = fmt.Sprint(s)
	}
	if size != n {
		return fmt.Errorf("writeNPY %s: shape %v holds %d elements, data %d", path, shape, size, n)
	}
	tuple := strings.Join(dims, ", ")
	if len(shape) == 1 {
		tuple += ","
	}
	header := fmt.Sprintf("{'descr': '%s', 'fortran_order': False, 'shape': (%s), }", descr, tuple)
	// Magic (6), version (2) and header length (2), then the header padded
	// with spaces and ended by a newline to a multiple of 64 bytes.
	pad := 64 - (10+len(header)+1)%64
	if pad == 64 {
		pad = 0
	}
	header += strings.Repeat(" ", pad) + "\n"
	var buf bytes.Buffer
	buf.WriteString("\x93NUMPY\x01\x00")
	_ = binary.Write(&buf, binary.LittleEndian, uint16(len(header))) // a bytes.Buffer does not fail
	buf.WriteString(header)
	_ = binary.Write(&buf, binary.LittleEndian, data)
	return os.WriteFile(path, buf.Bytes(), 0o644)
}
