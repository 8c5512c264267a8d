package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"runtime/debug"
	"strconv"
	"strings"
	"text/tabwriter"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/compile"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/optim"
	"github.com/batchfit/batchfit/planner"
	"github.com/batchfit/batchfit/precision"
	"github.com/batchfit/batchfit/recompute"
)

func main() {
	tuneGC()
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

// tuneGC sets the collector for a command that reads large files: a soft
// memory limit of 768 MiB, near which the heap is collected as often as
// needed, and otherwise a collection at 4× the live heap rather than 2×,
// which halves the collector's work on a snapshot of a million blocks
// (about a third of the command's time at GOGC's default). GOGC and
// GOMEMLIMIT, when set, win.
func tuneGC() {
	if os.Getenv("GOMEMLIMIT") == "" {
		debug.SetMemoryLimit(768 << 20)
	}
	if os.Getenv("GOGC") == "" {
		debug.SetGCPercent(300)
	}
}

// Exit codes.
const (
	exitOK    = 0
	exitPlan  = 1 // the plan failed (does not fit, the model did not build) or a file could not be read or written
	exitUsage = 2 // bad subcommand, flag or argument
)

// Usage errors: each wraps errUsage and one kind.
var (
	errUsage         = errors.New("usage")
	errMissing       = errors.New("missing")
	errUnknown       = errors.New("unknown name")
	errRange         = errors.New("out of range")
	errNotApplicable = errors.New("does not apply")
	errFlag          = errors.New("bad flag or argument")
)

// usageError is a command-line mistake, reported in one line and followed
// by where to find the flags (usageFailed).
type usageError struct {
	kind error
	msg  string
}

func (e *usageError) Error() string   { return e.msg }
func (e *usageError) Unwrap() []error { return []error{errUsage, e.kind} }

func usagef(kind error, format string, args ...any) error {
	return &usageError{kind: kind, msg: fmt.Sprintf(format, args...)}
}

const mainUsage = `Usage:
  batchfit estimate --model NAME|--hf-config FILE --batch N --budget SIZE|--gpu CARD|--gpu-memory SIZE [flags]
  batchfit snapshot --model NAME|--hf-config FILE --batch N --budget SIZE [flags] -o FILE
  batchfit report --model NAME|--hf-config FILE --batch N --budget SIZE [flags]
  batchfit report FILE
  batchfit compare [flags] BEFORE AFTER
  batchfit models
  batchfit launch -n N -- PROGRAM [ARGS...]

Subcommands:
  estimate   plan one training (or inference) step of a zoo model (or of a
             Hugging Face config.json, --hf-config) within a memory budget,
             without a GPU: chunk size, predicted peak, timeline
  snapshot   write the allocator snapshot of a planned step at its predicted
             peak (or after it): a pickle for pytorch.org/memory_viz, a pprof
             profile or folded stacks
  report     list the tensors live at the predicted peak, named, with totals;
             --profile adds the per-op memory profile, --run measures it
  compare    compare two snapshot files: segments only before and only after,
             or the bytes under each stack
  models     list the model zoo with parameter counts
  calibrate  time GEMMs, elementwise kernels and launches on the GPU and
             write a cost-model profile for estimate --profile (needs CUDA)
  launch     start N processes with torchrun's variables (RANK, WORLD_SIZE,
             MASTER_ADDR, ...) for data-parallel training, output prefixed

Run "batchfit SUBCOMMAND -h" for its flags.
`

// usageFailed reports a usage mistake of subcommand sub (or of the command
// line itself when sub is ""): the mistake in one line, then one line
// saying where the flags are, not the whole list, which would scroll the
// mistake away. It returns exitUsage; a model file that cannot be read
// (a *modelFileError) or a model that does not build (a *buildError) is
// reported in one line and returns exitPlan.
func usageFailed(stderr io.Writer, sub string, err error) int {
	var (
		mf *modelFileError
		be *buildError
	)
	if errors.As(err, &mf) || errors.As(err, &be) { // a file that cannot be read, a model that does not build: exit 1
		fmt.Fprintf(stderr, "batchfit %s: %v\n", sub, err)
		return exitPlan
	}
	if sub == "" {
		fmt.Fprintf(stderr, "batchfit: %v\nRun 'batchfit help' for the subcommands (docs/cli.md describes them all).\n", err)
		return exitUsage
	}
	fmt.Fprintf(stderr, "batchfit %s: %v\nRun 'batchfit %s -h' for its flags (docs/cli.md describes them all).\n", sub, err, sub)
	return exitUsage
}

// run is the whole command, so tests can call it; it returns the exit code.
func run(args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		return usageFailed(stderr, "", errors.New("missing subcommand"))
	}
	switch args[0] {
	case "estimate":
		return runEstimate(args[1:], stdout, stderr)
	case "snapshot":
		return runSnapshot(args[1:], stdout, stderr)
	case "report":
		return runReport(args[1:], os.Stdin, stdout, stderr)
	case "compare":
		return runCompare(args[1:], os.Stdin, stdout, stderr)
	case "models":
		return runModels(args[1:], stdout, stderr)
	case "calibrate":
		return runCalibrate(args[1:], stdout, stderr)
	case "launch":
		return runLaunch(args[1:], stdout, stderr)
	case "help", "-h", "-help", "--help":
		fmt.Fprint(stdout, mainUsage)
		return exitOK
	}
	return usageFailed(stderr, "", fmt.Errorf("unknown subcommand %q (want estimate, snapshot, report, compare, models, calibrate or launch)", args[0]))
}

