package tokenizer_test

import (
	"encoding/json"
	"os"
	"path/filepath"
	"syscall"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/tokenizer"
)

// variant is the GPT-2-style tokenizer.json with one key replaced.
func variant(t *testing.T, edit func(m map[string]any)) []byte {
	b, err := os.ReadFile(filepath.Join("testdata", "gpt2-style.json"))
	require.NoError(t, err)
	var m map[string]any
	require.NoError(t, json.Unmarshal(b, &m))
	edit(m)
	out, err := json.Marshal(m)
	require.NoError(t, err)
	return out
}

func model(m map[string]any) map[string]any { return m["model"].(map[string]any) }

// Components this package does not implement are refused by name, never
// encoded differently; malformed files are ErrFormat.
func TestParseRejects(t *testing.T) {
	cases := []struct {
		name  string
		edit  func(m map[string]any)
		want  error
		names string
	}{
		{"WordPiece", func(m map[string]any) { model(m)["type"] = "WordPiece" }, tokenizer.ErrUnsupported, "WordPiece"},
		{"Unigram", func(m map[string]any) { model(m)["type"] = "Unigram" }, tokenizer.ErrUnsupported, "Unigram"},
		{"Metaspace", func(m map[string]any) { m["pre_tokenizer"] = map[string]any{"type": "Metaspace", "replacement": "▁"} }, tokenizer.ErrUnsupported, "Metaspace"},
		{"no pre-tokenizer", func(m map[string]any) { m["pre_tokenizer"] = nil }, tokenizer.ErrUnsupported, "ByteLevel"},
		{"NFC", func(m map[string]any) { m["normalizer"] = map[string]any{"type": "NFC"} }, tokenizer.ErrUnsupported, "NFC"},
		{"other regex", func(m map[string]any) {
			m["pre_tokenizer"] = map[string]any{"type": "Sequence", "pretokenizers": []any{
				map[string]any{"type": "Split", "pattern": map[string]any{"Regex": `\w+|\s+`}, "behavior": "Isolated", "invert": false},
				map[string]any{"type": "ByteLevel", "add_prefix_space": false, "use_regex": false}}}
		}, tokenizer.ErrUnsupported, `\\w+|\\s+`},
		{"split removed", func(m map[string]any) {
			m["pre_tokenizer"] = map[string]any{"type": "Sequence", "pretokenizers": []any{
				map[string]any{"type": "Split", "pattern": map[string]any{"Regex": `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`}, "behavior": "Removed", "invert": false},
				map[string]any{"type": "ByteLevel", "use_regex": false}}}
		}, tokenizer.ErrUnsupported, "Removed"},
		{"after ByteLevel", func(m map[string]any) {
			m["pre_tokenizer"] = map[string]any{"type": "Sequence", "pretokenizers": []any{
				map[string]any{"type": "ByteLevel"}, map[string]any{"type": "Digits"}}}
		}, tokenizer.ErrUnsupported, "Digits"},
		{"WordPiece decoder", func(m map[string]any) { m["decoder"] = map[string]any{"type": "WordPiece"} }, tokenizer.ErrUnsupported, "WordPiece"},
		{"Roberta post-processor", func(m map[string]any) { m["post_processor"] = map[string]any{"type": "RobertaProcessing"} }, tokenizer.ErrUnsupported, "RobertaProcessing"},
		{"truncation", func(m map[string]any) { m["truncation"] = map[string]any{"max_length": 8} }, tokenizer.ErrUnsupported, "truncation"},
		{"padding", func(m map[string]any) { m["padding"] = map[string]any{"length": 8} }, tokenizer.ErrUnsupported, "padding"},
		{"dropout", func(m map[string]any) { model(m)["dropout"] = 0.1 }, tokenizer.ErrUnsupported, "dropout"},
		{"subword prefix", func(m map[string]any) { model(m)["continuing_subword_prefix"] = "##" }, tokenizer.ErrUnsupported, "##"},
		{"merge outside the vocabulary", func(m map[string]any) {
			model(m)["merges"] = append(model(m)["merges"].([]any), []any{"Ġ", "☃"})
		}, tokenizer.ErrFormat, "☃"},
		{"three-part merge", func(m map[string]any) { model(m)["merges"] = []any{"a b c"} }, tokenizer.ErrFormat, "a b c"},
		{"merge not a pair", func(m map[string]any) { model(m)["merges"] = []any{[]any{"a"}} }, tokenizer.ErrFormat, "merge 0"},
		{"duplicate id", func(m map[string]any) { model(m)["vocab"].(map[string]any)["dup"] = 5.0 }, tokenizer.ErrFormat, "share id 5"},
		{"negative id", func(m map[string]any) { model(m)["vocab"].(map[string]any)["neg"] = -1.0 }, tokenizer.ErrFormat, "-1"},
		{"unk not in vocab", func(m map[string]any) { model(m)["unk_token"] = "<unk>" }, tokenizer.ErrFormat, "<unk>"},
		{"added token stealing an id", func(m map[string]any) {
			m["added_tokens"] = []any{map[string]any{"id": 3.0, "content": "<x>", "special": true}}
		}, tokenizer.ErrFormat, "<x>"},
		{"template of an undefined token", func(m map[string]any) {
			m["post_processor"] = map[string]any{"type": "TemplateProcessing", "single": []any{map[string]any{"SpecialToken": map[string]any{"id": "<s>"}}}, "special_tokens": map[string]any{}}
		}, tokenizer.ErrFormat, "<s>"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := tokenizer.Parse(variant(t, c.edit))
			require.ErrorIs(t, err, c.want)
			assert.Contains(t, err.Error(), c.names)
		})
	}
	_, err := tokenizer.Parse([]byte("{"))
	assert.ErrorIs(t, err, tokenizer.ErrFormat)
	_, err = tokenizer.Parse(make([]byte, tokenizer.MaxFileBytes+1))
	assert.ErrorIs(t, err, tokenizer.ErrTooLarge)
}

