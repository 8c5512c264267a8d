package cuda

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"strings"
	"syscall"

	"github.com/batchfit/batchfit/graph"
)

// The timed algorithm search's disk cache (convfind.go), beside the cubin
// cache (module.go) and with its conventions: one file per key under
// os.UserCacheDir()/batchfit/cudnn (Options.AlgoCacheDir overrides it,
// Options.NoCache turns it off), named by the SHA-256 of the key, written
// through a temporary file and a rename. An entry is small JSON that
// repeats its key; readAlgoEntry takes nothing on trust: a file that is
// not a regular file within maxAlgoEntryBytes, not JSON of this format,
// for another key, or with a result out of cuDNN's ranges is an error
// wrapping ErrAlgoCache (a missing one wraps fs.ErrNotExist), and the
// search runs again and rewrites it.

// ErrAlgoCache is wrapped by the error of an algorithm cache entry that
// cannot be used: not a regular file, too large, not this format, written
// for another key, or holding values cuDNN does not return.
var ErrAlgoCache = errors.New("cuda: unusable cuDNN algorithm cache entry")

// algoFormat names the entry format; an entry of any other is stale.
const algoFormat = "batchfit-cudnn-find/1"

// maxAlgoEntryBytes caps what readAlgoEntry reads. An entry of the 16
// results a search returns at most is under 3 KiB.
const maxAlgoEntryBytes = 64 << 10

// maxAlgoResults bounds an entry's results: the perf array's length.
const maxAlgoResults = 16

// maxAlgoMemory bounds a result's workspace: no device has 2⁵⁰ bytes.
const maxAlgoMemory = 1 << 50

// algoKey is everything a timed search's results depend on: the pass, the
// dtype, the shapes (x [N, C, H, W], w [O, C/g, kh, kw], y [N, O, Ho, Wo],
// logical sizes), the window, the groups, the layout, the math type set on
// the descriptor, the workspace the search offered, and the device and
// cuDNN that ran it.
type algoKey struct {
	Pass             convPass
	DType            graph.DType
	X, W, Y          [4]int64
	Pad, Stride, Dil [2]int64
	Groups           int64
	NHWC             bool
	Math             int32
	Limit            int64 // the search's workspace bytes
	Device           string
	Arch             string
	CUDNN            int
	Im2col           string // the im2col path's kernels (im2colVersion), "" when it is no candidate
}

// String is the key's canonical text: every field, named, so that two
// keys are equal exactly when their texts are.
func (k algoKey) String() string {
	layout := "nchw"
	if k.NHWC {
		layout = "nhwc"
	}
	ints := func(v []int64) string {
		s := make([]string, len(v))
		for i, x := range v {
			s[i] = fmt.Sprint(x)
		}
		return strings.Join(s, ",")
	}
	return fmt.Sprintf("%s|pass=%s|dtype=%s|x=%s|w=%s|y=%s|pad=%s|stride=%s|dilation=%s|groups=%d|layout=%s|math=%d|workspace=%d|device=%q|arch=%s|cudnn=%d|im2col=%q",
		algoFormat, k.Pass, k.DType, ints(k.X[:]), ints(k.W[:]), ints(k.Y[:]), ints(k.Pad[:]), ints(k.Stride[:]), ints(k.Dil[:]),
		k.Groups, layout, k.Math, k.Limit, k.Device, k.Arch, k.CUDNN, k.Im2col)
}

// file is the key's entry name: the SHA-256 of its text.
func (k algoKey) file() string {
	h := sha256.Sum256([]byte(k.String()))
	return hex.EncodeToString(h[:]) + ".json"
}

// algoResult is one algorithm a search timed: cudnnAlgoPerf as stored,
// or the im2col path (Algo im2colAlgo).
type algoResult struct {
	Algo          int32   `json:"algo"`
	Status        int32   `json:"status"`
	TimeMS        float64 `json:"time_ms"`
	Memory        int64   `json:"memory"`
	Deterministic bool    `json:"deterministic"`
	Math          int32   `json:"math"`
}

// algoEntry is a cache file's contents.
type algoEntry struct {
	Format  string       `json:"format"`
	Key     string       `json:"key"`
	Results []algoResult `json:"results"`
}

// algoCount is the number of pass's algorithms.
func algoCount(p convPass) int32 {
	switch p {
	case convForward:
		return cudnnFwdAlgoCount
	case convGradInput:
		return cudnnBwdDataAlgoCount
	}
	return cudnnBwdFilterAlgoCount
}

