package checkpoint

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/batchfit/batchfit/hf"
	"github.com/batchfit/batchfit/internal/safefile"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/safetensors"
)

// testHook, when set (tests), is called at the phases of a save:
// "written" once every file but the manifest is in the temporary
// directory, "committed" once the checkpoint has its name and before the
// latest pointer names it.
var testHook func(phase string)

// Save writes the training's state as a new checkpoint in dir (made if
// need be) and returns its path, dir/ckpt-NNNNNNNN. On CUDA (with Session
// set) the parameters and optimizer state are synced from the device
// first. Everything is written into a temporary directory beside the
// others, every file and the directory synced, then renamed into place,
// and only then does dir's latest pointer (itself replaced atomically)
// name it: a crash or a failed write leaves the previous checkpoint the
// latest, loadable as it was. Save then removes all but the Keep newest
// checkpoints up to this step, and what saves that did not finish left
// behind. One process saves into a directory at a time.
func (t *Training) Save(dir string) (path string, err error) {
	ps, err := t.params()
	if err != nil {
		return "", err
	}
	if t.Step < 0 || t.Keep < 0 {
		return "", fmt.Errorf("%w: step %d, keep %d", ErrTraining, t.Step, t.Keep)
	}
	if s := t.Session; s != nil {
		if err := errors.Join(s.SyncParams(), s.SyncState()); err != nil {
			return "", fmt.Errorf("checkpoint: syncing the session: %w", err)
		}
	}
	m := &Manifest{Format: Format, Version: Version, Step: t.Step, Producer: producer(time.Now()), Meta: t.Meta, Data: t.Data}
	var optTensors []safetensors.Tensor
	if t.Optimizer != nil {
		if m.Optimizer, optTensors, err = saveOptimizer(t.Optimizer, ps); err != nil {
			return "", err
		}
	}
	if s := t.Session; s != nil {
		if st := s.LossScale(); st.Scale != 0 {
			m.LossScale = &LossScale{Scale: st.Scale, Steps: st.Steps, Skipped: st.Skipped, GoodInARow: st.GoodInARow, LastSkipped: st.LastSkipped}
		}
	}
	for _, d := range nn.Dropouts(t.Model) {
		m.Dropout = append(m.Dropout, DropoutState{Path: d.Path, Seed: d.Dropout.Seed, Step: d.Dropout.Step()})
	}
	var bufTensors []safetensors.Tensor
	for _, b := range nn.Buffers(t.Model) {
		f, err := floats(b.Name, b.Tensor.Value(), b.Tensor.Shape())
		if err != nil {
			return "", err
		}
		bufTensors = append(bufTensors, safetensors.Tensor{Name: b.Name, DType: safetensors.F32, Shape: b.Tensor.Shape(), Float32: f})
	}

	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", fmt.Errorf("checkpoint: %w", err)
	}
	tmp, err := os.MkdirTemp(dir, "."+checkpointName(t.Step, 0)+".tmp-*")
	if err != nil {
		return "", fmt.Errorf("checkpoint: %w", err)
	}
	defer func() {
		if err != nil {
			os.RemoveAll(tmp)
		}
	}()
	if err := os.Chmod(tmp, 0o755); err != nil {
		return "", fmt.Errorf("checkpoint: %w", err)
	}
	if m.Params, err = writeParams(tmp, t, ps); err != nil {
		return "", err
	}
	names := []string{m.Params.File}
	if m.Params.File == ModelFile {
		names = append(names, ConfigFile)
	}
	if len(optTensors) > 0 {
		if err := safetensors.WriteFile(filepath.Join(tmp, OptimizerFile), optTensors, nil); err != nil {
			return "", fmt.Errorf("checkpoint: %w", err)
		}
		m.Optimizer.File = OptimizerFile
		names = append(names, OptimizerFile)
	}
	if len(bufTensors) > 0 {
		if err := safetensors.WriteFile(filepath.Join(tmp, BuffersFile), bufTensors, nil); err != nil {
			return "", fmt.Errorf("checkpoint: %w", err)
		}
		m.Buffers = &TensorSet{File: BuffersFile, Layout: "names"}
		for _, b := range bufTensors {
			m.Buffers.Tensors = append(m.Buffers.Tensors, Named{Name: b.Name, Shape: b.Shape})
		}
		names = append(names, BuffersFile)
	}
	for _, name := range names {
		f, err := describe(filepath.Join(tmp, name))
		if err != nil {
			return "", err
		}
		m.Files = append(m.Files, f)
	}
	if testHook != nil {
		testHook("written")
	}
	b, err := m.encode()
	if err != nil {
		return "", err
	}
	if err := writeAtomic(filepath.Join(tmp, ManifestFile), b); err != nil { // syncs tmp too
		return "", fmt.Errorf("checkpoint: %w", err)
	}
	if path, err = commit(dir, tmp, t.Step); err != nil {
		if path == "" {
			return "", fmt.Errorf("checkpoint: %w", err)
		}
		// The checkpoint is complete under its name; only the pointer
		// failed, so the previous one stays the latest.
		return path, fmt.Errorf("checkpoint: %s is written, but %s does not name it: %w", path, LatestFile, err)
	}
	keep := t.Keep
	if keep == 0 {
		keep = 2
	}
	if err := prune(dir, path, keep); err != nil {
		return path, fmt.Errorf("checkpoint: %s is saved; removing older checkpoints: %w", path, err)
	}
	return path, nil
}

