package main

import (
	"context"
	"io"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/hf"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/models"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/safetensors"
	"github.com/batchfit/batchfit/tokenizer"
)

const (
	hfTestdata  = "../../hf/testdata"
	tokTestdata = "../../tokenizer/testdata"
)

// tinyCheckpoint saves a randomly initialised tiny model of arch whose
// vocabulary is the tokenizer file's, with the tokenizer beside it: a
// checkpoint directory as a hub download has it.
func tinyCheckpoint(t *testing.T, arch hf.Architecture, tokFile string) string {
	t.Helper()
	tok, err := tokenizer.Load(filepath.Join(tokTestdata, tokFile))
	require.NoError(t, err)
	v := tok.VocabSize()
	dir := filepath.Join(t.TempDir(), "base")
	cfg := hf.Config{Architecture: arch, BOS: -1}
	var m nn.Module
	switch arch {
	case hf.GPT2:
		g := models.GPTConfig{Vocab: v, Context: 64, Layers: 2, Heads: 2, Dim: 32}
		cfg.GPT, m = &g, models.NewGPT(nn.Seed(3), g)
	default:
		l := models.LlamaConfig{Vocab: v, Hidden: 32, Intermediate: 64, Layers: 2, Heads: 4, KVHeads: 2, MaxPositions: 128,
			RMSNormEps: 1e-5, TieEmbeddings: true, Rope: models.RopeConfig{Theta: 10000, Type: "default"}}
		cfg.Llama, m = &l, models.NewLlama(nn.Seed(3), l)
	}
	require.NoError(t, hf.Save(dir, cfg, m.Params()))
	b, err := os.ReadFile(filepath.Join(tokTestdata, tokFile))
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(filepath.Join(dir, "tokenizer.json"), b, 0o644))
	return dir
}

// corpus writes a text of seeded sentences over a few words, each word
// followed by one of two successors: a language a tiny model learns in a
// few dozen steps.
func corpus(t *testing.T) string {
	t.Helper()
	words := strings.Fields("the quick brown fox jumps over a lazy dog while seven silver owls sing softly near old stone bridges")
	r := rand.New(rand.NewPCG(5, 6))
	var b strings.Builder
	for line := range 200 {
		w := line % len(words)
		for range 12 {
			b.WriteString(words[w] + " ")
			w = (w*3 + 1 + r.IntN(2)) % len(words)
		}
		b.WriteString("\n")
	}
	path := filepath.Join(t.TempDir(), "corpus.txt")
	require.NoError(t, os.WriteFile(path, []byte(b.String()), 0o644))
	return path
}

func mean(x []float32) float64 {
	s := 0.0
	for _, v := range x {
		s += float64(v)
	}
	return s / float64(len(x))
}

// logits runs model over tokens [1, T] on a CPU session.
func logits(t *testing.T, model nn.Module, tokens []int64) []float32 {
	t.Helper()
	sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU})
	require.NoError(t, sess.Err())
	defer sess.Close()
	x := lazy.Wrap(tensor.New(tensor.WithShape(1, len(tokens)), tensor.WithBacking(tokens)), 0)
	out, err := sess.Eval(context.Background(), model.Forward(x))
	require.NoError(t, err)
	return out[0].Data().([]float32)
}

// The example end to end on the CPU, for a Llama with the Llama-3-style
// tokenizer and a GPT-2 with the GPT-2-style one: the loss drops, the
// saved checkpoint loads back with bit-equal weights and equal logits
// (tolerance 0: the same float32 weights on the same kernels), the
// directory holds the tokenizer, and generation yields ids of the
// vocabulary, the same from the reloaded model.
func TestFinetuneEndToEnd(t *testing.T) {
	for _, c := range []struct {
		arch hf.Architecture
		tok  string
	}{{hf.Llama, "llama3-style.json"}, {hf.GPT2, "gpt2-style.json"}} {
		t.Run(string(c.arch), func(t *testing.T) {
			base := tinyCheckpoint(t, c.arch, c.tok)
			out := filepath.Join(t.TempDir(), "tuned")
			var log strings.Builder
			o := options{model: base, data: corpus(t), out: out, steps: 40, batch: 4, seq: 32, lr: 3e-3, warmup: 4,
				minRatio: 0.1, clip: 1, wd: 0.01, logEvery: 10, generate: 8, seed: 1, precision: "fp32", device: batchfit.DeviceCPU,
				prompt: "the quick brown"}
			res, err := run(context.Background(), &log, o)
			require.NoError(t, err, log.String())
			t.Log(log.String())
			require.Len(t, res.Losses, 40)
			assert.Equal(t, res.Predicted, res.Measured, "the last step's peak reserved bytes, predicted and measured")
			assert.Positive(t, res.Measured)
			first, last := mean(res.Losses[:5]), mean(res.Losses[35:])
			assert.Greater(t, first, 6.0, "about log %d at initialisation", 2003)
			assert.Less(t, last, first-3, "the loss drops: first five steps %.3f, last five %.3f", first, last)

			cfg, reloaded, err := load(out)
			require.NoError(t, err)
			assert.Equal(t, c.arch, cfg.Architecture)
			want, got := res.Model.Params(), reloaded.Params()
			require.Equal(t, len(want), len(got))
			for i := range want {
				assert.Equal(t, want[i].Value().Data(), got[i].Value().Data(), want[i].Name())
			}
			probe := []int64{5, 17, 300, 42, 1000, 7, 7, 99}
			assert.Equal(t, logits(t, res.Model, probe), logits(t, reloaded, probe), "logits of the trained and the reloaded model")
			_, err = os.Stat(filepath.Join(out, "tokenizer.json"))
			assert.NoError(t, err)

			vocab, _ := dims(cfg)
			require.NotEmpty(t, res.Generated)
			assert.LessOrEqual(t, len(res.Generated), 8)
			for _, id := range res.Generated {
				assert.True(t, id >= 0 && id < vocab, "generated id %d", id)
			}
			sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU})
			defer sess.Close()
			again, err := generate(context.Background(), sess, reloaded, res.Prompt, 8, 64, cfg.EOS)
			require.NoError(t, err)
			assert.Equal(t, res.Generated, again, "greedy generation from the reloaded checkpoint")
			assert.Contains(t, log.String(), "generated ")
		})
	}
}

