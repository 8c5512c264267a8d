package dist

import (
	"fmt"

	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/optim"
	"github.com/batchfit/batchfit/planner"
)

// ZeROPlanOptions configures PlanZeRO.
type ZeROPlanOptions struct {
	// Stage is the ZeRO stage (ZeROOff plans a replicated rank).
	Stage int
	// Ranks is the world size.
	Ranks int
	// BucketBytes is the gradient bucket (DefaultBucketBytes if 0).
	BucketBytes int64
	// Overhead is the communicator's memory outside every allocator
	// (Communicator.Overhead, measured at init): taken out of the budget,
	// as New takes it out of a rank's session.
	Overhead int64
	// Planner are the rank's planner options; Budget is the rank's whole
	// device budget, Overhead included.
	Planner planner.Options
}

// RankPlan is one rank's plan of a step under ZeRO: every rank's is the
// same (the flat shards are padded to equal lengths), and each rank runs
// the step's program over its own part of the batch.
type RankPlan struct {
	// Plan is the rank's plan, made within Budget − Overhead through the
	// allocator replay of Program.
	Plan *planner.Plan
	// Program is the rank's sharded program (planner.Shard), or the step's
	// own for ZeROOff.
	Program *planner.Program
	// Bytes is what the rank holds per kind (zero for ZeROOff).
	Bytes planner.ShardBytes
	// Overhead is the communicator's memory the plan was made beside.
	Overhead int64
}

// Peak is what the rank's device holds at its peak: the plan's peak
// reserved bytes and the communicator's overhead.
func (r *RankPlan) Peak() int64 { return r.Plan.PeakReserved + r.Overhead }

// PlanZeRO plans one rank of sharded data parallel: p is the rank's
// training step (a Session's StepPlan.Program, built at the rank's batch),
// sharded by planner.Shard and planned by planner.Make within the budget
// less the communicator's overhead. The plan counts the rank's parameter,
// gradient and state shards, the gradient bucket and the gathered
// parameters (stage 3) in the schedule's own order, through the same
// allocator replay as every plan; what a DeepSpeed-style estimate leaves
// out (activations, workspaces, the allocator's rounding and cache) is
// in it too.
//
// The sharded program is a plan: the Trainer's ZeRO steps run the sums,
// the update and the gathers on host copies (see Trainer.Step), so on a
// CUDA device a rank holds what its session's own plan says, not this.
func PlanZeRO(p *planner.Program, o ZeROPlanOptions) (*RankPlan, error) {
	if o.Ranks < 1 {
		return nil, fmt.Errorf("%w: %d ranks", ErrZeRO, o.Ranks)
	}
	po := o.Planner
	if o.Overhead < 0 || o.Overhead >= po.Budget {
		return nil, fmt.Errorf("%w: budget %d B leaves nothing beside the communicator's %d B", planner.ErrBudget, po.Budget, o.Overhead)
	}
	po.Budget -= o.Overhead
	rp := &RankPlan{Program: p, Overhead: o.Overhead}
	if o.Stage != ZeROOff {
		q, sb, err := planner.Shard(p, planner.ShardOptions{Stage: o.Stage, Ranks: o.Ranks, BucketBytes: o.BucketBytes})
		if err != nil {
			return nil, fmt.Errorf("%w: %w", ErrZeRO, err)
		}
		rp.Program, rp.Bytes = q, sb
	}
	pl, err := planner.Make(rp.Program, po)
	if err != nil {
		return rp, err
	}
	rp.Plan = pl
	return rp, nil
}

// PlanRank plans this rank's step of loss (its shard of the batch, as for
// Step) under the trainer's ZeRO stage and world size: the session's
// compiled step (Session.Plan) sharded by PlanZeRO, within budget (the
// rank's whole device budget) less the communicator's Overhead, with the
// session's micro-batch cap. It runs nothing. Under ZeROOff it is the
// replicated rank's plan.
func (t *Trainer) PlanRank(loss *lazy.Tensor, params []*lazy.Tensor, opt optim.Optimizer, budget int64) (*RankPlan, error) {
	sp, err := t.sess.Plan(loss, params, opt)
	if sp == nil {
		return nil, err
	} // a step that does not fit replicated may fit sharded
	return PlanZeRO(sp.Program, ZeROPlanOptions{Stage: t.z.stage, Ranks: t.comm.Size(), BucketBytes: t.opts.BucketBytes,
		Overhead: t.comm.Overhead(), Planner: planner.Options{Budget: budget, NoHeadroom: true, NoChunkList: true, MaxChunk: t.opts.Session.MaxChunk}})
}
