package main

import (
	"flag"
	"fmt"
	"io"
	"math"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/internal/progress"
	"github.com/batchfit/batchfit/planner"
	"github.com/batchfit/batchfit/recompute"
)

// recomputeFlagValues are estimate's recompute flags.
type recomputeFlagValues struct {
	mode, profile, plot string
}

func addRecomputeFlags(fs *flag.FlagSet, v *recomputeFlagValues) {
	fs.StringVar(&v.mode, "recompute", "off", "activation recomputation: off (chunks only, today's plan) or auto "+
		"(search chunks and recompute sets for the most samples/s; prints the alternatives)")
	fs.StringVar(&v.profile, "profile", "", "cost model `profile` for --recompute and --plot: default, h100, h200 or a JSON file "+
		"(as batchfit calibrate writes it); default: h100 or h200 with that --gpu, default otherwise")
	fs.StringVar(&v.plot, "plot", "", "write an SVG `FILE` of predicted samples/s and peak against the budget "+
		"(chunks only and recompute auto, budgets up to --budget)")
}

// apply checks the flags into c.
func (v *recomputeFlagValues) apply(c *estimateConfig) error {
	m, err := recompute.ParseMode(v.mode)
	if err != nil || (m != recompute.Off && m != recompute.Auto) {
		return usagef(errUnknown, "unknown --recompute %q (want off or auto)", v.mode)
	}
	c.recompute, c.plot = m, v.plot
	name := v.profile
	if name == "" {
		name = "default"
		if c.device != nil {
			for _, card := range []string{"h100", "h200"} {
				if strings.Contains(strings.ToLower(c.device.Card), card) {
					name = card
				}
			}
		}
	}
	if c.profile, err = recompute.LoadProfile(name); err != nil {
		return usagef(errUnknown, "--profile: %v", err)
	}
	if (m != recompute.Off || v.plot != "") && !c.train {
		return usagef(errFlag, "--recompute and --plot plan training steps (--mode train)")
	}
	return nil
}

// recomputeReport is the recompute search's answer in estimate's report.
type recomputeReport struct {
	Mode          string            `json:"mode"`
	Profile       recompute.Profile `json:"profile"`
	Chosen        string            `json:"chosen"`
	SearchSeconds float64           `json:"search_seconds"`
	Candidates    []candidateRow    `json:"candidates"`
}

// candidateRow is one recompute candidate, planned within the budget.
type candidateRow struct {
	Name          string  `json:"name"`
	Role          string  `json:"role,omitempty"` // "chunks only", "full checkpointing"
	Chosen        bool    `json:"chosen"`
	Recomputed    int     `json:"recomputed_nodes"`
	Copies        int     `json:"copies"`
	Fits          bool    `json:"fits"`
	NumChunks     int     `json:"num_chunks,omitempty"`
	Chunk         int     `json:"chunk,omitempty"`
	PeakReserved  int64   `json:"peak_reserved,omitempty"`
	StepSeconds   float64 `json:"step_seconds,omitempty"`
	SamplesPerSec float64 `json:"samples_per_second,omitempty"`
	FLOPs         float64 `json:"flops"`
	ExtraFLOPs    float64 `json:"extra_flops"`
	Error         string  `json:"error,omitempty"`
}

// searchOptions are the recompute search's options for c at budget.
func searchOptions(c *estimateConfig, budget int64, all bool) recompute.Options {
	o := planOptions(c)
	o.Budget, o.Timeline = budget, false
	return recompute.Options{Planner: o, Profile: c.profile, PlanAll: all, TF32: c.policy.TF32()}
}

