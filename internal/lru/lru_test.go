package lru

import (
	"testing"

	"github.com/stretchr/testify/require"
)

func TestEvictsLeastRecentlyUsed(t *testing.T) {
	c := Cache[int, string]{Max: 2}
	c.Put(1, "a")
	c.Put(2, "b")
	_, ok := c.Get(1) // 2 is now the least recently used
	require.True(t, ok)
	c.Put(3, "c")
	require.Equal(t, 2, c.Len())
	_, ok = c.Get(2)
	require.False(t, ok, "2 was evicted")
	v, ok := c.Get(1)
	require.True(t, ok)
	require.Equal(t, "a", v)
	c.Put(1, "A") // replacing evicts nothing
	require.Equal(t, 2, c.Len())
	v, _ = c.Get(1)
	require.Equal(t, "A", v)
	all := map[int]string{}
	for k, v := range c.All() {
		all[k] = v
	}
	require.Equal(t, map[int]string{1: "A", 3: "c"}, all)
}

func TestInts(t *testing.T) {
	require.Equal(t, "", Ints(nil))
	require.Equal(t, "3,-1,40,", Ints([]int{3, -1, 40}))
	// Exact: neither a split nor a join of values gives the same key.
	require.NotEqual(t, Ints([]int{1, 23}), Ints([]int{12, 3}))
	require.NotEqual(t, Ints([]int{1}), Ints([]int{1, 0}))
}
