package hf

import (
	"errors"
	"fmt"
	"strings"

	"github.com/batchfit/batchfit/safetensors"
)

// Errors from this package wrap one of these (or safetensors' own, which
// tensor files report); test with errors.Is.
var (
	// ErrConfig: config.json is not valid JSON, or a key holds a value of
	// the wrong type or out of range.
	ErrConfig = errors.New("hf: invalid config")
	// ErrUnsupported: an architecture, rope type, activation or other
	// setting batchfit's models cannot reproduce, or a pickle checkpoint.
	ErrUnsupported = errors.New("hf: unsupported")
	// ErrCheckpoint: a checkpoint directory is incomplete or inconsistent
	// (no weights file, an index naming a file outside the directory or a
	// tensor its shard lacks, a tensor in two shards, an untied head where
	// the model ties it).
	ErrCheckpoint = errors.New("hf: invalid checkpoint")
	// ErrMissingTensor: the model has parameters the checkpoint lacks.
	ErrMissingTensor = errors.New("hf: tensors missing from the checkpoint")
	// ErrUnexpectedTensor: the checkpoint holds tensors the model does not
	// have (another model's weights, an adapter), which loading would
	// otherwise drop silently.
	ErrUnexpectedTensor = errors.New("hf: checkpoint tensors the model does not have")
	// ErrShape: a checkpoint tensor's shape is not its parameter's; the
	// error is a *ShapeError.
	ErrShape = errors.New("hf: tensor shape mismatch")

	// ErrTooLarge and ErrNotRegular are safetensors' errors, which this
	// package also returns for config.json and index files.
	ErrTooLarge   = safetensors.ErrTooLarge
	ErrNotRegular = safetensors.ErrNotRegular
)

// ShapeError is a checkpoint tensor whose shape differs from its
// parameter's. Want is the shape the file must hold (the parameter's, or
// its transpose for GPT-2's Conv1D weights); Got is the file's.
type ShapeError struct {
	Param, Tensor, File string
	Want, Got           []int
}

func (e *ShapeError) Error() string {
	return fmt.Sprintf("%v: parameter %s: tensor %q in %s is %v, the model needs %v", ErrShape, e.Param, e.Tensor, e.File, e.Got, e.Want)
}

// Is makes errors.Is(err, ErrShape) hold.
func (e *ShapeError) Is(target error) bool { return target == ErrShape }

// UnsupportedArchitectureError is a config.json whose architecture batchfit
// has no model for; it lists the ones it has.
type UnsupportedArchitectureError struct {
	Architecture string
	Supported    []Architecture
}

func (e *UnsupportedArchitectureError) Error() string {
	names := make([]string, len(e.Supported))
	for i, a := range e.Supported {
		names[i] = string(a)
	}
	return fmt.Sprintf("%v: architecture %q; supported: %s", ErrUnsupported, e.Architecture, strings.Join(names, ", "))
}

// Is makes errors.Is(err, ErrUnsupported) hold.
func (e *UnsupportedArchitectureError) Is(target error) bool { return target == ErrUnsupported }

// nameList formats up to ten names and how many more there are.
func nameList(names []string) string {
	const show = 10
	if len(names) <= show {
		return strings.Join(names, ", ")
	}
	return fmt.Sprintf("%s and %d more", strings.Join(names[:show], ", "), len(names)-show)
}