// optimizers maps a name to the optimizer whose state the plan holds.
var optimizers = []struct {
	name string
	make func() optim.Optimizer
}{
	{"sgd", func() optim.Optimizer { return optim.NewSGD(0.1, 0) }},
	{"sgd-momentum", func() optim.Optimizer { return optim.NewSGD(0.1, 0.9) }},
	{"adam", func() optim.Optimizer { return optim.NewAdam(1e-3) }},
	{"adamw", func() optim.Optimizer { return optim.NewAdamW(1e-3) }},
}

// makeOptimizer returns the optimizer named name (one of optimizers).
func makeOptimizer(name string) optim.Optimizer {
	for _, o := range optimizers {
		if o.name == name {
			return o.make()
		}
	}
	return nil
}

func optimizerNames() []string {
	var names []string
	for _, o := range optimizers {
		names = append(names, o.name)
	}
	return names
}

// estimateConfig is a parsed estimate command line.
type estimateConfig struct {
	model            zooModel
	batch, seq       int
	microBatch       int  // --micro-batch: planner.Options.MaxChunk
	lossChunk        int  // --loss-chunk: batchfit.Options.LossChunk
	noFusedLoss      bool // --no-fused-loss: batchfit.Options.NoFusedLoss
	budget, headroom int64
	optimizer        string // "" in inference mode
	slots            int    // optimizer state tensors per parameter
	dtype            graph.DType
	policy           precision.Policy // --precision
	train            bool
	table            bool
	top              int
	json             bool
	device           *device          // --gpu or --gpu-memory: plan as a CUDA session on it; nil for --budget
	perChunk         bool             // --batchnorm per-chunk: nn.Options.PerChunkStats
	offload          batchfit.Offload // --offload: batchfit.Options.Offload
	nchw             bool             // --nchw: conv nets stay NCHW under bf16-mixed (batchfit.Options.NoChannelsLast)
	recompute        recompute.Mode
	profile          recompute.Profile
	plot             string
	passes           bool     // --passes: print the pipeline's reports
	levers           bool     // --levers: print the lever settings the session weighed
	disable          []string // --disable-passes: batchfit.Options.DisablePasses
	// lora is --lora's adapters (nil without): applied to the zoo model
	// before its step is built (adapt).
	lora *nn.LoRA
	zero *zeroConfig // --ranks, --zero: plan one data-parallel rank
}

// adapt is c's --lora applied to a model, nil without --lora.
func (c *estimateConfig) adapt() adaptFunc {
	if c == nil || c.lora == nil {
		return nil
	}
	l := *c.lora
	return func(opt nn.Options, m nn.Module) error {
		opt.DType = graph.InvalidDType // the adapters are float32 whatever --dtype says
		_, err := l.Apply(opt, m)
		return err
	}
}

