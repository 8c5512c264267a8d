package checkpoint

import (
	"encoding/json"
	"math"
	"os"
	"path/filepath"
	"slices"
	"syscall"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/data"
	"github.com/batchfit/batchfit/hf"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/models"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/optim"
)

// values copies every parameter's float32 values.
func values(ps []*nn.Param) [][]float32 {
	out := make([][]float32, len(ps))
	for i, p := range ps {
		out[i] = slices.Clone(p.Value().Data().([]float32))
	}
	return out
}

// convNet is a small conv net with a batch norm (buffers) and a dropout.
func convNet(seed uint64, channels int) *nn.Sequential {
	o := nn.Seed(seed)
	d := nn.NewDropout(0.1)
	d.Seed = 11
	return nn.NewSequential(nn.NewConv2d(o, 1, channels, [2]int{3, 3}, true, lazyConv()), nn.NewBatchNorm2d(o, channels, 1e-5, 0.1), d)
}

func lazyConv() lazy.ConvOptions {
	return lazy.ConvOptions{Stride: [2]int{1, 1}, Padding: [2]int{1, 1}, Dilation: [2]int{1, 1}}
}

// trainedAdam is an AdamW with groups, clipping and state for every
// parameter of m, as if it had run 5 steps.
func trainedAdam(t *testing.T, m nn.Module) *optim.Adam {
	o := optim.NewAdamW(3e-3)
	o.Beta2, o.Eps = 0.95, 1e-6
	o.Clip = optim.Clip{MaxNorm: 1.5, NormType: math.Inf(1)}
	o.Schedule = optim.Cosine{Warmup: 2, Total: 9, MinRatio: 0.1}
	_, noDecay := optim.SplitDecay(m.Params())
	g := o.AddGroup("no_decay", optim.Keys(noDecay)...)
	g.WeightDecay, g.LR = 0, 1e-3
	for i, p := range m.Params() {
		n := len(p.Value().Data().([]float32))
		slots := [][]float32{make([]float32, n), make([]float32, n)}
		for j := range n {
			slots[0][j], slots[1][j] = float32(i+j)/7, float32(j)/3+1
		}
		require.NoError(t, o.SetState(p.Value(), n, 5-i%2, slots))
	}
	require.NoError(t, o.SetSteps(5))
	return o
}

// Everything Save writes comes back: parameters, buffers, dropout seeds
// and counters, the optimizer's hyperparameters, groups, clipping, state,
// step counts and Steps, the step, the data position and Meta; the
// manifest lists every tensor with its checksum and what wrote it.
func TestSaveLoadRoundTrip(t *testing.T) {
	dir := t.TempDir()
	m := convNet(1, 3)
	drop := nn.Dropouts(m)[0].Dropout
	drop.SetStep(41)
	bn := nn.Buffers(m)
	copy(bn[0].Tensor.Value().Data().([]float32), []float32{0.5, -1, 2})
	opt := trainedAdam(t, m)
	pos := data.Position{Epoch: 2, Index: 12, Seed: 1<<63 + 5, Shuffle: true, Len: 30}
	src := &Training{Model: m, Optimizer: opt, Step: 17, Data: pos, Meta: map[string]string{"run": "a"}}
	path, err := src.Save(dir)
	require.NoError(t, err)
	require.Equal(t, filepath.Join(dir, "ckpt-00000017"), path)
	latest, err := Latest(dir)
	require.NoError(t, err)
	require.Equal(t, path, latest)

	man, err := Verify(dir)
	require.NoError(t, err)
	assert.Equal(t, Format, man.Format)
	assert.Equal(t, Version, man.Version)
	assert.NotEmpty(t, man.Producer.Program)
	assert.NotEmpty(t, man.Producer.Go)
	assert.Equal(t, "names", man.Params.Layout)
	var tensors int
	for _, f := range man.Files {
		for _, ts := range f.Tensors {
			assert.Len(t, ts.SHA256, 64, ts.Name)
			assert.Equal(t, "F32", ts.DType, ts.Name)
			tensors++
		}
	}
	assert.Equal(t, 4+2+2*4, tensors, "4 parameters, 2 buffers, 2 slots of each parameter")
	assert.Equal(t, "optim.Cosine{Warmup:2, Total:9, WarmupStart:0, MinLR:0, MinRatio:0.1}", man.Optimizer.Schedule)

	dst := convNet(2, 3) // other values everywhere
	opt2 := optim.NewAdamW(1)
	opt2.AddGroup("other", dst.Params()[0].Value())
	into := &Training{Model: dst, Optimizer: opt2}
	require.NoError(t, into.Load(dir))
	assert.Equal(t, values(m.Params()), values(dst.Params()))
	assert.Equal(t, bn[0].Tensor.Value().Data(), nn.Buffers(dst)[0].Tensor.Value().Data())
	d2 := nn.Dropouts(dst)[0].Dropout
	assert.Equal(t, uint64(41), d2.Step())
	assert.Equal(t, uint64(11), d2.Seed)
	assert.Equal(t, 17, into.Step)
	assert.Equal(t, pos, into.Data)
	assert.Equal(t, map[string]string{"run": "a"}, into.Meta)

	// Saved again at once, the same tensors, bit for bit.
	again, err := into.Save(t.TempDir())
	require.NoError(t, err)
	man2, err := Verify(again)
	require.NoError(t, err)
	assert.Equal(t, man.Files, man2.Files)

	assert.Equal(t, opt.LR, opt2.LR)
	assert.Equal(t, opt.Beta2, opt2.Beta2)
	assert.Equal(t, opt.Eps, opt2.Eps)
	assert.Equal(t, opt.WeightDecay, opt2.WeightDecay)
	assert.True(t, math.IsInf(opt2.Clip.NormType, 1))
	assert.Equal(t, 1.5, opt2.Clip.MaxNorm)
	require.Len(t, opt2.Groups, 1)
	g := opt2.Groups[0]
	assert.Equal(t, "no_decay", g.Name)
	assert.Equal(t, 1e-3, g.LR)
	assert.Equal(t, 0.0, g.WeightDecay)
	_, noDecay := optim.SplitDecay(dst.Params())
	assert.Equal(t, optim.Keys(noDecay), g.Keys, "the group's parameters, by name, as the new model's keys")
	assert.Equal(t, 5, opt2.Steps())
	for i, p := range m.Params() {
		q := dst.Params()[i]
		assert.Equal(t, opt.ParamStep(p.Value()), opt2.ParamStep(q.Value()), p.Name())
		assert.Equal(t, opt.State(p.Value()), opt2.State(q.Value()), p.Name())
	}
}

