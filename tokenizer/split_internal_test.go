package tokenizer

import (
	"testing"

	"github.com/stretchr/testify/assert"
)

func pieces(sp splitter, s string) []string {
	var out []string
	sp(s, func(p string) { out = append(out, p) })
	return out
}

// The splitters cut as the regexes do under leftmost-first backtracking;
// each expectation is worked out from the pattern by hand.
func TestSplitters(t *testing.T) {
	gpt2 := knownSplitters[gpt2Pattern]
	llama3 := knownSplitters[llama3Pattern]
	qwen2 := knownSplitters[qwen2Pattern]
	cases := []struct {
		sp   splitter
		in   string
		want []string
	}{
		{gpt2, "Hello world", []string{"Hello", " world"}},
		{gpt2, "  x", []string{" ", " x"}},
		{gpt2, "a  \n b", []string{"a", "  \n", " b"}},
		{gpt2, "x   ", []string{"x", "   "}},
		{gpt2, "it's IT'S", []string{"it", "'s", " IT", "'", "S"}},
		{gpt2, " 's", []string{" '", "s"}},
		{gpt2, "v1.2  3", []string{"v", "1", ".", "2", " ", " 3"}},
		{gpt2, "\t\tx", []string{"\t", "\t", "x"}},
		{gpt2, "é…\u00a0ok", []string{"é", "…", "\u00a0", "ok"}},
		{llama3, "IT'S we'LL", []string{"IT", "'S", " we", "'LL"}},
		{llama3, "'ſ", []string{"'ſ"}},
		{llama3, "12345", []string{"123", "45"}},
		{llama3, "hello\n\nworld", []string{"hello", "\n\n", "world"}},
		{llama3, " \n\n x", []string{" \n\n", " x"}},
		{llama3, ".hello", []string{".hello"}},
		{llama3, "...\n\nfoo", []string{"...\n\n", "foo"}},
		{llama3, "\u00a0word\tx", []string{"\u00a0word", "\tx"}},
		{llama3, "a  ", []string{"a", "  "}},
		{llama3, "a   b", []string{"a", "  ", " b"}},
		{llama3, "x +1", []string{"x", " +", "1"}},
		{qwen2, "x123", []string{"x", "1", "2", "3"}},
	}
	for _, c := range cases {
		assert.Equal(t, c.want, pieces(c.sp, c.in), "%q", c.in)
	}
}

// Decoded bytes become text as Rust's from_utf8_lossy makes it: one
// U+FFFD per maximal invalid subsequence.
func TestLossyString(t *testing.T) {
	for in, want := range map[string]string{
		"ok":               "ok",
		"\xe2\x82":         "\ufffd",
		"\xe2\x82x":        "\ufffdx",
		"\xff\xfe":         "\ufffd\ufffd",
		"a\xf0\x9f\x98":    "a\ufffd",
		"\xed\xa0\x80":     "\ufffd\ufffd\ufffd", // a surrogate: ED is followed by A0, outside 80..9F
		"\xc0\xaf":         "\ufffd\ufffd",
		"\xf0\x9f\x98\x80": "😀",
	} {
		assert.Equal(t, want, lossyString([]byte(in)), "%q", in)
	}
}
