package dist_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/checkpoint"
	"github.com/batchfit/batchfit/dist"
	"github.com/batchfit/batchfit/optim"
)

// world runs fn on every rank of an in-process world of size ranks and
// returns the first error.
func world(t *testing.T, size int, fn func(r int, c dist.Communicator) error) {
	t.Helper()
	comms := dist.NewLocal(size, 10*time.Second)
	errs := make([]error, size)
	var wg sync.WaitGroup
	for r := range size {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[r] = fn(r, comms[r])
		}()
	}
	wg.Wait()
	for r, err := range errs {
		require.NoError(t, err, "rank %d of %d", r, size)
	}
}

// flatState is the optimizer's state of every rank's pieces laid out
// flat, one slice per slot: the whole state, whatever the world size.
func flatState(l *dist.Layout, rank int, opt optim.Optimizer, m *model, into [][]float32) {
	lo, hi := l.Shard(rank)
	for _, pc := range l.Pieces(lo, hi) {
		st := opt.State(dist.ShardKey{Key: m.params[pc.Param].Value(), Lo: pc.Lo})
		for i, s := range st {
			copy(into[i][pc.Flat:], s)
		}
	}
}

// A sharded checkpoint saved by one world size and loaded by another
// (2 → 4 and 4 → 2) under every stage: right after the load every rank
// holds the saved parameters and, laid out flat, the saved optimizer
// state bit for bit; three more AdamW steps of the new world then agree
// with three more of the old one within 1e-6 of each tensor's largest
// value (the new world splits each batch differently, so its float32
// gradient sums run in another order).
func TestShardedCheckpointReshards(t *testing.T) {
	const n, hidden, before, after, lr = 12, 16, 3, 3, 0.01
	rng := rand.New(rand.NewPCG(13, 14))
	var xs [][]float32
	var ys [][]int64
	for range before + after {
		x, y := batch(rng, n)
		xs, ys = append(xs, x), append(ys, y)
	}
	for _, stage := range []int{dist.ZeRO1, dist.ZeRO2, dist.ZeRO3} {
		for _, sizes := range [][2]int{{2, 4}, {4, 2}} {
			from, to := sizes[0], sizes[1]
			t.Run(fmt.Sprintf("stage=%d/%d→%d", stage, from, to), func(t *testing.T) {
				ctx := context.Background()
				dir := t.TempDir()
				opts := dist.Options{Session: batchfit.Options{Device: batchfit.DeviceCPU}, BucketBytes: 200, ZeRO: stage}
				var savedParams [][]float32
				var savedState [][]float32
				var mu sync.Mutex
				final := make([][][]float32, 2) // the old and the new world's parameters at the end
				steps := func(tr *dist.Trainer, m *model, opt optim.Optimizer, s0, s1 int) error {
					for s := s0; s < s1; s++ {
						lo, hi, err := tr.Shard(n)
						if err != nil {
							return err
						}
						if _, err := tr.Step(ctx, n, m.loss(xs[s], ys[s], lo, hi), m.params, opt); err != nil {
							return err
						}
					}
					return tr.GatherParams(ctx, m.params)
				}
				world(t, from, func(r int, c dist.Communicator) error {
					tr, err := dist.New(c, opts)
					if err != nil {
						return err
					}
					defer tr.Close()
					m, opt := newWide(1, hidden), optim.NewAdamW(lr)
					if err := steps(tr, m, opt, 0, before); err != nil {
						return err
					}
					path, err := tr.SaveSharded(ctx, dir, before, m.params, opt, map[string]string{"run": "reshard"})
					if err != nil {
						return err
					}
					if filepath.Base(path) != fmt.Sprintf("ckpt-%08d", before) {
						return fmt.Errorf("rank %d: saved at %s", r, path)
					}
					l := tr.Layout()
					mu.Lock()
					if savedParams == nil {
						savedParams = make([][]float32, len(m.data))
						for i, d := range m.data {
							savedParams[i] = slices.Clone(d)
						}
						savedState = [][]float32{make([]float32, l.Total), make([]float32, l.Total)}
					}
					flatState(l, r, opt, m, savedState)
					mu.Unlock()
					if err := steps(tr, m, opt, before, before+after); err != nil {
						return err
					}
					if r == 0 {
						final[0] = m.data
					}
					return nil
				})

				loadedState := [][]float32{make([]float32, len(savedState[0])), make([]float32, len(savedState[0]))}
				world(t, to, func(r int, c dist.Communicator) error {
					tr, err := dist.New(c, opts)
					if err != nil {
						return err
					}
					defer tr.Close()
					m, opt := newWide(7+uint64(r), hidden), optim.NewAdamW(lr) // other parameters: all must come from the checkpoint
					step, meta, err := tr.LoadSharded(dir, m.params, opt)
					if err != nil {
						return err
					}
					if step != before || meta["run"] != "reshard" || opt.Steps() != before {
						return fmt.Errorf("rank %d: step %d, meta %v, optimizer steps %d", r, step, meta, opt.Steps())
					}
					for i := range m.data {
						if !slices.Equal(savedParams[i], m.data[i]) {
							return fmt.Errorf("rank %d: parameter %d is not the saved one", r, i)
						}
					}
					mu.Lock()
					flatState(tr.Layout(), r, opt, m, loadedState)
					mu.Unlock()
					if err := steps(tr, m, opt, before, before+after); err != nil {
						return err
					}
					if r == to-1 {
						final[1] = m.data
					}
					return nil
				})
				require.Equal(t, savedState, loadedState, "the optimizer's state, laid out flat, bit for bit")
				for i := range final[0] {
					close32(t, fmt.Sprintf("parameter %d after %d more steps", i, after), final[0][i], final[1][i])
				}
			})
		}
	}
}

