package safefile_test

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/batchfit/batchfit/internal/safefile"
)

func Example() {
	dir, _ := os.MkdirTemp("", "safefile")
	defer os.RemoveAll(dir)
	p := filepath.Join(dir, "profile.json")
	_ = os.WriteFile(p, []byte(`{"name":"x"}`), 0o644)
	data, err := safefile.ReadAll(p, 64<<10)
	fmt.Println(string(data), err)
	_, err = safefile.ReadAll(p, 4)
	fmt.Println(errors.Is(err, safefile.ErrTooLarge))
	_, err = safefile.ReadAll("/dev/zero", 64<<10)
	fmt.Println(errors.Is(err, safefile.ErrNotRegular))
	// Output:
	// {"name":"x"} <nil>
	// true
	// true
}
