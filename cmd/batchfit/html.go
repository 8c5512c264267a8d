package main

import (
	"fmt"
	"io"
	"path/filepath"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/memviz"
	"github.com/batchfit/batchfit/planner"
)

// formatHTML is the offline memory report page (memviz.WriteHTML). It is a
// snapshot command's output only: no reader takes it back.
const formatHTML = "html"

// writeHTMLPage writes s's step as memviz's report page, with the
// timeline measured on the CPU executor when not nil.
func writeHTMLPage(w io.Writer, c *estimateConfig, s *simulated, measured []planner.Point) error {
	return memviz.WriteHTML(w, s.step.program, s.plan.Chunks, s.sim, memviz.HTMLOptions{
		Title:    "batchfit memory report: " + c.model.name,
		Subtitle: c.model.about + "; " + stepLine(c, s.plan),
		Plan:     s.plan,
		Measured: measured, MeasuredLabel: "CPU executor",
	})
}

// reportHTML writes the report page of the snapshot file c.file (read by
// the same readers as report FILE) to c.out.
func reportHTML(c *reportConfig, stdin io.Reader, stdout, stderr io.Writer) int {
	f, err := readSnapshotFile(c.file, stdin, formatPickle, "the report page draws a pickle snapshot")
	var n int64
	if err == nil {
		n, err = writeFile(c.out, stdout, func(w io.Writer) error {
			return memviz.WriteHTMLSnapshot(w, *f.snap, memviz.HTMLOptions{
				Title:    "batchfit memory report: " + filepath.Base(c.file),
				Subtitle: fmt.Sprintf("snapshot file %s (%s)", c.file, f.format)})
		})
	}
	if err != nil {
		fmt.Fprintf(stderr, "batchfit report: %v\n", err)
		return exitPlan
	}
	summary := stdout
	if c.out == "-" {
		summary = stderr
	}
	fmt.Fprintf(summary, "wrote %s (html, %s)%s\n", c.out, alloc.FormatBytes(n), viewHint(formatHTML, c.out))
	return exitOK
}
