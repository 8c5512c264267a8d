package data

import "math/bits"

// order is one epoch's sample order: the identity, or a pseudo-random
// permutation of [0, n) keyed by (seed, epoch). The permutation is a
// four-round Feistel network over the smallest domain of an even number
// of bits holding n, cycle-walking until the value falls below n: a
// bijection computed per index in O(1) time and memory, so an epoch over
// a billion windows needs no permutation table, and a resumed epoch
// starts at any index at once. Nothing in it depends on time, goroutines
// or earlier calls.
type order struct {
	n       int
	shuffle bool
	half    uint // bits per half of the domain
	mask    uint64
	keys    [4]uint64
}

func newOrder(n int, shuffle bool, seed uint64, epoch int) order {
	o := order{n: n, shuffle: shuffle && n > 1}
	if !o.shuffle {
		return o
	}
	o.half = uint(max(1, (bits.Len64(uint64(n-1))+1)/2))
	o.mask = 1<<o.half - 1
	k := seed ^ splitmix(uint64(epoch)+0x632be59bd9b4e019)
	for r := range o.keys {
		k = splitmix(k)
		o.keys[r] = k
	}
	return o
}

// at is the sample at position i (0 ≤ i < n) of the epoch.
func (o *order) at(i int) int {
	if !o.shuffle {
		return i
	}
	x := uint64(i)
	for {
		x = o.encrypt(x)
		if x < uint64(o.n) {
			return int(x)
		}
	}
}

func (o *order) encrypt(x uint64) uint64 {
	l, r := x>>o.half, x&o.mask
	for _, k := range o.keys {
		l, r = r, l^(splitmix(r^k)&o.mask)
	}
	return l<<o.half | r
}

// splitmix is SplitMix64's output function: a bijective mix of 64 bits.
func splitmix(x uint64) uint64 {
	x += 0x9e3779b97f4a7c15
	x = (x ^ x>>30) * 0xbf58476d1ce4e5b9
	x = (x ^ x>>27) * 0x94d049bb133111eb
	return x ^ x>>31
}
