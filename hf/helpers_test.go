package hf_test

import (
	"fmt"
	"math/rand/v2"

	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/models"
	"github.com/batchfit/batchfit/nn"
)

// spec is a parameter's name and shape.
type spec struct {
	name  string
	shape []int
}

// llamaSpecs lists the parameters a Llama-family model of cfg has, named
// as models.Llama names them (Hugging Face's names): the tests' stand-in
// for that model's parameter list.
func llamaSpecs(c models.LlamaConfig) []spec {
	kv, hd := c.KVHeads, c.HeadDim
	if kv == 0 {
		kv = c.Heads
	}
	if hd == 0 {
		hd = c.Hidden / c.Heads
	}
	s := []spec{{"model.embed_tokens.weight", []int{c.Vocab, c.Hidden}}}
	add := func(name string, shape ...int) { s = append(s, spec{name, shape}) }
	for i := range c.Layers {
		p := fmt.Sprintf("model.layers.%d.", i)
		add(p+"input_layernorm.weight", c.Hidden)
		for _, x := range []struct {
			n   string
			out int
		}{{"q", c.Heads * hd}, {"k", kv * hd}, {"v", kv * hd}} {
			add(p+"self_attn."+x.n+"_proj.weight", x.out, c.Hidden)
			if c.QKVBias {
				add(p+"self_attn."+x.n+"_proj.bias", x.out)
			}
		}
		add(p+"self_attn.o_proj.weight", c.Hidden, c.Heads*hd)
		if c.OutBias {
			add(p+"self_attn.o_proj.bias", c.Hidden)
		}
		add(p+"post_attention_layernorm.weight", c.Hidden)
		add(p+"mlp.gate_proj.weight", c.Intermediate, c.Hidden)
		add(p+"mlp.up_proj.weight", c.Intermediate, c.Hidden)
		add(p+"mlp.down_proj.weight", c.Hidden, c.Intermediate)
		if c.MLPBias {
			add(p+"mlp.gate_proj.bias", c.Intermediate)
			add(p+"mlp.up_proj.bias", c.Intermediate)
			add(p+"mlp.down_proj.bias", c.Hidden)
		}
	}
	add("model.norm.weight", c.Hidden)
	if !c.TieEmbeddings {
		add("lm_head.weight", c.Vocab, c.Hidden)
	}
	return s
}

// newParams makes parameters of the specs holding random (non-zero)
// values, so that a tensor loading forgot to fill shows.
func newParams(specs []spec, seed uint64) []*nn.Param {
	r := rand.New(rand.NewPCG(seed, 7))
	ps := make([]*nn.Param, len(specs))
	for i, s := range specs {
		n := 1
		for _, d := range s.shape {
			n *= d
		}
		data := make([]float32, n)
		for j := range data {
			data[j] = float32(r.NormFloat64()) + 10
		}
		ps[i] = nn.NewParam(s.name, tensor.New(tensor.WithShape(s.shape...), tensor.WithBacking(data)))
	}
	return ps
}

func numel(shape []int) int64 {
	n := int64(1)
	for _, d := range shape {
		n *= int64(d)
	}
	return n
}
