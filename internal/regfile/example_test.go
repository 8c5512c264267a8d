package regfile_test

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/batchfit/batchfit/internal/regfile"
)

func Example() {
	dir, _ := os.MkdirTemp("", "regfile")
	defer os.RemoveAll(dir)
	p := filepath.Join(dir, "profile.json")
	_ = os.WriteFile(p, []byte(`{"name":"x"}`), 0o644)
	data, err := regfile.ReadAll(p, 64<<10)
	fmt.Println(string(data), err)
	_, err = regfile.ReadAll(p, 4)
	fmt.Println(errors.Is(err, regfile.ErrTooLarge))
	_, err = regfile.ReadAll("/dev/zero", 64<<10)
	fmt.Println(errors.Is(err, regfile.ErrNotRegular))
	// Output:
	// {"name":"x"} <nil>
	// true
	// true
}