// A shard file changed after the save is ErrChecksum on load, another
// model's parameters ErrMismatch, and neither changes the training.
func TestShardedCheckpointRefuses(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	x, y := batch(rand.New(rand.NewPCG(2, 2)), 4)
	opts := dist.Options{Session: batchfit.Options{Device: batchfit.DeviceCPU}, ZeRO: dist.ZeRO2}
	world(t, 2, func(r int, c dist.Communicator) error {
		tr, err := dist.New(c, opts)
		if err != nil {
			return err
		}
		defer tr.Close()
		m, opt := newModel(1), optim.NewAdamW(0.01)
		lo, hi, _ := tr.Shard(4)
		if _, err := tr.Step(ctx, 4, m.loss(x, y, lo, hi), m.params, opt); err != nil {
			return err
		}
		_, err = tr.SaveSharded(ctx, dir, 1, m.params, opt, nil)
		return err
	})
	path, err := checkpoint.Latest(dir)
	require.NoError(t, err)
	s, err := checkpoint.OpenSharded(path)
	require.NoError(t, err)
	require.Equal(t, 2, s.Manifest.World)
	require.NoError(t, s.Close())
	_, err = checkpoint.Verify(path)
	require.ErrorIs(t, err, checkpoint.ErrVersion, "a whole-model checkpoint's reader refuses a sharded one")

	c := dist.NewLocal(1, time.Second)[0]
	other := newWide(1, 8) // another hidden width
	tw, err := dist.New(c, opts)
	require.NoError(t, err)
	defer tw.Close()
	before := slices.Clone(other.data[0])
	_, _, err = tw.LoadSharded(path, other.params, optim.NewAdamW(0.01))
	require.ErrorIs(t, err, checkpoint.ErrMismatch)
	require.Equal(t, before, other.data[0])
	_, _, err = tw.LoadSharded(path, newModel(1).params, optim.NewSGD(0.1, 0.9))
	require.ErrorIs(t, err, checkpoint.ErrMismatch, "another optimizer")

	f := filepath.Join(path, checkpoint.ShardFileName(1, 2))
	b, err := os.ReadFile(f)
	require.NoError(t, err)
	b[len(b)-1] ^= 0x40
	require.NoError(t, os.WriteFile(f, b, 0o644))
	m := newModel(1)
	before = slices.Clone(m.data[0])
	_, _, err = tw.LoadSharded(path, m.params, optim.NewAdamW(0.01))
	require.ErrorIs(t, err, checkpoint.ErrChecksum)
	require.Equal(t, before, m.data[0])
}
