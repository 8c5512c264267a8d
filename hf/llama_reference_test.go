package hf_test

import (
	"math"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/half"
	"github.com/batchfit/batchfit/hf"
	"github.com/batchfit/batchfit/models"
	"github.com/batchfit/batchfit/nn"
)

// llamaForward64 is a Llama-family decoder written out in float64 from
// transformers' modeling code (RMSNorm, rotary embedding with its
// default, linear and llama3 frequencies, grouped-query causal attention,
// SwiGLU), reading the loaded parameters by name: an independent check
// that a config and checkpoint mean what transformers made of them. With
// bf16Freq the rotary frequencies are rounded to bfloat16, as they are in
// a transformers model loaded in bfloat16 and then cast to float64.
func llamaForward64(c models.LlamaConfig, ps []*nn.Param, ids []int64, b, t int, bf16Freq bool) []float64 {
	w := map[string][]float32{}
	for _, p := range ps {
		w[p.Name()] = p.Value().Data().([]float32)
	}
	h, hd, nh, kv := c.Hidden, c.HeadDim, c.Heads, c.KVHeads
	// linear: out[o] = Σ_i W[o, i]·x[i] (+ bias)
	linear := func(name string, x []float64, out int) []float64 {
		wt, in := w[name+".weight"], len(x)
		y := make([]float64, out)
		for o := range out {
			s := 0.0
			for i := range in {
				s += float64(wt[o*in+i]) * x[i]
			}
			if bias, ok := w[name+".bias"]; ok {
				s += float64(bias[o])
			}
			y[o] = s
		}
		return y
	}
	rms := func(name string, x []float64) []float64 {
		ss := 0.0
		for _, v := range x {
			ss += v * v
		}
		r := 1 / math.Sqrt(ss/float64(len(x))+c.RMSNormEps)
		y := make([]float64, len(x))
		for i, v := range x {
			y[i] = v * r * float64(w[name+".weight"][i])
		}
		return y
	}
	invFreq := make([]float64, hd/2)
	for i := range invFreq {
		f := 1 / math.Pow(c.Rope.Theta, float64(2*i)/float64(hd))
		switch c.Rope.Type {
		case "linear":
			f /= c.Rope.Factor
		case "llama3":
			old := float64(c.Rope.OriginalMaxPositions)
			lowWave, highWave := old/c.Rope.LowFreqFactor, old/c.Rope.HighFreqFactor
			wave := 2 * math.Pi / f
			switch {
			case wave > lowWave:
				f /= c.Rope.Factor
			case wave >= highWave:
				s := (old/wave - c.Rope.LowFreqFactor) / (c.Rope.HighFreqFactor - c.Rope.LowFreqFactor)
				f = (1-s)*f/c.Rope.Factor + s*f
			}
		}
		if bf16Freq {
			f = float64(half.RoundBF16(float32(f)))
		}
		invFreq[i] = f
	}
	rope := func(x []float64, pos int) { // x is one head [hd], rotated in place (rotate_half)
		for i := range hd / 2 {
			a := float64(pos) * invFreq[i]
			cos, sin := math.Cos(a), math.Sin(a)
			x1, x2 := x[i], x[i+hd/2]
			x[i], x[i+hd/2] = x1*cos-x2*sin, x2*cos+x1*sin
		}
	}
	logits := make([]float64, 0, b*t*c.Vocab)
	for s := range b {
		xs := make([][]float64, t)
		for j := range t {
			xs[j] = make([]float64, h)
			e := w["model.embed_tokens.weight"][int(ids[s*t+j])*h:]
			for i := range h {
				xs[j][i] = float64(e[i])
			}
		}
		for l := range c.Layers {
			p := "model.layers." + itoa(l) + "."
			qs, ks, vs := make([][]float64, t), make([][]float64, t), make([][]float64, t)
			for j := range t {
				n := rms(p+"input_layernorm", xs[j])
				qs[j], ks[j], vs[j] = linear(p+"self_attn.q_proj", n, nh*hd), linear(p+"self_attn.k_proj", n, kv*hd), linear(p+"self_attn.v_proj", n, kv*hd)
				for hh := range nh {
					rope(qs[j][hh*hd:(hh+1)*hd], j)
				}
				for hh := range kv {
					rope(ks[j][hh*hd:(hh+1)*hd], j)
				}
			}
			for j := range t {
				att := make([]float64, nh*hd)
				for hh := range nh {
					g := hh / (nh / kv)
					scores := make([]float64, j+1)
					m := math.Inf(-1)
					for k := 0; k <= j; k++ {
						d := 0.0
						for i := range hd {
							d += qs[j][hh*hd+i] * ks[k][g*hd+i]
						}
						scores[k] = d / math.Sqrt(float64(hd))
						m = max(m, scores[k])
					}
					z := 0.0
					for k := range scores {
						scores[k] = math.Exp(scores[k] - m)
						z += scores[k]
					}
					for k := range scores {
						for i := range hd {
							att[hh*hd+i] += scores[k] / z * vs[k][g*hd+i]
						}
					}
				}
				o := linear(p+"self_attn.o_proj", att, h)
				for i := range h {
					xs[j][i] += o[i]
				}
				n := rms(p+"post_attention_layernorm", xs[j])
				gate, up := linear(p+"mlp.gate_proj", n, c.Intermediate), linear(p+"mlp.up_proj", n, c.Intermediate)
				for i := range gate {
					gate[i] = gate[i] / (1 + math.Exp(-gate[i])) * up[i]
				}
				d := linear(p+"mlp.down_proj", gate, h)
				for i := range h {
					xs[j][i] += d[i]
				}
			}
		}
		head := "lm_head"
		if c.TieEmbeddings {
			w["tied.weight"] = w["model.embed_tokens.weight"]
			head = "tied"
		}
		for j := range t {
			logits = append(logits, linear(head, rms("model.norm", xs[j]), c.Vocab)...)
		}
	}
	return logits
}

