package hf

import (
	"encoding/json"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strconv"

	"github.com/batchfit/batchfit/models"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/safetensors"
)

// Save writes a checkpoint transformers' from_pretrained loads: dir's
// config.json for cfg and model.safetensors holding params, in cfg.DType
// (float32 when unset), named and laid out as the architecture's
// checkpoints are (GPT-2 under "transformer.", its Conv1D weights
// transposed; a tied head omitted, as save_pretrained omits it). Keys of a
// config read from a file that Save does not own are written back as they
// were. Both files are written atomically; dir is created if needed, and a
// directory holding a sharded checkpoint is refused rather than left with
// stale shards beside the new file.
func Save(dir string, cfg Config, params []*nn.Param) error {
	dt, err := storageDType(cfg.DType)
	if err != nil {
		return err
	}
	conf, err := cfg.configJSON()
	if err != nil {
		return err
	}
	tensors, err := saveTensors(cfg, params, dt)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	if _, err := os.Lstat(filepath.Join(dir, IndexFile)); err == nil {
		return fmt.Errorf("%w: %s holds a sharded checkpoint (%s); save into another directory", ErrCheckpoint, dir, IndexFile)
	}
	if err := safetensors.WriteFile(filepath.Join(dir, WeightsFile), tensors, map[string]string{"format": "pt"}); err != nil {
		return err
	}
	return writeFileAtomic(filepath.Join(dir, ConfigFile), conf)
}

func storageDType(s string) (safetensors.DType, error) {
	switch s {
	case "", "float32":
		return safetensors.F32, nil
	case "bfloat16":
		return safetensors.BF16, nil
	case "float16":
		return safetensors.F16, nil
	}
	return 0, fmt.Errorf("%w: dtype %q; Save writes float32, bfloat16 or float16", ErrUnsupported, s)
}

// saveTensors maps params to the checkpoint's tensors.
func saveTensors(cfg Config, params []*nn.Param, dt safetensors.DType) ([]safetensors.Tensor, error) {
	t := tableFor(cfg.Architecture)
	tied, embedShape := true, []int{}
	switch {
	case cfg.Architecture.LlamaFamily() && cfg.Llama != nil:
		tied, embedShape = cfg.Llama.TieEmbeddings, []int{cfg.Llama.Vocab, cfg.Llama.Hidden}
	case cfg.Architecture == GPT2 && cfg.GPT != nil:
		embedShape = []int{cfg.GPT.Vocab, cfg.GPT.Dim}
	}
	var out []safetensors.Tensor
	hasHead, hasEmbed := false, false
	for _, p := range params {
		if p == nil {
			return nil, fmt.Errorf("%w: nil parameter", ErrConfig)
		}
		name, transposed, ok := t.fileName(p.Name())
		if !ok {
			return nil, fmt.Errorf("%w: parameter %q has no %s checkpoint name", ErrUnsupported, p.Name(), cfg.Architecture)
		}
		data, err := paramData(p)
		if err != nil {
			return nil, err
		}
		shape := slices.Clone(p.Shape())
		switch name {
		case t.head:
			hasHead = true
		case t.embed:
			hasEmbed = true
			if !slices.Equal(shape, embedShape) {
				return nil, &ShapeError{Param: p.Name(), Tensor: name, File: ConfigFile, Want: embedShape, Got: shape}
			}
		}
		st := safetensors.Tensor{Name: name, DType: dt, Shape: shape, Float32: data}
		if transposed {
			if len(shape) != 2 {
				return nil, fmt.Errorf("%w: parameter %s is %v; a transposed weight must be 2-d", ErrShape, p.Name(), shape)
			}
			rows, cols := shape[0], shape[1] // [out, in]; the file holds [in, out]
			st.Shape, st.Float32 = []int{cols, rows}, nil
			st.Fill = func(dst []float32, at int) { // element k of the file's [in, out] is data[(k mod out)·in + k div out]
				for j := range dst {
					k := at + j
					dst[j] = data[(k%rows)*cols+k/rows]
				}
			}
		}
		out = append(out, st)
	}
	switch {
	case !hasEmbed:
		return nil, fmt.Errorf("%w: no parameter for %q among the %d given", ErrMissingTensor, t.embed, len(params))
	case tied && hasHead:
		return nil, fmt.Errorf("%w: the config ties the head to the embedding, but the parameters include %q", ErrConfig, t.head)
	case !tied && !hasHead:
		return nil, fmt.Errorf("%w: the config has an untied head, but no parameter is %q", ErrMissingTensor, t.head)
	}
	return out, nil
}

