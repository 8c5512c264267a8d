package hf

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/batchfit/batchfit/safetensors"
)

// The weight files of a checkpoint directory, as save_pretrained names
// them.
const (
	WeightsFile = "model.safetensors"
	IndexFile   = "model.safetensors.index.json"
	ConfigFile  = "config.json"
)

// Bounds on an index: Llama 3.1 405B's is about 100 KiB over 191 shards.
const (
	maxIndexBytes = 16 << 20
	maxShards     = 4096
)

// Checkpoint is an open checkpoint directory: model.safetensors, or the
// shards model.safetensors.index.json lists. Only headers are held in
// memory; tensors stream from the files.
type Checkpoint struct {
	dir   string
	files []*safetensors.File
	where map[string]located
	names []string // sorted
}

type located struct {
	file int
	info safetensors.TensorInfo
}

// OpenCheckpoint opens dir's weights: model.safetensors when present
// (transformers prefers it too), else the shards of
// model.safetensors.index.json. Shard names must be plain file names
// inside dir; every tensor the index lists must be in its shard, and no
// tensor may be in two.
func OpenCheckpoint(dir string) (*Checkpoint, error) {
	c := &Checkpoint{dir: dir, where: map[string]located{}}
	single := filepath.Join(dir, WeightsFile)
	if _, err := os.Stat(single); err == nil {
		if err := c.add(single); err != nil {
			c.Close()
			return nil, err
		}
		c.finish()
		return c, nil
	}
	index := filepath.Join(dir, IndexFile)
	if _, err := os.Stat(index); err != nil {
		if _, perr := os.Stat(filepath.Join(dir, "pytorch_model.bin")); perr == nil {
			return nil, fmt.Errorf("%w: %s holds a pickle checkpoint (pytorch_model.bin), which batchfit does not read; save it as safetensors", ErrUnsupported, dir)
		}
		return nil, fmt.Errorf("%w: %s has neither %s nor %s: %w", ErrCheckpoint, dir, WeightsFile, IndexFile, fs.ErrNotExist)
	}
	weightMap, err := readIndex(index)
	if err != nil {
		return nil, err
	}
	var shards []string
	for _, s := range weightMap {
		if !slices.Contains(shards, s) {
			shards = append(shards, s)
		}
	}
	slices.Sort(shards)
	if len(shards) > maxShards {
		return nil, fmt.Errorf("%w: %s lists %d shards, at most %d", ErrTooLarge, index, len(shards), maxShards)
	}
	for _, s := range shards {
		if err := c.add(filepath.Join(dir, s)); err != nil {
			c.Close()
			return nil, err
		}
	}
	for name, s := range weightMap {
		l, ok := c.where[name]
		if !ok || c.files[l.file].Path() != filepath.Join(dir, s) {
			c.Close()
			return nil, fmt.Errorf("%w: %s places %q in %s, which does not hold it", ErrCheckpoint, index, name, s)
		}
	}
	c.finish()
	return c, nil
}

// readIndex reads an index's weight_map, checking that every shard is a
// plain file name (no directories, no "..", nothing absolute).
func readIndex(path string) (map[string]string, error) {
	b, err := readBounded(path, maxIndexBytes)
	if err != nil {
		return nil, err
	}
	var idx struct {
		WeightMap map[string]string `json:"weight_map"`
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	if err := dec.Decode(&idx); err != nil {
		return nil, fmt.Errorf("%w: %s: %v", ErrCheckpoint, path, err)
	}
	if len(idx.WeightMap) == 0 {
		return nil, fmt.Errorf("%w: %s has no weight_map", ErrCheckpoint, path)
	}
	for name, s := range idx.WeightMap {
		if !plainFileName(s) || !strings.HasSuffix(s, ".safetensors") {
			return nil, fmt.Errorf("%w: %s: tensor %q is in %q, not a .safetensors file name inside the directory", ErrCheckpoint, path, name, s)
		}
	}
	return idx.WeightMap, nil
}

// plainFileName reports whether s names a file directly inside a
// directory on every platform.
func plainFileName(s string) bool {
	return s != "" && s != "." && s != ".." && !strings.ContainsAny(s, `/\`+"\x00:") && filepath.Base(s) == s && !filepath.IsAbs(s)
}

// add opens one weights file and indexes its tensors.
func (c *Checkpoint) add(path string) error {
	f, err := safetensors.Open(path)
	if err != nil {
		return err
	}
	c.files = append(c.files, f)
	for _, t := range f.Tensors() {
		if prev, dup := c.where[t.Name]; dup {
			return fmt.Errorf("%w: tensor %q is in both %s and %s", ErrCheckpoint, t.Name, c.files[prev.file].Path(), path)
		}
		c.where[t.Name] = located{file: len(c.files) - 1, info: t}
	}
	return nil
}

func (c *Checkpoint) finish() {
	for n := range c.where {
		c.names = append(c.names, n)
	}
	slices.Sort(c.names)
}

// Close closes the checkpoint's files.
func (c *Checkpoint) Close() error {
	var errs []error
	for _, f := range c.files {
		errs = append(errs, f.Close())
	}
	c.files = nil
	return errors.Join(errs...)
}

// Dir is the checkpoint's directory.
func (c *Checkpoint) Dir() string { return c.dir }

// Names lists the checkpoint's tensors, sorted.
func (c *Checkpoint) Names() []string { return c.names }

// Tensor describes one tensor and the file holding it.
func (c *Checkpoint) Tensor(name string) (safetensors.TensorInfo, string, bool) {
	l, ok := c.where[name]
	if !ok {
		return safetensors.TensorInfo{}, "", false
	}
	return l.info, c.files[l.file].Path(), true
}

// ReadFloat32 reads a floating-point tensor into dst (see
// safetensors.File.ReadFloat32).
func (c *Checkpoint) ReadFloat32(name string, dst []float32) error {
	l, ok := c.where[name]
	if !ok {
		return fmt.Errorf("%w: %s: %q", safetensors.ErrNotFound, c.dir, name)
	}
	return c.files[l.file].ReadFloat32(name, dst)
}
