package hf

import (
	"strings"
)

// A nameTable maps one architecture's parameter names (as batchfit's model
// names them) to its checkpoints' tensor names. Patterns are dotted paths
// in which "{i}" stands for a layer index.
type nameTable struct {
	params []nameRule
	// ignored are checkpoint tensors that are buffers, not parameters
	// (older files saved them); loading skips them.
	ignored []string
	// head is the output projection's tensor and embed the token
	// embedding's: a model that ties them has no head parameter, and a
	// checkpoint may then hold the head only as an equal copy.
	head, embed string
	// prefix, when set, is a prefix some checkpoints of the architecture
	// omit (GPT-2's original files name "wte.weight", not
	// "transformer.wte.weight"); loading accepts both, saving writes it.
	prefix string
}

type nameRule struct {
	model, file string
	// transposed: the file stores the transpose of the parameter (GPT-2's
	// Conv1D weights are [in, out], batchfit's Linear weights [out, in]).
	transposed bool
}

// llamaNames is the Llama family's table: models.Llama names its
// parameters as Hugging Face does, so every rule is the identity.
var llamaNames = nameTable{
	params: identity(
		"model.embed_tokens.weight",
		"model.layers.{i}.input_layernorm.weight",
		"model.layers.{i}.self_attn.q_proj.weight", "model.layers.{i}.self_attn.q_proj.bias",
		"model.layers.{i}.self_attn.k_proj.weight", "model.layers.{i}.self_attn.k_proj.bias",
		"model.layers.{i}.self_attn.v_proj.weight", "model.layers.{i}.self_attn.v_proj.bias",
		"model.layers.{i}.self_attn.o_proj.weight", "model.layers.{i}.self_attn.o_proj.bias",
		"model.layers.{i}.post_attention_layernorm.weight",
		"model.layers.{i}.mlp.gate_proj.weight", "model.layers.{i}.mlp.gate_proj.bias",
		"model.layers.{i}.mlp.up_proj.weight", "model.layers.{i}.mlp.up_proj.bias",
		"model.layers.{i}.mlp.down_proj.weight", "model.layers.{i}.mlp.down_proj.bias",
		"model.norm.weight",
		"lm_head.weight",
	),
	ignored: []string{"model.layers.{i}.self_attn.rotary_emb.inv_freq"},
	head:    "lm_head.weight",
	embed:   "model.embed_tokens.weight",
}

// gpt2Names maps models.GPT (named as Hugging Face's GPT2Model) to
// GPT2LMHeadModel's checkpoints, whose Conv1D weights are transposed.
var gpt2Names = nameTable{
	params: []nameRule{
		{"wte.weight", "transformer.wte.weight", false},
		{"wpe.weight", "transformer.wpe.weight", false},
		{"h.{i}.ln_1.weight", "transformer.h.{i}.ln_1.weight", false},
		{"h.{i}.ln_1.bias", "transformer.h.{i}.ln_1.bias", false},
		{"h.{i}.attn.c_attn.weight", "transformer.h.{i}.attn.c_attn.weight", true},
		{"h.{i}.attn.c_attn.bias", "transformer.h.{i}.attn.c_attn.bias", false},
		{"h.{i}.attn.c_proj.weight", "transformer.h.{i}.attn.c_proj.weight", true},
		{"h.{i}.attn.c_proj.bias", "transformer.h.{i}.attn.c_proj.bias", false},
		{"h.{i}.ln_2.weight", "transformer.h.{i}.ln_2.weight", false},
		{"h.{i}.ln_2.bias", "transformer.h.{i}.ln_2.bias", false},
		{"h.{i}.mlp.c_fc.weight", "transformer.h.{i}.mlp.c_fc.weight", true},
		{"h.{i}.mlp.c_fc.bias", "transformer.h.{i}.mlp.c_fc.bias", false},
		{"h.{i}.mlp.c_proj.weight", "transformer.h.{i}.mlp.c_proj.weight", true},
		{"h.{i}.mlp.c_proj.bias", "transformer.h.{i}.mlp.c_proj.bias", false},
		{"ln_f.weight", "transformer.ln_f.weight", false},
		{"ln_f.bias", "transformer.ln_f.bias", false},
	},
	// The causal mask buffers of older transformers versions.
	ignored: []string{"transformer.h.{i}.attn.bias", "transformer.h.{i}.attn.masked_bias"},
	head:    "lm_head.weight",
	embed:   "transformer.wte.weight",
	prefix:  "transformer.",
}

func identity(names ...string) []nameRule {
	rs := make([]nameRule, len(names))
	for i, n := range names {
		rs[i] = nameRule{model: n, file: n}
	}
	return rs
}

func tableFor(a Architecture) *nameTable {
	if a == GPT2 {
		return &gpt2Names
	}
	return &llamaNames
}

// fileName maps a parameter name to its tensor name in a checkpoint.
func (t *nameTable) fileName(param string) (file string, transposed, ok bool) {
	for _, r := range t.params {
		if idx, ok := match(r.model, param); ok {
			return strings.Replace(r.file, "{i}", idx, 1), r.transposed, true
		}
	}
	return "", false, false
}

// isIgnored reports whether a checkpoint tensor is a buffer to skip.
func (t *nameTable) isIgnored(file string) bool {
	for _, p := range t.ignored {
		if _, ok := match(p, file); ok {
			return true
		}
		if t.prefix != "" {
			if _, ok := match(strings.TrimPrefix(p, t.prefix), file); ok {
				return true
			}
		}
	}
	return false
}

// match reports whether name fits pattern, and the layer index "{i}"
// stood for. An index is decimal digits without a leading zero.
func match(pattern, name string) (string, bool) {
	i := strings.Index(pattern, "{i}")
	if i < 0 {
		return "", pattern == name
	}
	head, tail := pattern[:i], pattern[i+3:]
	if !strings.HasPrefix(name, head) || !strings.HasSuffix(name, tail) || len(name) <= len(head)+len(tail) {
		return "", false
	}
	idx := name[len(head) : len(name)-len(tail)]
	if idx[0] == '0' && len(idx) > 1 {
		return "", false
	}
	for _, c := range []byte(idx) {
		if c < '0' || c > '9' {
			return "", false
		}
	}
	return idx, true
}
