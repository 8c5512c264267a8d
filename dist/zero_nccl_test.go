package dist_test

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/dist"
	"github.com/batchfit/batchfit/exec/cuda"
	"github.com/batchfit/batchfit/internal/testutil"
	"github.com/batchfit/batchfit/optim"
)

const zeroNCCLChildEnv = "BATCHFIT_ZERO_NCCL_CHILD" // the directory a child rank writes its result to

// On one GPU: a CUDA session refuses ZeRO stage 3 (its parameters are
// uploaded once, so host gathers would not reach them), before anything
// runs.
func TestZeRO3RefusedOnCUDA(t *testing.T) {
	d, err := cuda.Open(cuda.Options{})
	testutil.SkipWithoutGPU(t, err, cuda.ErrNoGPU)
	require.NoError(t, d.Close())
	c := dist.NewLocal(1, time.Second)[0]
	_, err = dist.New(c, dist.Options{Session: batchfit.Options{Device: batchfit.DeviceCUDA}, ZeRO: dist.ZeRO3})
	require.ErrorIs(t, err, dist.ErrZeRO)
}

// Two ranks on two GPUs as two processes over NCCL (its reduce-scatter
// and all-gather through the staging buffer), CUDA sessions, ZeRO stages
// 1 and 2 for 3 AdamW steps: the parameters agree with one CPU process
// over the same micro-batches within 1e-5 of each tensor's largest value
// (the GPU's float32 sums run in other orders than the CPU's). Needs a
// machine with 2 GPUs.
func TestNCCLTwoGPUZeRO(t *testing.T) {
	const world, n, hidden, steps, lr = 2, 96, 256, 3, 0.01
	if dir := os.Getenv(zeroNCCLChildEnv); dir != "" {
		zeroNCCLChild(t, dir, n, hidden, steps, lr)
		return
	}
	requireNCCL(t)
	if d, err := cuda.Open(cuda.Options{Ordinal: 1}); err != nil {
		t.Skipf("needs %d GPUs: %v", world, err)
	} else {
		require.NoError(t, d.Close())
	}
	xs, ys := childBatches(n, steps)
	_, ref := oneRank(t, world, n, hidden, steps, xs, ys, lr)
	for _, stage := range []int{dist.ZeRO1, dist.ZeRO2} {
		t.Run(fmt.Sprintf("stage=%d", stage), func(t *testing.T) {
			dir := t.TempDir()
			outs, errs := startRanks(t, "TestNCCLTwoGPUZeRO", world, zeroNCCLChildEnv+"="+dir, tcpStageEnv+"="+strconv.Itoa(stage))
			for r := range world {
				require.NoError(t, errs[r], "rank %d:\n%s", r, outs[r])
				b, err := os.ReadFile(filepath.Join(dir, fmt.Sprintf("rank%d.json", r)))
				require.NoError(t, err)
				var got [][]float32
				require.NoError(t, json.Unmarshal(b, &got))
				for i := range ref {
					closeTol(t, fmt.Sprintf("rank %d parameter %d", r, i), ref[i], got[i], 1e-5)
				}
			}
		})
	}
}

func zeroNCCLChild(t *testing.T, dir string, n, hidden, steps int, lr float64) {
	ctx := context.Background()
	env, err := dist.EnvFromOS()
	require.NoError(t, err)
	stage, err := strconv.Atoi(os.Getenv(tcpStageEnv))
	require.NoError(t, err)
	comm, err := dist.NewNCCL(ctx, env, dist.NCCLOptions{Timeout: time.Minute})
	require.NoError(t, err)
	defer comm.Close()
	t.Logf("rank %d: NCCL overhead %d B (reduce-scatter and all-gather warmed up at init)", env.Rank, comm.Overhead())
	tr, err := dist.New(comm, dist.Options{Session: batchfit.Options{Device: batchfit.DeviceCUDA}, ZeRO: stage})
	require.NoError(t, err)
	m := newWide(1+uint64(env.Rank), hidden)
	require.NoError(t, tr.BroadcastParams(ctx, m.params))
	xs, ys := childBatches(n, steps)
	opt := optim.NewAdamW(lr)
	for s := range steps {
		lo, hi, err := tr.Shard(n)
		require.NoError(t, err)
		_, err = tr.Step(ctx, n, m.loss(xs[s], ys[s], lo, hi), m.params, opt)
		require.NoError(t, err)
	}
	require.NoError(t, tr.Close()) // syncs the parameters to the host
	b, err := json.Marshal(m.data)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(filepath.Join(dir, fmt.Sprintf("rank%d.json", env.Rank)), b, 0o644))
}

// One GPU, one rank (the in-process communicator), ZeRO stages 1 and 2 on
// a CUDA session: the host path downloads the gradients, updates the
// rank's shard and the session uploads the parameters, so 3 AdamW steps
// agree with one CPU process within 1e-5 of each tensor's largest value.
func TestZeROOnCUDASession(t *testing.T) {
	d, err := cuda.Open(cuda.Options{})
	testutil.SkipWithoutGPU(t, err, cuda.ErrNoGPU)
	require.NoError(t, d.Close())
	const n, hidden, steps, lr = 32, 256, 3, 0.01
	xs, ys := childBatches(n, steps)
	_, ref := oneRank(t, 1, n, hidden, steps, xs, ys, lr)
	for _, stage := range []int{dist.ZeRO1, dist.ZeRO2} {
		ctx := context.Background()
		tr, err := dist.New(dist.NewLocal(1, time.Minute)[0], dist.Options{Session: batchfit.Options{Device: batchfit.DeviceCUDA}, ZeRO: stage})
		require.NoError(t, err)
		m, opt := newWide(1, hidden), optim.NewAdamW(lr)
		for s := range steps {
			_, err := tr.Step(ctx, n, m.loss(xs[s], ys[s], 0, n), m.params, opt)
			require.NoError(t, err, "stage %d step %d", stage, s)
		}
		require.NoError(t, tr.Close())
		for i := range ref {
			closeTol(t, fmt.Sprintf("stage %d parameter %d", stage, i), ref[i], m.data[i], 1e-5)
		}
	}
}