// check reports the first result of e that cuDNN could not have returned
// for key k.
func (e *algoEntry) check(k algoKey) error {
	switch {
	case e.Format != algoFormat:
		return fmt.Errorf("format %q, want %q", e.Format, algoFormat)
	case e.Key != k.String():
		return fmt.Errorf("written for another key")
	case len(e.Results) > maxAlgoResults:
		return fmt.Errorf("%d results, at most %d", len(e.Results), maxAlgoResults)
	}
	for i, r := range e.Results {
		switch {
		case r.Algo == im2colAlgo && k.Im2col == "":
			return fmt.Errorf("result %d: the im2col path, which this key does not time", i)
		case r.Algo < im2colAlgo || r.Algo >= algoCount(k.Pass):
			return fmt.Errorf("result %d: algorithm %d of %s", i, r.Algo, k.Pass)
		case r.Status < 0:
			return fmt.Errorf("result %d: status %d", i, r.Status)
		case math.IsNaN(r.TimeMS) || math.IsInf(r.TimeMS, 0) || (r.Status == 0 && r.TimeMS < 0):
			return fmt.Errorf("result %d: time %g ms", i, r.TimeMS)
		case r.Memory < 0 || r.Memory > maxAlgoMemory:
			return fmt.Errorf("result %d: workspace %d bytes", i, r.Memory)
		case r.Math < cudnnDefaultMath || r.Math > cudnnFMAMath:
			return fmt.Errorf("result %d: math type %d", i, r.Math)
		}
	}
	return nil
}

// algoPath is the cache file of k under dir.
func algoPath(dir string, k algoKey) string { return filepath.Join(dir, k.file()) }

// algoCacheDir is the device's algorithm cache directory, "" when caching
// is off or there is no cache directory.
func (d *Device) algoCacheDir() string {
	if d.opts.NoCache {
		return ""
	}
	if d.opts.AlgoCacheDir != "" {
		return d.opts.AlgoCacheDir
	}
	base, err := os.UserCacheDir()
	if err != nil {
		return ""
	}
	return filepath.Join(base, "batchfit", "cudnn")
}

// readAlgoEntry reads k's entry in dir. A missing entry's error wraps
// fs.ErrNotExist; any other failure wraps ErrAlgoCache.
func readAlgoEntry(dir string, k algoKey) ([]algoResult, error) {
	path := algoPath(dir, k)
	bad := func(format string, a ...any) error {
		return fmt.Errorf("%w: %s: %s", ErrAlgoCache, path, fmt.Sprintf(format, a...))
	}
	fi, err := os.Lstat(path)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return nil, err
		}
		return nil, bad("%v", err)
	}
	if !fi.Mode().IsRegular() { // a link, a FIFO or a device would read as anything, or block
		return nil, bad("not a regular file (%s)", fi.Mode().Type())
	}
	if fi.Size() > maxAlgoEntryBytes {
		return nil, bad("%d bytes, at most %d", fi.Size(), maxAlgoEntryBytes)
	}
	// Non-blocking, so a FIFO swapped in since Lstat cannot hang the open;
	// the open file is checked again.
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NONBLOCK, 0)
	if err != nil {
		return nil, bad("%v", err)
	}
	defer f.Close()
	if ofi, err := f.Stat(); err != nil || !os.SameFile(fi, ofi) {
		return nil, bad("replaced while opened")
	}
	b, err := io.ReadAll(io.LimitReader(f, maxAlgoEntryBytes+1))
	if err != nil {
		return nil, bad("%v", err)
	}
	if len(b) > maxAlgoEntryBytes {
		return nil, bad("grew past %d bytes", maxAlgoEntryBytes)
	}
	var e algoEntry
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&e); err != nil {
		return nil, bad("%v", err)
	}
	if dec.More() {
		return nil, bad("data after the entry")
	}
	if err := e.check(k); err != nil {
		return nil, bad("%v", err)
	}
	return e.Results, nil
}

// writeAlgoEntry writes k's results to dir, atomically.
func writeAlgoEntry(dir string, k algoKey, rs []algoResult) error {
	e := algoEntry{Format: algoFormat, Key: k.String(), Results: rs}
	if err := e.check(k); err != nil {
		return fmt.Errorf("%w: not written: %v", ErrAlgoCache, err)
	}
	b, err := json.MarshalIndent(e, "", " ")
	if err != nil {
		return err
	}
	return writeFileAtomic(algoPath(dir, k), append(b, '\n'))
}
