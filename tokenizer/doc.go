// Package tokenizer encodes and decodes text with a Hugging Face
// tokenizer.json of the byte-level BPE kind GPT-2, Llama 3 and Qwen2 use,
// giving the ids Hugging Face's tokenizers gives (held to on 12,034 test
// strings for a GPT-2-style and a Llama-3-style tokenizer).
//
// The pipeline is tokenizers': added tokens are split out first
// (leftmost-longest, with their lstrip, rstrip and single_word options;
// special tokens before normalized ones); the rest goes through the
// pre-tokenizers (a Split with a known regex, then ByteLevel, optionally
// with its own GPT-2 regex and prefix space); each piece is mapped to the
// byte-level alphabet and merged by the BPE model (ignore_merges,
// unk_token, fuse_unk and byte_fallback honoured); a TemplateProcessing
// post-processor adds Llama 3's <|begin_of_text|> when asked. Decode maps
// tokens back to bytes with the ByteLevel decoder and replaces invalid
// UTF-8 as Rust's from_utf8_lossy does.
//
// The pre-tokenizer regexes use a lookahead (\s+(?!\S)) Go's regexp lacks,
// so the GPT-2, Llama 3 and Qwen2 patterns are matched by hand (split.go),
// alternative by alternative; any other pattern is refused. Merging keeps
// a priority queue of adjacent pairs by merge rank, O(n log n) in a
// piece's length, and caches the ids of short pieces (BenchmarkEncode
// reports MB/s).
//
// Anything else tokenizers can do (WordPiece, Unigram or WordLevel
// models, normalizers, Metaspace and other pre-tokenizers, other decoders
// and post-processors, BPE dropout, truncation or padding set in the file)
// is refused with ErrUnsupported naming it, never encoded differently.
// Files are bounded (MaxFileBytes, vocabulary size) and must be regular.
//
// The testdata tokenizers were trained with tokenizers 0.23 on a generated
// corpus, and the ids of cases.jsonl.gz computed with it, by the
// repository's scripts/make-reference-data.py.
package tokenizer
