package tokenizer

import (
	"errors"

	"github.com/batchfit/batchfit/internal/safefile"
)

// Errors wrap one of these; test with errors.Is.
var (
	// ErrFormat: tokenizer.json is not valid (bad JSON, a merge of tokens
	// the vocabulary lacks, duplicate ids), or an id to decode is out of
	// range, or text to encode is not UTF-8.
	ErrFormat = errors.New("tokenizer: invalid")
	// ErrUnsupported: a component this package does not implement (a
	// WordPiece or Unigram model, a normalizer, a Metaspace
	// pre-tokenizer, an unknown split pattern, truncation or padding): it
	// is refused by name rather than encoded differently.
	ErrUnsupported = errors.New("tokenizer: unsupported")
	// ErrTooLarge: a file or vocabulary beyond this package's bounds.
	ErrTooLarge = errors.New("tokenizer: too large")
	// ErrNotRegular: the path is not a regular file.
	ErrNotRegular = safefile.ErrNotRegular
)
