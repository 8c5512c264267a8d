package data

import (
	"fmt"
	"slices"

	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/graph"
)

// Field is one value of every sample: its name, its shape per sample and
// its dtype, Float32 or Int64 (the host types a Session's inputs take;
// 16-bit inputs travel as float32). A batch holds it as a tensor of shape
// [batch, Shape...].
type Field struct {
	Name  string
	Shape []int
	DType graph.DType
}

// numel is the field's values per sample.
func (f Field) numel() int { return graph.Numel(f.Shape) }

// Slot is where one sample's value of a field goes: F for a Float32
// field, I for an Int64 one, of the field's values per sample.
type Slot struct {
	F []float32
	I []int64
}

// Dataset is N samples of fixed fields. Fill writes sample i (0 ≤ i <
// Len) into dst, one slot per field in Fields' order. A loader calls Fill
// from several goroutines at once and for samples in any order, so it
// must not depend on earlier calls; Fields must not change.
type Dataset interface {
	Len() int
	Fields() []Field
	Fill(i int, dst []Slot) error
}

// checkFields validates a dataset's fields.
func checkFields(fs []Field) error {
	if len(fs) == 0 {
		return errorf(ErrOptions, "a dataset of no fields")
	}
	for k, f := range fs {
		if f.DType != graph.Float32 && f.DType != graph.Int64 {
			return errorf(ErrOptions, "field %d (%q) is %s: want float32 or int64", k, f.Name, f.DType)
		}
		for _, d := range f.Shape {
			if d < 1 {
				return errorf(ErrOptions, "field %d (%q) has shape %v", k, f.Name, f.Shape)
			}
		}
	}
	return nil
}

// Windows is a token stream cut into language-model samples: sample i
// is the Seq+1 tokens from i·Stride on; its "inputs" field is the first
// Seq, its "targets" field the last Seq (each input's next token), both
// int64 [Seq]. With Stride = Seq (the default) the inputs tile the
// stream, as nanoGPT's and llm.c's loaders read it.
type Windows struct {
	t           *Tokens
	seq, stride int
	vocab       int64
	n           int
}

// WindowOptions configures NewWindows.
type WindowOptions struct {
	// Stride is the tokens between samples' starts (0: Seq).
	Stride int
	// Vocab, when positive, makes a sample holding a token ≥ Vocab an
	// ErrToken error when it is read: an embedding of Vocab rows must not
	// be indexed past its end, and a hostile file can hold any id.
	Vocab int
}

// NewWindows cuts t into samples of seq tokens and their targets.
func NewWindows(t *Tokens, seq int, o WindowOptions) (*Windows, error) {
	if t == nil {
		return nil, errorf(ErrOptions, "nil token stream")
	}
	stride := o.Stride
	if stride == 0 {
		stride = seq
	}
	if seq < 1 || stride < 1 || o.Vocab < 0 {
		return nil, errorf(ErrOptions, "windows of %d tokens every %d, vocabulary %d", seq, stride, o.Vocab)
	}
	w := &Windows{t: t, seq: seq, stride: stride, vocab: int64(o.Vocab)}
	if t.Len() > seq {
		w.n = (t.Len()-1-seq)/stride + 1
	}
	return w, nil
}

// Len is the number of windows.
func (w *Windows) Len() int { return w.n }

// Fields are "inputs" and "targets", int64 [Seq] each.
func (w *Windows) Fields() []Field {
	return []Field{{Name: "inputs", Shape: []int{w.seq}, DType: graph.Int64},
		{Name: "targets", Shape: []int{w.seq}, DType: graph.Int64}}
}

// Fill writes window i's inputs and targets: the tokens are widened once
// into the inputs, whose tail the targets copy.
func (w *Windows) Fill(i int, dst []Slot) error {
	if i < 0 || i >= w.n {
		return errorf(ErrOptions, "window %d of %d", i, w.n)
	}
	in, tg := dst[0].I, dst[1].I
	off := i * w.stride
	m := w.t.widen(in, off)
	copy(tg, in[1:])
	last := int64(w.t.At(off + w.seq))
	tg[w.seq-1] = last
	if w.vocab > 0 && max(m, last) >= w.vocab {
		for j := range w.seq + 1 {
			if v := w.t.At(off + j); int64(v) >= w.vocab {
				return errorf(ErrToken, "token %d (window %d) is %d, outside a vocabulary of %d", off+j, i, v, w.vocab)
			}
		}
	}
	return nil
}

// Arrays is a Dataset over tensors held in memory: field k's tensor is
// [N, shape...], sample i its row i (images [N, C, H, W] float32 and
// labels [N] int64, say).
type Arrays struct {
	fields []Field
	f      [][]float32
	i      [][]int64
	n      int
}

// NewArrays makes a dataset of the named tensors, which must be dense,
// float32 or int64, and agree on their first axis. Their data is shared,
// not copied.
func NewArrays(names []string, ts ...*tensor.Dense) (*Arrays, error) {
	if len(names) != len(ts) || len(ts) == 0 {
		return nil, errorf(ErrOptions, "%d names for %d tensors", len(names), len(ts))
	}
	a := &Arrays{f: make([][]float32, len(ts)), i: make([][]int64, len(ts))}
	for k, t := range ts {
		if t == nil || t.Dims() == 0 {
			return nil, errorf(ErrOptions, "tensor %q: want a tensor with a sample axis", names[k])
		}
		shape := []int(t.Shape())
		if k == 0 {
			a.n = shape[0]
		} else if shape[0] != a.n {
			return nil, errorf(ErrOptions, "tensor %q has %d samples, %q %d", names[k], shape[0], names[0], a.n)
		}
		if t.RequiresIterator() {
			return nil, errorf(ErrOptions, "tensor %q is a strided view: materialize it", names[k])
		}
		f := Field{Name: names[k], Shape: slices.Clone(shape[1:])}
		switch d := t.Data().(type) {
		case []float32:
			f.DType, a.f[k] = graph.Float32, d
		case []int64:
			f.DType, a.i[k] = graph.Int64, d
		default:
			return nil, errorf(ErrOptions, "tensor %q holds %T: want float32 or int64", names[k], t.Data())
		}
		a.fields = append(a.fields, f)
	}
	return a, checkFields(a.fields)
}

// Len is the number of samples.
func (a *Arrays) Len() int { return a.n }

// Fields are the tensors' names, per-sample shapes and dtypes.
func (a *Arrays) Fields() []Field { return a.fields }

// Fill copies row i of every tensor.
func (a *Arrays) Fill(i int, dst []Slot) error {
	if i < 0 || i >= a.n {
		return errorf(ErrOptions, "sample %d of %d", i, a.n)
	}
	for k, f := range a.fields {
		e := f.numel()
		if a.f[k] != nil {
			copy(dst[k].F, a.f[k][i*e:(i+1)*e])
		} else {
			copy(dst[k].I, a.i[k][i*e:(i+1)*e])
		}
	}
	return nil
}

var (
	_ Dataset = (*Windows)(nil)
	_ Dataset = (*Arrays)(nil)
)

func (f Field) String() string { return fmt.Sprintf("%s %s%v", f.Name, f.DType, f.Shape) }