// stepFlagValues are the flags that describe one step of a zoo model,
// shared by estimate, snapshot and report.
type stepFlagValues struct {
	model, hfConfig, budget, headroom, optimizer, dtype, mode, precision, batchnorm, offload string
	batch, seq, context, microBatch, lossChunk                                               int
	nchw, noFusedLoss                                                                        bool
}

// addStepFlags defines the step flags on fs.
func addStepFlags(fs *flag.FlagSet, v *stepFlagValues) {
	fs.StringVar(&v.model, "model", "", "zoo `model`: "+strings.Join(zooNames(), ", ")+" (required, unless --hf-config)")
	fs.StringVar(&v.hfConfig, "hf-config", "", "a Hugging Face config.json `FILE` (or a checkpoint directory holding one) to plan instead of a zoo --model: "+
		hfArchitectures()+"; --seq defaults to its max_position_embeddings (n_positions for GPT-2), at most "+thousands(maxHFSeqDefault))
	fs.IntVar(&v.batch, "batch", 0, "samples per step, `N` (required)")
	fs.IntVar(&v.microBatch, "micro-batch", 0, "largest chunk, `N` samples, the plan may use, as batchfit.Options.MaxChunk: a fixed micro-batch, gradient accumulation over chunks of at most N even where the budget holds more (0: as large as the budget allows)")
	fs.IntVar(&v.lossChunk, "loss-chunk", 0, "tokens per logits chunk of a language model's fused head and loss, `N`, as batchfit.Options.LossChunk (0: the planner's choice, the largest power of two from 8192 down that fits)")
	fs.BoolVar(&v.noFusedLoss, "no-fused-loss", false, "keep a language model's head and cross-entropy as two ops, storing the [tokens, vocab] logits and their gradient, as batchfit.Options.NoFusedLoss")
	fs.IntVar(&v.seq, "seq", 0, "tokens per sequence, `T`, for GPT models (default: the model's context)")
	fs.IntVar(&v.context, "context", 0, "positions of a GPT model, `P`: its learned position embedding gets P rows, so --seq may go up to P (default: the zoo's, 1024 for GPT-2)")
	fs.StringVar(&v.budget, "budget", "", "device memory the step may reserve, a `SIZE`: 24GiB, 24 GiB, 8GB (8·10⁹), 1.5GiB, 512MiB or bytes (required)")
	fs.StringVar(&v.headroom, "headroom", alloc.FormatBytes(planner.DefaultHeadroom), "`SIZE` kept back from the budget")
	fs.StringVar(&v.optimizer, "optimizer", "adamw", "`optimizer` whose state is held: "+strings.Join(optimizerNames(), ", "))
	fs.StringVar(&v.precision, "precision", "fp32", "precision `policy` the step runs with, as batchfit.Options.Precision: "+precision.Names()+
		" (mixed: matrix products from 16-bit copies, float32 parameters, gradients and optimizer state)")
	fs.StringVar(&v.dtype, "dtype", "float32", "element `type` of everything, parameters, activations, gradients and optimizer state alike: float32, float16, bfloat16 (a pure 16-bit what-if no Session runs; see --precision)")
	fs.StringVar(&v.mode, "mode", "train", "train (forward, loss, backward, optimizer state) or infer (forward only)")
	fs.BoolVar(&v.nchw, "nchw", false, "keep conv nets' activations NCHW under --precision bf16-mixed, as batchfit.Options.NoChannelsLast (by default their bfloat16 convolutions run channels last there, as a Session's do)")
	fs.StringVar(&v.offload, "offload", "none", "`what` lives in host memory: none, optimizer (ZeRO-Offload, as batchfit.Options.Offload: float32 master weights and Adam's moments in pinned host memory, bfloat16 weights and gradients on the device; needs --precision bf16-mixed and --optimizer adam or adamw) or auto (both planned, the faster predicted that fits; see --levers)")
	fs.StringVar(&v.batchnorm, "batchnorm", "whole", "`statistics` training-mode batch norm normalises with: whole (the batch's, PyTorch's default; the step runs in one chunk) or per-chunk (each chunk's own, as gradient accumulation does; nn.Options.PerChunkStats)")
}