// A GPT's checkpoint holds its parameters as Hugging Face saves GPT-2's
// (model.safetensors beside config.json, which hf.LoadInto, as
// from_pretrained, loads), and loads back into a GPT; a GPT of another
// width is a *ShapeError naming the tensor and both shapes, another model
// ErrMismatch, and neither changes a parameter.
func TestGPTCheckpointIsHuggingFace(t *testing.T) {
	cfg := models.GPTConfig{Vocab: 40, Context: 8, Layers: 2, Heads: 2, Dim: 16}
	m := models.NewGPT(nn.Seed(3), cfg)
	dir := t.TempDir()
	path, err := (&Training{Model: m, Step: 4}).Save(dir)
	require.NoError(t, err)
	for _, f := range []string{ModelFile, ConfigFile, ManifestFile} {
		assert.FileExists(t, filepath.Join(path, f))
	}
	hfCfg, err := hf.ReadConfig(path)
	require.NoError(t, err)
	assert.Equal(t, hf.GPT2, hfCfg.Architecture)
	viaHF := models.NewGPT(nn.Seed(4), cfg)
	require.NoError(t, hf.LoadInto(path, viaHF.Params()))
	assert.Equal(t, values(m.Params()), values(viaHF.Params()))

	back := models.NewGPT(nn.Seed(5), cfg)
	require.NoError(t, (&Training{Model: back}).Load(dir))
	assert.Equal(t, values(m.Params()), values(back.Params()))

	wide := cfg
	wide.Dim = 32
	w := models.NewGPT(nn.Seed(6), wide)
	before := values(w.Params())
	err = (&Training{Model: w}).Load(dir)
	var se *ShapeError
	require.ErrorAs(t, err, &se)
	assert.ErrorIs(t, err, ErrMismatch)
	assert.Equal(t, "wpe.weight", se.Tensor)
	assert.Equal(t, []int{8, 32}, se.Want)
	assert.Equal(t, []int{8, 16}, se.Got)
	assert.Contains(t, err.Error(), `"wpe.weight"`)
	assert.Equal(t, before, values(w.Params()), "nothing changed")

	mlp := nn.MLP(nn.Seed(1), []int{4, 4}, nn.ReLU{})
	err = (&Training{Model: mlp}).Load(dir)
	require.ErrorIs(t, err, ErrMismatch)
	assert.NotErrorIs(t, err, ErrCorrupt)
}

