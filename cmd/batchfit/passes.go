package main

import (
	"fmt"
	"io"
	"strings"
	"text/tabwriter"

	"github.com/batchfit/batchfit/alloc"
)

// writePasses prints --passes: a row per graph pass of the pipeline, in
// order: the nodes before and after, and the bytes of the values the
// step's outputs need, and their live peak in node order, before and
// after (shapeinfer at the full batch, before the allocator's rounding);
// or why the pass did not run.
func writePasses(w io.Writer, r *report) {
	if len(r.Passes) == 0 {
		return
	}
	fmt.Fprintln(w, "\ngraph passes, in order (bytes: the values the step needs at the whole batch, and their live peak):")
	var b strings.Builder
	tw := tabwriter.NewWriter(&b, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "PASS\tNODES\tBYTES\tCHANGE\tLIVE PEAK\tCHANGE\tNOTE")
	for _, p := range r.Passes {
		if !p.Ran {
			fmt.Fprintf(tw, "%s\t%s\t-\t-\t-\t-\tskipped: %s\n", p.Name, thousands(int64(p.NodesBefore)), p.Why)
			continue
		}
		nodes := fmt.Sprintf("%s → %s", thousands(int64(p.NodesBefore)), thousands(int64(p.NodesAfter)))
		if !p.Measured {
			fmt.Fprintf(tw, "%s\t%s\t-\t-\t-\t-\t%s\n", p.Name, nodes, p.Detail)
			continue
		}
		fmt.Fprintf(tw, "%s\t%s\t%s → %s\t%s\t%s → %s\t%s\t%s\n", p.Name, nodes,
			alloc.FormatBytes(p.BytesBefore), alloc.FormatBytes(p.BytesAfter), change(p.BytesAfter-p.BytesBefore),
			alloc.FormatBytes(p.PeakBefore), alloc.FormatBytes(p.PeakAfter), change(p.PeakAfter-p.PeakBefore), p.Detail)
	}
	tw.Flush()
	for _, l := range strings.SplitAfter(b.String(), "\n") {
		io.WriteString(w, strings.TrimRight(l, " \n")+strings.Repeat("\n", strings.Count(l, "\n")))
	}
}

// change is a signed byte count: "+1.5 MiB", "−256 B", "0".
func change(d int64) string {
	switch {
	case d > 0:
		return "+" + alloc.FormatBytes(d)
	case d < 0:
		return "−" + alloc.FormatBytes(-d)
	}
	return "0"
}