func estimateFlags() (*flag.FlagSet, *estimateFlagValues) {
	fs := flag.NewFlagSet("estimate", flag.ContinueOnError)
	fs.SetOutput(io.Discard) // errors are reported by runEstimate, in one line
	v := &estimateFlagValues{}
	addStepFlags(fs, &v.stepFlagValues)
	addDeviceFlags(fs, &v.device)
	fs.BoolVar(&v.table, "table", false, "print the per-op memory timeline of the first chunk")
	fs.IntVar(&v.top, "top", 0, "list the `N` largest buffers")
	fs.BoolVar(&v.json, "json", false, "print the plan as JSON")
	fs.BoolVar(&v.passes, "passes", false, "print what each graph pass of the pipeline did: ran or why not, nodes and bytes before and after")
	fs.BoolVar(&v.levers, "levers", false, "print every setting of the memory levers the session weighed (loss chunk, optimizer offload with --offload auto, recompute, batch chunks) with its peak and predicted step time")
	fs.StringVar(&v.disable, "disable-passes", "", "comma-separated graph `passes` the step leaves out, as batchfit.Options.DisablePasses: "+
		strings.Join(compile.Names(), ", "))
	addRecomputeFlags(fs, &v.recompute)
	fs.IntVar(&v.lora.rank, "lora", 0, "LoRA fine-tune: adapters of rank `R` on --lora-targets, the base frozen in bfloat16 (nn.LoRA): the plan holds the base's 16-bit weights without gradients or optimizer state, the adapters' float32 weights, gradients and state (0: train every parameter)")
	fs.StringVar(&v.lora.targets, "lora-targets", "q_proj,k_proj,v_proj,o_proj", "comma-separated `modules` --lora adapts (PEFT's target_modules: "+strings.Join(nn.DefaultLoRATargets, ",")+" for a Llama)")
	fs.Float64Var(&v.lora.alpha, "lora-alpha", 0, "--lora's `alpha`: the adapters' update is scaled by alpha/rank (0: the rank; the plan does not depend on it)")
	addZeROFlags(fs, &v.zero)
	return fs, v
}

type estimateFlagValues struct {
	stepFlagValues
	device      deviceFlagValues
	recompute   recomputeFlagValues
	lora        loraFlagValues
	zero        zeroFlagValues
	top         int
	table, json bool
	passes      bool
	levers      bool
	disable     string
}

// loraFlagValues are estimate's --lora flags.
type loraFlagValues struct {
	rank    int
	targets string
	alpha   float64
}

// apply checks the flags into c; set holds the flags given.
func (v *loraFlagValues) apply(c *estimateConfig, set map[string]bool) error {
	if !set["lora"] {
		for _, f := range []string{"lora-targets", "lora-alpha"} {
			if set[f] {
				return usagef(errNotApplicable, "--%s applies with --lora RANK only", f)
			}
		}
		return nil
	}
	if !c.train {
		return usagef(errNotApplicable, "--lora applies to --mode train only")
	}
	var targets []string
	for _, t := range strings.Split(v.targets, ",") {
		if t = strings.TrimSpace(t); t != "" {
			targets = append(targets, t)
		}
	}
	l := nn.LoRA{Rank: v.rank, Alpha: v.alpha, Targets: targets}
	if err := l.Check(); err != nil {
		return usagef(errRange, "--lora %d --lora-targets %q --lora-alpha %g: %v", v.rank, v.targets, v.alpha, err)
	}
	c.lora = &l
	return nil
}

// parseFlags parses args with fs; every error is a *usageError (or
// flag.ErrHelp). Flags and positional arguments may come in any order;
// "--" ends the flags. It returns the positional arguments and the flags
// set.
func parseFlags(fs *flag.FlagSet, args []string) ([]string, map[string]bool, error) {
	args = joinSizeUnits(fs, args)
	var pos []string
	for {
		if err := fs.Parse(args); err != nil {
			if errors.Is(err, flag.ErrHelp) {
				return nil, nil, err
			}
			return nil, nil, usagef(errFlag, "%v", err)
		}
		rest := fs.Args()
		if len(rest) == 0 {
			break
		}
		if len(args) > len(rest) && args[len(args)-len(rest)-1] == "--" {
			pos = append(pos, rest...)
			break
		}
		pos = append(pos, rest[0])
		args = rest[1:]
	}
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	return pos, set, nil
}

