package cuda

import "unsafe"

// Do runs fn on the device goroutine, for tests of the re-entrant path.
func (d *Device) Do(fn func() error) error { return d.do(fn) }

// ResidentData downloads every resident buffer (parameters, constants,
// optimizer state), in allocation order, as 4-byte words.
func (e *Executor) ResidentData() ([][]uint32, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	out := make([][]uint32, len(e.residentList))
	for i, rb := range e.residentList {
		if rb.blk == nil {
			return nil, ErrClosed
		}
		out[i] = make([]uint32, (rb.size+3)/4)
		if err := CopyDtoH(e.d, unsafe.Slice((*float32)(unsafe.Pointer(&out[i][0])), len(out[i])), rb.blk.Ptr()); err != nil {
			return nil, err
		}
	}
	return out, nil
}
