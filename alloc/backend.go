package alloc

import (
	"errors"
	"fmt"
	"sync"
)

// ErrDeviceOOM is what a Backend returns (wrapped) when it cannot provide a
// segment. The allocator reacts to it by releasing cache and retrying.
var ErrDeviceOOM = errors.New("device out of memory")

// Ptr is a device address.
type Ptr uint64

// Backend provides raw device memory in segments.
type Backend interface {
	// Malloc reserves size bytes, or fails wrapping ErrDeviceOOM.
	Malloc(size int64) (Ptr, error)
	// Free releases a segment returned by Malloc.
	Free(p Ptr) error
	// MemInfo reports the device's free and total bytes.
	MemInfo() (free, total int64, err error)
}

// SimBackend is a simulated device: address ranges with a capacity and no
// memory behind them. Planners replay programs on it.
type SimBackend struct {
	mu       sync.Mutex
	capacity int64
	used     int64
	next     Ptr
	live     map[Ptr]int64
	// Mallocs and Frees count device calls, for tests.
	Mallocs, Frees int
}

// segmentAlign keeps simulated segments on 2 MiB boundaries, as CUDA does.
const segmentAlign = 2 << 20

// NewSimBackend returns a simulated device with capacity bytes.
func NewSimBackend(capacity int64) *SimBackend {
	return &SimBackend{capacity: capacity, next: 1 << 32, live: map[Ptr]int64{}}
}

// Malloc reserves size bytes if they fit in the remaining capacity.
func (s *SimBackend) Malloc(size int64) (Ptr, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if size <= 0 {
		return 0, fmt.Errorf("simulated device: malloc of %d bytes", size)
	}
	if size > s.capacity-s.used { // not used+size: that can overflow
		return 0, fmt.Errorf("%w: simulated device: %d bytes requested, %d of %d free",
			ErrDeviceOOM, size, s.capacity-s.used, s.capacity)
	}
	p := s.next
	s.next += Ptr((size + segmentAlign - 1) / segmentAlign * segmentAlign)
	s.live[p] = size
	s.used += size
	s.Mallocs++
	return p, nil
}

// Free releases a segment.
func (s *SimBackend) Free(p Ptr) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	size, ok := s.live[p]
	if !ok {
		return fmt.Errorf("simulated device: free of unknown address %#x", p)
	}
	delete(s.live, p)
	s.used -= size
	s.Frees++
	return nil
}

// MemInfo reports the capacity left and the capacity.
func (s *SimBackend) MemInfo() (free, total int64, err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.capacity - s.used, s.capacity, nil
}

// Used is the bytes currently reserved on the simulated device.
func (s *SimBackend) Used() int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.used
}
