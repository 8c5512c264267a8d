package main

import (
	"encoding/json"
	"io"
)

// Record is one JSON line of gobench's output. Kind says which fields are
// set: "device" (the card), "throughput" (a timed training run), "maxbatch"
// (the planner's largest whole batch for the card's free memory, and a
// step run at it), "dist" (one data-parallel job's timed training run:
// World ranks, Batch the global batch), "tightness" (a batch too large for -budget: the
// planner's chunks, a step run in them, and the next larger chunk size's
// simulated need), "cap" (a training loop through batchfit.Session within
// -cap at -cap-batch: the planner's choice of chunks and recomputation, or
// chunks only, timed) or "error".
type Record struct {
	Kind  string `json:"kind"`
	Model string `json:"model,omitempty"`
	About string `json:"about,omitempty"`
	// Convolutions is what ran the executor's convolutions
	// (cuda.Executor.Convolutions).
	Convolutions string `json:"convolutions,omitempty"`
	// The executor's timed cuDNN algorithm search (-cudnn-find;
	// cuda.DNN.SearchStats) after the throughput steps: convolution shapes
	// timed on the device, read from the disk or process cache, left to the
	// heuristics (by reason), and the most device memory one search took.
	ConvSearched       int            `json:"conv_searched,omitempty"`
	ConvFromCache      int            `json:"conv_from_cache,omitempty"`
	ConvHeuristic      map[string]int `json:"conv_heuristic,omitempty"`
	ConvSearchMaxBytes int64          `json:"conv_search_max_bytes,omitempty"`
	// The executor's CUDA graphs (-cuda-graphs; cuda.GraphStats) after the
	// throughput steps: graphs captured, segments launched as a graph and
	// node by node, and the driver memory the live graphs took.
	GraphCaptures    int   `json:"graph_captures,omitempty"`
	GraphReplays     int   `json:"graph_replays,omitempty"`
	GraphEager       int   `json:"graph_eager,omitempty"`
	GraphDriverBytes int64 `json:"graph_driver_bytes,omitempty"`

	// device
	Device      string `json:"device,omitempty"`
	DeviceTotal int64  `json:"device_total,omitempty"`
	DeviceFree  int64  `json:"device_free,omitempty"`

	// throughput and maxbatch
	Batch     int    `json:"batch,omitempty"`
	Seq       int    `json:"seq,omitempty"`
	Optimizer string `json:"optimizer,omitempty"`
	Params    int64  `json:"params,omitempty"`
	TF32      bool   `json:"tf32,omitempty"`      // float32 GEMMs on TF32 tensor cores
	Precision string `json:"precision,omitempty"` // the precision policy (fp32, tf32, bf16-mixed, fp16-mixed)
	World     int    `json:"world,omitempty"`     // dist: ranks (GPUs) of the job
	// ChannelsLast: conv nets' bfloat16 activations stored NHWC (-channels-last, the default, under bf16-mixed).
	ChannelsLast bool `json:"channels_last,omitempty"`

	// throughput
	BuildModelSeconds float64 `json:"build_model_seconds,omitempty"` // parameter initialisation
	PlanSeconds       float64 `json:"plan_seconds,omitempty"`        // graph build + Analyze + Compile + planner.Make
	// ExecutorSeconds is cuda.NewExecutor's: the kernel files compiled
	// by NVRTC (or loaded from the cubin cache), cuBLAS and cuDNN handles.
	ExecutorSeconds float64 `json:"executor_seconds,omitempty"`
	Warmup          int     `json:"warmup,omitempty"`
	// throughput: gobench -host-work, the host's spin after each step
	HostWorkSeconds float64 `json:"host_work_seconds,omitempty"`
	// throughput and session, -interleave: the steps ran in alternate
	// blocks of Interleave with the other loop's; the session record's
	// OverPaired is the median over block pairs of its median step over
	// the executor's.
	Interleave        int       `json:"interleave,omitempty"`
	OverPaired        float64   `json:"over_paired,omitempty"`
	Steps             int       `json:"steps,omitempty"`
	StepSeconds       []float64 `json:"step_seconds,omitempty"` // each timed step, from its start to its return (loop.go)
	MedianStepSeconds float64   `json:"median_step_seconds,omitempty"`
	// session: each timed step's graph build (the model's forward over the
	// step's data, before Step) and Session.StepHostTime (Step's own host
	// work before the executor starts), medians of the timed steps.
	MedianBuildSeconds float64 `json:"median_build_seconds,omitempty"`
	MedianHostSeconds  float64 `json:"median_host_seconds,omitempty"`
	// session: the medians of Session.LastStepTimes' Execute (the
	// executor's run, to set beside the throughput record's step) and of
	// Step's work after it; and the Go garbage collections the timed
	// steps ran.
	MedianExecuteSeconds float64 `json:"median_execute_seconds,omitempty"`
	MedianAfterSeconds   float64 `json:"median_after_seconds,omitempty"`
	GCs                  uint32  `json:"gcs,omitempty"`
	// throughput and session: the segments the allocator took from and
	// gave back to the device during the timed steps (driver calls that
	// synchronise; a steady loop makes none).
	DeviceAllocs int64 `json:"device_allocs,omitempty"`
	DeviceFrees  int64 `json:"device_frees,omitempty"`
	// dist: each timed step's wait on communication (dist.Trainer.LastWait)
	CommWaitSeconds  []float64 `json:"comm_wait_seconds,omitempty"`
	StepsPerSecond   float64   `json:"steps_per_second,omitempty"`
	SamplesPerSecond float64   `json:"samples_per_second,omitempty"`
	FirstLoss        float64   `json:"first_loss,omitempty"`
	LastLoss         float64   `json:"last_loss,omitempty"`
	Chunks           int       `json:"chunks,omitempty"`
	// LossChunk is the fused loss's tokens per logits chunk the step ran
	// (a Session's: its planner's choice unless -loss-chunk).
	LossChunk int `json:"loss_chunk,omitempty"`
	// Predicted peaks are planner.Make's; measured ones the executor's
	// allocator over the run, Overhead (cuBLAS's workspace) included.
	PredictedPeakReserved  int64 `json:"predicted_peak_reserved,omitempty"`
	PredictedPeakAllocated int64 `json:"predicted_peak_allocated,omitempty"`
	Overhead               int64 `json:"overhead,omitempty"`
	MeasuredPeakReserved   int64 `json:"measured_peak_reserved,omitempty"`
	MeasuredPeakAllocated  int64 `json:"measured_peak_allocated,omitempty"`
	// Device-level use from cuMemGetInfo: total − free, before the
	// executor was made and at its highest after any step.
	DeviceUsedBefore int64 `json:"device_used_before,omitempty"`
	DeviceUsedPeak   int64 `json:"device_used_peak,omitempty"`

	// maxbatch (and Budget, Verified, VerifySeconds for tightness)
	Budget        int64   `json:"budget,omitempty"` // maxbatch: the plan's budget (the Session's: the card's free memory less Overhead); tightness: -budget; cap: -cap
	SearchSeconds float64 `json:"search_seconds,omitempty"`
	Replays       int     `json:"replays,omitempty"` // maxbatch: the steps Session.MaxBatch built and planned
	Upper         int     `json:"upper,omitempty"`   // maxbatch: the largest batch the search tries
	// The step at the found batch, run on the card through the search's
	// Session. PredictedPeakReserved is the shape-only step's plan at that
	// batch (MaxBatch's), StepPredictedPeakReserved the plan the step with
	// data ran (LastPlan): both against MeasuredPeakReserved − Overhead
	// to the byte.
	StepPredictedPeakReserved int64   `json:"step_predicted_peak_reserved,omitempty"`
	Verified                  bool    `json:"verified,omitempty"`
	VerifySeconds             float64 `json:"verify_seconds,omitempty"`
	VerifyFreeLeft            int64   `json:"verify_free_left,omitempty"` // cuMemGetInfo's free after the step

	// tightness: the plan within Budget − Overhead runs Chunks chunks of
	// ChunkSizes; the next larger chunk size (the fewest chunks above it:
	// NextChunks of NextChunkSizes) needs NextPeakReserved (two simulated
	// steps, as the planner judges a plan; Overhead not included), and
	// NextOutOfMemory says its simulation ran out of memory on a device of
	// the plan's budget. The measured peak of the step run in the plan's
	// chunks includes Overhead, to be held against Budget.
	ChunkSizes       []int `json:"chunk_sizes,omitempty"`
	NextChunks       int   `json:"next_chunks,omitempty"`
	NextChunkSizes   []int `json:"next_chunk_sizes,omitempty"`
	NextPeakReserved int64 `json:"next_peak_reserved,omitempty"`
	NextOutOfMemory  bool  `json:"next_out_of_memory,omitempty"`

	// cap: Batch samples a step through batchfit.Session with
	// Options.Budget = Budget (-cap), Overhead inside it, and
	// Options.Recompute RecomputeMode ("auto": the planner's choice of
	// chunks and recomputation; "off": chunks only). Chunks, ChunkSizes
	// and Recompute (Session.LastRecompute().Strategy, "none" when nothing
	// is recomputed; RecomputedNodes forward nodes, RecomputeCopies nodes
	// appended) are the last step's plan; PlanChanged says a timed step ran
	// another. PredictedStepSeconds is the cost model's (CostProfile) price
	// of that plan. The predicted (plan's, Overhead not included) and
	// measured (Overhead included) peaks are the largest over all steps,
	// warm-up included; WithinBudget is measured peak reserved ≤ Budget.
	// FirstStepSeconds is the first step's, which builds, differentiates,
	// searches, plans and compiles.
	RecomputeMode             string  `json:"recompute_mode,omitempty"`
	Recompute                 string  `json:"recompute,omitempty"`
	RecomputedNodes           int     `json:"recomputed_nodes,omitempty"`
	RecomputeCopies           int     `json:"recompute_copies,omitempty"`
	PlanChanged               bool    `json:"plan_changed,omitempty"`
	CostProfile               string  `json:"cost_profile,omitempty"`
	PredictedStepSeconds      float64 `json:"predicted_step_seconds,omitempty"`
	PredictedSamplesPerSecond float64 `json:"predicted_samples_per_second,omitempty"`
	FirstStepSeconds          float64 `json:"first_step_seconds,omitempty"`
	WithinBudget              *bool   `json:"within_budget,omitempty"`

	Error string `json:"error,omitempty"`
}

// writeRecord writes r as one JSON line.
func writeRecord(w io.Writer, r Record) error {
	b, err := json.Marshal(r)
	if err != nil {
		return err
	}
	_, err = w.Write(append(b, '\n'))
	return err
}
