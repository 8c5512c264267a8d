package batchfit

import (
	"errors"

	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/planner"
	"github.com/batchfit/batchfit/recompute"
)

// LeverChoice is one setting of the memory levers a Session chose among
// for a training step (StepPlan.Levers): the fused loss's token chunk,
// where the optimizer runs, the recompute set, and the batch chunks the
// planner picks for them, with the plan's exact peak and the cost
// model's predicted step time (recompute's roofline, Options.Profile).
// The session runs the setting with the shortest predicted step whose
// plan fits, or the loss chunk half its size when that one is predicted
// within LossChunkSlack of it and holds less; a tie goes to the one
// listed first (larger loss chunks, no offload).
type LeverChoice struct {
	// LossChunk is the fused loss's tokens per logits chunk; 0 for a step
	// without a fused loss.
	LossChunk int
	Offload   Offload // OffloadNone or OffloadOptimizer
	Recompute string  // the recompute strategy ("none", "selective", "blocks 8/16", …)
	// Plan is the plan of this setting; nil when it does not fit (Err
	// says why) or was Skipped.
	Plan *planner.Plan
	// Seconds is the predicted step time; 0 without a plan.
	Seconds float64
	// OffloadSeconds is the host's share of Seconds for an offloaded
	// optimizer (recompute.Profile.OffloadSeconds); 0 otherwise.
	OffloadSeconds float64
	Err            error
	// Skipped marks a setting not planned: one tried before it runs the
	// whole batch in one chunk recomputing nothing and the chunk half its
	// size was planned too, so this smaller one could only add launches.
	Skipped bool
	Chosen  bool
}

// SamplesPerSec is the predicted throughput, 0 without a plan.
func (c LeverChoice) SamplesPerSec() float64 {
	if c.Plan == nil || c.Seconds <= 0 {
		return 0
	}
	return float64(c.Plan.Batch) / c.Seconds
}

// profile is the cost model's device: Options.Profile, or
// recompute.DefaultProfile.
func (s *Session) profile() recompute.Profile {
	if s.opts.Profile.Bandwidth > 0 {
		return s.opts.Profile
	}
	return recompute.DefaultProfile()
}

// predicted is the cost model's step time of p run as pl plans it.
func (s *Session) predicted(p *planner.Program, pl *planner.Plan) (seconds, offload float64) {
	c := recompute.NewCost(p, s.profile(), s.opts.TF32 || s.policy.TF32())
	return c.Step(pl.Split), c.Offload
}

// LossChunkSlack is how much slower (a fraction of the fastest setting's
// predicted step) the fused-loss token chunk half the fastest's may be
// predicted and still run because its plan's peak is smaller. Half the
// chunk costs a few more launches, microseconds against a step's
// milliseconds and below what the cost model resolves; the memory it
// frees is exact. Only that one step down is taken: smaller chunks give
// the head's GEMMs fewer rows, where the roofline is least sure. The
// Llama-3.2-1B step at batch 4, seq 2048 holds 2.0 GiB less with 4,096
// tokens a chunk than with 8,192.
const LossChunkSlack = 0.005

// chooseLossChunk plans the step graph g at each of the fused loss's
// token chunks (planner.LossChunkCandidates over rows tokens, largest
// first), each with the session's recompute choice for it, and returns
// the chunk of the shortest predicted step that fits, or the one half its
// size when that is predicted within LossChunkSlack of it and holds less,
// with every setting tried. Once a setting runs the whole batch in one
// chunk recomputing nothing, only the chunk half its size is planned
// after it (lossChunksSettled). When none fits, the smallest chunk is
// returned (its plan's error says why).
func (s *Session) chooseLossChunk(g *graph.Graph, rows, boundary int, ids, trained []int, slots int, unscale bool) (int, []LeverChoice, error) {
	cands := planner.LossChunkCandidates(rows)
	var alts []LeverChoice
	best := -1
	offload := OffloadNone
	if s.offloading() {
		offload = OffloadOptimizer
	}
	for i, t := range cands {
		alt := LeverChoice{LossChunk: t, Offload: offload}
		if lossChunksSettled(alts, best) {
			alt.Skipped = true
			alts = append(alts, alt)
			continue
		}
		gc, err := graph.WithLossChunk(g, t)
		if err != nil {
			return 0, nil, err
		}
		p, re, _, err := s.recomputed(gc, nil, boundary, ids, trained, slots, unscale, false)
		if err != nil {
			return 0, nil, err
		}
		alt.Recompute = re.Strategy
		pl, err := s.planNext(p)
		var dnf *planner.DoesNotFitError
		switch {
		case errors.As(err, &dnf):
			alt.Err = err
		case err != nil:
			return 0, nil, err
		default:
			alt.Plan = pl
			alt.Seconds, alt.OffloadSeconds = s.predicted(p, pl)
			if best < 0 || alt.Seconds < alts[best].Seconds {
				best = i
			}
		}
		alts = append(alts, alt)
	}
	if best < 0 {
		return cands[len(cands)-1], alts, nil
	}
	chosen := best
	if h := best + 1; h < len(alts) && alts[h].Plan != nil && alts[h].Seconds <= alts[best].Seconds*(1+LossChunkSlack) &&
		alts[h].Plan.PeakReserved < alts[best].Plan.PeakReserved {
		chosen = h // half the chunk, as fast by the cost model, less held
	}
	alts[chosen].Chosen = true
	return cands[chosen], alts, nil
}

// lossChunksSettled reports whether the loss chunks after those in alts
// need no plan: the fastest so far (best) runs the whole batch in one
// chunk recomputing nothing, so a smaller chunk can only add launches,
// and the chunk after it, half its size, has been planned already.
func lossChunksSettled(alts []LeverChoice, best int) bool {
	return best >= 0 && alts[best].Plan.Split.K == 1 && alts[best].Recompute == "none" && len(alts) > best+1
}
