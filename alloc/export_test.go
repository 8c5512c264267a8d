package alloc

import "fmt"

// CheckFreeLists reports the first disagreement between the pools' free
// lists and the blocks of the segments: a test hook, since a free block
// missing from its list (or a stale one left in it) is invisible to
// Snapshot until a later Malloc hands out the wrong memory.
func CheckFreeLists(a *Allocator) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	listed := map[*Block]bool{}
	for pool := SmallPool; pool < numPools; pool++ {
		l := a.free[pool]
		for i, b := range l {
			if i > 0 && less(l[i-1], b) >= 0 {
				return fmt.Errorf("%s free list out of (size, address) order at %d", pool, i)
			}
			if b.allocated {
				return fmt.Errorf("%s free list holds an allocated block at %#x", pool, b.ptr)
			}
			if b.seg == nil || a.segments[b.seg.base] != b.seg {
				return fmt.Errorf("%s free list holds a block at %#x of no live segment", pool, b.ptr)
			}
			if b.seg.pool != pool {
				return fmt.Errorf("%s free list holds a %s block at %#x", pool, b.seg.pool, b.ptr)
			}
			listed[b] = true
		}
	}
	free := 0
	for _, seg := range a.segments {
		for b := seg.head; b != nil; b = b.next {
			if b.seg != seg {
				return fmt.Errorf("block at %#x points at another segment", b.ptr)
			}
			if !b.allocated {
				free++
				if !listed[b] {
					return fmt.Errorf("free block at %#x is missing from the %s free list", b.ptr, seg.pool)
				}
			}
		}
	}
	if free != len(listed) {
		return fmt.Errorf("free lists hold %d blocks, segments %d free blocks", len(listed), free)
	}
	return nil
}
