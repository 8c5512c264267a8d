// This file embeds the CUDA C sources of the kernels; kernels/README.md
// states each kernel's signature, launch configuration and layout
// preconditions.
package cuda

import (
	"embed"
	"io/fs"
	"path"
	"strings"
)

// Sources holds the kernel files (kernels/*.cu) and the header they share
// (kernels/common.cuh).
//
//go:embed kernels/*.cu kernels/*.cuh
var Sources embed.FS

// commonInclude is the line by which a kernel file includes the shared
// header.
const commonInclude = `#include "common.cuh"`

// Source returns kernels/<name> (for example "reduce.cu") ready for NVRTC,
// which compiles without an include path: the line #include "common.cuh" is
// replaced by the header's text. An unknown name gives an error wrapping
// fs.ErrNotExist.
func Source(name string) (string, error) {
	src, err := fs.ReadFile(Sources, path.Join("kernels", name))
	if err != nil {
		return "", err
	}
	lines := strings.SplitAfter(string(src), "\n")
	for i, l := range lines {
		if strings.TrimSpace(l) != commonInclude {
			continue
		}
		hdr, err := fs.ReadFile(Sources, "kernels/common.cuh")
		if err != nil {
			return "", err
		}
		lines[i] = string(hdr)
		break
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
