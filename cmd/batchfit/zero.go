package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"text/tabwriter"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/dist"
	"github.com/batchfit/batchfit/planner"
	"github.com/batchfit/batchfit/recompute"
)

// zeroFlagValues are estimate's data-parallel flags.
type zeroFlagValues struct {
	ranks, stage     int
	overhead, bucket string
}

func addZeROFlags(fs *flag.FlagSet, v *zeroFlagValues) {
	fs.IntVar(&v.ranks, "ranks", 1, "data-parallel ranks, `N`: plan one rank of N, each running --batch samples per step (a global batch of N × --batch)")
	fs.IntVar(&v.stage, "zero", 0, "ZeRO `STAGE` of the ranks, as dist.Options.ZeRO: 0 replicated, 1 optimizer state sharded, 2 gradients too, 3 parameters too (gathered per parameter ahead of use, freed after)")
	fs.StringVar(&v.overhead, "comm-overhead", "0 B", "the communicator's device memory outside the allocator, a `SIZE`, taken out of each rank's budget (dist.Communicator.Overhead reports NCCL's, measured at init; not known to a dry run)")
	fs.StringVar(&v.bucket, "bucket", alloc.FormatBytes(dist.DefaultBucketBytes), "gradient bucket `SIZE` of ZeRO stages 2 and 3 (dist.Options.BucketBytes)")
}

// zeroConfig is what the flags say; nil when estimate plans one device.
type zeroConfig struct {
	ranks, stage     int
	overhead, bucket int64
}

func (v *zeroFlagValues) apply(c *estimateConfig, set map[string]bool) error {
	if !set["ranks"] && !set["zero"] && !set["comm-overhead"] && !set["bucket"] {
		return nil
	}
	z := &zeroConfig{ranks: v.ranks, stage: v.stage}
	switch {
	case v.ranks < 1:
		return usagef(errRange, "--ranks must be positive, got %d", v.ranks)
	case v.stage < dist.ZeROOff || v.stage > dist.ZeRO3:
		return usagef(errRange, "--zero must be 0, 1, 2 or 3, got %d", v.stage)
	case !c.train:
		return usagef(errNotApplicable, "--ranks and --zero plan training steps, not --mode infer")
	case c.recompute == recompute.Auto:
		return usagef(errNotApplicable, "--ranks and --zero plan the step as it is; --recompute auto is not searched with them")
	}
	var err error
	if z.overhead, err = alloc.ParseBytes(v.overhead); err != nil {
		return &usageError{kind: alloc.ErrSize, msg: "--comm-overhead: " + err.Error()}
	}
	if z.bucket, err = alloc.ParseBytes(v.bucket); err != nil {
		return &usageError{kind: alloc.ErrSize, msg: "--bucket: " + err.Error()}
	}
	if z.bucket == 0 {
		return usagef(errRange, "--bucket must be positive")
	}
	c.zero = z
	return nil
}

// zeroReport is one rank's holdings under --ranks and --zero; the plan
// itself is report.Plan.
type zeroReport struct {
	Ranks      int   `json:"ranks"`
	Stage      int   `json:"stage"`
	ShardLen   int64 `json:"shard_elements"`
	Params     int64 `json:"param_bytes"`       // whole parameters, or the rank's shard (stage 3)
	Grads      int64 `json:"grad_shard_bytes"`  // stages 2, 3
	State      int64 `json:"state_shard_bytes"` // the optimizer state's shards
	Bucket     int64 `json:"bucket_bytes"`      // stages 2, 3
	Gather     int64 `json:"gather_peak_bytes"` // stage 3: gathered parameters held at once, at most
	Overhead   int64 `json:"comm_overhead"`
	RankPeak   int64 `json:"rank_peak"` // the plan's peak reserved + the communicator's overhead
	Persistent int64 `json:"persistent"`
}