// readInt64 reads an int64 tensor of a reference file.
func readInt64(t *testing.T, f *safetensors.File, name string) ([]int64, []int) {
	t.Helper()
	info, ok := f.Tensor(name)
	require.True(t, ok, name)
	n := 1
	for _, d := range info.Shape {
		n *= d
	}
	v := make([]int64, n)
	require.NoError(t, f.ReadInt64(name, v))
	return v, info.Shape
}

// Greedy generation equals transformers' generate(do_sample=False) in
// float32 on the GPT-2 testdata checkpoint (generate_ids: the prompt and
// 8 new tokens); on the Llama-family checkpoints, whose references hold
// float64 logits instead, the first generated token is the argmax of
// transformers' float64 logits at the prompt's last position.
func TestGenerateMatchesTransformers(t *testing.T) {
	sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU})
	require.NoError(t, sess.Err())
	defer sess.Close()
	ctx := context.Background()

	cfg, model, err := load(filepath.Join(hfTestdata, "gpt2-tiny"))
	require.NoError(t, err)
	f, err := safetensors.Open(filepath.Join(hfTestdata, "gpt2-tiny", "reference.safetensors"))
	require.NoError(t, err)
	defer f.Close()
	prompt64, _ := readInt64(t, f, "generate_prompt")
	want64, _ := readInt64(t, f, "generate_ids")
	prompt, want := ints(prompt64), ints(want64)
	_, positions := dims(cfg)
	got, err := generate(ctx, sess, model, prompt, len(want)-len(prompt), positions, cfg.EOS)
	require.NoError(t, err)
	assert.Equal(t, want[len(prompt):], got, "transformers' greedy continuation of %v", prompt)

	for _, dir := range []string{"llama-gqa-tied-llama3", "qwen2-tiny", "llama-mqa-linear-bf16", "llama-gqa-untied-sharded"} {
		cfg, model, err := load(filepath.Join(hfTestdata, dir))
		require.NoError(t, err, dir)
		f, err := safetensors.Open(filepath.Join(hfTestdata, dir, "reference.safetensors"))
		require.NoError(t, err, dir)
		ids, shape := readInt64(t, f, "input_ids")
		info, ok := f.Tensor("logits_f64")
		require.True(t, ok, dir)
		ref := make([]float64, info.Shape[0]*info.Shape[1]*info.Shape[2])
		require.NoError(t, f.ReadFloat64("logits_f64", ref))
		f.Close()
		v := info.Shape[2]
		for row := range shape[0] {
			seq := ints(ids[row*shape[1] : (row+1)*shape[1]])
			lastRow := ref[(row*shape[1]+shape[1]-1)*v : (row*shape[1]+shape[1])*v]
			best := 0
			for i, x := range lastRow {
				if x > lastRow[best] {
					best = i
				}
			}
			second := math.Inf(-1)
			for i, x := range lastRow {
				if i != best {
					second = math.Max(second, x)
				}
			}
			_, positions := dims(cfg)
			got, err := generate(ctx, sess, model, seq, 1, positions, nil)
			require.NoError(t, err, dir)
			assert.Equal(t, []int{best}, got, "%s row %d: argmax of transformers' float64 logits (margin %.3g over the next)", dir, row, lastRow[best]-second)
		}
	}
}

func ints(v []int64) []int {
	out := make([]int, len(v))
	for i, x := range v {
		out[i] = int(x)
	}
	return out
}

// Inputs that cannot be fine-tuned are refused before training: a
// tokenizer with ids past the model's vocabulary, a text too short for a
// batch, a sequence longer than the model's positions, saving over the
// source checkpoint, missing flags.
func TestFinetuneRefuses(t *testing.T) {
	base := tinyCheckpoint(t, hf.Llama, "llama3-style.json")
	text := corpus(t)
	short := filepath.Join(t.TempDir(), "short.txt")
	require.NoError(t, os.WriteFile(short, []byte("the quick brown fox"), 0o644))
	ok := options{model: base, data: text, out: filepath.Join(t.TempDir(), "o"), steps: 1, batch: 2, seq: 16, lr: 1e-3,
		logEvery: 1, precision: "fp32", device: batchfit.DeviceCPU}
	cases := []struct {
		name   string
		modify func(*options)
		want   string
	}{
		{"short text", func(o *options) { o.data = short }, "fewer than a batch"},
		{"seq past positions", func(o *options) { o.seq = 129 }, "longer than the model's 128 positions"},
		{"out is the model", func(o *options) { o.out = base }, "is the -model directory"},
		{"no data", func(o *options) { o.data = "" }, "required"},
	}
	for _, c := range cases {
		o := ok
		c.modify(&o)
		_, err := run(context.Background(), io.Discard, o)
		require.Error(t, err, c.name)
		assert.Contains(t, err.Error(), c.want, c.name)
	}
	// The GPT-2-style tokenizer's 1,501 ids fit the 2,003-token Llama;
	// a larger tokenizer on a smaller model does not.
	small := tinyCheckpoint(t, hf.Llama, "gpt2-style.json")
	o := ok
	o.model, o.tokenizer = small, filepath.Join(tokTestdata, "llama3-style.json")
	_, err := run(context.Background(), io.Discard, o)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "outside the model's vocabulary")
}
