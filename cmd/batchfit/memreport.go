package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"text/tabwriter"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/memviz"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/planner"
)

// What --run executes on the CPU, in host memory: models of at most
// maxRunParams parameters (the CPU executor trains the zoo's MLPs, ConvNet
// and tiny GPT in moments, GPT-2 small not), a batch of at most
// maxRunData bytes of random inputs and labels, and a plan within a budget
// of at most maxRunBudget (the CPU executor's buffers are host memory, as
// much as the plan's peak).
const (
	maxRunParams = 32 << 20
	maxRunData   = 512 << 20
	maxRunBudget = 4 << 30
)

type reportConfig struct {
	step      *estimateConfig // nil when reporting on a file
	file      string
	at        string
	profile   bool
	run       bool
	seed      uint64
	csv, json bool
	out       string // FILE form: write the HTML report page there
}

type reportFlagValues struct {
	stepFlagValues
	at, out                   string
	seed                      uint64
	profile, run, csv, asJSON bool
}

func reportFlags() (*flag.FlagSet, *reportFlagValues) {
	fs := flag.NewFlagSet("report", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	v := &reportFlagValues{}
	addStepFlags(fs, &v.stepFlagValues)
	fs.StringVar(&v.at, "at", atPeak, "`when`: peak (while the op at the predicted peak runs) or end (after the step)")
	fs.BoolVar(&v.profile, "profile", false, "also print the per-op memory profile: bytes each op allocates and frees, live and peak bytes after it")
	fs.BoolVar(&v.run, "run", false, "run the step on the CPU executor with random data and report measured figures beside the predicted ones (float32, models up to 32 Mi parameters, inputs up to 512 MiB, --budget up to 4 GiB)")
	fs.Uint64Var(&v.seed, "seed", 1, "`seed` of the parameters and data of --run")
	fs.BoolVar(&v.csv, "csv", false, "print one CSV table: the profile with --profile, the live tensors otherwise")
	fs.BoolVar(&v.asJSON, "json", false, "print everything as JSON")
	fs.StringVar(&v.out, "o", "", "with a snapshot FILE: write its HTML report page (trace timeline, live blocks, segments) to `PAGE`, - for standard output")
	return fs, v
}

const reportSynopsis = `  batchfit report --model NAME|--hf-config FILE --batch N --budget SIZE [flags]
  batchfit report [--csv|--json] FILE
  batchfit report FILE -o PAGE.html

The first form plans a zoo model's step and lists the tensors live at the
predicted peak (or after the step), named after the model's parameters,
their gradients and optimizer state, and activations by module path; the
totals itemise the allocated bytes. The second lists the live blocks of a
pickle snapshot (batchfit snapshot, torch.cuda.memory._dump_snapshot),
named from their frames; with -o it writes the snapshot's offline HTML
report page instead.`

func parseReport(args []string) (*reportConfig, error) {
	fs, v := reportFlags()
	pos, set, err := parseFlags(fs, args)
	if err != nil {
		return nil, err
	}
	c := &reportConfig{at: v.at, profile: v.profile, run: v.run, seed: v.seed, csv: v.csv, json: v.asJSON, out: v.out}
	if c.out != "" && (c.csv || c.json) {
		return nil, usagef(errFlag, "-o writes an HTML page: not with --csv or --json")
	}
	if c.csv && c.json {
		return nil, usagef(errFlag, "--csv and --json exclude each other")
	}
	if len(pos) > 1 {
		return nil, usagef(errFlag, "unexpected argument %q (one snapshot file at most)", pos[1])
	}
	if len(pos) == 1 {
		for _, f := range []string{"model", "hf-config", "batch", "seq", "budget", "headroom", "optimizer", "dtype", "precision", "mode", "at", "profile", "run", "seed"} {
			if set[f] {
				return nil, usagef(errNotApplicable, "--%s applies to a zoo model, not to a snapshot file", f)
			}
		}
		c.file = pos[0]
		return c, nil
	}
	if c.out != "" {
		return nil, usagef(errNotApplicable, "-o applies to a snapshot FILE; for a zoo model's page run batchfit snapshot -o PAGE.html")
	}
	if c.step, err = v.config(set); err != nil {
		return nil, err
	}
	if c.at != atPeak && c.at != atEnd {
		return nil, usagef(errUnknown, "unknown --at %q (want peak or end)", c.at)
	}
	if set["seed"] && !c.run {
		return nil, usagef(errNotApplicable, "--seed applies to --run only")
	}
	if c.run {
		if err := runnable(c.step); err != nil {
			return nil, err
		}
	}
	return c, nil
}

// runnable says why --run cannot execute c's step on the CPU, or nil.
func runnable(c *estimateConfig) error {
	if c.dtype != graph.Float32 {
		return usagef(errNotApplicable, "--run executes what a Session runs: parameters in float32, not --dtype %s (use --precision)", c.dtype)
	}
	// The parameters do not depend on the sequence length: c.seq, checked
	// already, bounds what building allocates (a Llama's rotary table).
	b := c.model.build(nn.Options{ShapeOnly: true}, 1, c.seq, false, nil, nil)
	if n := nn.NumParams(b.module); n > maxRunParams {
		return usagef(errNotApplicable, "--run executes on the CPU: %s has %s parameters, more than %s",
			c.model.name, thousands(int64(n)), thousands(maxRunParams))
	}
	if c.budget > maxRunBudget {
		return usagef(errRange, "--run executes on the CPU, in host memory: --budget %s is more than %s",
			alloc.FormatBytes(c.budget), alloc.FormatBytes(maxRunBudget))
	}
	// The step's inputs at the full batch, shape only: their bytes are the
	// random data --run would draw.
	b = c.model.build(nn.Options{ShapeOnly: true}, c.batch, c.seq, c.train, nil, nil)
	out := b.output
	if c.train {
		out = b.loss
	}
	if err := out.Err(); err != nil {
		return &buildError{model: c.model.name, err: err}
	}
	var data int64
	for _, nd := range out.Graph().IR().Nodes() {
		if nd.Op == graph.OpInput {
			data += nd.Type.Bytes()
		}
	}
	if data > maxRunData {
		return usagef(errRange, "--run draws the batch's inputs at random: %s at --batch %d, more than %s",
			alloc.FormatBytes(data), c.batch, alloc.FormatBytes(maxRunData))
	}
	return nil
}

// memReport is what report prints as JSON.
type memReport struct {
	Model    string          `json:"model,omitempty"`
	Step     string          `json:"step,omitempty"`
	File     string          `json:"file,omitempty"`
	Snapshot string          `json:"snapshot"` // when it was taken
	Measured *measured       `json:"measured,omitempty"`
	Report   *memviz.Report  `json:"report"`
	Profile  *memviz.Profile `json:"profile,omitempty"`
}

// measured is what --run measured on the CPU executor.
type measured struct {
	PeakReserved           int64    `json:"peak_reserved"`
	PeakAllocated          int64    `json:"peak_allocated"`
	PredictedPeakReserved  int64    `json:"predicted_peak_reserved"`
	PredictedPeakAllocated int64    `json:"predicted_peak_allocated"`
	Loss                   *float32 `json:"loss,omitempty"` // training only
}

// executed is a zoo model's step run once on the CPU executor.
type executed struct {
	program *planner.Program
	plan    *planner.Plan
	usage   planner.Usage
	end     alloc.Snapshot // the executor's allocator after the step
	loss    *float32       // training only
}

// execute runs c's step on a session of c's budget with parameters and
// data drawn from seed.
func execute(c *estimateConfig, seed uint64) (*executed, error) {
	data := rand.New(rand.NewPCG(seed, seed^0x5eed))
	b := c.model.build(nn.Seed(seed), c.batch, c.seq, c.train, data, nil)
	if err := nn.Check(b.module); err != nil {
		return nil, fmt.Errorf("building %s: %w", c.model.name, err)
	}
	// The CPU executor accounts on a simulated device of exactly the
	// budget, which is what this report is about, GPU or not.
	sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, Budget: c.budget, Headroom: c.headroom, Timeline: true,
		Precision: string(c.policy), NoChannelsLast: c.nchw, LossChunk: c.lossChunk, NoFusedLoss: c.noFusedLoss})
	x := &executed{}
	var err error
	if c.train {
		var loss float32
		loss, err = sess.Step(context.Background(), b.loss, nn.ParamTensors(b.module), makeOptimizer(c.optimizer))
		x.loss = &loss
	} else {
		_, err = sess.Eval(context.Background(), b.output)
	}
	if err != nil {
		return nil, err
	}
	x.program, x.plan, x.usage, x.end = sess.LastProgram(), sess.LastPlan(), sess.LastUsage(), sess.Allocator().Snapshot()
	return x, nil
}