// estimateZeRO replans st as one rank of c.zero and fills r's plan with
// it.
func estimateZeRO(c *estimateConfig, st *step, r *report) (*report, error) {
	z := c.zero
	o := planOptions(c)
	o.Timeline, o.NoChunkList = c.table, true
	rp, err := dist.PlanZeRO(st.program, dist.ZeROPlanOptions{Stage: z.stage, Ranks: z.ranks, BucketBytes: z.bucket,
		Overhead: z.overhead, Planner: o})
	zr := &zeroReport{Ranks: z.ranks, Stage: z.stage, Overhead: z.overhead}
	if rp != nil {
		b := rp.Bytes
		zr.ShardLen, zr.Params, zr.Grads, zr.State, zr.Bucket, zr.Gather = b.ShardLen, b.Params, b.Grads, b.State, b.Bucket, b.Gather
		zr.Persistent = b.Persistent()
		if z.stage == dist.ZeROOff {
			zr.Params, zr.State = r.ParamBytes, r.StateBytes
			zr.Persistent = r.ParamBytes + r.StateBytes // constants aside
		}
	}
	r.ZeRO = zr
	var dnf *planner.DoesNotFitError
	if errors.As(err, &dnf) {
		r.DoesNotFit = &fitReport{Message: dnf.Error(), Chunk: dnf.Chunk, Needed: dnf.Needed, Whole: dnf.Whole,
			Available: dnf.Available, Fixed: dnf.Fixed}
		return r, fmt.Errorf("one rank of %d at ZeRO stage %d: %w", z.ranks, z.stage, err)
	}
	if err != nil {
		return r, err
	}
	pl := rp.Plan
	zr.RankPeak = rp.Peak()
	pr := &planReport{WholeBatch: pl.Split.Len() == 1, Chunk: pl.Chunk, NumChunks: pl.Split.Len(),
		PeakReserved: pl.PeakReserved, PeakAllocated: pl.PeakAllocated, Fixed: pl.Fixed, PerSample: pl.PerSample,
		Persistent: pl.Persistent, WholePeakReserved: pl.PeakReserved, Replays: pl.Replays, PlanningSeconds: st.planSeconds}
	for _, run := range pl.Split.Runs() {
		pr.Chunks = append(pr.Chunks, chunkRun(run))
	}
	if !pr.WholeBatch { // what the rank's whole batch would need in one chunk, as estimate reports it
		for _, bi := range rp.Program.Accumulators {
			pr.Accumulators += rp.Program.Buffers[bi].Bytes(0)
		}
		whole, err := wholeBatchPeak(rp.Program, c.batch)
		if err != nil {
			return r, err
		}
		pr.WholePeakReserved = whole
		if whole >= 0 {
			pr.WholePeakReserved += z.overhead
		}
	}
	r.Plan, r.DoesNotFit = pr, nil
	r.Timeline, r.Largest = nil, nil
	if c.table {
		r.Timeline = timeline(rp.Program, pl)
	}
	if c.top > 0 {
		r.Largest = largest(rp.Program, pl, c.top)
	}
	return r, nil
}

// writeZeRO prints the rank's holdings.
func writeZeRO(w io.Writer, r *report) {
	z := r.ZeRO
	if z == nil {
		return
	}
	fmt.Fprintf(w, "\nper rank (one of %d, ZeRO stage %d; every rank's plan is the same, the flat shards padded to %s elements):\n",
		z.Ranks, z.Stage, thousands(z.ShardLen))
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	line := func(k string, n int64, note string) { fmt.Fprintf(tw, "  %s\t%s\t%s\n", k, exact(n), note) }
	what := "the whole parameters"
	if z.Stage == dist.ZeRO3 {
		what = "the rank's shard"
	}
	line("parameters", z.Params, what)
	if z.Stage >= dist.ZeRO2 {
		line("gradient shard", z.Grads, "reduce-scattered; whole gradients freed after their last reader")
		line("gradient bucket", z.Bucket, "--bucket")
	}
	if z.Stage >= dist.ZeRO1 {
		line("optimizer state", z.State, "the rank's shards")
	} else {
		line("optimizer state", z.State, "replicated")
	}
	if z.Stage == dist.ZeRO3 {
		line("gathered parameters", z.Gather, "at most at once: each gathered before its first read (one ahead), freed after its last, in forward and again in backward")
	}
	line("communicator", z.Overhead, "--comm-overhead, outside the allocator")
	if r.Plan != nil {
		line("rank peak", z.RankPeak, "the plan's peak reserved + the communicator")
	}
	tw.Flush()
}
