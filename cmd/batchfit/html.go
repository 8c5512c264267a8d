package main

import (
	"io"
	"path/filepath"
	"strings"

	"github.com/batchfit/batchfit/memviz"
	"github.com/batchfit/batchfit/planner"
)

// formatHTML is the offline memory report page (memviz.WriteHTML). It is a
// snapshot command's output only: no reader takes it back.
const formatHTML = "html"

// isHTMLName reports whether a file name asks for the HTML page.
func isHTMLName(path string) bool {
	name := strings.ToLower(filepath.Base(path))
	return strings.HasSuffix(name, ".html") || strings.HasSuffix(name, ".htm")
}

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
