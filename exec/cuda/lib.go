package cuda

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"unsafe"

	"github.com/ebitengine/purego"
)

// dlopen loads the first of names that the dynamic linker finds, then tries
// each name under the usual CUDA install directories.
func dlopen(names ...string) (uintptr, error) {
	var errs []string
	try := func(path string) uintptr {
		h, err := purego.Dlopen(path, purego.RTLD_NOW|purego.RTLD_GLOBAL)
		if err != nil {
			errs = append(errs, err.Error())
			return 0
		}
		return h
	}
	for _, n := range names {
		if h := try(n); h != 0 {
			return h, nil
		}
	}
	var dirs []string
	for _, env := range []string{"CUDA_HOME", "CUDA_PATH"} {
		if d := os.Getenv(env); d != "" {
			dirs = append(dirs, filepath.Join(d, "lib64"))
		}
	}
	dirs = append(dirs, "/usr/local/cuda/lib64", "/usr/local/cuda/targets/x86_64-linux/lib")
	for _, d := range dirs {
		for _, n := range names {
			p := filepath.Join(d, n)
			if _, err := os.Stat(p); err != nil {
				continue
			}
			if h := try(p); h != 0 {
				return h, nil
			}
		}
	}
	return 0, errors.New(strings.Join(errs, "; "))
}

// symbol is one C function to bind: fptr points at a Go func variable, and
// the first of names that the library exports is used.
type symbol struct {
	fptr  any
	names []string
}

func sym(fptr any, names ...string) symbol { return symbol{fptr, names} }

// bind resolves every symbol, or fails naming the first one missing.
// purego.RegisterLibFunc would panic on a missing symbol instead.
func bind(lib uintptr, syms []symbol) error {
	for _, s := range syms {
		var addr uintptr
		for _, n := range s.names {
			if a, err := purego.Dlsym(lib, n); err == nil {
				addr = a
				break
			}
		}
		if addr == 0 {
			return fmt.Errorf("missing symbol %s", s.names[0])
		}
		purego.RegisterFunc(s.fptr, addr)
	}
	return nil
}

// goString copies a NUL-terminated C string.
func goString(p *byte) string {
	if p == nil {
		return ""
	}
	n := 0
	for *(*byte)(unsafe.Add(unsafe.Pointer(p), n)) != 0 {
		n++
	}
	return string(unsafe.Slice(p, n))
}

// cString returns s as a NUL-terminated byte slice.
func cString(s string) []byte {
	b := make([]byte, len(s)+1)
	copy(b, s)
	return b
}
