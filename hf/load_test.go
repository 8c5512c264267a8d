package hf_test

import (
	"encoding/binary"
	"errors"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/half"
	"github.com/batchfit/batchfit/hf"
	"github.com/batchfit/batchfit/models"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/safetensors"
)

// fileValues decodes a tensor's bytes by hand (little-endian F32, or BF16
// as the upper half of a float32), independently of the reader.
func fileValues(t *testing.T, f *safetensors.File, name string) []float32 {
	ti, ok := f.Tensor(name)
	require.True(t, ok)
	raw := make([]byte, ti.Bytes())
	require.NoError(t, f.ReadRaw(name, raw))
	out := make([]float32, ti.NumElements())
	for i := range out {
		switch ti.DType {
		case safetensors.F32:
			out[i] = math.Float32frombits(binary.LittleEndian.Uint32(raw[4*i:]))
		case safetensors.BF16:
			out[i] = math.Float32frombits(uint32(binary.LittleEndian.Uint16(raw[2*i:])) << 16)
		default:
			t.Fatalf("%s is %s", name, ti.DType)
		}
	}
	return out
}

// Every Llama-family checkpoint loads into the parameters its config
// implies (names and shapes as models.Llama has them), each holding the
// file's values exactly, bfloat16 widened; the sharded copy loads through
// its index.
func TestLoadLlamaFamily(t *testing.T) {
	for _, dir := range []string{"llama-gqa-tied-llama3", "llama-mqa-linear-bf16", "qwen2-tiny", "llama-gqa-untied-sharded"} {
		t.Run(dir, func(t *testing.T) {
			path := filepath.Join("testdata", dir)
			cfg, err := hf.ReadConfig(path)
			require.NoError(t, err)
			specs := llamaSpecs(*cfg.Llama)
			params := newParams(specs, 1)
			require.NoError(t, hf.LoadInto(path, params))

			ck, err := hf.OpenCheckpoint(path)
			require.NoError(t, err)
			defer ck.Close()
			var names []string
			for _, s := range specs {
				names = append(names, s.name)
			}
			slices.Sort(names)
			assert.Equal(t, names, ck.Names(), "the file holds exactly the model's parameters")
			for _, p := range params {
				info, file, ok := ck.Tensor(p.Name())
				require.True(t, ok)
				assert.Equal(t, p.Shape(), info.Shape)
				f, err := safetensors.Open(file)
				require.NoError(t, err)
				want := fileValues(t, f, p.Name())
				f.Close()
				require.Equal(t, want, p.Value().Data().([]float32), p.Name())
			}
		})
	}
}

