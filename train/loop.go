// Package train runs the loop around a training step: a number of steps
// from a start (a resumed run's), an evaluation every k steps, a
// checkpoint callback every k steps and after the last, and one log line
// per interval with the step, the interval's mean loss, the learning
// rate, tokens/s or samples/s, the allocator's reserved and peak bytes
// and the time left:
//
//	step 120/5000  loss 3.4121  lr 3.00e-04  41.2k tok/s  mem 6.43 GiB (peak 6.51 GiB)  eta 1h02m
//
// The step itself is the caller's (a function that builds the graph over
// the next batch and calls batchfit.Session.Step); package train owns no
// model, data or optimizer, so it has no opinion on any of them.
package train

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"strings"
	"time"

	"github.com/batchfit/batchfit/alloc"
)

// Result is what one step reports.
type Result struct {
	Loss float32
	// Tokens and Samples are what the step trained on; the log's rate is
	// tokens/s when Tokens is set, samples/s when only Samples is, and
	// absent when neither is.
	Tokens, Samples int
	// LR is the learning rate the step used (0: not logged).
	LR float64
}

// StepFunc runs training step step (0-based) and reports it.
type StepFunc func(ctx context.Context, step int) (Result, error)

// Config configures Run.
type Config struct {
	// Steps is the step count of the whole run; Run runs steps Start…Steps−1.
	Steps, Start int
	// LogEvery writes a log line every LogEvery steps and after the last
	// (0: 10).
	LogEvery int
	// Eval, when set, runs every EvalEvery steps (0: only after the last)
	// and its loss is logged: "eval step 500  loss 3.2011".
	Eval      func(ctx context.Context, step int) (float32, error)
	EvalEvery int
	// Checkpoint, when set, runs every CheckpointEvery steps (0: only
	// after the last) and after the last, given the steps done: the Start
	// of a run resumed from it.
	Checkpoint      func(ctx context.Context, done int) error
	CheckpointEvery int
	// Allocator, when set, is read for the log's memory: its reserved
	// bytes now and their peak (batchfit.Session.Allocator).
	Allocator *alloc.Allocator
	// Out gets the log lines (nil: os.Stderr).
	Out io.Writer
	// Now is the clock (nil: time.Now).
	Now func() time.Time
}

// Summary is what Run did.
type Summary struct {
	Steps    int     // steps run
	Loss     float32 // the last step's
	EvalLoss float32 // the last evaluation's (0 without one)
	Elapsed  time.Duration
}

// ErrConfig is Run's error for a configuration out of range.
var ErrConfig = errors.New("train: invalid configuration")