// measure runs c's step once on the CPU executor and makes s the
// executed program's: that program is compiled from the real graph, so
// profiles and names go against it, with its own plan's simulation.
func (s *simulated) measure(c *estimateConfig, seed uint64) (*executed, error) {
	x, err := execute(c, seed)
	if err != nil {
		return nil, fmt.Errorf("running %s on the CPU executor: %w", c.model.name, err)
	}
	sim, err := memviz.Simulate(x.program, x.plan.Chunks, memviz.SimOptions{Capacity: x.plan.Available()})
	if err != nil {
		return nil, err
	}
	s.step.program, s.plan, s.sim = x.program, x.plan, sim
	return x, nil
}

func runReport(args []string, stdin io.Reader, stdout, stderr io.Writer) int {
	fs, _ := reportFlags()
	c, err := parseReport(args)
	if code, ok := parsed("report", err, stdout, stderr, fs, reportSynopsis); !ok {
		return code
	}
	if c.out != "" {
		return reportHTML(c, stdin, stdout, stderr)
	}
	var r *memReport
	if c.file != "" {
		r, err = reportFile(c, stdin)
	} else {
		r, err = reportModel(c)
	}
	if err == nil {
		err = writeMemReport(stdout, c, r)
	}
	if err != nil {
		fmt.Fprintf(stderr, "batchfit report: %v\n", err)
		return exitPlan
	}
	return exitOK
}

