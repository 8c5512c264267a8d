package checkpoint

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"slices"
	"time"

	"github.com/batchfit/batchfit/safetensors"
)

// A sharded checkpoint is what the ranks of sharded data parallel (ZeRO,
// package dist) save: the trained parameters flattened back to back into
// one space of Total values, padded to World shards of ShardLen, and rank
// r's file holding its shard [r·ShardLen, (r+1)·ShardLen) of the
// parameters ("params") and of each optimizer state slot (Slots). Its
// manifest.json declares ShardedFormat, so Training.Load refuses it
// (ErrVersion) and OpenSharded refuses a whole-model checkpoint. It lives
// in the same directory of checkpoints (ckpt-NNNNNNNN, the latest
// pointer, pruning) and is made as atomically: every rank writes its file
// into one temporary directory, then one rank (CommitShards) writes the
// manifest with every file's checksums and renames the directory into
// place before the pointer moves. Any world size may read it back
// (Sharded.Read takes any flat range).
const (
	ShardedFormat  = "batchfit-sharded-checkpoint"
	ShardedVersion = 1
	// ShardParams is the tensor of a shard file holding its parameters.
	ShardParams = "params"
	maxWorld    = 1 << 16
)

// ShardedManifest is a sharded checkpoint's manifest.json.
type ShardedManifest struct {
	Format   string            `json:"format"`
	Version  int               `json:"version"`
	Step     int               `json:"step"`
	Producer Producer          `json:"producer"`
	Meta     map[string]string `json:"meta,omitempty"`
	// World is the number of shards (the ranks that saved), ShardLen the
	// values of each, Total the parameters' values (≤ World·ShardLen).
	World    int   `json:"world"`
	ShardLen int64 `json:"shard_len"`
	Total    int64 `json:"total"`
	// Params are the flattened parameters, in order: each one's name,
	// shape and offset in the flat space.
	Params []FlatParam `json:"params"`
	// Optimizer is its name (optim.Optimizer.Name), Steps its completed
	// steps (every parameter's own count), Slots the names of its state
	// tensors in each shard file ("exp_avg", "exp_avg_sq" for Adam).
	Optimizer string   `json:"optimizer"`
	Steps     int      `json:"optimizer_steps"`
	Slots     []string `json:"slots"`
	// Files are the shard files in rank order (ShardFileName), each with
	// its tensors' checksums.
	Files    []File `json:"files"`
	Checksum string `json:"checksum"`
}

// FlatParam is one parameter of a sharded checkpoint's flat space.
type FlatParam struct {
	Name   string `json:"name"`
	Shape  []int  `json:"shape"`
	Offset int64  `json:"offset"`
}

// ShardFileName is rank's file of a world-rank sharded checkpoint.
func ShardFileName(rank, world int) string {
	return fmt.Sprintf("shard-%05d-of-%05d.safetensors", rank, world)
}

// ShardTemp is the temporary directory in dir that the ranks of a
// sharded save of step write their files into: one name every rank
// computes alike. The next save's pruning removes it if the save does not
// finish.
func ShardTemp(dir string, step int) string {
	return filepath.Join(dir, fmt.Sprintf(".ckpt-%08d.tmp-shards", step))
}

// PrepareShards makes dir and an empty ShardTemp(dir, step), removing
// what an unfinished save left there. One rank calls it, before any rank
// writes its shard.
func PrepareShards(dir string, step int) (string, error) {
	if step < 0 {
		return "", fmt.Errorf("%w: step %d is negative", ErrTraining, step)
	}
	tmp := ShardTemp(dir, step)
	if err := os.RemoveAll(tmp); err != nil {
		return "", fmt.Errorf("checkpoint: %w", err)
	}
	if err := os.MkdirAll(tmp, 0o755); err != nil {
		return "", fmt.Errorf("checkpoint: %w", err)
	}
	return tmp, nil
}

