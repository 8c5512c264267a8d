package alloc_test

import (
	"errors"
	"fmt"

	"github.com/batchfit/batchfit/alloc"
)

// The caching allocator over a simulated 64 MiB device, PyTorch's rules
// and memory_stats included: a request rounds up to 512 bytes, a small one
// is carved from a 2 MiB segment, a freed block stays cached (reserved)
// for the next request, and a request the device cannot hold is an
// *OOMError after the cache has been released once.
func ExampleNew() {
	a := alloc.New(alloc.NewSimBackend(64<<20), alloc.Options{})
	small, _ := a.Malloc(1000, alloc.Tag{Node: -1, Op: "bias"})
	large, _ := a.Malloc(3<<20, alloc.Tag{Node: -1, Op: "weight"})
	s := a.Stats()
	fmt.Println("allocated", alloc.FormatBytes(s.AllocatedBytes[alloc.All].Current),
		"reserved", alloc.FormatBytes(s.ReservedBytes[alloc.All].Current))

	_ = a.Free(large)
	again, _ := a.Malloc(3<<20, alloc.Tag{Node: -1, Op: "weight"}) // from the cache
	fmt.Println("segments asked of the device:", a.Stats().NumDeviceAlloc)

	_, err := a.Malloc(100<<20, alloc.Tag{Node: -1, Op: "too big"})
	fmt.Println("out of memory:", errors.Is(err, alloc.ErrOutOfMemory))
	_, _ = a.Free(small), a.Free(again)
	fmt.Println("after both frees: allocated", alloc.FormatBytes(a.Stats().AllocatedBytes[alloc.All].Current),
		"reserved", alloc.FormatBytes(a.Stats().ReservedBytes[alloc.All].Current))
	// Output:
	// allocated 3.00 MiB reserved 22.00 MiB
	// segments asked of the device: 2
	// out of memory: true
	// after both frees: allocated 0 B reserved 22.00 MiB
}

// ParseBytes reads sizes as the CLI's --budget does; FormatBytes prints
// them with a binary unit.
func ExampleParseBytes() {
	n, err := alloc.ParseBytes("1.5 GiB")
	fmt.Println(n, err, alloc.FormatBytes(n))
	_, err = alloc.ParseBytes("24 XB")
	fmt.Println(errors.Is(err, alloc.ErrSize))
	// Output:
	// 1610612736 <nil> 1.50 GiB
	// true
}
