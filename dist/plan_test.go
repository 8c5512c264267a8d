package dist_test

import (
	"math/rand/v2"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/dist"
	"github.com/batchfit/batchfit/optim"
	"github.com/batchfit/batchfit/planner"
)

// One rank's plan under each ZeRO stage, of the CPU session's own
// training program: the shards are ⌈T/N⌉ elements (T the parameters'
// elements), the plan's persistent bytes are exactly the shards, the
// bucket and what is not sharded, each stage holds less at its peak than
// the one before on this model (two samples: parameters and gradients
// outweigh activations), and over one rank stage 1's persistent
// bytes are the unsharded program's.
func TestPlanZeRO(t *testing.T) {
	const n, hidden, ranks = 2, 16384, 4
	m := newWide(1, hidden)
	x, y := batch(rand.New(rand.NewPCG(1, 1)), n)
	sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU})
	defer sess.Close()
	sp, err := sess.Plan(m.loss(x, y, 0, n), m.params, optim.NewAdamW(0.01))
	require.NoError(t, err)
	total := int64(0)
	for _, d := range m.data {
		total += int64(len(d))
	}
	shard := (total + ranks - 1) / ranks
	po := planner.Options{Budget: 1 << 30, NoHeadroom: true, NoChunkList: true}

	off, err := dist.PlanZeRO(sp.Program, dist.ZeROPlanOptions{Ranks: ranks, Planner: po})
	require.NoError(t, err)
	require.Equal(t, sp.Plan.PeakReserved, off.Plan.PeakReserved, "stage 0 is the session's own plan")
	prev := off.Plan.PeakAllocated
	for stage := dist.ZeRO1; stage <= dist.ZeRO3; stage++ {
		rp, err := dist.PlanZeRO(sp.Program, dist.ZeROPlanOptions{Stage: stage, Ranks: ranks, BucketBytes: 1 << 16, Overhead: 1 << 20, Planner: po})
		require.NoError(t, err, "stage %d", stage)
		b := rp.Bytes
		require.Equal(t, shard, b.ShardLen)
		require.Equal(t, 2*4*shard, b.State, "stage %d: AdamW's moments, sharded", stage)
		wantParams, wantGrads, wantBucket := 4*total, int64(0), int64(0)
		if stage >= dist.ZeRO2 {
			wantGrads, wantBucket = 4*shard, 1<<16
		}
		if stage == dist.ZeRO3 {
			wantParams = 4 * shard
			// The first linear reads w1 and b1 at once, and w2's gather,
			// one ahead, is allocated when that read starts: the most held.
			require.Equal(t, int64(4*(hidden*nIn+hidden+nClasses*hidden)), b.Gather, "w1, b1 and w2 gathered at once")
		}
		require.Equal(t, wantParams, b.Params, "stage %d", stage)
		require.Equal(t, wantGrads, b.Grads, "stage %d", stage)
		require.Equal(t, wantBucket, b.Bucket, "stage %d", stage)
		require.Equal(t, b.Persistent(), rp.Plan.Persistent, "stage %d: the plan's persistent bytes", stage)
		require.Equal(t, po.Budget-1<<20, rp.Plan.Budget, "the communicator's overhead is out of the budget")
		require.Equal(t, rp.Plan.PeakReserved+1<<20, rp.Peak())
		require.Less(t, rp.Plan.PeakAllocated, prev, "stage %d holds less at its peak", stage)
		t.Logf("stage %d: peak reserved %d B, allocated %d B, persistent %d B", stage, rp.Plan.PeakReserved, rp.Plan.PeakAllocated, rp.Plan.Persistent)
		prev = rp.Plan.PeakAllocated
	}
	one, err := dist.PlanZeRO(sp.Program, dist.ZeROPlanOptions{Stage: dist.ZeRO1, Ranks: 1, Planner: po})
	require.NoError(t, err)
	require.Equal(t, sp.Plan.Persistent, one.Plan.Persistent, "over one rank the flat state is the state")

	_, err = dist.PlanZeRO(sp.Program, dist.ZeROPlanOptions{Stage: 4, Ranks: ranks, Planner: po})
	require.ErrorIs(t, err, dist.ErrZeRO)
	_, err = dist.PlanZeRO(sp.Program, dist.ZeROPlanOptions{Stage: 1, Ranks: ranks, Overhead: 2 << 30, Planner: po})
	require.ErrorIs(t, err, planner.ErrBudget)
}

// Trainer.PlanRank is PlanZeRO of the rank's own compiled step, at its
// stage and world size, with the communicator's overhead (0 for the
// in-process one) out of the budget.
func TestTrainerPlanRank(t *testing.T) {
	const n, hidden = 4, 4096
	m := newWide(1, hidden)
	comms := dist.NewLocal(2, time.Second)
	tr, err := dist.New(comms[0], dist.Options{Session: batchfit.Options{Device: batchfit.DeviceCPU}, ZeRO: dist.ZeRO3})
	require.NoError(t, err)
	defer tr.Close()
	x, y := batch(rand.New(rand.NewPCG(1, 1)), n)
	lo, hi, _ := tr.Shard(n)
	loss := m.loss(x, y, lo, hi)
	rp, err := tr.PlanRank(loss, m.params, optim.NewAdamW(0.01), 1<<30)
	require.NoError(t, err)
	sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU})
	defer sess.Close()
	sp, err := sess.Plan(loss, m.params, optim.NewAdamW(0.01))
	require.NoError(t, err)
	want, err := dist.PlanZeRO(sp.Program, dist.ZeROPlanOptions{Stage: dist.ZeRO3, Ranks: 2,
		Planner: planner.Options{Budget: 1 << 30, NoHeadroom: true, NoChunkList: true}})
	require.NoError(t, err)
	require.Equal(t, want.Bytes, rp.Bytes)
	require.Equal(t, want.Plan.PeakReserved, rp.Plan.PeakReserved)
	require.Less(t, rp.Plan.Persistent-rp.Bytes.Bucket, sp.Plan.Persistent, "sharded, the rank holds less beside the (25 MiB) bucket")
}