// estimateRecompute lists the recompute candidates for --recompute auto
// in r.Recompute: the search over the plain step, every candidate planned,
// the Session's choice (st's plan and program) marked chosen.
func estimateRecompute(c *estimateConfig, st *step, r *report) error {
	if c.recompute != recompute.Auto {
		return nil
	}
	start := time.Now()
	res, err := recompute.Search(st.rstep, searchOptions(c, c.budget, true))
	if err != nil {
		return err
	}
	rr := &recomputeReport{Mode: string(c.recompute), Profile: c.profile, SearchSeconds: time.Since(start).Seconds()}
	for _, ch := range res.All {
		row := candidateRow{Name: ch.Name, Chosen: st.plan != nil && ch.Name == st.recomputed.Strategy, Recomputed: len(ch.Recompute), Copies: ch.Copies,
			FLOPs: ch.Cost.FLOPs, ExtraFLOPs: ch.ExtraFLOPs(res.Plain)}
		switch ch {
		case res.Plain:
			row.Role = "chunks only"
		case res.Full:
			row.Role = "full checkpointing"
		}
		if ch.Plan != nil {
			row.Fits, row.NumChunks, row.Chunk, row.PeakReserved = true, ch.Plan.Split.Len(), ch.Plan.Chunk, ch.Plan.PeakReserved
			row.StepSeconds, row.SamplesPerSec = ch.Time, ch.SamplesPerSec()
		} else if ch.Err != nil {
			row.Error = ch.Err.Error()
		}
		rr.Candidates = append(rr.Candidates, row)
	}
	r.Recompute = rr
	rr.Chosen = "none fits"
	if st.plan != nil {
		rr.Chosen = st.recomputed.Strategy
	}
	return nil
}

// writeRecompute prints the recompute section of the text report.
func writeRecompute(w io.Writer, r *report) {
	rr := r.Recompute
	if rr == nil {
		return
	}
	fmt.Fprintf(w, "\nrecompute (--recompute %s, cost model %q): chosen %s; search took %s\n", rr.Mode, rr.Profile.Name, rr.Chosen,
		round(rr.SearchSeconds))
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "\tCANDIDATE\tRECOMPUTED\tCHUNKS\tPEAK RESERVED\tSTEP TIME\tSAMPLES/S\tEXTRA FLOPS")
	for _, c := range rr.Candidates {
		mark := ""
		if c.Chosen {
			mark = "*"
		}
		name := c.Name
		if c.Role != "" {
			name += " (" + c.Role + ")"
		}
		if !c.Fits {
			fmt.Fprintf(tw, "%s\t%s\t%d nodes\t-\tdoes not fit\t-\t-\t%s\n", mark, name, c.Recomputed, percent(c.ExtraFLOPs, c.FLOPs-c.ExtraFLOPs))
			continue
		}
		fmt.Fprintf(tw, "%s\t%s\t%d nodes\t%s\t%s\t%s\t%.4g\t%s\n", mark, name, c.Recomputed,
			planner.Split{N: r.Batch, K: c.NumChunks}, alloc.FormatBytes(c.PeakReserved), round(c.StepSeconds), c.SamplesPerSec,
			percent(c.ExtraFLOPs, c.FLOPs-c.ExtraFLOPs))
	}
	tw.Flush()
	fmt.Fprintln(w, "step times are the cost model's predictions (roofline per op); peaks are exact replays")
}

func percent(extra, base float64) string {
	if base <= 0 {
		return "-"
	}
	return fmt.Sprintf("+%.1f%%", 100*extra/base)
}

// plotPoint is one budget of --plot.
type plotPoint struct {
	budget              int64
	plainRate, autoRate float64 // samples/s, 0 when nothing fits
	plainPeak, autoPeak int64
	autoName            string
}

// sweep plans c's step at n budgets up to c.budget, chunks only and
// recompute auto, reporting each budget searched to rep (nil: silent).
func sweep(c *estimateConfig, st *step, n int, rep *progress.Reporter) ([]plotPoint, error) {
	var pts []plotPoint
	for i := 1; i <= n; i++ {
		b := c.budget * int64(i) / int64(n)
		res, err := recompute.Search(st.rstep, searchOptions(c, b, false))
		if err != nil {
			return nil, err
		}
		rep.Done("budget " + alloc.FormatBytes(b))
		pt := plotPoint{budget: b}
		if p := res.Plain; p.Plan != nil {
			pt.plainRate, pt.plainPeak = p.SamplesPerSec(), p.Plan.PeakReserved
		}
		if p := res.Best; p != nil {
			pt.autoRate, pt.autoPeak, pt.autoName = p.SamplesPerSec(), p.Plan.PeakReserved, p.Name
		}
		pts = append(pts, pt)
	}
	return pts, nil
}

