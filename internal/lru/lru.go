// Package lru is a bounded map that evicts its least recently used entry.
package lru

import (
	"iter"
	"strconv"
)

// Cache maps keys to values, holding at most Max entries: adding one more
// evicts the entry least recently added or found. The zero Cache holds
// nothing; it takes no lock.
type Cache[K comparable, V any] struct {
	Max   int
	m     map[K]*entry[V]
	clock uint64
}

type entry[V any] struct {
	v    V
	used uint64
}

// Get returns the value of k and marks it used.
func (c *Cache[K, V]) Get(k K) (V, bool) {
	e, ok := c.m[k]
	if !ok {
		var zero V
		return zero, false
	}
	c.clock++
	e.used = c.clock
	return e.v, true
}

// Put stores v under k, evicting the least recently used entry when the
// cache is full.
func (c *Cache[K, V]) Put(k K, v V) {
	if c.m == nil {
		c.m = map[K]*entry[V]{}
	}
	c.clock++
	if e, ok := c.m[k]; ok {
		e.v, e.used = v, c.clock
		return
	}
	if len(c.m) >= max(c.Max, 1) {
		var oldest K
		first := true
		for key, e := range c.m {
			if first || e.used < c.m[oldest].used {
				oldest, first = key, false
			}
		}
		delete(c.m, oldest)
	}
	c.m[k] = &entry[V]{v: v, used: c.clock}
}

// All yields every entry, in no particular order, marking none used.
func (c *Cache[K, V]) All() iter.Seq2[K, V] {
	return func(yield func(K, V) bool) {
		for k, e := range c.m {
			if !yield(k, e.v) {
				return
			}
		}
	}
}

// Len is the number of entries.
func (c *Cache[K, V]) Len() int { return len(c.m) }

// Ints is an exact key for s: its values in decimal, each followed by a
// comma. Keys built every training step use it instead of fmt.Sprint,
// which takes several times longer for the same string's worth.
func Ints(s []int) string {
	b := make([]byte, 0, 6*len(s))
	for _, v := range s {
		b = strconv.AppendInt(b, int64(v), 10)
		b = append(b, ',')
	}
	return string(b)
}