// Mismatches between a sound checkpoint and the training are ErrMismatch
// and change nothing: an optimizer of another kind, none saved, another
// set of dropout layers, a parameter the checkpoint lacks.
func TestLoadMismatch(t *testing.T) {
	dir := t.TempDir()
	m := convNet(1, 3)
	_, err := (&Training{Model: m, Optimizer: trainedAdam(t, m)}).Save(dir)
	require.NoError(t, err)

	dst := convNet(2, 3)
	before := values(dst.Params())
	sgd := optim.NewSGD(0.1, 0.9)
	require.ErrorIs(t, (&Training{Model: dst, Optimizer: sgd}).Load(dir), ErrMismatch)
	assert.Equal(t, before, values(dst.Params()))
	assert.Zero(t, sgd.Steps())

	noOpt := t.TempDir()
	_, err = (&Training{Model: m}).Save(noOpt)
	require.NoError(t, err)
	err = (&Training{Model: dst, Optimizer: optim.NewAdamW(1)}).Load(noOpt)
	require.ErrorIs(t, err, ErrMismatch)
	assert.Contains(t, err.Error(), "no optimizer state")

	o := nn.Seed(2)
	noDrop := nn.NewSequential(nn.NewConv2d(o, 1, 3, [2]int{3, 3}, true, lazyConv()), nn.NewBatchNorm2d(o, 3, 1e-5, 0.1))
	require.ErrorIs(t, (&Training{Model: noDrop}).Load(dir), ErrMismatch)

	extra := nn.NewSequential(convNet(2, 3), nn.NewLinear(o, 2, 2, false))
	err = (&Training{Model: extra}).Load(dir)
	require.ErrorIs(t, err, ErrMismatch)
	assert.Equal(t, before, values(dst.Params()))
}

// A checkpoint damaged on disk is a typed error, whatever the damage: a
// flipped bit in a tensor (ErrChecksum), a truncated file (ErrTruncated),
// a missing file or tensor (ErrMissingTensor), an edited manifest
// (ErrChecksum), a manifest of an unknown version (ErrVersion), with an
// unknown field (ErrCorrupt), over the size bound (ErrTooLarge) or not a
// regular file (ErrNotRegular), and a latest pointer out of the
// directory (ErrCorrupt).
func TestLoadCorrupt(t *testing.T) {
	save := func(t *testing.T) (string, string) {
		dir := t.TempDir()
		m := convNet(1, 3)
		path, err := (&Training{Model: m, Optimizer: trainedAdam(t, m), Step: 3}).Save(dir)
		require.NoError(t, err)
		return dir, path
	}
	load := func(dir string) error {
		return (&Training{Model: convNet(2, 3), Optimizer: optim.NewAdamW(1)}).Load(dir)
	}
	rewrite := func(t *testing.T, path string, edit func(m *Manifest)) {
		m, err := readManifest(path)
		require.NoError(t, err)
		edit(m)
		b, err := m.encode()
		require.NoError(t, err)
		require.NoError(t, os.WriteFile(filepath.Join(path, ManifestFile), b, 0o644))
	}
	cases := []struct {
		name   string
		damage func(t *testing.T, dir, path string)
		want   error
	}{
		{"flipped bit", func(t *testing.T, _, path string) {
			f := filepath.Join(path, OptimizerFile)
			b, err := os.ReadFile(f)
			require.NoError(t, err)
			b[len(b)-3] ^= 0x10
			require.NoError(t, os.WriteFile(f, b, 0o644))
		}, ErrChecksum},
		{"truncated", func(t *testing.T, _, path string) {
			require.NoError(t, os.Truncate(filepath.Join(path, ParamsFile), 100))
		}, ErrTruncated},
		{"missing file", func(t *testing.T, _, path string) {
			require.NoError(t, os.Remove(filepath.Join(path, BuffersFile)))
		}, ErrMissingTensor},
		{"missing tensor", func(t *testing.T, _, path string) {
			rewrite(t, path, func(m *Manifest) {
				f := &m.Files[0]
				f.Tensors = append(f.Tensors, Tensor{Name: "ghost", DType: "F32", Shape: []int{1}, SHA256: f.Tensors[0].SHA256})
			})
		}, ErrMissingTensor},
		{"edited manifest", func(t *testing.T, _, path string) {
			f := filepath.Join(path, ManifestFile)
			b, err := os.ReadFile(f)
			require.NoError(t, err)
			var m map[string]any
			require.NoError(t, json.Unmarshal(b, &m))
			m["step"] = 4
			b, err = json.Marshal(m)
			require.NoError(t, err)
			require.NoError(t, os.WriteFile(f, b, 0o644))
		}, ErrChecksum},
		{"unknown version", func(t *testing.T, _, path string) {
			rewrite(t, path, func(m *Manifest) { m.Version = 2 })
		}, ErrVersion},
		{"unknown field", func(t *testing.T, _, path string) {
			f := filepath.Join(path, ManifestFile)
			b, err := os.ReadFile(f)
			require.NoError(t, err)
			require.NoError(t, os.WriteFile(f, append([]byte(`{"extra": 1, `), b[1:]...), 0o644))
		}, ErrCorrupt},
		{"manifest too large", func(t *testing.T, _, path string) {
			require.NoError(t, os.Truncate(filepath.Join(path, ManifestFile), MaxManifestBytes+1))
		}, ErrTooLarge},
		{"manifest a FIFO", func(t *testing.T, _, path string) {
			f := filepath.Join(path, ManifestFile)
			require.NoError(t, os.Remove(f))
			require.NoError(t, syscall.Mkfifo(f, 0o644))
		}, ErrNotRegular},
		{"pointer out of the directory", func(t *testing.T, dir, _ string) {
			require.NoError(t, os.WriteFile(filepath.Join(dir, LatestFile), []byte("../ckpt-00000003\n"), 0o644))
		}, ErrCorrupt},
		{"file the manifest does not know", func(t *testing.T, _, path string) {
			rewrite(t, path, func(m *Manifest) { m.Files[0].Name = "../params.safetensors" })
		}, ErrCorrupt},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			dir, path := save(t)
			c.damage(t, dir, path)
			err := load(dir)
			require.ErrorIs(t, err, c.want)
			_, verr := Verify(dir)
			require.ErrorIs(t, verr, c.want)
		})
	}
	_, err := Latest(t.TempDir())
	require.ErrorIs(t, err, ErrNoCheckpoint)
	require.ErrorIs(t, load(t.TempDir()), ErrNoCheckpoint)
}