// Run runs steps Start…Steps−1 of step, with evaluations, checkpoints and
// log lines as cfg says, until the last, the first error (returned, with
// the step it came from), or ctx's end (its error).
func Run(ctx context.Context, cfg Config, step StepFunc) (Summary, error) {
	if step == nil || cfg.Steps < 0 || cfg.Start < 0 || cfg.Start > cfg.Steps || cfg.LogEvery < 0 || cfg.EvalEvery < 0 || cfg.CheckpointEvery < 0 {
		return Summary{}, fmt.Errorf("%w: steps %d from %d, log every %d, eval every %d, checkpoint every %d (nil step: %v)",
			ErrConfig, cfg.Steps, cfg.Start, cfg.LogEvery, cfg.EvalEvery, cfg.CheckpointEvery, step == nil)
	}
	if cfg.LogEvery == 0 {
		cfg.LogEvery = 10
	}
	if cfg.Out == nil {
		cfg.Out = os.Stderr
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	every := func(k, done int) bool { return done == cfg.Steps || k > 0 && done%k == 0 }
	var (
		sum   Summary
		iv    interval
		start = cfg.Now()
	)
	iv.reset(start)
	for s := cfg.Start; s < cfg.Steps; s++ {
		if err := ctx.Err(); err != nil {
			sum.Elapsed = cfg.Now().Sub(start)
			return sum, err
		}
		r, err := step(ctx, s)
		if err != nil {
			sum.Elapsed = cfg.Now().Sub(start)
			return sum, fmt.Errorf("step %d: %w", s, err)
		}
		done := s + 1
		sum.Steps++
		sum.Loss = r.Loss
		iv.add(r)
		if every(cfg.LogEvery, done) {
			now := cfg.Now()
			fmt.Fprintln(cfg.Out, iv.line(cfg, done, now))
			iv.reset(now)
		}
		if cfg.Eval != nil && every(cfg.EvalEvery, done) {
			l, err := cfg.Eval(ctx, done)
			if err != nil {
				sum.Elapsed = cfg.Now().Sub(start)
				return sum, fmt.Errorf("eval after step %d: %w", s, err)
			}
			sum.EvalLoss = l
			fmt.Fprintf(cfg.Out, "eval step %d  loss %.4f\n", done, l)
		}
		if cfg.Checkpoint != nil && every(cfg.CheckpointEvery, done) {
			if err := cfg.Checkpoint(ctx, done); err != nil {
				sum.Elapsed = cfg.Now().Sub(start)
				return sum, fmt.Errorf("checkpoint after step %d: %w", s, err)
			}
		}
	}
	sum.Elapsed = cfg.Now().Sub(start)
	return sum, nil
}

// interval accumulates the steps since the last log line.
type interval struct {
	since           time.Time
	steps           int
	loss            float64
	tokens, samples int
	lr              float64
}

func (iv *interval) reset(now time.Time) { *iv = interval{since: now} }

func (iv *interval) add(r Result) {
	iv.steps++
	iv.loss += float64(r.Loss)
	iv.tokens += r.Tokens
	iv.samples += r.Samples
	iv.lr = r.LR
}

// line is the interval's log line, done steps of cfg.Steps done at now.
func (iv *interval) line(cfg Config, done int, now time.Time) string {
	var b strings.Builder
	width := len(fmt.Sprint(cfg.Steps))
	fmt.Fprintf(&b, "step %*d/%d  loss %.4f", width, done, cfg.Steps, iv.loss/float64(iv.steps))
	if iv.lr != 0 {
		fmt.Fprintf(&b, "  lr %.2e", iv.lr)
	}
	secs := now.Sub(iv.since).Seconds()
	switch {
	case secs <= 0:
	case iv.tokens > 0:
		fmt.Fprintf(&b, "  %s tok/s", si(float64(iv.tokens)/secs))
	case iv.samples > 0:
		fmt.Fprintf(&b, "  %s samples/s", si(float64(iv.samples)/secs))
	}
	if cfg.Allocator != nil {
		r := cfg.Allocator.Stats().ReservedBytes[alloc.All]
		fmt.Fprintf(&b, "  mem %s (peak %s)", alloc.FormatBytes(r.Current), alloc.FormatBytes(r.Peak))
	}
	if left := cfg.Steps - done; left > 0 && secs > 0 {
		fmt.Fprintf(&b, "  eta %s", eta(time.Duration(float64(left)*secs/float64(iv.steps)*float64(time.Second))))
	}
	return b.String()
}

// si writes x with three significant digits and a k, M or G suffix.
func si(x float64) string {
	for _, u := range []struct {
		div float64
		sfx string
	}{{1e9, "G"}, {1e6, "M"}, {1e3, "k"}} {
		if x >= u.div {
			return fmt.Sprintf("%.3g%s", x/u.div, u.sfx)
		}
	}
	return fmt.Sprintf("%.3g", x)
}

// eta writes d as 1h02m, 4m05s or 12s.
func eta(d time.Duration) string {
	s := int64(math.Round(d.Seconds()))
	switch {
	case s >= 3600:
		return fmt.Sprintf("%dh%02dm", s/3600, s%3600/60)
	case s >= 60:
		return fmt.Sprintf("%dm%02ds", s/60, s%60)
	}
	return fmt.Sprintf("%ds", s)
}
