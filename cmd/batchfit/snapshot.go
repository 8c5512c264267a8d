package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"slices"
	"strings"
	"text/tabwriter"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/memviz"
	"github.com/batchfit/batchfit/planner"
	"github.com/batchfit/batchfit/precision"
)

// Where in the step a snapshot is taken.
const (
	atPeak = "peak" // while the node at the predicted peak of allocated bytes runs
	atEnd  = "end"  // after the step: parameters and optimizer state held, the rest cached
)

// defaultTrace is how many allocator events a snapshot keeps by default:
// memory_viz draws its timeline from them.
const defaultTrace = 1 << 16

type snapshotConfig struct {
	step   *estimateConfig
	format string
	at     string
	trace  int
	out    string
	run    bool // html: measure the step on the CPU executor too
}

type snapshotFlagValues struct {
	stepFlagValues
	format, at, out string
	trace           int
	run             bool
}

func snapshotFlags() (*flag.FlagSet, *snapshotFlagValues) {
	fs := flag.NewFlagSet("snapshot", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	v := &snapshotFlagValues{}
	addStepFlags(fs, &v.stepFlagValues)
	fs.StringVar(&v.out, "o", "", "write the snapshot to `FILE` (required; - for standard output)")
	fs.StringVar(&v.out, "output", "", "same as -o")
	fs.StringVar(&v.format, "format", "", "`format` of the file: pickle (pytorch.org/memory_viz), pprof (go tool pprof), folded (flamegraph.pl, speedscope) or html (an offline report page: timeline, live tensors, segments, plan); default from FILE's extension (.pickle, .pkl: pickle; .pb.gz, .pprof, .pb: pprof; .folded, .collapsed, .txt: folded; .html, .htm: html; another is refused), pickle for -")
	fs.StringVar(&v.at, "at", atPeak, "`when`: peak (while the op at the predicted peak runs) or end (after the step)")
	fs.IntVar(&v.trace, "trace", defaultTrace, "keep the last `N` allocator events in a pickle (memory_viz's timeline)")
	fs.BoolVar(&v.run, "run", false, "html: also run the step once on the CPU executor with random data and draw the measured timeline over the predicted one (float32, models up to 32 Mi parameters, inputs up to 512 MiB, --budget up to 4 GiB)")
	return fs, v
}

const snapshotSynopsis = "  batchfit snapshot --model NAME|--hf-config FILE --batch N --budget SIZE [flags] -o FILE"

func parseSnapshot(args []string) (*snapshotConfig, error) {
	fs, v := snapshotFlags()
	pos, set, err := parseFlags(fs, args)
	if err != nil {
		return nil, err
	}
	if len(pos) > 0 {
		return nil, usagef(errFlag, "unexpected argument %q (flags only; the file goes after -o)", pos[0])
	}
	c := &snapshotConfig{at: v.at, trace: v.trace, out: v.out, run: v.run}
	if c.step, err = v.config(set); err != nil {
		return nil, err
	}
	if c.out == "" {
		return nil, usagef(errMissing, "missing -o FILE")
	}
	switch c.format = v.format; {
	case c.format != "":
	case c.out == "-": // standard output has no name to tell the format by
		c.format = formatPickle
	default:
		if c.format = formatOfName(c.out); c.format == "" {
			return nil, usagef(errUnknown, "-o %s: the name does not tell the format: end it in %s, or give --format", c.out, knownExtensions())
		}
	}
	if !slices.Contains(formats, c.format) && c.format != formatHTML {
		return nil, usagef(errUnknown, "unknown --format %q (want %s)", c.format, strings.Join(append(formats, formatHTML), ", "))
	}
	if c.at != atPeak && c.at != atEnd {
		return nil, usagef(errUnknown, "unknown --at %q (want peak or end)", c.at)
	}
	if c.trace < 0 || c.trace > alloc.MaxTraceEntries {
		return nil, usagef(errRange, "--trace must be 0 to %d, got %d", alloc.MaxTraceEntries, c.trace)
	}
	if set["trace"] && c.format != formatPickle {
		return nil, usagef(errNotApplicable, "--trace applies to --format pickle only")
	}
	if c.run && c.format != formatHTML {
		return nil, usagef(errNotApplicable, "--run applies to --format html only")
	}
	if c.run {
		if err := runnable(c.step); err != nil {
			return nil, err
		}
	}
	return c, nil
}

// usage prints a subcommand's synopsis and flags.
func usage(w io.Writer, fs *flag.FlagSet, synopsis string) {
	fmt.Fprintf(w, "Usage:\n%s\n\nFlags (one dash or two):\n", synopsis)
	fs.SetOutput(w)
	fs.PrintDefaults()
	fs.SetOutput(io.Discard)
}

// parsed reports a parse result: help goes to stdout (exit 0), a usage
// mistake to stderr as usageFailed says it (exit 2). ok is true when the
// command should go on.
func parsed(name string, err error, stdout, stderr io.Writer, fs *flag.FlagSet, synopsis string) (code int, ok bool) {
	if errors.Is(err, flag.ErrHelp) {
		usage(stdout, fs, synopsis)
		return exitOK, false
	}
	if err != nil {
		return usageFailed(stderr, name, err), false
	}
	return exitOK, true
}

// simulated is a zoo model's step planned and replayed on the simulated
// device.
type simulated struct {
	step *step
	plan *planner.Plan
	sim  *memviz.Simulation
}

// simulate plans c's step and replays the plan, keeping trace allocator
// events, on a simulated device of the planner's capacity.
func simulate(c *estimateConfig, trace int) (*simulated, error) {
	st, err := buildStep(c)
	if err != nil {
		return nil, fmt.Errorf("building %s: %w", c.model.name, err)
	}
	if st.planErr != nil {
		return nil, st.planErr
	}
	pl := *st.plan // the simulation runs its chunks: list them
	pl.Chunks = pl.Split.List()
	sim, err := memviz.Simulate(st.program, pl.Chunks, memviz.SimOptions{Capacity: pl.Available(), TraceEntries: trace})
	if err != nil {
		return nil, err
	}
	return &simulated{step: st, plan: &pl, sim: sim}, nil
}

// snapshot is the allocator state at.
func (s *simulated) snapshot(at string) memviz.Snapshot {
	if at == atEnd {
		return memviz.NewSnapshot(0, s.sim.End)
	}
	return memviz.NewSnapshot(0, s.sim.Snapshot)
}

// where describes when the snapshot at was taken.
func (s *simulated) where(at string) string {
	if at == atEnd {
		return "after the step (parameters and optimizer state held, the rest cached)"
	}
	pk := s.sim.Peak
	if pk.Node < 0 {
		return "after the persistent allocations (no op ran)"
	}
	nd := s.step.program.Graph.Node(pk.Node)
	return fmt.Sprintf("at the predicted peak of allocated bytes, while node %d (%s in %s) runs in chunk %d, program step %d",
		pk.Node, nd.Op, dash(s.step.program.Buffers[s.step.program.OutputBuf[pk.Node]].Tag.Scope), pk.Chunk, pk.Step)
}

// stepLine summarises c's step and plan in one line.
func stepLine(c *estimateConfig, pl *planner.Plan) string {
	var b strings.Builder
	kind := c.dtype.String()
	if c.policy != "" && c.policy != precision.FP32 {
		kind = string(c.policy)
	}
	if c.train {
		fmt.Fprintf(&b, "train, %s, %s", kind, c.optimizer)
	} else {
		fmt.Fprintf(&b, "infer, %s", kind)
	}
	fmt.Fprintf(&b, ", batch %d", c.batch)
	if c.seq > 0 {
		fmt.Fprintf(&b, " × %d tokens", c.seq)
	}
	if len(pl.Chunks) == 1 {
		b.WriteString(" in one chunk")
	} else {
		fmt.Fprintf(&b, " as %s", planner.DescribeSizes(planner.Sizes(pl.Chunks)))
	}
	fmt.Fprintf(&b, "; budget %s, predicted peak %s reserved, %s allocated", alloc.FormatBytes(c.budget),
		alloc.FormatBytes(pl.PeakReserved), alloc.FormatBytes(pl.PeakAllocated))
	return b.String()
}

func runSnapshot(args []string, stdout, stderr io.Writer) int {
	fs, _ := snapshotFlags()
	c, err := parseSnapshot(args)
	if code, ok := parsed("snapshot", err, stdout, stderr, fs, snapshotSynopsis); !ok {
		return code
	}
	trace := c.trace
	if c.format != formatPickle { // only a pickle carries the trace
		trace = 0
	}
	s, err := simulate(c.step, trace)
	var measured []planner.Point
	if err == nil && c.run {
		var x *executed
		if x, err = s.measure(c.step, 1); err == nil {
			measured = x.usage.Timeline
		}
	}
	if err != nil {
		fmt.Fprintf(stderr, "batchfit snapshot: %v\n", err)
		return exitPlan
	}
	snap := s.snapshot(c.at)
	names := memviz.NewNames(s.step.program, memviz.Options{})
	n, err := writeFile(c.out, stdout, func(w io.Writer) error {
		switch c.format {
		case formatPprof:
			return memviz.WritePprof(w, snap, names)
		case formatFolded:
			return memviz.WriteFolded(w, snap, names)
		case formatHTML:
			return writeHTMLPage(w, c.step, s, measured)
		}
		return memviz.WritePickle(w, snap)
	})
	if err != nil {
		fmt.Fprintf(stderr, "batchfit snapshot: %v\n", err)
		return exitPlan
	}
	summary := stdout
	if c.out == "-" {
		summary = stderr
	}
	d := snap.Devices[0]
	blocks := 0
	for _, seg := range d.Segments {
		for _, b := range seg.Blocks {
			if b.State == alloc.ActiveAllocated {
				blocks++
			}
		}
	}
	tw := tabwriter.NewWriter(summary, 0, 0, 2, ' ', 0)
	line := func(k, format string, args ...any) { fmt.Fprintf(tw, "%s\t%s\n", k, fmt.Sprintf(format, args...)) }
	line("model", "%s: %s", c.step.model.name, c.step.model.about)
	line("step", "%s", stepLine(c.step, s.plan))
	line("snapshot", "%s", s.where(c.at))
	peak := s.sim.Usage
	line("allocated", "%s in %d %s%s", exact(d.Allocated()), blocks, plural(blocks, "block"), peakNote(d.Allocated(), peak.PeakAllocated, "allocated"))
	line("reserved", "%s in %d %s%s", exact(d.Reserved()), len(d.Segments), plural(len(d.Segments), "segment"), peakNote(d.Reserved(), peak.PeakReserved, "reserved"))
	if c.format == formatPickle {
		line("trace", "%d allocator events", len(d.Trace))
	}
	line("wrote", "%s (%s, %s)%s", c.out, c.format, alloc.FormatBytes(n), viewHint(c.format, c.out))
	tw.Flush()
	return exitOK
}

// peakNote says whether v, a figure of the snapshot, is the step's peak
// of what (allocated or reserved bytes): the two peaks need not come at
// the same point of the step, and a snapshot shows one point.
func peakNote(v, peak int64, what string) string {
	if v == peak {
		return ": the step's peak " + what
	}
	return fmt.Sprintf("; the step's peak %s, %s, is at another point", what, alloc.FormatBytes(peak))
}

// viewHint says how to look at a written file.
func viewHint(format, path string) string {
	switch format {
	case formatPprof:
		return ": go tool pprof -top " + path
	case formatFolded:
		return ": flamegraph.pl " + path + " > flame.svg"
	case formatHTML:
		return ": open it in a browser (it needs no network)"
	}
	return ": open it at https://pytorch.org/memory_viz"
}