// configJSON is cfg as config.json: the file's own keys, then the ones
// Save owns set from cfg, with sorted keys and 2-space indents as
// transformers writes them.
func (cfg Config) configJSON() ([]byte, error) {
	m := map[string]any{}
	for k, v := range cfg.raw {
		m[k] = v
	}
	mt := cfg.Architecture.modelType()
	if mt == "" {
		return nil, &UnsupportedArchitectureError{Architecture: string(cfg.Architecture), Supported: Architectures()}
	}
	m["architectures"] = []string{string(cfg.Architecture)}
	m["model_type"] = mt
	dtype := cfg.DType
	if dtype == "" {
		dtype = "float32"
	}
	m["dtype"], m["torch_dtype"] = dtype, dtype
	if cfg.BOS >= 0 {
		m["bos_token_id"] = cfg.BOS
	} else if _, ok := m["bos_token_id"]; !ok {
		m["bos_token_id"] = nil
	}
	switch len(cfg.EOS) {
	case 0:
		if _, ok := m["eos_token_id"]; !ok {
			m["eos_token_id"] = nil
		}
	case 1:
		m["eos_token_id"] = cfg.EOS[0]
	default:
		m["eos_token_id"] = cfg.EOS
	}
	var err error
	switch {
	case cfg.Architecture == GPT2:
		err = gpt2JSON(m, cfg.GPT)
	case cfg.Architecture.LlamaFamily():
		err = llamaJSON(m, cfg.Architecture, cfg.Llama, cfg.SlidingWindow)
	}
	if err != nil {
		return nil, err
	}
	b, err := json.MarshalIndent(m, "", "  ")
	if err != nil {
		return nil, err
	}
	return append(b, '\n'), nil
}

// pyFloat marshals as Python's json writes a float (8.0, 1e-05), so the
// file reads back in transformers as the float it is.
type pyFloat float64

func (f pyFloat) MarshalJSON() ([]byte, error) {
	v := float64(f)
	if math.IsInf(v, 0) || math.IsNaN(v) {
		return nil, fmt.Errorf("%w: %v is not a JSON number", ErrConfig, v)
	}
	a := math.Abs(v)
	switch {
	case v == math.Trunc(v) && a < 1e16:
		return strconv.AppendFloat(nil, v, 'f', 1, 64), nil
	case a >= 1e-4 && a < 1e16:
		return strconv.AppendFloat(nil, v, 'f', -1, 64), nil
	}
	return strconv.AppendFloat(nil, v, 'e', -1, 64), nil
}

func gpt2JSON(m map[string]any, g *models.GPTConfig) error {
	if g == nil {
		return fmt.Errorf("%w: a GPT2LMHeadModel config needs Config.GPT", ErrConfig)
	}
	delete(m, "n_ctx")
	m["vocab_size"], m["n_positions"], m["n_embd"], m["n_layer"], m["n_head"] = g.Vocab, g.Context, g.Dim, g.Layers, g.Heads
	m["n_inner"] = nil
	if act, _ := m["activation_function"].(json.RawMessage); string(act) != `"gelu_pytorch_tanh"` {
		m["activation_function"] = "gelu_new"
	}
	m["layer_norm_epsilon"] = pyFloat(1e-5)
	m["tie_word_embeddings"], m["scale_attn_weights"] = true, true
	m["scale_attn_by_inverse_layer_idx"], m["add_cross_attention"] = false, false
	return nil
}

