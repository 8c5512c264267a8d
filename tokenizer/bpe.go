package tokenizer

import (
	"fmt"
	"sync"
)

// bpe is a byte-level BPE model: a vocabulary of byte-level strings and a
// ranked list of merges.
type bpe struct {
	vocab  map[string]int32
	merges map[uint64]merge // by pairKey(left, right)
	// byteID is the id of each byte's byte-level character, -1 if the
	// vocabulary lacks it.
	byteID       [256]int32
	unk          int32 // -1 without unk_token
	fuseUnk      bool
	byteFallback bool
	ignoreMerges bool

	mu    sync.Mutex
	cache map[string][]int32 // by the piece's raw text
}

type merge struct{ rank, id int32 }

func pairKey(a, b int32) uint64 { return uint64(uint32(a))<<32 | uint64(uint32(b)) }

// cacheable pieces are short: long ones are rare and would pin memory.
const (
	maxCachedPiece = 256
	maxCacheSize   = 1 << 16
)

// tokenize appends the ids of one pre-tokenized piece (raw bytes, before
// the byte-level mapping) to out.
func (m *bpe) tokenize(piece string, out []int32) []int32 {
	if len(piece) <= maxCachedPiece {
		m.mu.Lock()
		ids, ok := m.cache[piece]
		m.mu.Unlock()
		if ok {
			return append(out, ids...)
		}
	}
	start := len(out)
	out = m.merge(piece, out)
	if len(piece) <= maxCachedPiece {
		ids := append([]int32(nil), out[start:]...)
		m.mu.Lock()
		if len(m.cache) >= maxCacheSize {
			clear(m.cache)
		}
		m.cache[piece] = ids
		m.mu.Unlock()
	}
	return out
}

// symbol is one token of a word being merged, in a linked list.
type symbol struct {
	id         int32
	prev, next int32
	dead       bool
}

// merge runs BPE on one piece as Hugging Face's tokenizers does: every
// adjacent pair with a merge goes into a priority queue ordered by (rank,
// position); the best is applied, its neighbours' new pairs queued, and
// stale entries skipped, until the queue is empty. O(n log n) in the
// piece's length.
func (m *bpe) merge(piece string, out []int32) []int32 {
	if m.ignoreMerges {
		if id, ok := m.vocab[byteLevel(piece)]; ok {
			return append(out, id)
		}
	}
	syms := make([]symbol, 0, len(piece))
	push := func(id int32) {
		syms = append(syms, symbol{id: id, prev: int32(len(syms)) - 1, next: int32(len(syms)) + 1})
	}
	for i := 0; i < len(piece); i++ {
		if id := m.byteID[piece[i]]; id >= 0 {
			push(id)
			continue
		}
		// A byte whose character the vocabulary lacks: byte fallback to
		// <0xXX> tokens of the character's UTF-8, else the unknown token
		// (fused with a preceding one), else dropped, as tokenizers does.
		if m.byteFallback {
			ch := byteChars[piece[i]]
			ids := make([]int32, 0, len(ch))
			for j := 0; j < len(ch); j++ {
				if id, ok := m.vocab[fmt.Sprintf("<0x%02X>", ch[j])]; ok {
					ids = append(ids, id)
				}
			}
			if len(ids) == len(ch) {
				for _, id := range ids {
					push(id)
				}
				continue
			}
		}
		if m.unk >= 0 {
			if m.fuseUnk && len(syms) > 0 && syms[len(syms)-1].id == m.unk {
				continue
			}
			push(m.unk)
		}
	}
	if len(syms) == 0 {
		return out
	}
	syms[len(syms)-1].next = -1
	var q mergeQueue
	for i := 0; i+1 < len(syms); i++ {
		if mg, ok := m.merges[pairKey(syms[i].id, syms[i+1].id)]; ok {
			q.push(entry{rank: mg.rank, pos: int32(i), id: mg.id})
		}
	}
	for len(q) > 0 {
		top := q.pop()
		s := &syms[top.pos]
		if s.dead || s.next < 0 {
			continue
		}
		right := &syms[s.next]
		if mg, ok := m.merges[pairKey(s.id, right.id)]; !ok || mg.id != top.id {
			continue // stale: one side has merged since
		}
		s.id = top.id
		right.dead = true
		s.next = right.next
		if s.next >= 0 {
			syms[s.next].prev = top.pos
		}
		if s.prev >= 0 {
			if mg, ok := m.merges[pairKey(syms[s.prev].id, s.id)]; ok {
				q.push(entry{rank: mg.rank, pos: s.prev, id: mg.id})
			}
		}
		if s.next >= 0 {
			if mg, ok := m.merges[pairKey(s.id, syms[s.next].id)]; ok {
				q.push(entry{rank: mg.rank, pos: top.pos, id: mg.id})
			}
		}
	}
	for i := int32(0); i >= 0; i = syms[i].next {
		out = append(out, syms[i].id)
	}
	return out
}

// entry is a queued merge of the symbol at pos with its right neighbour.
type entry struct{ rank, pos, id int32 }

func (a entry) less(b entry) bool { return a.rank < b.rank || a.rank == b.rank && a.pos < b.pos }

// mergeQueue is a binary min-heap of entries.
type mergeQueue []entry

func (q *mergeQueue) push(e entry) {
	h := append(*q, e)
	for i := len(h) - 1; i > 0; {
		p := (i - 1) / 2
		if !h[i].less(h[p]) {
			break
		}
		h[i], h[p] = h[p], h[i]
		i = p
	}
	*q = h
}

func (q *mergeQueue) pop() entry {
	h := *q
	top := h[0]
	n := len(h) - 1
	h[0] = h[n]
	h = h[:n]
	for i := 0; ; {
		l, r, m := 2*i+1, 2*i+2, i
		if l < n && h[l].less(h[m]) {
			m = l
		}
		if r < n && h[r].less(h[m]) {
			m = r
		}
		if m == i {
			break
		}
		h[i], h[m] = h[m], h[i]
		i = m
	}
	*q = h
	return top
}