// WriteShard writes rank's shard file into tmp: params (the rank's flat
// parameter shard) and one tensor per named state slot, each of the same
// length, float32, synced.
func WriteShard(tmp string, rank, world int, params []float32, slotNames []string, slots [][]float32) error {
	if rank < 0 || rank >= world || len(slotNames) != len(slots) {
		return fmt.Errorf("%w: shard %d of %d with %d slot names for %d slots", ErrTraining, rank, world, len(slotNames), len(slots))
	}
	ts := []safetensors.Tensor{{Name: ShardParams, DType: safetensors.F32, Shape: []int{len(params)}, Float32: params}}
	for i, s := range slots {
		if len(s) != len(params) || slotNames[i] == ShardParams {
			return fmt.Errorf("%w: shard %d: slot %q of %d values beside %d parameters", ErrTraining, rank, slotNames[i], len(s), len(params))
		}
		ts = append(ts, safetensors.Tensor{Name: slotNames[i], DType: safetensors.F32, Shape: []int{len(s)}, Float32: s})
	}
	if err := safetensors.WriteFile(filepath.Join(tmp, ShardFileName(rank, world)), ts, nil); err != nil {
		return fmt.Errorf("checkpoint: %w", err)
	}
	return nil
}

// CommitShards completes a sharded save once every rank's file is in tmp
// (the caller's barrier): it checksums each file into m.Files, writes the
// manifest (m's format, version, producer and checksum set here), syncs
// and renames tmp to its step's checkpoint directory in dir, points
// latest at it and keeps the keep newest (2 if 0). One rank calls it.
func CommitShards(dir, tmp string, m *ShardedManifest, keep int) (string, error) {
	m.Format, m.Version, m.Producer = ShardedFormat, ShardedVersion, producer(time.Now())
	m.Files = m.Files[:0]
	for r := range m.World {
		f, err := describe(filepath.Join(tmp, ShardFileName(r, m.World)))
		if err != nil {
			return "", err
		}
		m.Files = append(m.Files, f)
	}
	if err := m.check(); err != nil {
		return "", fmt.Errorf("%w: %w", ErrTraining, err)
	}
	b, err := m.encode()
	if err != nil {
		return "", err
	}
	if err := writeAtomic(filepath.Join(tmp, ManifestFile), b); err != nil {
		return "", fmt.Errorf("checkpoint: %w", err)
	}
	path, err := commit(dir, tmp, m.Step)
	if err != nil {
		return path, fmt.Errorf("checkpoint: %w", err)
	}
	if keep <= 0 {
		keep = 2
	}
	if err := prune(dir, path, keep); err != nil {
		return path, fmt.Errorf("checkpoint: %s is saved; removing older checkpoints: %w", path, err)
	}
	return path, nil
}

func (m *ShardedManifest) encode() ([]byte, error) {
	m.Checksum = ""
	b, err := json.MarshalIndent(m, "", "  ")
	if err != nil {
		return nil, fmt.Errorf("%w: manifest: %w", ErrTraining, err)
	}
	sum := sha256.Sum256(b)
	m.Checksum = "sha256:" + hex.EncodeToString(sum[:])
	if b, err = json.MarshalIndent(m, "", "  "); err != nil {
		return nil, err
	}
	return append(b, '\n'), nil
}

// check validates what a sharded manifest declares: a bounded world, a
// flat space the shards cover, the parameters back to back in it, one
// file per rank holding params and every slot of ShardLen values.
func (m *ShardedManifest) checksum() string { return m.Checksum }

func (m *ShardedManifest) check() error {
	bad := func(format string, a ...any) error {
		return fmt.Errorf("%w: %s", ErrCorrupt, fmt.Sprintf(format, a...))
	}
	switch {
	case m.Step < 0 || m.Steps < 0:
		return bad("step %d, optimizer steps %d", m.Step, m.Steps)
	case m.World < 1 || m.World > maxWorld:
		return bad("world of %d shards", m.World)
	case m.ShardLen < 0 || m.Total < 0 || m.ShardLen > math.MaxInt64/int64(m.World) || m.Total > m.ShardLen*int64(m.World):
		return bad("%d values in %d shards of %d", m.Total, m.World, m.ShardLen)
	case len(m.Params) > maxTensors || len(m.Slots) > 16:
		return fmt.Errorf("%w: %d parameters, %d slots", ErrTooLarge, len(m.Params), len(m.Slots))
	case len(m.Files) != m.World:
		return bad("%d files for %d shards", len(m.Files), m.World)
	}
	off := int64(0)
	names := map[string]bool{}
	for _, p := range m.Params {
		if err := checkShape(p.Name, p.Shape); err != nil {
			return err
		}
		n := int64(1)
		for _, d := range p.Shape {
			if d > 0 && n > math.MaxInt64/int64(d) {
				return bad("parameter %q of shape %v", p.Name, p.Shape)
			}
			n *= int64(d)
		}
		if p.Offset != off || names[p.Name] {
			return bad("parameter %q at %d, want %d (each once, back to back)", p.Name, p.Offset, off)
		}
		names[p.Name] = true
		off += n
	}
	if off != m.Total {
		return bad("the parameters hold %d values, the manifest's total %d", off, m.Total)
	}
	want := append([]string{ShardParams}, m.Slots...)
	for r, f := range m.Files {
		if f.Name != ShardFileName(r, m.World) {
			return bad("file %d is %q, want %q", r, f.Name, ShardFileName(r, m.World))
		}
		if len(f.Tensors) != len(want) {
			return bad("%s holds %d tensors, want %d (params and the slots)", f.Name, len(f.Tensors), len(want))
		}
		seen := map[string]bool{}
		for _, t := range f.Tensors {
			if !slices.Contains(want, t.Name) || seen[t.Name] || t.DType != safetensors.F32.String() || !slices.Equal(t.Shape, []int{int(m.ShardLen)}) {
				return bad("%s: tensor %q %s %v, want each of %v once, F32 [%d]", f.Name, t.Name, t.DType, t.Shape, want, m.ShardLen)
			}
			seen[t.Name] = true
		}
	}
	return nil
}

