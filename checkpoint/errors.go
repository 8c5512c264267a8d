package checkpoint

import (
	"errors"
	"fmt"

	"github.com/batchfit/batchfit/internal/safefile"
)

// The errors Save, Load, Verify and Latest return wrap one of these; test
// with errors.Is (and errors.As for a *ShapeError). Each message names the
// checkpoint's path and, where there is one, the tensor.
var (
	// ErrNoCheckpoint: the directory holds no checkpoint (no manifest and
	// no latest pointer).
	ErrNoCheckpoint = errors.New("checkpoint: no checkpoint")
	// ErrVersion: a manifest of another format, or of a format version
	// this package does not read.
	ErrVersion = errors.New("checkpoint: unknown format or version")
	// ErrCorrupt: the checkpoint's files are not what its manifest says
	// (ErrChecksum, ErrTruncated, ErrMissingTensor wrap it), or the
	// manifest itself is malformed or fails its own checksum.
	ErrCorrupt = errors.New("checkpoint: corrupt")
	// ErrChecksum: a tensor's (or file's) SHA-256 is not the manifest's.
	ErrChecksum = fmt.Errorf("%w: checksum mismatch", ErrCorrupt)
	// ErrTruncated: a file is shorter than the manifest says.
	ErrTruncated = fmt.Errorf("%w: truncated file", ErrCorrupt)
	// ErrMissingTensor: a tensor or file the manifest lists is absent.
	ErrMissingTensor = fmt.Errorf("%w: missing tensor", ErrCorrupt)
	// ErrMismatch: a sound checkpoint of another model or training: a
	// parameter of another shape (a *ShapeError), parameters, buffers or
	// dropout layers that one side has and the other has not, another
	// optimizer.
	ErrMismatch = errors.New("checkpoint: does not match the training")
	// ErrTooLarge: a manifest or latest pointer over its size bound, or a
	// manifest declaring more than the bounds here allow.
	ErrTooLarge = errors.New("checkpoint: too large")
	// ErrNotRegular: a file of the checkpoint is a directory, FIFO, device
	// or socket.
	ErrNotRegular = safefile.ErrNotRegular
	// ErrTraining: what Save was given cannot be saved (no model, a
	// shape-only or non-float32 parameter, two parameters of one name,
	// optimizer state of a parameter not among them, state left on the
	// device without the session to sync it).
	ErrTraining = errors.New("checkpoint: invalid training state")
	// ErrUnsupported: an optimizer whose hyperparameters this package
	// does not know (it saves optim.Adam and optim.SGD).
	ErrUnsupported = errors.New("checkpoint: unsupported")
)

// ShapeError is a checkpoint tensor whose shape is not the training's:
// the checkpoint of another model, or of another size of the same one.
type ShapeError struct {
	Path   string // the checkpoint
	Tensor string // the parameter's (or buffer's, or state slot's) name
	// Want is the training's shape, Got the checkpoint's.
	Want, Got []int
}

func (e *ShapeError) Error() string {
	return fmt.Sprintf("checkpoint: %s: tensor %q is %v in the checkpoint, %v in the training", e.Path, e.Tensor, e.Got, e.Want)
}

// Is makes a ShapeError match ErrMismatch.
func (e *ShapeError) Is(target error) bool { return target == ErrMismatch }