// joinSizeUnits reads a size whose unit came as an argument of its own,
// "--budget 24 GB" (the space unquoted), as "--budget '24 GB'": the value
// of a SIZE flag (its usage names it `SIZE`) that is a plain number,
// followed by an argument that is a unit alone. "--" ends the flags.
func joinSizeUnits(fs *flag.FlagSet, args []string) []string {
	isNumber := func(v string) bool {
		return v != "" && strings.Trim(v, "0123456789.") == "" && strings.Count(v, ".") <= 1
	}
	isUnit := func(u string) bool {
		if u == "" || strings.ContainsAny(u, "0123456789.-=") {
			return false
		}
		_, err := alloc.ParseBytes("1" + u)
		return err == nil
	}
	out := make([]string, 0, len(args))
	for i := 0; i < len(args); i++ {
		a := args[i]
		if a == "--" {
			return append(out, args[i:]...)
		}
		name, value, inline := strings.Cut(strings.TrimPrefix(strings.TrimPrefix(a, "-"), "-"), "=")
		f := fs.Lookup(name)
		if !strings.HasPrefix(a, "-") || f == nil {
			out = append(out, a)
			continue
		}
		if kind, _ := flag.UnquoteUsage(f); kind != "SIZE" {
			out = append(out, a)
			continue
		}
		switch {
		case inline && i+1 < len(args) && isNumber(value) && isUnit(args[i+1]):
			out = append(out, a+" "+args[i+1])
			i++
		case !inline && i+2 < len(args) && isNumber(args[i+1]) && isUnit(args[i+2]):
			out = append(out, a, args[i+1]+" "+args[i+2])
			i += 2
		default:
			out = append(out, a)
		}
	}
	return out
}

// parseEstimate reads the estimate flags; every error is a *usageError
// (or flag.ErrHelp).
func parseEstimate(args []string) (*estimateConfig, error) {
	fs, v := estimateFlags()
	pos, set, err := parseFlags(fs, args)
	if err != nil {
		return nil, err
	}
	if len(pos) > 0 {
		return nil, usagef(errFlag, "unexpected argument %q (flags only)", pos[0])
	}
	d, err := v.device.resolve(set)
	if err != nil {
		return nil, err
	}
	if d != nil { // the card's budget stands in for --budget
		v.budget, set["budget"] = strconv.FormatInt(d.Budget, 10), true
	}
	c, err := v.config(set)
	if err != nil {
		return nil, err
	}
	c.table, c.top, c.json, c.device, c.passes, c.levers = v.table, v.top, v.json, d, v.passes, v.levers
	if v.top < 0 {
		return nil, usagef(errRange, "--top must not be negative, got %d", v.top)
	}
	if v.disable != "" {
		for _, n := range strings.Split(v.disable, ",") {
			c.disable = append(c.disable, strings.TrimSpace(n))
		}
		if err := compile.Check(c.disable); err != nil {
			return nil, usagef(errUnknown, "--disable-passes: %v", err)
		}
	}
	if err := v.recompute.apply(c); err != nil {
		return nil, err
	}
	if err := v.lora.apply(c, set); err != nil {
		return nil, err
	}
	if c.lora != nil && c.offload != batchfit.OffloadNone {
		return nil, usagef(errNotApplicable, "--offload %s and --lora exclude each other: a LoRA step's optimizer state is its adapters' only", c.offload)
	}
	if err := v.zero.apply(c, set); err != nil {
		return nil, err
	}
	if c.zero != nil && c.offload != batchfit.OffloadNone {
		return nil, usagef(errNotApplicable, "--offload %s plans one device's step; --ranks and --zero shard it instead", c.offload)
	}
	return c, nil
}