func TestLoadHostileFiles(t *testing.T) {
	dir := t.TempDir()
	fifo := filepath.Join(dir, "tokenizer.json")
	require.NoError(t, syscall.Mkfifo(fifo, 0o644))
	link := filepath.Join(dir, "zero.json")
	require.NoError(t, os.Symlink("/dev/zero", link))
	for _, p := range []string{fifo, link, dir} {
		_, err := tokenizer.Load(p)
		assert.ErrorIs(t, err, tokenizer.ErrNotRegular, p)
	}
	_, err := tokenizer.Load(filepath.Join(dir, "absent.json"))
	assert.ErrorIs(t, err, os.ErrNotExist)
}

func TestEncodeDecodeErrors(t *testing.T) {
	tok := load(t, "gpt2-style.json")
	_, err := tok.Encode("ok \xff", false)
	assert.ErrorIs(t, err, tokenizer.ErrFormat)
	_, err = tok.Decode([]int{5, tok.VocabSize()}, false)
	assert.ErrorIs(t, err, tokenizer.ErrFormat)
	_, err = tok.Decode([]int{-1}, false)
	assert.ErrorIs(t, err, tokenizer.ErrFormat)
}

func TestSpecialTokens(t *testing.T) {
	tok := load(t, "llama3-style.json")
	assert.Equal(t, 2003, tok.VocabSize())
	bos, ok := tok.TokenID("<|begin_of_text|>")
	require.True(t, ok)
	assert.Equal(t, 2000, bos)
	s, ok := tok.Token(2001)
	require.True(t, ok)
	assert.Equal(t, "<|end_of_text|>", s)
	ids, err := tok.Encode("hi<|end_of_text|>", true)
	require.NoError(t, err)
	assert.Equal(t, 2000, ids[0])
	assert.Equal(t, 2001, ids[len(ids)-1])
	text, err := tok.Decode(ids, true)
	require.NoError(t, err)
	assert.Equal(t, "hi", text, "special tokens skipped")
	text, err = tok.Decode(ids, false)
	require.NoError(t, err)
	assert.Equal(t, "<|begin_of_text|>hi<|end_of_text|>", text)
}
