package main

import (
	"context"
	"encoding/binary"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/hf"
	"github.com/batchfit/batchfit/safetensors"
	"github.com/batchfit/batchfit/tokenizer"
)

// exportText is encoded by the saved tokenizer on both sides of the
// from_pretrained check.
const exportText = "the quick brown fox jumps over a lazy dog\nwhile  seven silver owls sing — softly"

// TestExportFinetuned writes fine-tuned checkpoints into
// $BATCHFIT_HF_EXPORT for scripts/check-hf-saves.py: for a Llama (with
// the Llama-3-style tokenizer) and a GPT-2 (GPT-2-style) trained 20 steps
// by the example, the saved directory finetuned-<name> and beside it
// finetuned-<name>.reference.safetensors: input_ids [2, 16] (seeded) and
// the trained model's float32 logits over them on the CPU (logits_f32),
// text_ids (exportText as the tokenizer encodes it, with special
// tokens), and generate_prompt / generate_ids (the prompt and its greedy
// continuation of 8 tokens, as transformers' generate returns them).
func TestExportFinetuned(t *testing.T) {
	out := os.Getenv("BATCHFIT_HF_EXPORT")
	if out == "" {
		t.Skip("set BATCHFIT_HF_EXPORT=DIR to write fine-tuned checkpoints for the from_pretrained check (scripts/check-hf-saves.py)")
	}
	for _, c := range []struct {
		name string
		arch hf.Architecture
		tok  string
	}{{"llama", hf.Llama, "llama3-style.json"}, {"gpt2", hf.GPT2, "gpt2-style.json"}} {
		dir := filepath.Join(out, "finetuned-"+c.name)
		require.NoError(t, os.RemoveAll(dir))
		o := options{model: tinyCheckpoint(t, c.arch, c.tok), data: corpus(t), out: dir, steps: 20, batch: 4, seq: 32, lr: 3e-3,
			warmup: 2, minRatio: 0.1, clip: 1, wd: 0.01, logEvery: 20, generate: 8, seed: 1, precision: "fp32",
			device: batchfit.DeviceCPU, prompt: "the quick brown"}
		res, err := run(context.Background(), io.Discard, o)
		require.NoError(t, err, c.name)
		vocab, _ := dims(res.Config)

		r := rand.New(rand.NewPCG(11, 12))
		ids := make([]int64, 2*16)
		for i := range ids {
			ids[i] = int64(r.IntN(vocab))
		}
		var logitsF32 []float32
		for row := range 2 {
			logitsF32 = append(logitsF32, logits(t, res.Model, ids[row*16:(row+1)*16])...)
		}
		tok, err := tokenizer.Load(filepath.Join(dir, "tokenizer.json"))
		require.NoError(t, err)
		textIDs, err := tok.Encode(exportText, true)
		require.NoError(t, err)
		gen := append(append([]int(nil), res.Prompt...), res.Generated...)
		tensors := []safetensors.Tensor{
			i64("input_ids", ids, 2, 16),
			{Name: "logits_f32", DType: safetensors.F32, Shape: []int{2, 16, vocab}, Float32: logitsF32},
			i64("text_ids", int64s(textIDs), len(textIDs)),
			i64("generate_prompt", int64s(res.Prompt), 1, len(res.Prompt)),
			i64("generate_ids", int64s(gen), 1, len(gen)),
		}
		require.NoError(t, safetensors.WriteFile(dir+".reference.safetensors", tensors, map[string]string{"text": exportText}))
	}
}

func i64(name string, v []int64, shape ...int) safetensors.Tensor {
	raw := make([]byte, 8*len(v))
	for i, x := range v {
		binary.LittleEndian.PutUint64(raw[8*i:], uint64(x))
	}
	return safetensors.Tensor{Name: name, DType: safetensors.I64, Shape: shape, Raw: raw}
}

func int64s(v []int) []int64 {
	out := make([]int64, len(v))
	for i, x := range v {
		out[i] = int64(x)
	}
	return out
}
