package cuda

import (
	"testing"
	"unsafe"

	"github.com/stretchr/testify/assert"
)

// pinnedSet says whether a copy's source lies wholly inside one
// allocation: a range straddling an allocation's end, or two, is not (it
// would read unpinned memory by DMA), and a removed allocation is gone.
func TestPinnedSetHolds(t *testing.T) {
	var s pinnedSet
	buf := make([]byte, 1000)
	base := unsafe.Pointer(unsafe.SliceData(buf))
	at := func(off int) unsafe.Pointer { return unsafe.Add(base, off) }
	s.add(hostRange{p: at(500), start: uintptr(at(500)), end: uintptr(at(700))})
	s.add(hostRange{p: at(100), start: uintptr(at(100)), end: uintptr(at(300))})
	s.add(hostRange{p: at(300), start: uintptr(at(300)), end: uintptr(at(400))})
	for _, c := range []struct {
		off, n int
		want   bool
	}{
		{100, 200, true}, {150, 10, true}, {299, 1, true}, {300, 100, true}, {500, 200, true},
		{99, 2, false}, {250, 100, false}, {399, 2, false}, {450, 10, false}, {650, 100, false}, {700, 1, false}, {0, 10, false},
	} {
		assert.Equal(t, c.want, s.holds(at(c.off), uintptr(c.n)), "[%d, %d)", c.off, c.off+c.n)
	}
	assert.True(t, s.remove(uintptr(at(300))))
	assert.False(t, s.remove(uintptr(at(300))))
	assert.False(t, s.holds(at(300), 10))
	assert.True(t, s.holds(at(100), 200))
	assert.Len(t, s.ranges, 2)
}