// config checks the step flags; set holds the flags given.
func (v *stepFlagValues) config(set map[string]bool) (*estimateConfig, error) {
	c := &estimateConfig{batch: v.batch}
	var m zooModel
	switch {
	case set["model"] && set["hf-config"]:
		return nil, usagef(errFlag, "--model and --hf-config exclude each other")
	case set["hf-config"] && v.hfConfig == "":
		return nil, usagef(errMissing, "--hf-config: empty path (want a config.json or a checkpoint directory)")
	case set["hf-config"]:
		var err error
		if m, err = hfModel(v.hfConfig); err != nil {
			return nil, err
		}
	case v.model == "":
		return nil, usagef(errMissing, "missing --model (one of %s) or --hf-config FILE", strings.Join(zooNames(), ", "))
	default:
		var ok bool
		if m, ok = findModel(v.model); !ok {
			return nil, usagef(errUnknown, "unknown model %q (want one of %s)", v.model, strings.Join(zooNames(), ", "))
		}
	}
	if set["context"] {
		switch {
		case m.withContext == nil:
			return nil, usagef(errNotApplicable, "--context applies to GPT models only, not %s", m.name)
		case v.context < 1:
			return nil, usagef(errRange, "--context must be positive, got %d", v.context)
		}
		m = m.withContext(v.context)
	}
	c.model = m
	switch {
	case !set["batch"]:
		return nil, usagef(errMissing, "missing --batch")
	case v.batch <= 0:
		return nil, usagef(errRange, "--batch must be positive, got %d", v.batch)
	case v.microBatch < 0:
		return nil, usagef(errRange, "--micro-batch must be 0 or positive, got %d", v.microBatch)
	}
	c.microBatch = v.microBatch
	if v.lossChunk < 0 {
		return nil, usagef(errRange, "--loss-chunk must be 0 or positive, got %d", v.lossChunk)
	}
	c.lossChunk, c.noFusedLoss = v.lossChunk, v.noFusedLoss
	switch {
	case m.context == 0 && set["seq"]:
		return nil, usagef(errNotApplicable, "--seq applies to sequence models only, not %s", m.name)
	case m.context == 0:
	case !set["seq"] && m.seqDefault > 0:
		c.seq = m.seqDefault
	case !set["seq"]:
		c.seq = m.context
	case v.seq < 1 || v.seq > m.context:
		return nil, usagef(errRange, "--seq must lie in 1…%d (the context of %s), got %d", m.context, m.name, v.seq)
	default:
		c.seq = v.seq
	}
	if m.checkSeq != nil {
		if err := m.checkSeq(c.seq); err != nil {
			return nil, err
		}
	}
	if !set["budget"] {
		return nil, usagef(errMissing, "missing --budget (for example 24GiB)")
	}
	var err error
	if c.budget, err = alloc.ParseBytes(v.budget); err != nil {
		return nil, &usageError{kind: alloc.ErrSize, msg: "--budget: " + err.Error()}
	}
	if c.budget == 0 {
		return nil, usagef(errRange, "--budget must be positive")
	}
	if c.headroom, err = alloc.ParseBytes(v.headroom); err != nil {
		return nil, &usageError{kind: alloc.ErrSize, msg: "--headroom: " + err.Error()}
	}
	if c.headroom >= c.budget {
		return nil, usagef(errRange, "--headroom %s leaves nothing of --budget %s",
			alloc.FormatBytes(c.headroom), alloc.FormatBytes(c.budget))
	}
	switch v.mode {
	case "train":
		c.train = true
	case "infer":
		if set["optimizer"] {
			return nil, usagef(errNotApplicable, "--optimizer applies to --mode train only")
		}
	default:
		return nil, usagef(errUnknown, "unknown mode %q (want train or infer)", v.mode)
	}
	if c.train {
		o := makeOptimizer(v.optimizer)
		if o == nil {
			return nil, usagef(errUnknown, "unknown optimizer %q (want one of %s)", v.optimizer, strings.Join(optimizerNames(), ", "))
		}
		c.optimizer, c.slots = v.optimizer, o.StateSlots()
	}
	c.dtype, err = graph.ParseDType(v.dtype)
	if err != nil || !c.dtype.IsFloat() {
		return nil, usagef(errUnknown, "unknown --dtype %q (want float32, float16 or bfloat16)", v.dtype)
	}
	if v.precision == "" { // the library reads "" as fp32; on the command line it is a mistake
		return nil, usagef(errUnknown, "--precision: empty (want %s)", precision.Names())
	}
	if c.policy, err = precision.Parse(v.precision); err != nil {
		return nil, usagef(errUnknown, "--precision: %v", err)
	}
	if c.policy != precision.FP32 && c.dtype != graph.Float32 {
		return nil, usagef(errNotApplicable, "--dtype %s (everything in 16 bits) and --precision %s exclude each other", c.dtype, c.policy)
	}
	c.nchw = v.nchw
	if c.offload, err = batchfit.ParseOffload(v.offload); err != nil {
		return nil, usagef(errUnknown, "--offload: unknown %q (want none, optimizer or auto)", v.offload)
	}
	if c.offload != batchfit.OffloadNone {
		switch {
		case !c.train:
			return nil, usagef(errNotApplicable, "--offload %s applies to --mode train only", c.offload)
		case c.policy != precision.BF16Mixed:
			return nil, usagef(errNotApplicable, "--offload %s keeps bfloat16 weights on the device: it needs --precision bf16-mixed, not %s", c.offload, c.policy)
		case c.optimizer != "adam" && c.optimizer != "adamw":
			return nil, usagef(errNotApplicable, "--offload %s runs Adam and AdamW on the host, not --optimizer %s", c.offload, c.optimizer)
		}
	}
	switch v.batchnorm {
	case "whole":
	case "per-chunk":
		c.perChunk = true
	default:
		return nil, usagef(errUnknown, "unknown --batchnorm %q (want whole or per-chunk)", v.batchnorm)
	}
	return c, nil
}

