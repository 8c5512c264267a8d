package checkpoint

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"runtime/debug"
	"slices"
	"time"

	"github.com/batchfit/batchfit/data"
)

// The format a manifest declares; Load refuses any other with ErrVersion.
const (
	Format  = "batchfit-checkpoint"
	Version = 1
)

// File names inside a checkpoint directory, and the pointer beside them.
const (
	ManifestFile  = "manifest.json"
	ModelFile     = "model.safetensors" // parameters in Hugging Face's names and layout (hf.Save)
	ConfigFile    = "config.json"       // beside ModelFile: Hugging Face's config
	ParamsFile    = "params.safetensors"
	OptimizerFile = "optimizer.safetensors"
	BuffersFile   = "buffers.safetensors"
	LatestFile    = "latest" // in the parent directory: the latest checkpoint's name
)

// Bounds on what a checkpoint may declare.
const (
	// MaxManifestBytes bounds manifest.json: a model of 100,000 tensors
	// with Adam's state lists about 50 MiB.
	MaxManifestBytes = 64 << 20
	maxLatestBytes   = 4 << 10
	maxTensors       = 1 << 20 // as package safetensors
	maxRank          = 64
)

// Manifest is a checkpoint's manifest.json: what the checkpoint holds and
// the checksum of every tensor. Verify returns it.
type Manifest struct {
	Format  string `json:"format"`
	Version int    `json:"version"`
	// Step is the training steps done (Training.Step): the step a resumed
	// run starts at.
	Step     int               `json:"step"`
	Producer Producer          `json:"producer"`
	Meta     map[string]string `json:"meta,omitempty"`
	// Files are the checkpoint's files, each with its size, and every
	// tensor of a safetensors file with its SHA-256; another file has a
	// SHA-256 of its whole contents.
	Files  []File    `json:"files"`
	Params TensorSet `json:"params"`
	// Buffers are the model's buffers (nn.Buffers: batch norms' running
	// statistics), nil without any.
	Buffers   *TensorSet      `json:"buffers,omitempty"`
	Optimizer *OptimizerState `json:"optimizer,omitempty"`
	LossScale *LossScale      `json:"loss_scale,omitempty"`
	Dropout   []DropoutState  `json:"dropout,omitempty"`
	Data      data.Position   `json:"data"`
	// Checksum is "sha256:" and the hex SHA-256 of the manifest as
	// written with Checksum empty.
	Checksum string `json:"checksum"`
}

// Producer is what wrote a checkpoint.
type Producer struct {
	Program string `json:"program"` // the executable's base name
	// Module and Version are the main module's path and version (Go's
	// build information); Batchfit is batchfit's version when it is a
	// dependency; Revision and Modified the VCS state built from.
	Module   string `json:"module,omitempty"`
	Version  string `json:"version,omitempty"`
	Batchfit string `json:"batchfit,omitempty"`
	Revision string `json:"revision,omitempty"`
	Modified bool   `json:"modified,omitempty"`
	Go       string `json:"go"`
	Saved    string `json:"saved"` // RFC 3339, UTC
}

// File is one file of a checkpoint.
type File struct {
	Name    string   `json:"name"`
	Bytes   int64    `json:"bytes"`
	SHA256  string   `json:"sha256,omitempty"` // of a file that is not safetensors
	Tensors []Tensor `json:"tensors,omitempty"`
}

// Tensor is one tensor of a safetensors file.
type Tensor struct {
	Name   string `json:"name"`
	DType  string `json:"dtype"`
	Shape  []int  `json:"shape"`
	SHA256 string `json:"sha256"`
}

// TensorSet is a group of the training's tensors: the file holding them
// and their names and shapes as the training has them.
type TensorSet struct {
	File string `json:"file"`
	// Layout is "hf" when File is ModelFile, written by hf.Save in
	// Hugging Face's names and layout for Architecture (GPT-2's Conv1D
	// weights transposed, under "transformer."), and "names" when File
	// holds each tensor under its own name, in its own layout.
	Layout       string  `json:"layout"`
	Architecture string  `json:"architecture,omitempty"`
	Tensors      []Named `json:"tensors"`
}

// Named is a tensor by the training's name for it.
type Named struct {
	Name  string `json:"name"`
	Shape []int  `json:"shape"`
}

// OptimizerState is an optimizer's state: its hyperparameters and groups,
// the schedule's position, and each parameter's step count and slots.
type OptimizerState struct {
	Name string `json:"name"` // optim.Optimizer.Name: "adamw", "adam", "sgd"
	// File holds the state slots, "" when no parameter has any.
	File  string `json:"file,omitempty"`
	Steps int    `json:"steps"`
	Hyper Hyper  `json:"hyper"`
	Clip  Clip   `json:"clip"`
	// Schedule describes the learning-rate schedule, for people: a
	// schedule is code, built again by the resumed program, and Steps is
	// its position.
	Schedule string       `json:"schedule,omitempty"`
	Groups   []Group      `json:"groups,omitempty"`
	State    []ParamState `json:"state"`
}

