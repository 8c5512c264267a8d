package alloc_test

import (
	"math/rand/v2"
	"testing"

	"github.com/batchfit/batchfit/alloc"
)

var benchSizes = []struct {
	name string
	size int64
}{{"4KiB", 4 * KiB}, {"4MiB", 4 * MiB}}

// BenchmarkCachedAllocFree is one Malloc+Free pair served from the cache:
// the first pair reserves the segment, every later one finds its block in
// the free list and merges it back on Free.
func BenchmarkCachedAllocFree(b *testing.B) {
	for _, c := range benchSizes {
		b.Run(c.name, func(b *testing.B) {
			a, be := newAlloc(GiB, 0)
			mustFree(b, a, mustMalloc(b, a, c.size))
			b.ReportAllocs()
			for b.Loop() {
				blk, err := a.Malloc(c.size, noTag)
				if err != nil {
					b.Fatal(err)
				}
				if err := a.Free(blk); err != nil {
					b.Fatal(err)
				}
			}
			if be.Mallocs != 1 {
				b.Fatalf("%d device mallocs, want 1", be.Mallocs)
			}
		})
	}
}

// BenchmarkAllocFreeMixed replaces one of 64 live blocks per op with a
// block of a random size (small, medium and large mixed) over a cache
// warmed by two passes through the same size sequence.
func BenchmarkAllocFreeMixed(b *testing.B) {
	r := rand.New(rand.NewPCG(7, 7))
	sizes := make([]int64, 4096)
	for i := range sizes {
		sizes[i] = randomSize(r)
	}
	const window = 64
	a, be := newAlloc(1<<40, 0)
	var live [window]*alloc.Block
	k := 0
	step := func() {
		slot := k % window
		if live[slot] != nil {
			if err := a.Free(live[slot]); err != nil {
				b.Fatal(err)
			}
		}
		blk, err := a.Malloc(sizes[k%len(sizes)], noTag)
		if err != nil {
			b.Fatal(err)
		}
		live[slot] = blk
		k++
	}
	for range 2 * len(sizes) {
		step()
	}
	before := be.Mallocs
	b.ReportAllocs()
	for b.Loop() {
		step()
	}
	b.ReportMetric(float64(be.Mallocs-before)/float64(b.N), "segments/op")
}

// BenchmarkNewSegment goes to the device every time: Malloc reserves a
// segment, Free caches it whole and EmptyCache releases it.
func BenchmarkNewSegment(b *testing.B) {
	for _, c := range benchSizes {
		b.Run(c.name, func(b *testing.B) {
			a, be := newAlloc(GiB, 0)
			b.ReportAllocs()
			for b.Loop() {
				blk, err := a.Malloc(c.size, noTag)
				if err != nil {
					b.Fatal(err)
				}
				if err := a.Free(blk); err != nil {
					b.Fatal(err)
				}
				if err := a.EmptyCache(); err != nil {
					b.Fatal(err)
				}
			}
			if be.Mallocs != be.Frees || be.Used() != 0 {
				b.Fatalf("%d device mallocs, %d frees, %d B used", be.Mallocs, be.Frees, be.Used())
			}
		})
	}
}