func reportFile(c *reportConfig, stdin io.Reader) (*memReport, error) {
	f, err := readSnapshotFile(c.file, stdin, formatPickle, "report lists the blocks of a pickle snapshot (batchfit compare reads stacks)")
	if err != nil {
		return nil, err
	}
	rep, err := memviz.NewReport(nil, *f.snap, memviz.Options{})
	if err != nil {
		return nil, &fileError{Path: c.file, Format: f.format, How: f.how, Err: err}
	}
	return &memReport{File: c.file, Snapshot: "as written", Report: rep}, nil
}

func reportModel(c *reportConfig) (*memReport, error) {
	s, err := simulate(c.step, 0)
	if err != nil {
		return nil, err
	}
	r := &memReport{Model: c.step.model.name + ": " + c.step.model.about, Step: stepLine(c.step, s.plan),
		Snapshot: s.where(c.at)}
	prog, chunks, snap := s.step.program, s.plan.Chunks, s.snapshot(c.at)
	var timeline []planner.Point
	if c.run {
		x, err := s.measure(c.step, c.seed)
		if err != nil {
			return nil, err
		}
		prog, chunks = x.program, x.plan.Chunks
		snap = s.snapshot(c.at)
		r.Snapshot = s.where(c.at)
		if c.at == atEnd {
			snap = memviz.NewSnapshot(0, x.end)
			r.Snapshot = "measured on the CPU executor after the step"
		}
		timeline = x.usage.Timeline
		r.Measured = &measured{PeakReserved: x.usage.PeakReserved, PeakAllocated: x.usage.PeakAllocated,
			PredictedPeakReserved: x.plan.PeakReserved, PredictedPeakAllocated: x.plan.PeakAllocated, Loss: x.loss}
	}
	if r.Report, err = memviz.NewReport(prog, snap, memviz.Options{}); err != nil {
		return nil, err
	}
	if c.profile {
		if r.Profile, err = memviz.NewProfile(prog, chunks, s.sim.Usage.Timeline, timeline, memviz.Options{}); err != nil {
			return nil, err
		}
	}
	return r, nil
}

func writeMemReport(w io.Writer, c *reportConfig, r *memReport) error {
	switch {
	case c.json:
		e := json.NewEncoder(w)
		e.SetIndent("", "  ")
		return e.Encode(r)
	case c.csv && r.Profile != nil:
		return r.Profile.WriteCSV(w)
	case c.csv:
		return r.Report.WriteCSV(w)
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	line := func(k, format string, args ...any) { fmt.Fprintf(tw, "%s\t%s\n", k, fmt.Sprintf(format, args...)) }
	if r.File != "" {
		line("file", "%s", r.File)
	} else {
		line("model", "%s", r.Model)
		line("step", "%s", r.Step)
		line("snapshot", "%s", r.Snapshot)
	}
	if m := r.Measured; m != nil {
		same := "as predicted"
		if m.PeakReserved != m.PredictedPeakReserved || m.PeakAllocated != m.PredictedPeakAllocated {
			same = fmt.Sprintf("predicted %s reserved, %s allocated", alloc.FormatBytes(m.PredictedPeakReserved),
				alloc.FormatBytes(m.PredictedPeakAllocated))
		}
		loss := ""
		if m.Loss != nil {
			loss = fmt.Sprintf("; loss %.4g", *m.Loss)
		}
		line("measured", "on the CPU executor: peak %s reserved, %s allocated (%s)%s", alloc.FormatBytes(m.PeakReserved),
			alloc.FormatBytes(m.PeakAllocated), same, loss)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	fmt.Fprintln(w)
	if err := r.Report.WriteText(w); err != nil {
		return err
	}
	if r.Profile == nil {
		return nil
	}
	what := "predicted"
	if r.Measured != nil {
		what = "predicted, and measured on the CPU executor"
	}
	fmt.Fprintf(w, "\nper-op memory profile (%s):\n", what)
	return r.Profile.WriteText(w)
}