// Hyper is a group's hyperparameters (the optimizer's own for its default
// group); each optimizer reads its own.
type Hyper struct {
	LR          float64 `json:"lr"`
	WeightDecay float64 `json:"weight_decay"`
	Beta1       float64 `json:"beta1,omitempty"`
	Beta2       float64 `json:"beta2,omitempty"`
	Eps         float64 `json:"eps,omitempty"`
	Momentum    float64 `json:"momentum,omitempty"`
	Dampening   float64 `json:"dampening,omitempty"`
	Nesterov    bool    `json:"nesterov,omitempty"`
	Decoupled   bool    `json:"decoupled,omitempty"`
}

// Clip is optim.Clip; NormType is "2" or "inf".
type Clip struct {
	MaxNorm  float64 `json:"max_norm"`
	NormType string  `json:"norm_type"`
}

// Group is a parameter group, its parameters by name.
type Group struct {
	Name   string   `json:"name"`
	Params []string `json:"params"`
	Hyper  Hyper    `json:"hyper"`
}

// ParamState is one parameter's optimizer state: its own step count
// (PyTorch's state[p]["step"]) and its slots' tensors, in slot order.
type ParamState struct {
	Param string   `json:"param"`
	Step  int      `json:"step"`
	Slots []string `json:"slots,omitempty"`
}

// LossScale is dynamic loss scaling's state (precision.ScalerStats).
type LossScale struct {
	Scale       float32 `json:"scale"`
	Steps       int     `json:"steps"`
	Skipped     int     `json:"skipped"`
	GoodInARow  int     `json:"good_in_a_row"`
	LastSkipped bool    `json:"last_skipped,omitempty"`
}

// DropoutState is one nn.Dropout's random stream: its seed and counter.
type DropoutState struct {
	Path string `json:"path"`
	Seed uint64 `json:"seed"`
	Step uint64 `json:"step"`
}

// producer describes the running program.
func producer(now time.Time) Producer {
	p := Producer{Program: filepath.Base(os.Args[0]), Saved: now.UTC().Format(time.RFC3339Nano)}
	if bi, ok := debug.ReadBuildInfo(); ok {
		p.Module, p.Version, p.Go = bi.Main.Path, bi.Main.Version, bi.GoVersion
		for _, d := range bi.Deps {
			if d.Path == "github.com/batchfit/batchfit" {
				p.Batchfit = d.Version
			}
		}
		for _, s := range bi.Settings {
			switch s.Key {
			case "vcs.revision":
				p.Revision = s.Value
			case "vcs.modified":
				p.Modified = s.Value == "true"
			}
		}
	}
	return p
}

// encode is m as manifest.json, its Checksum set.
func (m *Manifest) encode() ([]byte, error) {
	m.Checksum = ""
	b, err := json.MarshalIndent(m, "", "  ")
	if err != nil {
		return nil, fmt.Errorf("%w: manifest: %w", ErrTraining, err)
	}
	sum := sha256.Sum256(b)
	m.Checksum = "sha256:" + hex.EncodeToString(sum[:])
	b, err = json.MarshalIndent(m, "", "  ")
	if err != nil {
		return nil, err
	}
	return append(b, '\n'), nil
}

// readManifest reads and checks dir's manifest: bounded, its format and
// version first, then strictly (no unknown fields), its own checksum and
// the consistency of what it declares.
func readManifest(dir string) (*Manifest, error) {
	m := &Manifest{}
	if err := decodeManifest(dir, Format, Version, "this batchfit reads", m); err != nil {
		return nil, err
	}
	return m, nil
}

// manifestFile is a manifest decodeManifest reads: Manifest or
// ShardedManifest.
type manifestFile interface {
	encode() ([]byte, error) // sets its Checksum to its contents'
	check() error
	checksum() string
}

func (m *Manifest) checksum() string { return m.Checksum }

