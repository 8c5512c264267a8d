package cuda

import (
	"unsafe"

	"github.com/batchfit/batchfit/alloc"
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

// The staging sizes (staging.go), for tests.
const (
	StageMin   = stageMin
	StagePiece = stagePiece
)

// CopyHtoDNoWait is the executor's upload: a large copy may still be
// moving when it returns, ordered before later stream-0 work.
func CopyHtoDNoWait[T Elem](d *Device, dst alloc.Ptr, src []T) error {
	return copyHtoD(d, dst, src, false)
}

// CopyHtoDPageable is one cuMemcpyHtoD from src, unstaged: the baseline
// of BenchmarkUpload.
func CopyHtoDPageable[T Elem](d *Device, dst alloc.Ptr, src []T) error {
	n := uintptr(len(src)) * unsafe.Sizeof(src[0])
	return d.do(func() error {
		return d.drv.check("cuMemcpyHtoD_v2", d.drv.cuMemcpyHtoD(CUdeviceptr(dst), unsafe.Pointer(&src[0]), n))
	})
}

// SetStageCopiers sets the goroutines that copy each staged piece and
// returns the previous number.
func SetStageCopiers(n int) int {
	old := stageCopiers
	stageCopiers = n
	return old
}