// GPT-2 checkpoints come with and without the "transformer." prefix, with
// or without the old attention-mask buffers and with the tied head saved
// as a copy; all load the same, and an untied head is refused.
func TestLoadGPT2Variants(t *testing.T) {
	src := filepath.Join("testdata", "gpt2-tiny")
	cfg, err := hf.ReadConfig(src)
	require.NoError(t, err)
	load := func(dir string) ([]*nn.Param, error) {
		m := models.NewGPT(nn.Seed(2), *cfg.GPT)
		return m.Params(), hf.LoadInto(dir, m.Params())
	}
	want, err := load(src)
	require.NoError(t, err)

	orig, err := safetensors.Open(filepath.Join(src, hf.WeightsFile))
	require.NoError(t, err)
	defer orig.Close()
	rewrite := func(t *testing.T, edit func(name string, v []float32, shape []int) []safetensors.Tensor) string {
		dir := t.TempDir()
		copyFile(t, filepath.Join(src, hf.ConfigFile), filepath.Join(dir, hf.ConfigFile))
		var ts []safetensors.Tensor
		for _, ti := range orig.Tensors() {
			ts = append(ts, edit(ti.Name, fileValues(t, orig, ti.Name), ti.Shape)...)
		}
		require.NoError(t, safetensors.WriteFile(filepath.Join(dir, hf.WeightsFile), ts, map[string]string{"format": "pt"}))
		return dir
	}
	same := func(t *testing.T, dir string) {
		got, err := load(dir)
		require.NoError(t, err)
		for i := range got {
			require.Equal(t, want[i].Value().Data(), got[i].Value().Data(), got[i].Name())
		}
	}
	t.Run("unprefixed with buffers and a tied copy", func(t *testing.T) {
		same(t, rewrite(t, func(name string, v []float32, shape []int) []safetensors.Tensor {
			name = strings.TrimPrefix(name, "transformer.")
			ts := []safetensors.Tensor{{Name: name, DType: safetensors.F32, Shape: shape, Float32: v}}
			if strings.HasSuffix(name, "ln_1.weight") {
				layer := strings.TrimSuffix(name, "ln_1.weight")
				ts = append(ts, safetensors.Tensor{Name: layer + "attn.bias", DType: safetensors.F32, Shape: []int{1, 1, 4, 4}, Float32: make([]float32, 16)},
					safetensors.Tensor{Name: layer + "attn.masked_bias", DType: safetensors.F32, Shape: []int{}, Float32: []float32{-1e4}})
			}
			if name == "wte.weight" {
				ts = append(ts, safetensors.Tensor{Name: "lm_head.weight", DType: safetensors.F32, Shape: shape, Float32: v})
			}
			return ts
		}))
	})
	t.Run("head copy in another dtype", func(t *testing.T) {
		// An embedding of bfloat16 values stored as F32, its head copy as
		// BF16: equal in value, so they tie.
		dir := rewrite(t, func(name string, v []float32, shape []int) []safetensors.Tensor {
			if name != "transformer.wte.weight" {
				return []safetensors.Tensor{{Name: name, DType: safetensors.F32, Shape: shape, Float32: v}}
			}
			r := make([]float32, len(v))
			for i, x := range v {
				r[i] = half.RoundBF16(x)
			}
			return []safetensors.Tensor{{Name: name, DType: safetensors.F32, Shape: shape, Float32: r},
				{Name: "lm_head.weight", DType: safetensors.BF16, Shape: shape, Float32: r}}
		})
		_, err := load(dir)
		require.NoError(t, err)
	})
	t.Run("F64 head", func(t *testing.T) {
		dir := rewrite(t, func(name string, v []float32, shape []int) []safetensors.Tensor {
			ts := []safetensors.Tensor{{Name: name, DType: safetensors.F32, Shape: shape, Float32: v}}
			if name == "transformer.wte.weight" {
				ts = append(ts, safetensors.Tensor{Name: "lm_head.weight", DType: safetensors.F64, Shape: shape, Float32: v})
			}
			return ts
		})
		_, err := load(dir)
		assert.ErrorIs(t, err, safetensors.ErrDType, "an F64 head is not a weight dtype")
	})
	t.Run("untied head", func(t *testing.T) {
		dir := rewrite(t, func(name string, v []float32, shape []int) []safetensors.Tensor {
			ts := []safetensors.Tensor{{Name: name, DType: safetensors.F32, Shape: shape, Float32: v}}
			if name == "transformer.wte.weight" {
				head := slices.Clone(v)
				head[len(head)-1] += 1
				ts = append(ts, safetensors.Tensor{Name: "lm_head.weight", DType: safetensors.F32, Shape: shape, Float32: head})
			}
			return ts
		})
		_, err := load(dir)
		assert.ErrorIs(t, err, hf.ErrCheckpoint)
	})
}

func copyFile(t *testing.T, from, to string) {
	b, err := os.ReadFile(from)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(to, b, 0o644))
}