// decodeManifest reads dir's manifest file into m:
// read within MaxManifestBytes, its format and version format's and
// version's first (ErrVersion otherwise, the message saying expect), then
// decoded strictly (no unknown fields, nothing after it), its own checksum
// (ErrChecksum) and m.check's consistency.
func decodeManifest(dir, format string, version int, expect string, m manifestFile) error {
	path := filepath.Join(dir, ManifestFile)
	b, err := readBounded(path, MaxManifestBytes)
	if err != nil {
		if os.IsNotExist(err) {
			return fmt.Errorf("%w: %s: %w", ErrNoCheckpoint, dir, err)
		}
		return fmt.Errorf("checkpoint: %w", err)
	}
	var head struct {
		Format  string `json:"format"`
		Version int    `json:"version"`
	}
	if err := json.Unmarshal(b, &head); err != nil {
		return fmt.Errorf("%w: %s: %w", ErrCorrupt, path, err)
	}
	if head.Format != format || head.Version != version {
		return fmt.Errorf("%w: %s declares %q version %d; %s %q version %d", ErrVersion, path, head.Format, head.Version, expect, format, version)
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(m); err != nil {
		return fmt.Errorf("%w: %s: %w", ErrCorrupt, path, err)
	}
	if dec.More() {
		return fmt.Errorf("%w: %s: data after the manifest", ErrCorrupt, path)
	}
	want := m.checksum()
	if _, err := m.encode(); err != nil {
		return fmt.Errorf("%w: %s: %w", ErrCorrupt, path, err)
	}
	if got := m.checksum(); got != want {
		return fmt.Errorf("%w: %s: the manifest's checksum is %s, its contents' %s", ErrChecksum, path, want, got)
	}
	if err := m.check(); err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	return nil
}

func (m *Manifest) check() error {
	bad := func(format string, a ...any) error {
		return fmt.Errorf("%w: %s", ErrCorrupt, fmt.Sprintf(format, a...))
	}
	if m.Step < 0 {
		return bad("step %d is negative", m.Step)
	}
	tensors := 0
	files := map[string]map[string]Tensor{}
	for _, f := range m.Files {
		if !slices.Contains([]string{ModelFile, ConfigFile, ParamsFile, OptimizerFile, BuffersFile}, f.Name) {
			return bad("file %q is not one a checkpoint holds", f.Name)
		}
		if files[f.Name] != nil {
			return bad("file %q listed twice", f.Name)
		}
		if f.Bytes < 0 {
			return bad("file %q of %d bytes", f.Name, f.Bytes)
		}
		if tensors += len(f.Tensors); tensors > maxTensors {
			return fmt.Errorf("%w: more than %d tensors", ErrTooLarge, maxTensors)
		}
		byName := make(map[string]Tensor, len(f.Tensors))
		for _, t := range f.Tensors {
			if _, dup := byName[t.Name]; dup {
				return bad("tensor %q listed twice in %s", t.Name, f.Name)
			}
			if err := checkShape(t.Name, t.Shape); err != nil {
				return err
			}
			if len(t.SHA256) != 64 {
				return bad("tensor %q: checksum %q is not a SHA-256", t.Name, t.SHA256)
			}
			byName[t.Name] = t
		}
		if f.Tensors == nil && len(f.SHA256) != 64 {
			return bad("file %q: checksum %q is not a SHA-256", f.Name, f.SHA256)
		}
		files[f.Name] = byName
	}
	set := func(what string, s *TensorSet) error {
		switch {
		case s.Layout == "hf" && s.File == ModelFile && files[ConfigFile] != nil:
		case s.Layout == "names" && s.File != ModelFile:
		default:
			return bad("%s: layout %q in file %q", what, s.Layout, s.File)
		}
		in := files[s.File]
		if in == nil {
			return fmt.Errorf("%w: %s: file %q is not listed", ErrMissingTensor, what, s.File)
		}
		if len(s.Tensors) > maxTensors {
			return fmt.Errorf("%w: %s: %d tensors", ErrTooLarge, what, len(s.Tensors))
		}
		seen := make(map[string]bool, len(s.Tensors))
		for _, t := range s.Tensors {
			if seen[t.Name] {
				return bad("%s: %q listed twice", what, t.Name)
			}
			seen[t.Name] = true
			if err := checkShape(t.Name, t.Shape); err != nil {
				return err
			}
			if s.Layout == "names" {
				if ft, ok := in[t.Name]; !ok {
					return fmt.Errorf("%w: %s: %q is not in %s", ErrMissingTensor, what, t.Name, s.File)
				} else if !slices.Equal(ft.Shape, t.Shape) || ft.DType != "F32" {
					return bad("%s: %q is %s %v in %s, %v in the manifest", what, t.Name, ft.DType, ft.Shape, s.File, t.Shape)
				}
			}
		}
		return nil
	}
	if err := set("params", &m.Params); err != nil {
		return err
	}
	if m.Buffers != nil {
		if err := set("buffers", m.Buffers); err != nil {
			return err
		}
		if m.Buffers.Layout != "names" {
			return bad("buffers: layout %q", m.Buffers.Layout)
		}
	}
	if o := m.Optimizer; o != nil {
		if o.Steps < 0 {
			return bad("optimizer steps %d", o.Steps)
		}
		if _, err := normType(o.Clip.NormType); err != nil {
			return err
		}
		in := files[o.File]
		if o.File != "" && (o.File != OptimizerFile || in == nil) {
			return fmt.Errorf("%w: optimizer file %q is not listed", ErrMissingTensor, o.File)
		}
		for _, st := range o.State {
			if st.Step < 0 {
				return bad("optimizer state of %q: step %d", st.Param, st.Step)
			}
			for _, s := range st.Slots {
				if _, ok := in[s]; !ok {
					return fmt.Errorf("%w: optimizer state %q is not in %q", ErrMissingTensor, s, o.File)
				}
			}
		}
	}
	return nil
}

func checkShape(name string, shape []int) error {
	if len(shape) > maxRank {
		return fmt.Errorf("%w: tensor %q has %d dimensions", ErrTooLarge, name, len(shape))
	}
	for _, d := range shape {
		if d < 0 {
			return fmt.Errorf("%w: tensor %q has shape %v", ErrCorrupt, name, shape)
		}
	}
	return nil
}
