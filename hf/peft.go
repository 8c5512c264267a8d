package hf

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/safetensors"
)

// The files of a PEFT LoRA adapter directory (PeftModel.save_pretrained).
const (
	AdapterConfigFile  = "adapter_config.json"
	AdapterWeightsFile = "adapter_model.safetensors"
)

// peftPrefix is what PeftModel puts before a model's own parameter names
// in an adapter file: its base_model (a LoraModel) holding the model.
const peftPrefix = "base_model.model."

// maxAdapterConfigBytes bounds adapter_config.json (PEFT's are about 1 KB).
const maxAdapterConfigBytes = 1 << 20

// maxAdapterRank bounds an adapter config's r.
const maxAdapterRank = 1 << 16

// ErrAdapterRank: an adapter tensor's rank is not the r its
// adapter_config.json gives; the error is a *RankError.
var ErrAdapterRank = errors.New("hf: adapter rank mismatch")

// RankError is an adapter tensor whose rank axis (lora_A's rows,
// lora_B's columns) differs from the config's r.
type RankError struct {
	Tensor, File string
	Rank, Got    int
}

func (e *RankError) Error() string {
	return fmt.Sprintf("%v: tensor %q in %s has rank %d, %s says r = %d", ErrAdapterRank, e.Tensor, e.File, e.Got, AdapterConfigFile, e.Rank)
}

// Is makes errors.Is(err, ErrAdapterRank) hold.
func (e *RankError) Is(target error) bool { return target == ErrAdapterRank }

// AdapterConfig is what batchfit reads of and writes to an
// adapter_config.json: a LoRA's settings and the base model's name.
type AdapterConfig struct {
	LoRA nn.LoRA
	// BaseModel is base_model_name_or_path: the base checkpoint's
	// directory or hub name, which PeftModel.from_pretrained does not
	// need (it is given the base model) but AutoPeftModel does.
	BaseModel string
}

// SaveAdapter writes m's LoRA adapters as PeftModel.save_pretrained does,
// so that PeftModel.from_pretrained(base, dir) loads them:
// adapter_model.safetensors holding each adapter's lora_A and lora_B in
// float32 under "base_model.model." and the parameter's name
// ("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"), and
// adapter_config.json (peft_type LORA, task_type CAUSAL_LM, r, lora_alpha,
// lora_dropout, target_modules: the adapted layers' last names, sorted,
// or their full paths when those names would reach layers that are not
// adapted; bias "none", fan_in_fan_out false). base names the base model
// (base_model_name_or_path; "" writes null). Every adapter must share one
// rank, alpha and dropout (PEFT's rank_pattern is not written). The values
// are the host's: after training in a Session, call its SyncParams first.
// Both files are written atomically; dir is created if needed.
func SaveAdapter(dir string, m nn.Module, base string) error {
	ls := nn.LoRAAdapters(m)
	if len(ls) == 0 {
		return fmt.Errorf("%w: the model has no LoRA adapters (nn.LoRA.Apply)", ErrConfig)
	}
	first := ls[0].Layer
	drop := 0.0
	if first.Dropout != nil {
		drop = first.Dropout.P
	}
	targets := map[string]bool{}
	var tensors []safetensors.Tensor
	for _, a := range ls {
		l := a.Layer
		d := 0.0
		if l.Dropout != nil {
			d = l.Dropout.P
		}
		if l.Rank != first.Rank || l.Alpha != first.Alpha || d != drop {
			return fmt.Errorf("%w: adapter %s has r %d, alpha %g, dropout %g where %s has %d, %g, %g; one adapter config holds one of each",
				ErrUnsupported, a.Path, l.Rank, l.Alpha, d, ls[0].Path, first.Rank, first.Alpha, drop)
		}
		targets[a.Path[strings.LastIndex(a.Path, ".")+1:]] = true
		for _, p := range []*nn.Param{l.A, l.B} {
			data, err := paramData(p)
			if err != nil {
				return err
			}
			tensors = append(tensors, safetensors.Tensor{Name: peftPrefix + p.Name(), DType: safetensors.F32,
				Shape: slices.Clone(p.Shape()), Float32: data})
		}
	}
	names := make([]string, 0, len(targets))
	for t := range targets {
		names = append(names, t)
	}
	slices.Sort(names)
	// The layers' last names, when they adapt exactly these layers (PEFT
	// matches a target as a path suffix, as nn.LoRA does); otherwise the
	// layers' paths, so that a load adapts no other layer.
	if !slices.Equal(nn.LoRAReach(m, names), pathsOf(ls)) {
		names = pathsOf(ls)
		slices.Sort(names)
	}
	conf, err := adapterJSON(AdapterConfig{LoRA: nn.LoRA{Rank: first.Rank, Alpha: first.Alpha, Dropout: drop, Targets: names}, BaseModel: base})
	if err != nil {
		return err
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	if err := safetensors.WriteFile(filepath.Join(dir, AdapterWeightsFile), tensors, map[string]string{"format": "pt"}); err != nil {
		return err
	}
	return writeFileAtomic(filepath.Join(dir, AdapterConfigFile), conf)
}

// pathsOf lists the adapted layers' paths.
func pathsOf(ls []nn.NamedLoRA) []string {
	ps := make([]string, len(ls))
	for i, l := range ls {
		ps[i] = l.Path
	}
	return ps
}

// adapterJSON is c as PEFT's LoraConfig.to_dict writes it (keys sorted,
// two-space indent), with the keys every PEFT release since 0.9 reads.
func adapterJSON(c AdapterConfig) ([]byte, error) {
	var base any
	if c.BaseModel != "" {
		base = c.BaseModel
	}
	m := map[string]any{
		"alpha_pattern":           map[string]any{},
		"auto_mapping":            nil,
		"base_model_name_or_path": base,
		"bias":                    "none",
		"fan_in_fan_out":          false,
		"inference_mode":          true,
		"init_lora_weights":       true,
		"layers_pattern":          nil,
		"layers_to_transform":     nil,
		"lora_alpha":              pyNumber(c.LoRA.AlphaOrDefault()),
		"lora_dropout":            pyFloat(c.LoRA.Dropout),
		"modules_to_save":         nil,
		"peft_type":               "LORA",
		"r":                       c.LoRA.Rank,
		"rank_pattern":            map[string]any{},
		"revision":                nil,
		"target_modules":          c.LoRA.Targets,
		"task_type":               "CAUSAL_LM",
		"use_dora":                false,
		"use_rslora":              false,
	}
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetIndent("", "  ")
	enc.SetEscapeHTML(false)
	if err := enc.Encode(m); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrConfig, err)
	}
	return buf.Bytes(), nil
}

