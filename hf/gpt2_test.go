package hf_test

import (
	"context"
	"math"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/hf"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/models"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/safetensors"
)

// reference reads a checkpoint's reference.safetensors (made by
// transformers, see testdata/README.md).
type reference struct {
	t *testing.T
	f *safetensors.File
}

func openReference(t *testing.T, dir string) reference {
	f, err := safetensors.Open(filepath.Join(dir, "reference.safetensors"))
	require.NoError(t, err)
	t.Cleanup(func() { f.Close() })
	return reference{t, f}
}

func (r reference) info(name string) safetensors.TensorInfo {
	ti, ok := r.f.Tensor(name)
	require.True(r.t, ok, "reference has no %s", name)
	return ti
}

func (r reference) f64(name string) ([]float64, []int) {
	ti := r.info(name)
	v := make([]float64, ti.NumElements())
	require.NoError(r.t, r.f.ReadFloat64(name, v))
	return v, ti.Shape
}

func (r reference) i64(name string) ([]int64, []int) {
	ti := r.info(name)
	v := make([]int64, ti.NumElements())
	require.NoError(r.t, r.f.ReadInt64(name, v))
	return v, ti.Shape
}

// maxRelErr is max |got − want| / max |want| over all elements: the error
// relative to the tensor's scale, so that near-zero elements do not
// dominate.
func maxRelErr(got []float32, want []float64) float64 {
	scale, worst := 0.0, 0.0
	for i, w := range want {
		scale = max(scale, math.Abs(w))
		worst = max(worst, math.Abs(float64(got[i])-w))
	}
	return worst / scale
}

// hfLoss is transformers' causal-LM loss of logits [B, T, V] for labels
// [B, T]: position t predicts labels[t+1], labels of -100 are ignored,
// the mean is over the rest. Computed in float64.
func hfLoss(logits []float32, labels []int64, b, tt, v int) float64 {
	sum, n := 0.0, 0
	for i := range b {
		for j := range tt - 1 {
			y := labels[i*tt+j+1]
			if y == -100 {
				continue
			}
			row := logits[(i*tt+j)*v : (i*tt+j+1)*v]
			m := math.Inf(-1)
			for _, x := range row {
				m = max(m, float64(x))
			}
			z := 0.0
			for _, x := range row {
				z += math.Exp(float64(x) - m)
			}
			sum += m + math.Log(z) - float64(row[y])
			n++
		}
	}
	return sum / float64(n)
}

// GPT-2 saved by transformers, loaded into models.GPT and run on the CPU
// executor, gives transformers' logits (float64 reference, float32 run:
// within 1e-4 of the logits' scale), its loss (1e-5 relative) and its
// float64 gradients (1e-4 of each gradient's scale), the Conv1D weights'
// transposed back.
func TestGPT2TinyMatchesTransformers(t *testing.T) {
	dir := filepath.Join("testdata", "gpt2-tiny")
	cfg, err := hf.ReadConfig(dir)
	require.NoError(t, err)
	m := models.NewGPT(nn.Seed(1), *cfg.GPT)
	require.NoError(t, nn.Check(m))
	require.NoError(t, hf.LoadInto(dir, m.Params()))

	ref := openReference(t, dir)
	ids, shape := ref.i64("input_ids")
	labels, _ := ref.i64("labels")
	wantLogits, lshape := ref.f64("logits_f64")
	wantLoss, _ := ref.f64("loss_f64")
	b, tt, v := shape[0], shape[1], lshape[2]
	require.Equal(t, cfg.GPT.Vocab, v)

	tokens := lazy.Wrap(tensor.New(tensor.WithShape(b, tt), tensor.WithBacking(ids)), 0)
	logits := m.Forward(tokens)
	// transformers' loss as a graph: −Σ one-hot · log_softmax over the
	// shifted, unmasked positions, divided by their count.
	onehot := make([]float32, b*(tt-1)*v)
	count := 0
	for i := range b {
		for j := range tt - 1 {
			if y := labels[i*tt+j+1]; y != -100 {
				onehot[(i*(tt-1)+j)*v+int(y)] = 1
				count++
			}
		}
	}
	target := tokens.Graph().Wrap(tensor.New(tensor.WithShape(b, tt-1, v), tensor.WithBacking(onehot)), 0)
	loss := logits.Slice(1, 0, tt-1).LogSoftmax(-1).Mul(target).Sum().MulScalar(-1 / float64(count))
	params := m.Params()
	grads := lazy.Grad(loss, nn.ParamTensors(m)...)

	sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU})
	defer sess.Close()
	out, err := sess.Eval(context.Background(), append([]*lazy.Tensor{logits, loss}, grads...)...)
	require.NoError(t, err)
	got := out[0].Data().([]float32)
	e := maxRelErr(got, wantLogits)
	t.Logf("logits: max error %.2g of their scale", e)
	require.Less(t, e, 1e-4)
	require.InEpsilon(t, wantLoss[0], hfLoss(got, labels, b, tt, v), 1e-5, "loss from the logits")
	require.InEpsilon(t, wantLoss[0], float64(out[1].Data().(float32)), 1e-5, "loss from the graph")

	// Gradients: the reference names them by checkpoint tensor, Conv1D
	// weights [in, out].
	checked := 0
	for i, p := range params {
		name := "grad.transformer." + p.Name()
		ti, ok := ref.f.Tensor(name)
		if !ok {
			continue
		}
		want, _ := ref.f64(name)
		g := out[2+i].Data().([]float32)
		if len(ti.Shape) == 2 && ti.Shape[0] != p.Shape()[0] { // transposed Conv1D
			rows, cols := p.Shape()[0], p.Shape()[1]
			tr := make([]float32, len(g))
			for r := range rows {
				for c := range cols {
					tr[c*rows+r] = g[r*cols+c]
				}
			}
			g = tr
		}
		e := maxRelErr(g, want)
		t.Logf("%s: max error %.2g of its scale", name, e)
		require.Less(t, e, 1e-4, name)
		checked++
	}
	require.Equal(t, 6, checked, "every reference gradient was compared")
}
