package main

import (
	"bufio"
	"flag"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/memviz"
)

type compareConfig struct {
	before, after string
	folded        bool
	stacks        bool
	top           int
}

type compareFlagValues struct {
	folded, stacks bool
	top            int
}

func compareFlags() (*flag.FlagSet, *compareFlagValues) {
	fs := flag.NewFlagSet("compare", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	v := &compareFlagValues{}
	fs.BoolVar(&v.folded, "folded", false, "print folded stacks instead of text: the blocks of differing segments for two pickles "+
		"(as torch.cuda._memory_viz compare does), \"stack before after\" lines otherwise (flamegraph.pl draws them as a differential flame graph)")
	fs.BoolVar(&v.stacks, "stacks", false, "compare two pickles by stack (module path and op) rather than by segment")
	fs.IntVar(&v.top, "top", 0, "print only the `N` largest stack changes (0: all)")
	return fs, v
}

const compareSynopsis = `  batchfit compare [flags] BEFORE AFTER

BEFORE and AFTER are snapshot files: pickles (batchfit snapshot, or
torch.cuda.memory._dump_snapshot), pprof profiles or folded stacks, told
apart by their content and name; - reads standard input. Two pickles are
compared by segment (address and size), as torch.cuda._memory_viz compare
does; other pairs by the bytes under each stack.`

func parseCompare(args []string) (*compareConfig, error) {
	fs, v := compareFlags()
	pos, _, err := parseFlags(fs, args)
	if err != nil {
		return nil, err
	}
	switch {
	case len(pos) < 2:
		return nil, usagef(errMissing, "want two snapshot files, BEFORE and AFTER; got %d", len(pos))
	case len(pos) > 2:
		return nil, usagef(errFlag, "unexpected argument %q (want two files)", pos[2])
	case pos[0] == "-" && pos[1] == "-":
		return nil, usagef(errFlag, "only one file can be standard input")
	case v.top < 0:
		return nil, usagef(errRange, "--top must not be negative, got %d", v.top)
	}
	return &compareConfig{before: pos[0], after: pos[1], folded: v.folded, stacks: v.stacks, top: v.top}, nil
}

func runCompare(args []string, stdin io.Reader, stdout, stderr io.Writer) int {
	fs, _ := compareFlags()
	c, err := parseCompare(args)
	if code, ok := parsed("compare", err, stdout, stderr, fs, compareSynopsis); !ok {
		return code
	}
	var files [2]*snapshotFile
	for i, path := range []string{c.before, c.after} {
		if files[i], err = readSnapshotFile(path, stdin, "", ""); err != nil {
			fmt.Fprintf(stderr, "batchfit compare: %v\n", err)
			return exitPlan
		}
	}
	a, b := files[0], files[1]
	if a.snap != nil && b.snap != nil && !c.stacks {
		d := memviz.Compare(*a.snap, *b.snap)
		if c.folded {
			err = d.WriteFolded(stdout, nil)
		} else {
			err = d.WriteText(stdout)
		}
	} else {
		err = writeStackDeltas(stdout, c, a, b)
	}
	if err != nil {
		fmt.Fprintf(stderr, "batchfit compare: %v\n", err)
		return exitPlan
	}
	return exitOK
}

// signed formats a byte delta with its sign.
func signed(n int64) string {
	switch {
	case n > 0:
		return "+" + alloc.FormatBytes(n)
	case n < 0:
		return "−" + alloc.FormatBytes(-n)
	}
	return "0 B"
}

// writeStackDeltas prints the stacks whose bytes differ, largest change
// first, or with --folded "stack before after" lines.
func writeStackDeltas(w io.Writer, c *compareConfig, a, b *snapshotFile) error {
	deltas := memviz.CompareStacks(a.Stacks(), b.Stacks())
	changed := len(deltas)
	if c.top > 0 && len(deltas) > c.top {
		deltas = deltas[:c.top]
	}
	if c.folded {
		bw := bufio.NewWriter(w)
		for _, d := range deltas {
			fmt.Fprintf(bw, "%s %d %d\n", strings.Join(d.Stack, ";"), d.Before, d.After)
		}
		return bw.Flush()
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	for i, f := range []*snapshotFile{a, b} {
		fmt.Fprintf(tw, "%s\t%s (%s): %s in %d stacks\n", [2]string{"before", "after"}[i], f.path, f.format,
			alloc.FormatBytes(memviz.TotalBytes(f.Stacks())), len(f.Stacks()))
	}
	fmt.Fprintf(tw, "change\t%s\n", signed(memviz.TotalBytes(b.Stacks())-memviz.TotalBytes(a.Stacks())))
	if err := tw.Flush(); err != nil {
		return err
	}
	if len(deltas) == 0 {
		_, err := fmt.Fprintln(w, "no stack changed")
		return err
	}
	if len(deltas) < changed {
		fmt.Fprintf(w, "\n%d stacks changed; the %d largest changes:\n", changed, len(deltas))
	} else {
		fmt.Fprintf(w, "\n%d stacks changed, largest change first:\n", changed)
	}
	tw = tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "BEFORE\tAFTER\tCHANGE\t\tSTACK")
	for _, d := range deltas {
		fmt.Fprintf(tw, "%s\t%s\t%s\t\t%s\n", alloc.FormatBytes(d.Before), alloc.FormatBytes(d.After),
			signed(d.After-d.Before), strings.Join(d.Stack, ";"))
	}
	return tw.Flush()
}