func itoa(i int) string {
	if i < 10 {
		return string(rune('0' + i))
	}
	return itoa(i/10) + itoa(i%10)
}

// The Llama-family checkpoints, loaded and run through llamaForward64,
// give transformers' float64 logits and loss, so their configs' rope
// scaling, head counts, biases and tying were read as transformers reads
// them. Tolerance: 1e-6 of the logits' scale, since transformers keeps
// RMSNorm's variance and the rotary cos/sin in float32 even in a float64
// model (measured: about 1e-7). The bfloat16 checkpoint's reference was
// made from the model loaded in bfloat16, whose rotary frequencies are
// then bfloat16 (3e-5 of the scale, growing with position, without
// that rounding). reference.safetensors here is transformers' file cut to
// input_ids, labels, logits_f64 and loss_f64, bytes unchanged.
func TestLlamaFamilyMatchesTransformers(t *testing.T) {
	for _, dir := range []string{"llama-gqa-tied-llama3", "llama-mqa-linear-bf16", "qwen2-tiny", "llama-gqa-untied-sharded"} {
		t.Run(dir, func(t *testing.T) {
			path := filepath.Join("testdata", dir)
			cfg, err := hf.ReadConfig(path)
			require.NoError(t, err)
			ps := newParams(llamaSpecs(*cfg.Llama), 11)
			require.NoError(t, hf.LoadInto(path, ps))
			ref := openReference(t, path)
			ids, shape := ref.i64("input_ids")
			labels, _ := ref.i64("labels")
			want, _ := ref.f64("logits_f64")
			wantLoss, _ := ref.f64("loss_f64")
			got := llamaForward64(*cfg.Llama, ps, ids, shape[0], shape[1], cfg.DType == "bfloat16")
			got32 := make([]float32, len(got))
			scale, worst := 0.0, 0.0
			for i, v := range want {
				scale = max(scale, math.Abs(v))
				worst = max(worst, math.Abs(got[i]-v))
				got32[i] = float32(got[i])
			}
			t.Logf("logits: max error %.2g of their scale", worst/scale)
			require.Less(t, worst/scale, 1e-6)
			require.InEpsilon(t, wantLoss[0], hfLoss(got32, labels, shape[0], shape[1], cfg.Llama.Vocab), 1e-6)
		})
	}
}
