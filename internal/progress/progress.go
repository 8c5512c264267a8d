// Package progress reports the progress of long command-line work
// (calibrate's timings, estimate's budget sweeps) on the writer the
// command's messages go to: a progress bar
// (github.com/schollz/progressbar/v3, kept up and small, thread-safe,
// ANSI on every OS) when that writer is a terminal, and one plain line per
// finished item otherwise, so logs and pipes get text without carriage
// returns. A nil *Reporter reports nothing.
package progress

import (
	"fmt"
	"io"
	"os"
	"time"

	"github.com/schollz/progressbar/v3"
	"golang.org/x/term"
)

// Reporter reports total items of work named what.
type Reporter struct {
	w     io.Writer
	what  string
	total int
	done  int
	start time.Time
	now   func() time.Time
	bar   *progressbar.ProgressBar // nil: plain lines
}

// New reports to w: a bar when w is a terminal (IsTerminal), plain lines
// otherwise.
func New(w io.Writer, what string, total int) *Reporter {
	r := Lines(w, what, total)
	if IsTerminal(w) {
		r.bar = progressbar.NewOptions(total, progressbar.OptionSetWriter(w), progressbar.OptionSetDescription(what),
			progressbar.OptionShowCount(), progressbar.OptionSetElapsedTime(true), progressbar.OptionSetPredictTime(true),
			progressbar.OptionThrottle(100*time.Millisecond), progressbar.OptionClearOnFinish(), progressbar.OptionSetWidth(30))
	}
	return r
}

// Lines reports to w in plain lines whatever w is.
func Lines(w io.Writer, what string, total int) *Reporter {
	return &Reporter{w: w, what: what, total: total, start: time.Now(), now: time.Now}
}

// IsTerminal reports whether w is a file open on a terminal.
func IsTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	return ok && term.IsTerminal(int(f.Fd()))
}

// Done marks one item finished, item naming it: the bar moves, or a line
// "what: done/total item (elapsed)" is written.
func (r *Reporter) Done(item string) {
	if r == nil {
		return
	}
	r.done++
	if r.bar != nil {
		r.bar.Describe(fmt.Sprintf("%s: %s", r.what, item))
		_ = r.bar.Add(1) // a terminal write error leaves the work going
		return
	}
	fmt.Fprintf(r.w, "%s: %d/%d %s (%s)\n", r.what, r.done, r.total, item, r.now().Sub(r.start).Round(100*time.Millisecond))
}

// Finish ends the report: the bar is cleared from the terminal.
func (r *Reporter) Finish() {
	if r == nil || r.bar == nil {
		return
	}
	_ = r.bar.Finish()
}