// pyNumber marshals a whole number as an integer (PEFT's lora_alpha is an
// int) and any other as pyFloat does.
type pyNumber float64

func (f pyNumber) MarshalJSON() ([]byte, error) {
	v := float64(f)
	if v == math.Trunc(v) && math.Abs(v) < 1<<53 {
		return []byte(fmt.Sprintf("%d", int64(v))), nil
	}
	return pyFloat(v).MarshalJSON()
}

// ReadAdapterConfig reads an adapter directory's adapter_config.json
// (at most 1 MiB, through internal/safefile) as ParseAdapterConfig does.
func ReadAdapterConfig(dir string) (AdapterConfig, error) {
	path := filepath.Join(dir, AdapterConfigFile)
	b, err := readBounded(path, maxAdapterConfigBytes)
	if err != nil {
		return AdapterConfig{}, err
	}
	c, err := ParseAdapterConfig(b)
	if err != nil {
		return AdapterConfig{}, fmt.Errorf("%s: %w", path, err)
	}
	return c, nil
}

// ParseAdapterConfig parses an adapter_config.json. It must be a LoRA
// (peft_type "LORA") batchfit computes as PEFT does: r in [1, 65536],
// lora_alpha finite and positive, lora_dropout in [0, 1), target_modules a
// non-empty list of module names (a regular expression string is
// refused), bias "none", and none of fan_in_fan_out, use_rslora,
// use_dora, lora_bias, use_qalora, rank_pattern, alpha_pattern,
// layers_to_transform, layers_pattern, modules_to_save, exclude_modules,
// target_parameters, layer_replication or trainable_token_indices set
// (the other keys newer PEFT releases write do not change what a plain
// LoRA computes, and are ignored). Bad values wrap ErrConfig; settings batchfit does
// not reproduce wrap ErrUnsupported.
func ParseAdapterConfig(b []byte) (AdapterConfig, error) {
	if len(b) > maxAdapterConfigBytes {
		return AdapterConfig{}, fmt.Errorf("%w: adapter config of %d bytes, at most %d", ErrTooLarge, len(b), maxAdapterConfigBytes)
	}
	var raw map[string]json.RawMessage
	if err := json.Unmarshal(b, &raw); err != nil {
		return AdapterConfig{}, fmt.Errorf("%w: %s is not a JSON object: %w", ErrConfig, AdapterConfigFile, err)
	}
	r := &reader{m: raw}
	var c AdapterConfig
	if pt := r.str("peft_type", ""); r.err == nil && pt != "LORA" {
		return c, fmt.Errorf("%w: peft_type %q; batchfit reads LoRA adapters (LORA)", ErrUnsupported, pt)
	}
	c.LoRA.Rank = r.integer("r", 8, 1, maxAdapterRank)
	c.LoRA.Alpha = r.float("lora_alpha", 8, true)
	c.LoRA.Dropout = r.float("lora_dropout", 0, false)
	c.BaseModel = r.str("base_model_name_or_path", "")
	if r.err != nil {
		return AdapterConfig{}, r.err
	}
	if !(c.LoRA.Dropout >= 0 && c.LoRA.Dropout < 1) {
		return AdapterConfig{}, fmt.Errorf("%w: lora_dropout %g is outside [0, 1)", ErrConfig, c.LoRA.Dropout)
	}
	if math.IsInf(c.LoRA.Alpha, 0) {
		return AdapterConfig{}, fmt.Errorf("%w: lora_alpha %g is not finite", ErrConfig, c.LoRA.Alpha)
	}
	if bias := r.str("bias", "none"); r.err == nil && bias != "none" {
		return AdapterConfig{}, fmt.Errorf("%w: bias %q: batchfit's adapters train no biases (bias \"none\")", ErrUnsupported, bias)
	}
	if tt := r.str("task_type", "CAUSAL_LM"); r.err == nil && tt != "CAUSAL_LM" {
		return AdapterConfig{}, fmt.Errorf("%w: task_type %q; batchfit's models are causal language models (CAUSAL_LM)", ErrUnsupported, tt)
	}
	for _, k := range []string{"fan_in_fan_out", "use_rslora", "use_dora", "lora_bias", "use_qalora"} {
		if r.boolean(k, false) && r.err == nil {
			return AdapterConfig{}, fmt.Errorf("%w: %s is true; batchfit computes plain LoRA", ErrUnsupported, k)
		}
	}
	for _, k := range []string{"rank_pattern", "alpha_pattern", "layers_to_transform", "layers_pattern", "modules_to_save",
		"exclude_modules", "target_parameters", "layer_replication", "trainable_token_indices"} {
		if v, ok := raw[k]; ok && !emptyJSON(v) {
			return AdapterConfig{}, fmt.Errorf("%w: %s is set (%s); batchfit reads one rank and alpha for every target", ErrUnsupported, k, clip(v))
		}
	}
	if r.err != nil {
		return AdapterConfig{}, r.err
	}
	tm, ok := raw["target_modules"]
	if !ok || emptyJSON(tm) {
		return AdapterConfig{}, fmt.Errorf("%w: no target_modules", ErrConfig)
	}
	if err := json.Unmarshal(tm, &c.LoRA.Targets); err != nil {
		var s string
		if json.Unmarshal(tm, &s) == nil {
			return AdapterConfig{}, fmt.Errorf("%w: target_modules is the pattern %q; batchfit reads a list of module names", ErrUnsupported, s)
		}
		return AdapterConfig{}, fmt.Errorf("%w: target_modules is %s, not a list of names", ErrConfig, clip(tm))
	}
	if len(c.LoRA.Targets) == 0 {
		return AdapterConfig{}, fmt.Errorf("%w: target_modules is empty", ErrConfig)
	}
	slices.Sort(c.LoRA.Targets)
	c.LoRA.Targets = slices.Compact(c.LoRA.Targets)
	if err := c.LoRA.Check(); err != nil {
		return AdapterConfig{}, fmt.Errorf("%w: %w", ErrConfig, err)
	}
	return c, nil
}