func estimateUsage(w io.Writer) {
	fs, _ := estimateFlags()
	fmt.Fprintf(w, "Usage:\n  batchfit estimate --model NAME|--hf-config FILE --batch N --budget SIZE|--gpu CARD|--gpu-memory SIZE [flags]\n\nFlags (one dash or two):\n")
	fs.SetOutput(w)
	fs.PrintDefaults()
}

func runEstimate(args []string, stdout, stderr io.Writer) int {
	c, err := parseEstimate(args)
	if errors.Is(err, flag.ErrHelp) {
		estimateUsage(stdout)
		return exitOK
	}
	if err != nil {
		return usageFailed(stderr, "estimate", err)
	}
	rep, err := estimate(c)
	if rep != nil {
		if c.json {
			if jerr := writeJSON(stdout, rep); jerr != nil {
				fmt.Fprintf(stderr, "batchfit estimate: %v\n", jerr)
				return exitPlan
			}
		} else {
			writeText(stdout, rep, err == nil)
		}
	}
	if err != nil {
		fmt.Fprintf(stderr, "batchfit estimate: %v\n", err)
		return exitPlan
	}
	if c.plot != "" {
		if err := writePlot(c, stdout, stderr); err != nil {
			fmt.Fprintf(stderr, "batchfit estimate: --plot: %v\n", err)
			return exitPlan
		}
	}
	return exitOK
}

func runModels(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("models", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	usage := "Usage:\n  batchfit models\n"
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			fmt.Fprint(stdout, usage)
			return exitOK
		}
		return usageFailed(stderr, "models", err)
	}
	if fs.NArg() > 0 {
		return usageFailed(stderr, "models", fmt.Errorf("unexpected argument %q", fs.Arg(0)))
	}
	tw := tabwriter.NewWriter(stdout, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "MODEL\tPARAMETERS\tFLOAT32\tINPUT PER SAMPLE\tDESCRIPTION")
	for _, m := range zoo() {
		b := m.build(nn.Options{ShapeOnly: true}, 1, m.context, false, nil, nil)
		if err := nn.Check(b.module); err != nil {
			fmt.Fprintf(stderr, "batchfit models: %s: %v\n", m.name, err)
			return exitPlan
		}
		n := int64(nn.NumParams(b.module))
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\n", m.name, thousands(n), alloc.FormatBytes(4*n), m.input, m.about)
	}
	if err := tw.Flush(); err != nil {
		fmt.Fprintf(stderr, "batchfit models: %v\n", err)
		return exitPlan
	}
	return exitOK
}

// thousands groups digits by three: 124439808 → "124,439,808".
func thousands(n int64) string {
	s := fmt.Sprint(n)
	neg := strings.HasPrefix(s, "-")
	s = strings.TrimPrefix(s, "-")
	var b strings.Builder
	for i, r := range s {
		if i > 0 && (len(s)-i)%3 == 0 {
			b.WriteByte(',')
		}
		b.WriteRune(r)
	}
	if neg {
		return "-" + b.String()
	}
	return b.String()
}
