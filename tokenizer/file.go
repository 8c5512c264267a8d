package tokenizer

import "github.com/batchfit/batchfit/internal/safefile"

func readBounded(path string) ([]byte, error) {
	return safefile.ReadFile(path, MaxFileBytes, ErrTooLarge)
}