// writeSVG draws two panels: predicted samples/s against the budget, and
// the replayed peak against the budget (with the budget's own line).
func writeSVG(w io.Writer, title string, pts []plotPoint) error {
	const W, H, pad, gap = 720, 300, 60, 40
	var maxRate float64
	var maxB int64
	for _, p := range pts {
		maxRate = max(maxRate, p.plainRate, p.autoRate)
		maxB = max(maxB, p.budget)
	}
	if maxRate == 0 {
		maxRate = 1
	}
	if maxB == 0 {
		maxB = 1
	}
	var b strings.Builder
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" font-family="sans-serif" font-size="12">`+"\n", W, 2*H+gap)
	fmt.Fprintf(&b, `<rect width="100%%" height="100%%" fill="white"/>`+"\n")
	fmt.Fprintf(&b, `<text x="%d" y="20" font-size="14">%s</text>`+"\n", pad, xmlEscape(title))
	panel := func(top int, ylabel string, ymax float64, series []struct {
		name, color string
		y           func(plotPoint) float64
		dash        bool
	}) {
		x0, y0, pw, ph := pad, top+H-pad/2, W-2*pad, H-pad-10
		fmt.Fprintf(&b, `<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="black"/>`+"\n", x0, y0, x0+pw, y0)
		fmt.Fprintf(&b, `<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="black"/>`+"\n", x0, y0, x0, y0-ph)
		fmt.Fprintf(&b, `<text x="%d" y="%d">%s</text>`+"\n", x0, y0-ph-6, xmlEscape(ylabel))
		fmt.Fprintf(&b, `<text x="%d" y="%d" text-anchor="end">budget %s</text>`+"\n", x0+pw, y0+28, alloc.FormatBytes(maxB))
		fmt.Fprintf(&b, `<text x="%d" y="%d" text-anchor="end">%.4g</text>`+"\n", x0-4, y0-ph+4, ymax)
		fmt.Fprintf(&b, `<text x="%d" y="%d" text-anchor="end">0</text>`+"\n", x0-4, y0+4)
		for si, s := range series {
			var pl []string
			for _, p := range pts {
				v := s.y(p)
				if v <= 0 || math.IsNaN(v) {
					continue
				}
				x := float64(x0) + float64(pw)*float64(p.budget)/float64(maxB)
				y := float64(y0) - float64(ph)*min(v/ymax, 1)
				pl = append(pl, fmt.Sprintf("%.1f,%.1f", x, y))
			}
			dash := ""
			if s.dash {
				dash = ` stroke-dasharray="4 3"`
			}
			fmt.Fprintf(&b, `<polyline fill="none" stroke="%s" stroke-width="2"%s points="%s"/>`+"\n", s.color, dash, strings.Join(pl, " "))
			fmt.Fprintf(&b, `<text x="%d" y="%d" fill="%s">%s</text>`+"\n", x0+10, y0-ph+14+16*si, s.color, xmlEscape(s.name))
		}
	}
	type series = struct {
		name, color string
		y           func(plotPoint) float64
		dash        bool
	}
	panel(30, "predicted samples/s", maxRate*1.05, []series{
		{"recompute auto", "#c0392b", func(p plotPoint) float64 { return p.autoRate }, false},
		{"chunks only", "#2c3e50", func(p plotPoint) float64 { return p.plainRate }, true},
	})
	panel(30+H+gap, "peak reserved (bytes)", float64(maxB)*1.05, []series{
		{"recompute auto", "#c0392b", func(p plotPoint) float64 { return float64(p.autoPeak) }, false},
		{"chunks only", "#2c3e50", func(p plotPoint) float64 { return float64(p.plainPeak) }, true},
		{"budget", "#999999", func(p plotPoint) float64 { return float64(p.budget) }, true},
	})
	b.WriteString("</svg>\n")
	_, err := io.WriteString(w, b.String())
	return err
}

func xmlEscape(s string) string {
	return strings.NewReplacer("&", "&amp;", "<", "&lt;", ">", "&gt;", `"`, "&quot;").Replace(s)
}

// plotPoints is how many budgets --plot plans.
const plotPoints = 24