// A checkpoint that does not fit the model is refused before any
// parameter changes, with an error naming what is wrong.
func TestLoadMismatches(t *testing.T) {
	path := filepath.Join("testdata", "llama-gqa-tied-llama3")
	cfg, err := hf.ReadConfig(path)
	require.NoError(t, err)
	ck, err := hf.OpenCheckpoint(path)
	require.NoError(t, err)
	defer ck.Close()
	unchanged := func(t *testing.T, ps []*nn.Param, seed uint64) {
		fresh := newParams(llamaSpecs(*cfg.Llama), seed)
		for i, p := range ps {
			if i < len(fresh) && p.Name() == fresh[i].Name() {
				require.Equal(t, fresh[i].Value().Data(), p.Value().Data(), "%s changed", p.Name())
			}
		}
	}

	t.Run("missing", func(t *testing.T) {
		c := *cfg.Llama
		c.Layers = 3
		ps := newParams(llamaSpecs(c), 3)
		err := ck.LoadInto(hf.Llama, ps)
		require.ErrorIs(t, err, hf.ErrMissingTensor)
		assert.Contains(t, err.Error(), "model.layers.2.input_layernorm.weight")
		unchanged(t, ps, 3)
	})
	t.Run("unexpected", func(t *testing.T) {
		c := *cfg.Llama
		c.Layers = 1
		ps := newParams(llamaSpecs(c), 4)
		err := ck.LoadInto(hf.Llama, ps)
		require.ErrorIs(t, err, hf.ErrUnexpectedTensor)
		assert.Contains(t, err.Error(), "model.layers.1.")
		unchanged(t, ps, 4)
	})
	t.Run("shape", func(t *testing.T) {
		c := *cfg.Llama
		c.KVHeads = 4 // the file's k_proj is [32, 64]
		ps := newParams(llamaSpecs(c), 5)
		err := ck.LoadInto(hf.Llama, ps)
		var se *hf.ShapeError
		require.True(t, errors.As(err, &se), "%v", err)
		assert.ErrorIs(t, err, hf.ErrShape)
		assert.Equal(t, "model.layers.0.self_attn.k_proj.weight", se.Tensor)
		assert.Equal(t, []int{64, 64}, se.Want)
		assert.Equal(t, []int{32, 64}, se.Got)
		assert.Contains(t, err.Error(), "[32 64]")
		assert.Contains(t, err.Error(), "[64 64]")
	})
	t.Run("untied model, tied checkpoint", func(t *testing.T) {
		c := *cfg.Llama
		c.TieEmbeddings = false
		err := ck.LoadInto(hf.Llama, newParams(llamaSpecs(c), 6))
		require.ErrorIs(t, err, hf.ErrMissingTensor)
		assert.Contains(t, err.Error(), "lm_head.weight")
	})
	t.Run("unknown parameter name", func(t *testing.T) {
		ps := append(newParams(llamaSpecs(*cfg.Llama), 7), newParams([]spec{{"model.layers.0.lora_A", []int{2}}}, 1)...)
		assert.ErrorIs(t, ck.LoadInto(hf.Llama, ps), hf.ErrUnsupported)
	})
	t.Run("shape-only parameters", func(t *testing.T) {
		m := models.NewGPT(nn.Options{ShapeOnly: true}, models.GPTConfig{Vocab: 320, Context: 64, Layers: 2, Heads: 4, Dim: 64})
		assert.ErrorIs(t, hf.LoadInto(filepath.Join("testdata", "gpt2-tiny"), m.Params()), graph.ErrNoData)
	})
}

// writeShard writes a small Llama-named safetensors file.
func writeShard(t *testing.T, path string, names ...string) {
	var ts []safetensors.Tensor
	for _, n := range names {
		ts = append(ts, safetensors.Tensor{Name: n, DType: safetensors.F32, Shape: []int{2}, Float32: []float32{1, 2}})
	}
	require.NoError(t, safetensors.WriteFile(path, ts, map[string]string{"format": "pt"}))
}

func writeIndex(t *testing.T, dir string, weightMap string) {
	require.NoError(t, os.WriteFile(filepath.Join(dir, hf.IndexFile), []byte(`{"metadata": {}, "weight_map": `+weightMap+`}`), 0o644))
}

