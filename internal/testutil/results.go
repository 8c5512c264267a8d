package testutil

import (
	"errors"
	"math"
	"os"
	"testing"

	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"
)

// RequireGPUEnv, when set, makes GPU tests fail instead of skip, for runs
// on a machine known to have one (scripts/gpu-check run sets it).
const RequireGPUEnv = "BATCHFIT_REQUIRE_GPU"

// SkipWithoutGPU skips tb when err is noGPU (the executor's "no GPU"
// error, exec/cuda.ErrNoGPU), or fails it when RequireGPUEnv is set; any
// other error fails it.
func SkipWithoutGPU(tb testing.TB, err, noGPU error) {
	tb.Helper()
	if errors.Is(err, noGPU) {
		if os.Getenv(RequireGPUEnv) != "" {
			tb.Fatalf("%s is set: %v", RequireGPUEnv, err)
		}
		tb.Skipf("no GPU: %v", err)
	}
	require.NoError(tb, err)
}

// Float32s is the data of a float32 tensor, a scalar's included.
func Float32s(t testing.TB, d *tensor.Dense) []float32 {
	t.Helper()
	switch v := d.Data().(type) {
	case float32:
		return []float32{v}
	case []float32:
		return v
	}
	t.Fatalf("output holds %T", d.Data())
	return nil
}

// Bits is the IEEE 754 bits of every value, for comparisons bit for bit.
func Bits(d []float32) []uint32 {
	b := make([]uint32, len(d))
	for i, x := range d {
		b[i] = math.Float32bits(x)
	}
	return b
}
