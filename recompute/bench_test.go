package recompute_test

import (
	"fmt"
	"sync"
	"testing"

	"github.com/batchfit/batchfit/models"
	"github.com/batchfit/batchfit/planner"
	"github.com/batchfit/batchfit/recompute"
)

var gpt2Steps sync.Map // batch → recompute.Step

func gpt2Step(b testing.TB, batch int) recompute.Step {
	if st, ok := gpt2Steps.Load(batch); ok {
		return st.(recompute.Step)
	}
	st := gptStep(b, models.GPT2Small(), batch, 1024)
	gpt2Steps.Store(batch, st)
	return st
}

// BenchmarkSearchGPT2Small times recompute.Search on GPT-2 small's
// training step (AdamW, tokens [batch, 1024]): every candidate's
// transform, analysis, compile and plan. 24 GiB holds batch 8 whole (the
// search stops after the plain plan); 8 GiB needs chunks or recompute; at
// 3 GiB chunks alone do not fit even one sample.
func BenchmarkSearchGPT2Small(b *testing.B) {
	for _, c := range []struct {
		batch  int
		budget int64
	}{{8, 24 * gib}, {8, 8 * gib}, {8, 3 * gib}, {64, 24 * gib}} {
		b.Run(fmt.Sprintf("batch=%d/budget=%dGiB", c.batch, c.budget/gib), func(b *testing.B) {
			st := gpt2Step(b, c.batch)
			var res *recompute.Result
			for b.Loop() {
				var err error
				if res, err = recompute.Search(st, recompute.Options{Planner: planner.Options{Budget: c.budget}}); err != nil {
					b.Fatal(err)
				}
			}
			if res.Best == nil {
				b.Fatal("nothing fits")
			}
			b.ReportMetric(float64(res.Best.Plan.Split.K), "chunks")
			b.ReportMetric(float64(len(res.Best.Recompute)), "recomputed")
			b.ReportMetric(float64(res.Best.Plan.PeakReserved)/(1<<20), "peak-MiB")
			b.ReportMetric(res.Best.SamplesPerSec(), "samples/s")
			b.Logf("%s: %s", res.Best.Name, res.Best.Plan.Split)
		})
	}
}
