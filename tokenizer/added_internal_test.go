package tokenizer

import (
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// byteTokenizer is a byte-level tokenizer whose vocabulary is the 256
// byte characters (id = byte) and two merges, with added tokens.
func byteTokenizer(t *testing.T, added []map[string]any, model map[string]any) *Tokenizer {
	vocab := map[string]int{}
	for b := range 256 {
		vocab[byteChars[b]] = b
	}
	vocab["ab"], vocab["abc"] = 300, 301
	m := map[string]any{"type": "BPE", "vocab": vocab, "merges": []string{"a b", "ab c"}}
	for k, v := range model {
		m[k] = v
	}
	f := map[string]any{"added_tokens": added, "pre_tokenizer": map[string]any{"type": "ByteLevel", "add_prefix_space": false, "use_regex": true},
		"decoder": map[string]any{"type": "ByteLevel"}, "model": m}
	b, err := json.Marshal(f)
	require.NoError(t, err)
	tok, err := Parse(b)
	require.NoError(t, err)
	return tok
}

// Added tokens' lstrip, rstrip and single_word options, as tokenizers'
// AddedVocabulary applies them.
func TestAddedTokenOptions(t *testing.T) {
	tok := byteTokenizer(t, []map[string]any{
		{"id": 256, "content": "<l>", "lstrip": true, "special": true},
		{"id": 257, "content": "<r>", "rstrip": true, "special": true},
		{"id": 258, "content": "<w>", "single_word": true, "special": true},
		{"id": 259, "content": "<l><r>x", "special": true}, // longest match wins
		{"id": 260, "content": "abc!", "normalized": true}, // matched in the second pass
	}, nil)
	const sp, a, b, c = 32, 97, 98, 99 // ' ' is Ġ, id 32
	for in, want := range map[string][]int{
		"a  <l> b": {a, 256, sp, b},     // the spaces before <l> go with it
		"a <r>  b": {a, sp, 257, b},     // the spaces after <r> go with it
		"a<w>b":    {a, 60, 119, 62, b}, // not a single word: plain text
		" <w> ":    {sp, 258, sp},       // a single word
		"<l><r>x":  {259},               // leftmost-longest
		"x abc!":   {120, sp, 260},      // a non-special added token
		"abc":      {301},               // merges: a b → ab, ab c → abc
		"cab":      {c, 300},
		"":         {},
	} {
		got, err := tok.Encode(in, false)
		require.NoError(t, err)
		assert.Equal(t, want, got, "%q", in)
	}
}

// Characters the vocabulary lacks become the unknown token (fused when
// fuse_unk is set) or <0xXX> byte tokens (byte_fallback), else are
// dropped, as tokenizers does.
func TestUnknownCharacters(t *testing.T) {
	vocab := map[string]int{"a": 0, "<unk>": 1, "<0xC4>": 2, "<0xA0>": 3}
	mk := func(model map[string]any) *Tokenizer {
		m := map[string]any{"type": "BPE", "vocab": vocab, "merges": []string{}}
		for k, v := range model {
			m[k] = v
		}
		b, err := json.Marshal(map[string]any{"pre_tokenizer": map[string]any{"type": "ByteLevel", "use_regex": false},
			"decoder": map[string]any{"type": "ByteLevel"}, "model": m})
		require.NoError(t, err)
		tok, err := Parse(b)
		require.NoError(t, err)
		return tok
	}
	for _, c := range []struct {
		model map[string]any
		want  []int
	}{
		{nil, []int{0, 0}},
		{map[string]any{"unk_token": "<unk>"}, []int{0, 1, 1, 0}},
		{map[string]any{"unk_token": "<unk>", "fuse_unk": true}, []int{0, 1, 0}},
		{map[string]any{"byte_fallback": true, "unk_token": "<unk>"}, []int{0, 2, 3, 1, 0}}, // ' ' is Ġ = C4 A0; 'b' has no byte tokens
	} {
		got, err := mk(c.model).Encode("a b"+"a", false)
		require.NoError(t, err)
		assert.Equal(t, c.want, got, "%v", c.model)
	}
}