// writeParams writes the parameters into dir: through hf.Save when they
// are a GPT's or a Llama's, under their own names otherwise.
func writeParams(dir string, t *Training, ps []param) (TensorSet, error) {
	set := TensorSet{File: ParamsFile, Layout: "names"}
	for _, p := range ps {
		set.Tensors = append(set.Tensors, Named{Name: p.name, Shape: p.shape})
	}
	if cfg, ok := t.hfConfig(); ok && t.Params == nil {
		nps := make([]*nn.Param, len(ps))
		for i, p := range ps {
			nps[i] = p.p
		}
		err := hf.Save(dir, cfg, nps)
		if err == nil {
			set.File, set.Layout, set.Architecture = ModelFile, "hf", string(cfg.Architecture)
			return set, nil
		}
		if !errors.Is(err, hf.ErrUnsupported) {
			return set, fmt.Errorf("checkpoint: %w", err)
		}
		// A configuration Hugging Face's classes do not express: the
		// parameters keep their own names.
		os.Remove(filepath.Join(dir, hf.WeightsFile))
		os.Remove(filepath.Join(dir, hf.ConfigFile))
	}
	ts := make([]safetensors.Tensor, len(ps))
	for i, p := range ps {
		ts[i] = safetensors.Tensor{Name: p.name, DType: safetensors.F32, Shape: p.shape, Float32: p.data}
	}
	if err := safetensors.WriteFile(filepath.Join(dir, ParamsFile), ts, nil); err != nil {
		return set, fmt.Errorf("checkpoint: %w", err)
	}
	return set, nil
}

// describe is the manifest's entry for the file at path: its size and its
// tensors' checksums (a safetensors file) or its own.
func describe(path string) (File, error) {
	f := File{Name: filepath.Base(path)}
	if !strings.HasSuffix(path, ".safetensors") {
		sum, n, err := hashFile(path)
		if err != nil {
			return f, err
		}
		f.SHA256, f.Bytes = sum, n
		return f, nil
	}
	st, err := safetensors.Open(path)
	if err != nil {
		return f, fmt.Errorf("checkpoint: %w", err)
	}
	defer st.Close()
	fi, err := os.Stat(path)
	if err != nil {
		return f, fmt.Errorf("checkpoint: %w", err)
	}
	f.Bytes = fi.Size()
	f.Tensors = make([]Tensor, 0, len(st.Tensors()))
	for _, ti := range st.Tensors() {
		sum, err := hashTensor(st, ti.Name)
		if err != nil {
			return f, err
		}
		f.Tensors = append(f.Tensors, Tensor{Name: ti.Name, DType: ti.DType.String(), Shape: ti.Shape, SHA256: sum})
	}
	return f, nil
}

func hashTensor(f *safetensors.File, name string) (string, error) {
	sec, err := f.Section(name)
	if err != nil {
		return "", fmt.Errorf("checkpoint: %w", err)
	}
	h := sha256.New()
	if _, err := io.Copy(h, sec); err != nil {
		return "", fmt.Errorf("checkpoint: %s: tensor %q: %w", f.Path(), name, err)
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}

func hashFile(path string) (string, int64, error) {
	f, _, err := safefile.Open(path, math.MaxInt64)
	if err != nil {
		return "", 0, fmt.Errorf("checkpoint: %w", err)
	}
	defer f.Close()
	h := sha256.New()
	n, err := io.Copy(h, f)
	if err != nil {
		return "", 0, fmt.Errorf("checkpoint: %s: %w", path, err)
	}
	return hex.EncodeToString(h.Sum(nil)), n, nil
}
