package compile_test

import (
	"testing"

	"github.com/batchfit/batchfit/compile"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/models"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/precision"
)

// BenchmarkTrainGPT2Small is the pipeline on GPT-2 small's bf16-mixed
// training step (batch 8, seq 1024, shape-only), as a Session builds a
// step template, with the reports' bytes measured and without
// (Options.NoMeasure): what measuring costs.
func BenchmarkTrainGPT2Small(b *testing.B) {
	model := models.NewGPT(nn.Options{ShapeOnly: true}, models.GPT2Small())
	tokens := lazy.Placeholder([]int{8, 1024}, graph.Int64, 0)
	loss := models.Loss(model.Forward(tokens), tokens.Graph().Placeholder([]int{8, 1024}, graph.Int64, 0))
	wrt, err := lazy.ParamIDs(loss, nn.ParamTensors(model)...)
	if err != nil {
		b.Fatal(err)
	}
	g := loss.Graph().IR()
	for _, c := range []struct {
		name string
		off  bool
	}{{"measured", false}, {"unmeasured", true}} {
		b.Run(c.name, func(b *testing.B) {
			for b.Loop() {
				if _, err := compile.Train(g, loss.ID(), wrt, compile.Options{Policy: precision.BF16Mixed, Plain: true, NoMeasure: c.off}); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
