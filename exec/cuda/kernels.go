// This file embeds the CUDA C sources of the kernels; kernels/README.md
// states each kernel's signature, launch configuration and layout
// preconditions.
package cuda

//go:generate go run ./internal/gen

import (
	"embed"
	"io/fs"
	"path"
	"regexp"
	"strings"
)

// Sources holds the kernel files (kernels/*.cu) and the headers they share
// (kernels/common.cuh, and kernels/opcodes.cuh, which go generate writes
// from the op codes of the family files; see OpcodeHeader).
//
//go:embed kernels/*.cu kernels/*.cuh
var Sources embed.FS

// localInclude matches a line that includes a header of kernels/.
var localInclude = regexp.MustCompile(`^\s*#include "([a-z0-9_]+\.cuh)"\s*$`)

// Source returns kernels/<name> (for example "reduce.cu") ready for NVRTC,
// which compiles without an include path: each line #include "x.cuh" is
// replaced by kernels/x.cuh's text, itself expanded the same way (the
// headers' guards make a repeated one harmless). An unknown name gives an
// error wrapping fs.ErrNotExist.
func Source(name string) (string, error) {
	src, err := fs.ReadFile(Sources, path.Join("kernels", name))
	if err != nil {
		return "", err
	}
	lines := strings.SplitAfter(string(src), "\n")
	for i, l := range lines {
		m := localInclude.FindStringSubmatch(l)
		if m == nil {
			continue
		}
		hdr, err := Source(m[1])
		if err != nil {
			return "", err
		}
		lines[i] = hdr
	}
	return strings.Join(lines, ""), nil
}

// Names lists the kernel files, one NVRTC module each, in lexical order.
func Names() []string {
	entries, _ := fs.Glob(Sources, "kernels/*.cu") // the pattern is valid
	names := make([]string, len(entries))
	for i, e := range entries {
		names[i] = path.Base(e)
	}
	return names
}