func TestOpenCheckpointHostile(t *testing.T) {
	outside := t.TempDir()
	writeShard(t, filepath.Join(outside, "evil.safetensors"), "a")
	cases := []struct {
		name  string
		setup func(t *testing.T, dir string)
		want  error
	}{
		{"empty directory", func(t *testing.T, dir string) {}, hf.ErrCheckpoint},
		{"pickle only", func(t *testing.T, dir string) {
			require.NoError(t, os.WriteFile(filepath.Join(dir, "pytorch_model.bin"), []byte("PK"), 0o644))
		}, hf.ErrUnsupported},
		{"weights are a FIFO", func(t *testing.T, dir string) {
			require.NoError(t, syscall.Mkfifo(filepath.Join(dir, hf.WeightsFile), 0o644))
		}, hf.ErrNotRegular},
		{"weights are a directory", func(t *testing.T, dir string) {
			require.NoError(t, os.Mkdir(filepath.Join(dir, hf.WeightsFile), 0o755))
		}, hf.ErrNotRegular},
		{"weights are garbage", func(t *testing.T, dir string) {
			require.NoError(t, os.WriteFile(filepath.Join(dir, hf.WeightsFile), []byte("\xff\xff\xff\xff\xff\xff\xff\x7fjunk"), 0o644))
		}, safetensors.ErrTooLarge},
		{"shard outside by ..", func(t *testing.T, dir string) {
			writeIndex(t, dir, `{"a": "../`+filepath.Base(outside)+`/evil.safetensors"}`)
		}, hf.ErrCheckpoint},
		{"absolute shard", func(t *testing.T, dir string) {
			writeIndex(t, dir, `{"a": "`+filepath.Join(outside, "evil.safetensors")+`"}`)
		}, hf.ErrCheckpoint},
		{"shard in a subdirectory", func(t *testing.T, dir string) {
			require.NoError(t, os.Mkdir(filepath.Join(dir, "sub"), 0o755))
			writeShard(t, filepath.Join(dir, "sub", "s.safetensors"), "a")
			writeIndex(t, dir, `{"a": "sub/s.safetensors"}`)
		}, hf.ErrCheckpoint},
		{"shard not safetensors", func(t *testing.T, dir string) {
			writeIndex(t, dir, `{"a": "config.json"}`)
		}, hf.ErrCheckpoint},
		{"missing shard", func(t *testing.T, dir string) {
			writeIndex(t, dir, `{"a": "model-00001-of-00002.safetensors"}`)
		}, os.ErrNotExist},
		{"tensor not in its shard", func(t *testing.T, dir string) {
			writeShard(t, filepath.Join(dir, "s1.safetensors"), "a")
			writeShard(t, filepath.Join(dir, "s2.safetensors"), "b")
			writeIndex(t, dir, `{"a": "s1.safetensors", "b": "s1.safetensors", "c": "s2.safetensors"}`)
		}, hf.ErrCheckpoint},
		{"tensor in two shards", func(t *testing.T, dir string) {
			writeShard(t, filepath.Join(dir, "s1.safetensors"), "a", "b")
			writeShard(t, filepath.Join(dir, "s2.safetensors"), "b")
			writeIndex(t, dir, `{"a": "s1.safetensors", "b": "s2.safetensors"}`)
		}, hf.ErrCheckpoint},
		{"shard is a link to a FIFO", func(t *testing.T, dir string) {
			fifo := filepath.Join(outside, "fifo")
			_ = syscall.Mkfifo(fifo, 0o644)
			require.NoError(t, os.Symlink(fifo, filepath.Join(dir, "s1.safetensors")))
			writeIndex(t, dir, `{"a": "s1.safetensors"}`)
		}, hf.ErrNotRegular},
		{"index not JSON", func(t *testing.T, dir string) {
			require.NoError(t, os.WriteFile(filepath.Join(dir, hf.IndexFile), []byte("{"), 0o644))
		}, hf.ErrCheckpoint},
		{"index too large", func(t *testing.T, dir string) {
			require.NoError(t, os.WriteFile(filepath.Join(dir, hf.IndexFile), make([]byte, 16<<20+1), 0o644))
		}, hf.ErrTooLarge},
		{"empty weight map", func(t *testing.T, dir string) { writeIndex(t, dir, `{}`) }, hf.ErrCheckpoint},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			dir := t.TempDir()
			c.setup(t, dir)
			ck, err := hf.OpenCheckpoint(dir)
			if ck != nil {
				ck.Close()
			}
			assert.ErrorIs(t, err, c.want)
		})
	}
}

// Weights must be F32, BF16 or F16.
func TestLoadRejectsIntegerWeights(t *testing.T) {
	dir := t.TempDir()
	copyFile(t, filepath.Join("testdata", "gpt2-tiny", hf.ConfigFile), filepath.Join(dir, hf.ConfigFile))
	cfg, err := hf.ReadConfig(dir)
	require.NoError(t, err)
	m := models.NewGPT(nn.Seed(3), *cfg.GPT)
	var ts []safetensors.Tensor
	for _, p := range m.Params() {
		name := "transformer." + p.Name()
		shape := slices.Clone(p.Shape())
		if strings.HasSuffix(name, "c_attn.weight") || strings.HasSuffix(name, "c_proj.weight") || strings.HasSuffix(name, "c_fc.weight") {
			shape[0], shape[1] = shape[1], shape[0]
		}
		st := safetensors.Tensor{Name: name, DType: safetensors.F32, Shape: shape, Float32: p.Value().Data().([]float32)}
		if name == "transformer.ln_f.bias" {
			st = safetensors.Tensor{Name: name, DType: safetensors.I32, Shape: shape, Raw: make([]byte, 4*numel(shape))}
		}
		ts = append(ts, st)
	}
	require.NoError(t, safetensors.WriteFile(filepath.Join(dir, hf.WeightsFile), ts, nil))
	err = hf.LoadInto(dir, m.Params())
	require.ErrorIs(t, err, safetensors.ErrDType)
	assert.Contains(t, err.Error(), "ln_f.bias")
}