// emptyJSON reports whether v is null, {} or [].
func emptyJSON(v json.RawMessage) bool {
	s := string(bytes.TrimSpace(v))
	if s == "null" {
		return true
	}
	var m map[string]json.RawMessage
	if json.Unmarshal(v, &m) == nil && len(m) == 0 {
		return true
	}
	var l []json.RawMessage
	return json.Unmarshal(v, &l) == nil && len(l) == 0
}

// clip is v for an error message, at most 60 bytes of it.
func clip(v json.RawMessage) string {
	if len(v) > 60 {
		return string(v[:60]) + "…"
	}
	return string(v)
}

// LoadAdapter reads a PEFT LoRA adapter directory (adapter_config.json and
// adapter_model.safetensors, as PeftModel.save_pretrained writes them, or
// SaveAdapter) and applies it to m: the config's LoRA (nn.LoRA.Apply, the
// base frozen in base, zero meaning bfloat16) with every adapter's A and
// B read from the file. m must have data (not shape-only) and no adapters
// yet. Everything is checked before m is changed: every tensor must be
// one adapter's lora_A or lora_B of a targeted layer
// (ErrUnexpectedTensor otherwise), every targeted layer must have both
// (ErrMissingTensor), each of the shape its layer and r give (a
// *ShapeError, or a *RankError when only the rank axis differs), in F32,
// BF16 or F16. The files are hostile input: they are opened through
// internal/safefile (regular files, bounded), and safetensors validates
// the header before a byte of data is read.
func LoadAdapter(dir string, m nn.Module, base graph.DType) (AdapterConfig, error) {
	c, err := ReadAdapterConfig(dir)
	if err != nil {
		return AdapterConfig{}, err
	}
	c.LoRA.Base = base
	paths, shapes, err := c.LoRA.Targeted(m)
	if err != nil {
		return AdapterConfig{}, err
	}
	wpath := filepath.Join(dir, AdapterWeightsFile)
	f, err := safetensors.Open(wpath)
	if err != nil {
		return AdapterConfig{}, err
	}
	defer f.Close()
	// want maps each adapter tensor's name to its shape.
	want := map[string][]int{}
	r := c.LoRA.Rank
	for i, p := range paths {
		out, in := shapes[i][0], shapes[i][1]
		want[peftPrefix+p+".lora_A.weight"] = []int{r, in}
		want[peftPrefix+p+".lora_B.weight"] = []int{out, r}
	}
	var unexpected []string
	for _, t := range f.Tensors() {
		w, ok := want[t.Name]
		if !ok {
			unexpected = append(unexpected, t.Name)
			continue
		}
		if err := weightDType(t, wpath); err != nil {
			return AdapterConfig{}, err
		}
		if !slices.Equal(t.Shape, w) {
			isA := strings.HasSuffix(t.Name, ".lora_A.weight")
			if len(t.Shape) == 2 {
				if rk, other := t.Shape[0], t.Shape[1]; isA && other == w[1] && rk != r {
					return AdapterConfig{}, &RankError{Tensor: t.Name, File: wpath, Rank: r, Got: rk}
				}
				if rk, other := t.Shape[1], t.Shape[0]; !isA && other == w[0] && rk != r {
					return AdapterConfig{}, &RankError{Tensor: t.Name, File: wpath, Rank: r, Got: rk}
				}
			}
			return AdapterConfig{}, &ShapeError{Param: strings.TrimPrefix(t.Name, peftPrefix), Tensor: t.Name, File: wpath, Want: w, Got: t.Shape}
		}
	}
	if len(unexpected) > 0 {
		slices.Sort(unexpected)
		return AdapterConfig{}, fmt.Errorf("%w: %s holds %d tensors that are no adapter of the config's target_modules %v: %s",
			ErrUnexpectedTensor, wpath, len(unexpected), c.LoRA.Targets, nameList(unexpected))
	}
	var missing []string
	for name := range want {
		if _, ok := f.Tensor(name); !ok {
			missing = append(missing, name)
		}
	}
	if len(missing) > 0 {
		slices.Sort(missing)
		return AdapterConfig{}, fmt.Errorf("%w: %s lacks %d adapter tensors: %s", ErrMissingTensor, wpath, len(missing), nameList(missing))
	}
	for _, p := range m.Params() {
		if _, err := paramData(p); err != nil {
			return AdapterConfig{}, err
		}
	}
	ls, err := c.LoRA.Apply(nn.Seed(0), m)
	if err != nil {
		return AdapterConfig{}, err
	}
	for _, a := range ls {
		for _, p := range []*nn.Param{a.Layer.A, a.Layer.B} {
			dst, err := paramData(p)
			if err == nil {
				err = f.ReadFloat32(peftPrefix+p.Name(), dst)
			}
			if err != nil {
				return AdapterConfig{}, err
			}
		}
	}
	return c, nil
}
