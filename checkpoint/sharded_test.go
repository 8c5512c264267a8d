package checkpoint_test

import (
	"bytes"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit/checkpoint"
)

// Three shards of 4 over 10 values: any flat range reads back across the
// shard boundaries (the padding as zeros); a range outside the padded
// space is ErrMismatch; an edited manifest is ErrChecksum and a shortened
// shard ErrTruncated.
func TestShardedReadAcrossShards(t *testing.T) {
	dir := t.TempDir()
	const world, shard, total = 3, 4, 10
	tmp, err := checkpoint.PrepareShards(dir, 5)
	require.NoError(t, err)
	flat := make([]float32, world*shard)
	for i := range total {
		flat[i] = float32(i) + 0.25
	}
	for r := range world {
		p := flat[r*shard : (r+1)*shard]
		m := make([]float32, shard)
		for i := range m {
			m[i] = -p[i]
		}
		require.NoError(t, checkpoint.WriteShard(tmp, r, world, p, []string{"exp_avg"}, [][]float32{m}))
	}
	m := &checkpoint.ShardedManifest{Step: 5, World: world, ShardLen: shard, Total: total, Optimizer: "adam", Steps: 5,
		Slots: []string{"exp_avg"}, Params: []checkpoint.FlatParam{{Name: "w", Shape: []int{2, 3}}, {Name: "b", Shape: []int{4}, Offset: 6}}}
	path, err := checkpoint.CommitShards(dir, tmp, m, 0)
	require.NoError(t, err)
	require.Equal(t, filepath.Join(dir, "ckpt-00000005"), path)

	s, err := checkpoint.OpenSharded(dir)
	require.NoError(t, err)
	got := make([]float32, 9)
	require.NoError(t, s.Read(checkpoint.ShardParams, 2, got))
	require.Equal(t, flat[2:11], got)
	require.NoError(t, s.Read("exp_avg", 3, got[:2]))
	require.Equal(t, []float32{-3.25, -4.25}, got[:2])
	require.ErrorIs(t, s.Read(checkpoint.ShardParams, 8, make([]float32, 5)), checkpoint.ErrMismatch)
	require.ErrorIs(t, s.Read("exp_avg_sq", 0, got), checkpoint.ErrMismatch)
	require.NoError(t, s.Close())

	man := filepath.Join(path, checkpoint.ManifestFile)
	b, err := os.ReadFile(man)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(man, bytes.Replace(b, []byte(`"step": 5`), []byte(`"step": 6`), 1), 0o644))
	_, err = checkpoint.OpenSharded(path)
	require.ErrorIs(t, err, checkpoint.ErrChecksum)
	require.NoError(t, os.WriteFile(man, b, 0o644))

	f := filepath.Join(path, checkpoint.ShardFileName(2, world))
	fb, err := os.ReadFile(f)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(f, fb[:len(fb)-4], 0o644))
	_, err = checkpoint.OpenSharded(path)
	require.ErrorIs(t, err, checkpoint.ErrTruncated)
}