// writePlot builds c's step again and writes the --plot SVG, its budget
// sweep's progress on stderr.
func writePlot(c *estimateConfig, stdout, stderr io.Writer) error {
	st, err := buildStep(c)
	if err != nil {
		return err
	}
	rep := progress.New(stderr, "batchfit estimate --plot", plotPoints)
	pts, err := sweep(c, st, plotPoints, rep)
	rep.Finish()
	if err != nil {
		return err
	}
	title := fmt.Sprintf("%s, batch %d: predicted samples/s (cost model %q) and replayed peak against the budget",
		c.model.name, c.batch, c.profile.Name)
	_, err = writeFile(c.plot, stdout, func(w io.Writer) error { return writeSVG(w, title, pts) })
	return err
}

// leverRow is one lever setting the session weighed
// (batchfit.LeverChoice).
type leverRow struct {
	LossChunk      int     `json:"loss_chunk,omitempty"`
	Offload        string  `json:"offload,omitempty"`
	Recompute      string  `json:"recompute,omitempty"`
	Chosen         bool    `json:"chosen"`
	Fits           bool    `json:"fits"`
	Skipped        bool    `json:"skipped,omitempty"` // not planned: an earlier setting runs the whole batch at once
	NumChunks      int     `json:"num_chunks,omitempty"`
	PeakReserved   int64   `json:"peak_reserved,omitempty"`
	HostPinned     int64   `json:"host_pinned,omitempty"`
	StepSeconds    float64 `json:"step_seconds,omitempty"`
	OffloadSeconds float64 `json:"offload_seconds,omitempty"`
	SamplesPerSec  float64 `json:"samples_per_second,omitempty"`
	Error          string  `json:"error,omitempty"`
}

func leverRows(cs []batchfit.LeverChoice) []leverRow {
	var rows []leverRow
	for _, c := range cs {
		row := leverRow{LossChunk: c.LossChunk, Offload: string(c.Offload), Recompute: c.Recompute, Chosen: c.Chosen, Skipped: c.Skipped,
			StepSeconds: c.Seconds, OffloadSeconds: c.OffloadSeconds, SamplesPerSec: c.SamplesPerSec()}
		if c.Plan != nil {
			row.Fits, row.NumChunks, row.PeakReserved, row.HostPinned = true, c.Plan.Split.Len(), c.Plan.PeakReserved, c.Plan.HostPinned
		} else if c.Err != nil {
			row.Error = c.Err.Error()
		}
		rows = append(rows, row)
	}
	return rows
}

// writeLevers prints the lever settings of --levers.
func writeLevers(w io.Writer, r *report) {
	if len(r.Levers) == 0 {
		return
	}
	fmt.Fprintf(w, "\nlevers: %d settings weighed, * the one planned\n", len(r.Levers))
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "\tLOSS CHUNK\tOPTIMIZER\tRECOMPUTE\tCHUNKS\tPEAK RESERVED\tSTEP TIME\tSAMPLES/S")
	for i := 0; i < len(r.Levers); i++ {
		c := r.Levers[i]
		mark, chunk, where := "", "-", "device"
		if c.Chosen {
			mark = "*"
		}
		if c.LossChunk > 0 {
			chunk = strconv.Itoa(c.LossChunk)
		}
		if c.Offload != "" {
			where = "host"
		}
		if c.Skipped { // one row for the run of settings not planned
			j := i
			for j+1 < len(r.Levers) && r.Levers[j+1].Skipped && r.Levers[j+1].Offload == c.Offload {
				j++
			}
			if j > i {
				chunk += "…" + strconv.Itoa(r.Levers[j].LossChunk)
			}
			i = j
			fmt.Fprintf(tw, "%s\t%s\t%s\t-\t-\tnot planned: smaller chunks only add launches\t-\t-\n", mark, chunk, where)
			continue
		}
		if !c.Fits {
			fmt.Fprintf(tw, "%s\t%s\t%s\t-\t-\tdoes not fit\t-\t-\n", mark, chunk, where)
			continue
		}
		step := round(c.StepSeconds)
		if c.OffloadSeconds > 0 {
			step += " (host " + round(c.OffloadSeconds) + ")"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%.4g\n", mark, chunk, where, c.Recompute,
			planner.Split{N: r.Batch, K: c.NumChunks}, alloc.FormatBytes(c.PeakReserved), step, c.SamplesPerSec)
	}
	tw.Flush()
	fmt.Fprintln(w, "step times are the cost model's predictions (roofline per op, the host's share of an offloaded optimizer); peaks are exact replays")
}
