package tokenizer_test

import (
	"bufio"
	"compress/gzip"
	"encoding/json"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/tokenizer"
)

// hfCase is one line of testdata/cases.jsonl.gz: a text and the ids
// Hugging Face's tokenizers gave for it.
type hfCase struct {
	Text        string `json:"text"`
	GPT2        []int  `json:"gpt2"`
	Llama3      []int  `json:"llama3"`
	Llama3BOS   []int  `json:"llama3_bos"` // with add_special_tokens, the first 500 lines
	GPT2Decoded string `json:"gpt2_decoded"`
}

func readCases(t testing.TB) []hfCase {
	f, err := os.Open(filepath.Join("testdata", "cases.jsonl.gz"))
	require.NoError(t, err)
	defer f.Close()
	z, err := gzip.NewReader(f)
	require.NoError(t, err)
	sc := bufio.NewScanner(z)
	sc.Buffer(nil, 1<<24)
	var cs []hfCase
	for sc.Scan() {
		var c hfCase
		require.NoError(t, json.Unmarshal(sc.Bytes(), &c))
		cs = append(cs, c)
	}
	require.NoError(t, sc.Err())
	return cs
}

func load(t testing.TB, name string) *tokenizer.Tokenizer {
	tok, err := tokenizer.Load(filepath.Join("testdata", name))
	require.NoError(t, err)
	return tok
}

// Every test string (unicode, whitespace runs, empty lines, contractions,
// numbers, special tokens in the text) encodes to the ids Hugging Face's
// tokenizers gave, for a GPT-2-style and a Llama-3-style tokenizer, with
// and without Llama 3's <|begin_of_text|>; decoding gives the text back.
func TestIDsEqualHuggingFace(t *testing.T) {
	cases := readCases(t)
	require.GreaterOrEqual(t, len(cases), 10_000)
	gpt2, llama3 := load(t, "gpt2-style.json"), load(t, "llama3-style.json")
	bad := 0
	withBOS := 0
	for i, c := range cases {
		got, err := gpt2.Encode(c.Text, true)
		require.NoError(t, err)
		if !assert.Equal(t, c.GPT2, got, "gpt2-style, line %d: %q", i+1, c.Text) {
			bad++
		}
		got, err = llama3.Encode(c.Text, false)
		require.NoError(t, err)
		if !assert.Equal(t, c.Llama3, got, "llama3-style, line %d: %q", i+1, c.Text) {
			bad++
		}
		if c.Llama3BOS != nil {
			withBOS++
			got, err = llama3.Encode(c.Text, true)
			require.NoError(t, err)
			assert.Equal(t, c.Llama3BOS, got, "llama3-style with BOS, line %d: %q", i+1, c.Text)
		}
		text, err := gpt2.Decode(c.GPT2, false)
		require.NoError(t, err)
		if !assert.Equal(t, c.GPT2Decoded, text, "gpt2-style decode, line %d", i+1) {
			bad++
		}
		text, err = llama3.Decode(c.Llama3, false)
		require.NoError(t, err)
		assert.Equal(t, c.Text, text, "llama3-style decode, line %d", i+1)
		if bad > 20 {
			t.Fatal("too many mismatches")
		}
	}
	assert.GreaterOrEqual(t, withBOS, 500)
}
