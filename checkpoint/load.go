package checkpoint

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"

	"github.com/batchfit/batchfit/hf"
	"github.com/batchfit/batchfit/internal/safefile"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/precision"
	"github.com/batchfit/batchfit/safetensors"
)

// Verify checks the checkpoint at path (a checkpoint directory, or a
// directory of them, whose latest it checks) against its manifest without
// loading it: the manifest's format, version and own checksum, every file
// present, regular and of its size, every tensor of its dtype and shape
// with its SHA-256. It returns the manifest.
func Verify(path string) (*Manifest, error) {
	_, m, files, err := open(path)
	if err != nil {
		return nil, err
	}
	closeAll(files)
	return m, nil
}

// open resolves path, reads the manifest, and opens and verifies every
// file it lists, returning the safetensors files open.
func open(path string) (string, *Manifest, map[string]*safetensors.File, error) {
	dir, err := Latest(path)
	if err != nil {
		return "", nil, nil, err
	}
	m, err := readManifest(dir)
	if err != nil {
		return dir, nil, nil, err
	}
	files := map[string]*safetensors.File{}
	for _, f := range m.Files {
		st, err := verifyFile(dir, f)
		if err != nil {
			closeAll(files)
			return dir, nil, nil, err
		}
		if st != nil {
			files[f.Name] = st
		}
	}
	return dir, m, files, nil
}

func closeAll(files map[string]*safetensors.File) {
	for _, f := range files {
		f.Close()
	}
}

// verifyFile checks one file against its manifest entry; a safetensors
// file is returned open.
func verifyFile(dir string, e File) (*safetensors.File, error) {
	path := filepath.Join(dir, e.Name)
	fi, err := os.Stat(path)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return nil, fmt.Errorf("%w: %s is missing", ErrMissingTensor, path)
	case err != nil:
		return nil, fmt.Errorf("checkpoint: %w", err)
	case !fi.Mode().IsRegular():
		return nil, fmt.Errorf("checkpoint: %w: %s", safefile.ErrNotRegular, path)
	case fi.Size() < e.Bytes:
		return nil, fmt.Errorf("%w: %s holds %d bytes, the manifest says %d", ErrTruncated, path, fi.Size(), e.Bytes)
	case fi.Size() != e.Bytes:
		return nil, fmt.Errorf("%w: %s holds %d bytes, the manifest says %d", ErrCorrupt, path, fi.Size(), e.Bytes)
	}
	if e.Tensors == nil {
		sum, _, err := hashFile(path)
		if err != nil {
			return nil, err
		}
		if sum != e.SHA256 {
			return nil, fmt.Errorf("%w: %s: SHA-256 %s, the manifest's %s", ErrChecksum, path, sum, e.SHA256)
		}
		return nil, nil
	}
	st, err := safetensors.Open(path)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrCorrupt, err)
	}
	fail := func(err error) (*safetensors.File, error) {
		st.Close()
		return nil, err
	}
	if len(st.Tensors()) != len(e.Tensors) {
		for _, t := range e.Tensors {
			if _, ok := st.Tensor(t.Name); !ok {
				return fail(fmt.Errorf("%w: %s: tensor %q", ErrMissingTensor, path, t.Name))
			}
		}
		return fail(fmt.Errorf("%w: %s holds %d tensors, the manifest lists %d", ErrCorrupt, path, len(st.Tensors()), len(e.Tensors)))
	}
	for _, t := range e.Tensors {
		info, ok := st.Tensor(t.Name)
		switch {
		case !ok:
			return fail(fmt.Errorf("%w: %s: tensor %q", ErrMissingTensor, path, t.Name))
		case info.DType.String() != t.DType || !slices.Equal(info.Shape, t.Shape):
			return fail(fmt.Errorf("%w: %s: tensor %q is %s %v, the manifest says %s %v", ErrCorrupt, path, t.Name, info.DType, info.Shape, t.DType, t.Shape))
		}
		sum, err := hashTensor(st, t.Name)
		if err != nil {
			return fail(err)
		}
		if sum != t.SHA256 {
			return fail(fmt.Errorf("%w: %s: tensor %q: SHA-256 %s, the manifest's %s", ErrChecksum, path, t.Name, sum, t.SHA256))
		}
	}
	return st, nil
}