// Save keeps the Keep newest checkpoints up to its step and names a step
// saved again with a suffix; checkpoints of later steps (a continuation
// abandoned by loading an older one) stay.
func TestSaveKeepsNewest(t *testing.T) {
	dir := t.TempDir()
	m := convNet(1, 2)
	tr := &Training{Model: m, Keep: 2}
	for s := 1; s <= 5; s++ {
		tr.Step = s
		_, err := tr.Save(dir)
		require.NoError(t, err)
	}
	list := func() []string {
		ents, err := os.ReadDir(dir)
		require.NoError(t, err)
		var names []string
		for _, e := range ents {
			names = append(names, e.Name())
		}
		return names
	}
	assert.Equal(t, []string{"ckpt-00000004", "ckpt-00000005", LatestFile}, list())
	tr.Step = 4
	path, err := tr.Save(dir)
	require.NoError(t, err)
	assert.Equal(t, "ckpt-00000004-1", filepath.Base(path))
	assert.Equal(t, []string{"ckpt-00000004", "ckpt-00000004-1", "ckpt-00000005", LatestFile}, list())
	tr.Step = 2
	_, err = tr.Save(dir)
	require.NoError(t, err)
	assert.Equal(t, []string{"ckpt-00000002", "ckpt-00000004", "ckpt-00000004-1", "ckpt-00000005", LatestFile}, list())
	man, err := Verify(dir)
	require.NoError(t, err)
	assert.Equal(t, 2, man.Step)
}

// What cannot be saved is refused before anything is written: no model,
// a shape-only parameter, an optimizer this package does not know, state
// of a parameter not saved.
func TestSaveRefuses(t *testing.T) {
	dir := t.TempDir()
	_, err := (&Training{}).Save(dir)
	require.ErrorIs(t, err, ErrTraining)
	shapeOnly := nn.MLP(nn.Options{ShapeOnly: true}, []int{4, 4}, nn.ReLU{})
	_, err = (&Training{Model: shapeOnly}).Save(dir)
	require.ErrorIs(t, err, ErrTraining)
	m := convNet(1, 2)
	_, err = (&Training{Model: m, Optimizer: other{}}).Save(dir)
	require.ErrorIs(t, err, ErrUnsupported)
	opt := optim.NewAdam(1)
	stray := tensor.New(tensor.WithShape(2), tensor.WithBacking([]float32{1, 2}))
	require.NoError(t, opt.SetState(stray, 2, 1, [][]float32{{1, 2}, {3, 4}}))
	_, err = (&Training{Model: m, Optimizer: opt}).Save(dir)
	require.ErrorIs(t, err, ErrTraining)
	ents, err := os.ReadDir(dir)
	require.NoError(t, err)
	assert.Empty(t, ents)
}

// other is an optimizer this package does not save.
type other struct{}

func (other) Name() string             { return "other" }
func (other) StateSlots() int          { return 0 }
func (other) Step([]optim.Param) error { return nil }
func (other) State(any) [][]float32    { return nil }
func (other) Steps() int               { return 0 }