// Sharded is an open sharded checkpoint, its files verified.
type Sharded struct {
	Dir      string
	Manifest *ShardedManifest
	files    []*safetensors.File
}

// OpenSharded opens the sharded checkpoint at path (a checkpoint
// directory, or a directory of them whose latest it opens): the manifest
// read within MaxManifestBytes, its format and version
// ShardedFormat's (ErrVersion otherwise), strictly decoded, its checksum
// its own, consistent (ErrCorrupt), and every shard file present, of its
// size and every tensor's SHA-256 the manifest's (ErrTruncated,
// ErrChecksum, ErrMissingTensor). Close it after reading.
func OpenSharded(path string) (*Sharded, error) {
	dir, err := Latest(path)
	if err != nil {
		return nil, err
	}
	m := &ShardedManifest{}
	if err := decodeManifest(dir, ShardedFormat, ShardedVersion, "a sharded checkpoint is", m); err != nil {
		return nil, err
	}
	s := &Sharded{Dir: dir, Manifest: m}
	for _, f := range m.Files {
		st, err := verifyFile(dir, f)
		if err != nil {
			return nil, errors.Join(err, s.Close())
		}
		s.files = append(s.files, st)
	}
	return s, nil
}

// Close closes the shard files.
func (s *Sharded) Close() error {
	var errs []error
	for _, f := range s.files {
		if f != nil {
			errs = append(errs, f.Close())
		}
	}
	s.files = nil
	return errors.Join(errs...)
}

// Read fills dst with the flat range [lo, lo+len(dst)) of tensor name
// (ShardParams or a slot) across the shards, whatever the world size that
// reads it: a range past Total reads the padding's zeros; one outside the
// padded space is ErrMismatch.
func (s *Sharded) Read(name string, lo int64, dst []float32) error {
	m := s.Manifest
	hi := lo + int64(len(dst))
	if lo < 0 || hi > m.ShardLen*int64(m.World) {
		return fmt.Errorf("%w: %s: flat range [%d, %d) outside %d shards of %d", ErrMismatch, s.Dir, lo, hi, m.World, m.ShardLen)
	}
	if name != ShardParams && !slices.Contains(m.Slots, name) {
		return fmt.Errorf("%w: %s: no tensor %q (params, %v)", ErrMismatch, s.Dir, name, m.Slots)
	}
	buf := make([]byte, 0, 4<<10)
	for r := int(lo / max(m.ShardLen, 1)); r < m.World && int64(r)*m.ShardLen < hi; r++ {
		rlo := int64(r) * m.ShardLen
		a, b := max(lo, rlo), min(hi, rlo+m.ShardLen)
		if a >= b {
			continue
		}
		sec, err := s.files[r].Section(name)
		if err != nil {
			return fmt.Errorf("checkpoint: %w", err)
		}
		for at := a; at < b; {
			n := min(b-at, int64(cap(buf)/4))
			buf = buf[:4*n]
			if k, err := sec.ReadAt(buf, 4*(at-rlo)); k != len(buf) {
				return fmt.Errorf("%w: %s: tensor %q: read %d of %d bytes: %w", ErrTruncated, s.files[r].Path(), name, k, len(buf), err)
			}
			out := dst[at-lo : at-lo+n]
			for i := range out {
				out[i] = math.Float32frombits(binary.LittleEndian.Uint32(buf[4*i:]))
			}
			at += n
		}
	}
	return nil
}