func llamaJSON(m map[string]any, arch Architecture, l *models.LlamaConfig, window int) error {
	if l == nil {
		return fmt.Errorf("%w: a %s config needs Config.Llama", ErrConfig, arch)
	}
	switch {
	case arch == Llama && l.QKVBias != l.OutBias:
		return fmt.Errorf("%w: Llama's attention_bias sets q, k, v and o biases together (QKVBias %v, OutBias %v)", ErrUnsupported, l.QKVBias, l.OutBias)
	case arch == Qwen2 && (!l.QKVBias || l.OutBias || l.MLPBias):
		return fmt.Errorf("%w: Qwen2 has q, k, v biases and no others (QKVBias %v, OutBias %v, MLPBias %v)", ErrUnsupported, l.QKVBias, l.OutBias, l.MLPBias)
	case arch == Mistral && (l.QKVBias || l.OutBias || l.MLPBias):
		return fmt.Errorf("%w: Mistral has no biases", ErrUnsupported)
	}
	kv, hd := l.KVHeads, l.HeadDim
	if kv == 0 {
		kv = l.Heads
	}
	if hd == 0 && l.Heads > 0 {
		hd = l.Hidden / l.Heads
	}
	m["vocab_size"], m["hidden_size"], m["intermediate_size"] = l.Vocab, l.Hidden, l.Intermediate
	m["num_hidden_layers"], m["num_attention_heads"], m["num_key_value_heads"], m["head_dim"] = l.Layers, l.Heads, kv, hd
	if arch == Qwen2 && l.Heads > 0 && hd == l.Hidden/l.Heads {
		// transformers' Qwen2Config has no head_dim of its own (its
		// attention derives it): written only when it differs, as
		// transformers' own files are.
		delete(m, "head_dim")
	}
	m["max_position_embeddings"], m["rms_norm_eps"] = l.MaxPositions, pyFloat(l.RMSNormEps)
	m["tie_word_embeddings"], m["hidden_act"] = l.TieEmbeddings, "silu"
	if arch == Llama {
		m["attention_bias"], m["mlp_bias"] = l.QKVBias, l.MLPBias
	}
	switch arch {
	case Mistral:
		m["sliding_window"] = nullIfZero(window)
	case Qwen2:
		m["use_sliding_window"] = window > 0
		if window > 0 {
			m["sliding_window"] = window
		}
	}
	// Both spellings of the rope settings, consistent: transformers 5
	// reads rope_parameters, older versions rope_theta and rope_scaling.
	r := l.Rope
	params := map[string]any{"rope_type": "default", "rope_theta": pyFloat(r.Theta)}
	var scaling map[string]any
	switch r.Type {
	case "", "default":
	case "linear":
		scaling = map[string]any{"rope_type": "linear", "factor": pyFloat(r.Factor)}
	case "llama3":
		scaling = map[string]any{"rope_type": "llama3", "factor": pyFloat(r.Factor), "low_freq_factor": pyFloat(r.LowFreqFactor),
			"high_freq_factor": pyFloat(r.HighFreqFactor), "original_max_position_embeddings": r.OriginalMaxPositions}
	default:
		return fmt.Errorf("%w: rope type %q", ErrUnsupported, r.Type)
	}
	for k, v := range scaling {
		params[k] = v
	}
	m["rope_theta"], m["rope_parameters"] = pyFloat(r.Theta), params
	if scaling != nil {
		m["rope_scaling"] = scaling
	} else {
		m["rope_scaling"] = nil
	}
	return nil
}

func nullIfZero(n int) any {
	if n == 0 {
		return nil
	}
	return n
}

// writeFileAtomic writes b to a temporary file beside path and renames it
// into place.
func writeFileAtomic(path string, b []byte) error {
	f, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".tmp-*")
	if err != nil {
		return err
	}
	_, werr := f.Write(b)
	if werr == nil {
		werr = f.Chmod(0o644)
	}
	if werr == nil {
		werr = f.Sync()
	}
	if cerr := f.Close(); werr == nil {
		werr = cerr
	}
	if werr == nil {
		werr = os.Rename(f.Name(), path)
	}
	if werr != nil {
		os.Remove(f.Name())
	}
	return werr
}
