package cuda

import (
	"unsafe"

	"github.com/batchfit/batchfit/exec"
)

// keptOutputs is exec.KeptOutputs, as the tests of the output mapping name it.
var keptOutputs = exec.KeptOutputs

// Do runs fn on the device goroutine, for tests of the re-entrant path.
func (d *Device) Do(fn func() error) error { return d.do(fn) }

// ResidentData downloads every resident buffer (parameters, constants,
// optimizer state), in allocation order, as 4-byte words.
func (e *Executor) ResidentData() ([][]uint32, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	list := e.resident.List()
	out := make([][]uint32, len(list))
	for i, rb := range list {
		if rb.Blk == nil {
			return nil, ErrClosed
		}
		out[i] = make([]uint32, (rb.Size+3)/4)
		if err := CopyDtoH(e.d, unsafe.Slice((*float32)(unsafe.Pointer(&out[i][0])), len(out[i])), rb.Blk.Ptr()); err != nil {
			return nil, err
		}
	}
	return out, nil
}
