package cuda

import (
	"fmt"
	"os/exec"
	"path/filepath"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestKernelPartsCoverTheirFiles: each file of kernelParts, preprocessed
// once per part with BATCHFIT_PART defined (g++ -E, scripts/cuda-emu/run
// parts), instantiates every kernel of the whole file in exactly one part,
// so each kernel kernelFiles names is in one of the file's modules. Needs
// g++ and bash; skipped without them.
func TestKernelPartsCoverTheirFiles(t *testing.T) {
	for _, tool := range []string{"g++", "bash"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("no %s: the check preprocesses the kernel files with it", tool)
		}
	}
	var specs []string
	for file, n := range kernelParts {
		require.Contains(t, kernelFiles, file)
		specs = append(specs, fmt.Sprintf("%s:%d", file, n))
	}
	slices.Sort(specs)
	cmd := exec.Command("bash", append([]string{filepath.Join("..", "..", "scripts", "cuda-emu", "run"), "parts"}, specs...)...)
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "%s", out)
	t.Logf("%s", out)
}
