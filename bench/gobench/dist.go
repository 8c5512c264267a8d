package main

import (
	"context"
	"fmt"
	"math/rand/v2"
	"time"

	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/dist"
	"github.com/batchfit/batchfit/nn"
)

// distThroughput times one rank of a data-parallel training loop (-dist,
// started by `batchfit launch -n N` or torchrun, which set RANK,
// WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT): NCCL from
// package dist, a Trainer whose session plans this rank's shard of the
// global batch m.batch, the graph built again every step over the shard
// as a user's loop does, gradients summed over the ranks on the device
// before the device optimizer. Each step is timed on the host clock
// around Trainer.Step, which returns after the loss's all-reduce, so
// every rank's step has finished. The record is the job's: rank 0's
// times, samples per second over the global batch.
func distThroughput(c config, m benchModel) (Record, error) {
	r := Record{Kind: "dist", Model: m.name, About: m.about, Batch: m.batch, Seq: m.seq, Optimizer: m.optName,
		Warmup: c.warmup, Steps: c.steps, TF32: c.tf32, Precision: c.precision, ChannelsLast: c.nhwc()}
	ctx := context.Background()
	env, err := dist.EnvFromOS()
	if err != nil {
		return r, err
	}
	r.World = env.WorldSize
	comm, err := dist.NewNCCL(ctx, env, dist.NCCLOptions{RendezvousTimeout: 5 * time.Minute, BucketBytes: c.bucket})
	if err != nil {
		return r, err
	}
	defer comm.Close()
	tr, err := dist.New(comm, dist.Options{BucketBytes: c.bucket,
		Session: batchfit.Options{Device: batchfit.DeviceCUDA, TF32: c.tf32, Precision: c.precision, NoChannelsLast: !c.channelsLast}})
	if err != nil {
		return r, err
	}
	defer tr.Close()
	r.Overhead = comm.Overhead()
	mod := m.module(nn.Seed(1))
	if err := nn.Check(mod); err != nil {
		return r, err
	}
	r.Params = int64(nn.NumParams(mod))
	params := nn.ParamTensors(mod)
	if err := tr.BroadcastParams(ctx, params); err != nil {
		return r, err
	}
	lo, hi, err := tr.Shard(m.batch)
	if err != nil {
		return r, err
	}
	// Each rank draws its own shard's data (a rank reads its part of the
	// dataset); the timing does not depend on which rows.
	rng := rand.New(rand.NewPCG(2, 3+uint64(env.Rank)))
	feeds := make([][]tensor.Tensor, 4)
	for i := range feeds {
		_, in := m.build(mod, hi-lo, rng)
		feeds[i] = []tensor.Tensor{in[0].Value(), in[1].Value()}
	}
	opt := m.optimizer()
	for i := range c.warmup + c.steps {
		t0 := time.Now()
		loss, err := rebuild(m, mod, feeds[i%len(feeds)])
		if err != nil {
			return r, err
		}
		l, err := tr.Step(ctx, m.batch, loss, params, opt)
		dt := time.Since(t0).Seconds()
		if err != nil {
			return r, fmt.Errorf("%s data-parallel step %d (rank %d of %d): %w", m.name, i, env.Rank, env.WorldSize, err)
		}
		if i == 0 {
			r.FirstLoss = float64(l)
		}
		r.LastLoss = float64(l)
		if i >= c.warmup {
			r.StepSeconds = append(r.StepSeconds, dt)
			r.CommWaitSeconds = append(r.CommWaitSeconds, tr.LastWait().Seconds())
		}
	}
	s := tr.Session()
	pl, u := s.LastPlan(), s.LastUsage()
	r.Chunks = len(pl.Chunks)
	r.PredictedPeakReserved, r.PredictedPeakAllocated = pl.PeakReserved+s.Overhead(), pl.PeakAllocated+s.Overhead()
	r.MeasuredPeakReserved, r.MeasuredPeakAllocated = u.PeakReserved, u.PeakAllocated
	r.setRates(m.batch)
	return r, nil
}
