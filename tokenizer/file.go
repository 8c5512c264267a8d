package tokenizer

import (
	"errors"
	"fmt"

	"github.com/batchfit/batchfit/internal/safefile"
)

// readBounded reads a regular file of at most MaxFileBytes; a longer one
// is ErrTooLarge.
func readBounded(path string) ([]byte, error) {
	b, err := safefile.ReadAll(path, MaxFileBytes)
	if errors.Is(err, safefile.ErrTooLarge) {
		err = fmt.Errorf("%w: %w", ErrTooLarge, err)
	}
	return b, err
}
