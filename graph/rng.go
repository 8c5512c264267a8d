package graph

// splitmix64 is SplitMix64's finaliser: a bijective 64-bit mixer.
func splitmix64(x uint64) uint64 {
	x += 0x9e3779b97f4a7c15
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9
	x = (x ^ (x >> 27)) * 0x94d049bb133111eb
	return x ^ (x >> 31)
}

// DropoutKeep reports whether an element survives dropout with drop
// probability p. It is a counter-based generator: the answer depends only
// on (seed, step, row, elem), where row is the global index along the batch
// axis and elem the element's index within that row, so a batch run whole
// or in any chunks draws the same mask, and a gradient can redraw it
// instead of saving it. Executors on other devices implement the same
// function.
func DropoutKeep(seed, step uint64, row, elem int64, p float64) bool {
	h := splitmix64(seed ^ splitmix64(step^splitmix64(uint64(row)^splitmix64(uint64(elem)))))
	u := float64(h>>11) * (1.0 / (1 << 53)) // uniform in [0, 1)
	return u >= p
}