// Load restores the training from the checkpoint at path: a checkpoint
// directory, or a directory of them (Save's dir), whose latest it loads.
// The checkpoint is verified first (Verify), then checked against t
// before anything changes: every parameter of t present with its shape (a
// *ShapeError otherwise), no parameter t lacks, the same buffers and
// dropout layers, the same optimizer. Then the parameters' and buffers'
// values are read into their host tensors, the dropout counters and
// seeds, the optimizer's hyperparameters, groups, clipping, state and
// Steps, and the session's loss scale restored (when both the checkpoint
// and the session scale: the precision policy is the caller's choice), t's
// Step, Data and Meta set, and the session's device copies refreshed
// (Session.UploadParams), so the next Step continues the saved run bit
// for bit. A read that fails after the checks leaves the training partly
// loaded; load again.
func (t *Training) Load(path string) error {
	ps, err := t.params()
	if err != nil {
		return err
	}
	dir, m, files, err := open(path)
	if err != nil {
		return err
	}
	defer closeAll(files)

	// Check everything before changing anything.
	if err := checkSet(dir, "parameter", m.Params, names(ps)); err != nil {
		return err
	}
	if m.Params.Layout == "hf" {
		if cfg, ok := t.hfConfig(); !ok || string(cfg.Architecture) != m.Params.Architecture {
			return fmt.Errorf("%w: %s holds a %s's parameters, the training is another model", ErrMismatch, dir, m.Params.Architecture)
		}
	}
	bufs := nn.Buffers(t.Model)
	var want []Named
	for _, b := range bufs {
		want = append(want, Named{Name: b.Name, Shape: b.Tensor.Shape()})
	}
	var bufData [][]float32
	if m.Buffers == nil && len(bufs) > 0 {
		return fmt.Errorf("%w: %s holds no buffers; the model has %d (%s, …)", ErrMismatch, dir, len(bufs), bufs[0].Name)
	}
	if m.Buffers != nil {
		if err := checkSet(dir, "buffer", *m.Buffers, want); err != nil {
			return err
		}
		for _, b := range bufs {
			f, err := floats(b.Name, b.Tensor.Value(), b.Tensor.Shape())
			if err != nil {
				return err
			}
			bufData = append(bufData, f)
		}
	}
	drops := nn.Dropouts(t.Model)
	if len(drops) != len(m.Dropout) {
		return fmt.Errorf("%w: %s holds %d dropout layers' counters, the model has %d", ErrMismatch, dir, len(m.Dropout), len(drops))
	}
	for i, d := range drops {
		if d.Path != m.Dropout[i].Path {
			return fmt.Errorf("%w: %s: dropout layer %d is %s in the checkpoint, %s in the model", ErrMismatch, dir, i, dropoutPath(m.Dropout[i].Path), dropoutPath(d.Path))
		}
	}
	var ol *optimizerLoad
	if t.Optimizer != nil {
		if ol, err = checkOptimizer(dir, t.Optimizer, m.Optimizer, files, ps); err != nil {
			return err
		}
	}
	var scale *precision.ScalerStats
	if m.LossScale != nil && t.Session != nil && t.Session.LossScale().Scale != 0 {
		l := m.LossScale
		scale = &precision.ScalerStats{Scale: l.Scale, Steps: l.Steps, Skipped: l.Skipped, GoodInARow: l.GoodInARow, LastSkipped: l.LastSkipped}
	}

	// Restore. The loss scale first: SetLossScale checks the stats and
	// changes nothing when it refuses them.
	if scale != nil {
		if err := t.Session.SetLossScale(*scale); err != nil {
			return fmt.Errorf("%w: %s: %w", ErrCorrupt, dir, err)
		}
	}
	if err := readParams(dir, m.Params, files, ps); err != nil {
		return err
	}
	for i, b := range bufs {
		if err := files[m.Buffers.File].ReadFloat32(b.Name, bufData[i]); err != nil {
			return fmt.Errorf("checkpoint: %w", err)
		}
	}
	for i, d := range drops {
		d.Dropout.Seed = m.Dropout[i].Seed
		d.Dropout.SetStep(m.Dropout[i].Step)
	}
	if ol != nil {
		if err := ol.apply(t.Optimizer, files[m.Optimizer.File]); err != nil {
			return err
		}
	}
	t.Step, t.Data, t.Meta = m.Step, m.Data, m.Meta
	if t.Session != nil {
		if err := t.Session.UploadParams(); err != nil {
			return fmt.Errorf("checkpoint: refreshing the session's parameters: %w", err)
		}
	}
	return nil
}

func names(ps []param) []Named {
	out := make([]Named, len(ps))
	for i, p := range ps {
		out[i] = Named{Name: p.name, Shape: p.shape}
	}
	return out
}

// checkSet compares the checkpoint's tensors of a set with the
// training's, by name.
func checkSet(dir, what string, s TensorSet, want []Named) error {
	got := make(map[string][]int, len(s.Tensors))
	for _, n := range s.Tensors {
		got[n.Name] = n.Shape
	}
	for _, w := range want {
		g, ok := got[w.Name]
		if !ok {
			return fmt.Errorf("%w: %s holds no %s %q", ErrMismatch, dir, what, w.Name)
		}
		if !slices.Equal(g, w.Shape) {
			return &ShapeError{Path: dir, Tensor: w.Name, Want: w.Shape, Got: g}
		}
		delete(got, w.Name)
	}
	for _, n := range s.Tensors {
		if _, extra := got[n.Name]; extra {
			return fmt.Errorf("%w: %s holds %s %q %v, which the training does not have", ErrMismatch, dir, what, n.Name, n.Shape)
		}
	}
	return nil
}

// readParams reads the parameters' values into their host tensors.
func readParams(dir string, s TensorSet, files map[string]*safetensors.File, ps []param) error {
	if s.Layout == "hf" {
		c, err := hf.OpenCheckpoint(dir)
		if err != nil {
			return fmt.Errorf("%w: %w", ErrCorrupt, err)
		}
		defer c.Close()
		nps := make([]*nn.Param, len(ps))
		for i, p := range ps {
			nps[i] = p.p
		}
		if err := c.LoadInto(hf.Architecture(s.Architecture), nps); err != nil {
			return fmt.Errorf("%w: %s: %w", ErrCorrupt, dir, err)
		}
		return nil
	}
	f := files[s.File]
	for _, p := range ps {
		if err := f.ReadFloat32(p.name, p.data); err != nil {
			return fmt.Errorf("checkpoint: %w", err)
		}
	}
	return nil
}
