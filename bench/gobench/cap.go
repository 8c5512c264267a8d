package main

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"time"

	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/planner"
	"github.com/batchfit/batchfit/recompute"
)

// capModes are the plans a cap record times, in this order: the
// planner's choice (chunks and recomputation) and chunks only.
var capModes = []recompute.Mode{recompute.Auto, recompute.Off}

// capModeName is a recompute mode as the cap records name it: "auto" or
// "off" (chunks only).
func capModeName(m recompute.Mode) string {
	if m == recompute.Off {
		return "off"
	}
	return string(m)
}

// capBatchOf is the batch of m's cap records: -cap-batch, or m's timed
// batch when it is 0.
func capBatchOf(c config, m benchModel) int {
	if c.capBatch > 0 {
		return c.capBatch
	}
	return m.batch
}

// checkCap checks the -cap flags: the cost profile must load.
func (c config) checkCap() error {
	if c.cap <= 0 {
		return nil
	}
	if c.capBatch < 0 {
		return fmt.Errorf("-cap-batch %d: want a batch, or 0 for each model's timed batch", c.capBatch)
	}
	if _, err := recompute.LoadProfile(c.costProfile); err != nil {
		return fmt.Errorf("-cost-profile: %w", err)
	}
	return nil
}

// capThroughput times a training loop within a memory cap (the planner's
// plans against PyTorch's gradient accumulation): batchfit.Session (device, the graph
// built again every step, as sessionThroughput) with Options.Budget
// c.cap at the model's cap batch, recomputation mode (recompute.Auto:
// the planner picks chunks and recomputation for the most predicted
// samples/s; recompute.Off: chunks only). The record holds the plan of
// the last step (chunks, the recompute choice), the cost model's
// predicted step time for it, the predicted peak (the plan's, plus
// Overhead) and the measured one (the session's allocator), each the
// largest over all steps, warm-up included, and whether the measured
// peak stayed within the cap. deviceUsed, when not nil, reads the card's
// used memory after each step.
func capThroughput(c config, m benchModel, mode recompute.Mode, device string, deviceUsed func() (int64, error)) (Record, error) {
	n := capBatchOf(c, m)
	r := Record{Kind: "cap", Model: m.name, About: m.about, Batch: n, Seq: m.seq, Optimizer: m.optName,
		Warmup: c.warmup, Steps: c.steps, TF32: c.tf32, Precision: c.precision, ChannelsLast: c.nhwc(), Budget: c.cap,
		RecomputeMode: capModeName(mode)}
	prof, err := recompute.LoadProfile(c.costProfile)
	if err != nil {
		return r, err
	}
	r.CostProfile = prof.Name
	mod := m.module(nn.Seed(1))
	if err := nn.Check(mod); err != nil {
		return r, err
	}
	r.Params = int64(nn.NumParams(mod))
	rng := rand.New(rand.NewPCG(2, 3))
	feeds := make([][]tensor.Tensor, 4)
	for i := range feeds {
		_, in := m.build(mod, n, rng)
		feeds[i] = []tensor.Tensor{in[0].Value(), in[1].Value()}
	}
	sess := batchfit.NewSession(batchfit.Options{Device: device, TF32: c.tf32, Precision: c.precision,
		Budget: c.cap, Recompute: mode, Profile: prof, NoChannelsLast: !c.channelsLast, NoPointwiseFusion: c.noPointwise,
		NoFusedLoss: c.noFusedLoss, LossChunk: c.lossChunk})
	if err := sess.Err(); err != nil {
		return r, err
	}
	defer sess.Close()
	r.Overhead = sess.Overhead()
	if deviceUsed != nil {
		if r.DeviceUsedBefore, err = deviceUsed(); err != nil {
			return r, err
		}
	}
	opt := m.optimizer()
	params := nn.ParamTensors(mod)
	var last string // the last timed step's plan, to notice a change
	for i := range c.warmup + c.steps {
		t0 := time.Now()
		loss, err := rebuild(m, mod, feeds[i%len(feeds)])
		if err != nil {
			return r, err
		}
		l, err := sess.Step(context.Background(), loss, params, opt)
		dt := time.Since(t0).Seconds()
		if err != nil {
			return r, fmt.Errorf("%s cap step %d (recompute %s, batch %d within %s): %w", m.name, i, r.RecomputeMode, n,
				alloc.FormatBytes(c.cap), err)
		}
		if i == 0 {
			r.FirstLoss, r.FirstStepSeconds = float64(l), dt
		}
		r.LastLoss = float64(l)
		pl, u := sess.LastPlan(), sess.LastUsage()
		r.PredictedPeakReserved = max(r.PredictedPeakReserved, pl.PeakReserved)
		r.PredictedPeakAllocated = max(r.PredictedPeakAllocated, pl.PeakAllocated)
		r.MeasuredPeakReserved = max(r.MeasuredPeakReserved, u.PeakReserved)
		r.MeasuredPeakAllocated = max(r.MeasuredPeakAllocated, u.PeakAllocated)
		if deviceUsed != nil {
			du, err := deviceUsed()
			if err != nil {
				return r, err
			}
			r.DeviceUsedPeak = max(r.DeviceUsedPeak, du)
		}
		if i >= c.warmup {
			r.StepSeconds = append(r.StepSeconds, dt)
			plan := sess.LastRecompute().Strategy + " in " + pl.Split.String()
			if last != "" && plan != last {
				r.PlanChanged = true
			}
			last = plan
		}
	}
	r.setRates(n)
	pl, re := sess.LastPlan(), sess.LastRecompute()
	if pl == nil {
		return r, fmt.Errorf("%s cap: no step ran (-warmup %d, -steps %d)", m.name, c.warmup, c.steps)
	}
	r.Chunks, r.ChunkSizes = pl.Split.Len(), planner.Sizes(pl.Split.List())
	r.Recompute, r.RecomputedNodes, r.RecomputeCopies = re.Strategy, re.Nodes, re.Copies
	// The cost model's price of the program the last step ran (the copies
	// of a recompute set are nodes of it), as recompute.Search prices its
	// candidates.
	r.PredictedStepSeconds = recompute.NewCost(sess.LastProgram(), prof, c.tf32).Step(pl.Split)
	if r.PredictedStepSeconds > 0 {
		r.PredictedSamplesPerSecond = float64(n) / r.PredictedStepSeconds
	}
	within := r.MeasuredPeakReserved <= c.cap
	r.WithinBudget = &within
	fmt.Fprintf(os.Stderr, "gobench: %s cap: batch %d within %s, recompute %s: %s in %s, %.1f samples/s (predicted %.1f), peak %s (predicted %s + overhead %s)\n",
		m.name, n, alloc.FormatBytes(c.cap), r.RecomputeMode, r.Recompute, pl.Split, r.SamplesPerSecond,
		r.PredictedSamplesPerSecond, alloc.FormatBytes(r.MeasuredPeakReserved), alloc.FormatBytes(r.PredictedPeakReserved),
		alloc.FormatBytes(r.Overhead))
	if !within {
		return r, fmt.Errorf("%s cap: measured peak reserved %s is over the cap %s", m.name,
			alloc.FormatBytes(r.MeasuredPeakReserved), alloc.FormatBytes(c.cap))
	}
	return r, nil
}
