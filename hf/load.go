package hf

import (
	"bytes"
	"fmt"
	"io"
	"slices"
	"strings"

	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/safetensors"
)

// LoadInto reads dir's config.json for the architecture and fills params
// (a model's nn.Params, named as batchfit's model names them) from dir's
// checkpoint. See Checkpoint.LoadInto.
func LoadInto(dir string, params []*nn.Param) error {
	cfg, err := ReadConfig(dir)
	if err != nil {
		return err
	}
	c, err := OpenCheckpoint(dir)
	if err != nil {
		return err
	}
	defer c.Close()
	return c.LoadInto(cfg.Architecture, params)
}

// binding is one parameter and the checkpoint tensor it loads from.
type binding struct {
	p          *nn.Param
	dst        []float32
	tensor     string
	transposed bool
}

// LoadInto fills params from the checkpoint, mapping names with arch's
// table (GPT-2's Conv1D weights are transposed on the way). Everything is
// checked before any parameter changes: every parameter's tensor must be
// present (ErrMissingTensor) with its shape (a *ShapeError) and a float
// dtype (F32, BF16 or F16); every checkpoint tensor must be used
// (ErrUnexpectedTensor), except buffers the architecture ignores and a
// head tied to the embedding, which must then equal it (ErrCheckpoint).
// Tensors stream straight into the parameters' float32 data; only a
// transposed tensor passes through a buffer of its own size.
func (c *Checkpoint) LoadInto(arch Architecture, params []*nn.Param) error {
	t := tableFor(arch)
	// GPT-2 files saved from GPT2Model (the original hub files) lack the
	// "transformer." prefix.
	strip := t.prefix != "" && !c.has(t.embed) && c.has(strings.TrimPrefix(t.embed, t.prefix))
	fileName := func(n string) string {
		if strip {
			return strings.TrimPrefix(n, t.prefix)
		}
		return n
	}
	var bs []binding
	var missing []string
	used := map[string]bool{}
	hasHead := false
	for _, p := range params {
		if p == nil {
			return fmt.Errorf("%w: nil parameter", graph.ErrNilTensor)
		}
		name, transposed, ok := t.fileName(p.Name())
		if !ok {
			return fmt.Errorf("%w: parameter %q has no %s checkpoint name", ErrUnsupported, p.Name(), arch)
		}
		name = fileName(name)
		if used[name] {
			return fmt.Errorf("%w: two parameters load from %q", ErrCheckpoint, name)
		}
		used[name] = true
		hasHead = hasHead || name == fileName(t.head)
		dst, err := paramData(p)
		if err != nil {
			return err
		}
		info, file, ok := c.Tensor(name)
		if !ok {
			missing = append(missing, name)
			continue
		}
		want := p.Shape()
		if transposed {
			if len(want) != 2 {
				return fmt.Errorf("%w: parameter %s is %v; a transposed weight must be 2-d", graph.ErrShape, p.Name(), want)
			}
			want = []int{want[1], want[0]}
		}
		if !slices.Equal(want, info.Shape) {
			return &ShapeError{Param: p.Name(), Tensor: name, File: file, Want: want, Got: info.Shape}
		}
		if err := weightDType(info, file); err != nil {
			return err
		}
		bs = append(bs, binding{p: p, dst: dst, tensor: name, transposed: transposed})
	}
	if len(missing) > 0 {
		return fmt.Errorf("%w: %s lacks %s", ErrMissingTensor, c.dir, nameList(missing))
	}
	var unexpected []string
	tiedHead := false
	for _, n := range c.names {
		switch {
		case used[n], t.isIgnored(n):
		case n == fileName(t.head) && !hasHead:
			tiedHead = true
		default:
			unexpected = append(unexpected, n)
		}
	}
	if len(unexpected) > 0 {
		return fmt.Errorf("%w: %s holds %s", ErrUnexpectedTensor, c.dir, nameList(unexpected))
	}
	if tiedHead {
		if err := c.checkTied(fileName(t.head), fileName(t.embed)); err != nil {
			return err
		}
	}
	for _, b := range bs {
		if err := c.fill(b); err != nil {
			return err
		}
	}
	return nil
}

func (c *Checkpoint) has(name string) bool { _, ok := c.where[name]; return ok }

// paramData is p's float32 data, which loading overwrites in place.
func paramData(p *nn.Param) ([]float32, error) {
	if err := p.Err(); err != nil {
		return nil, err
	}
	v := p.Value()
	if v == nil {
		return nil, fmt.Errorf("%w: parameter %s is shape-only (nn.Options.ShapeOnly); load into a model with data", graph.ErrNoData, p.Name())
	}
	d, ok := v.Data().([]float32)
	if !ok || len(d) != graph.Numel(p.Shape()) {
		return nil, fmt.Errorf("%w: parameter %s holds %T, not %d float32s", graph.ErrDType, p.Name(), v.Data(), graph.Numel(p.Shape()))
	}
	return d, nil
}

// weightDType accepts the float dtypes weights come in.
func weightDType(info safetensors.TensorInfo, file string) error {
	switch info.DType {
	case safetensors.F32, safetensors.BF16, safetensors.F16:
		return nil
	}
	return fmt.Errorf("%w: tensor %q in %s is %s; weights must be F32, BF16 or F16", safetensors.ErrDType, info.Name, file, info.DType)
}

// fill reads one tensor into its parameter.
func (c *Checkpoint) fill(b binding) error {
	if !b.transposed {
		return c.ReadFloat32(b.tensor, b.dst)
	}
	s := b.p.Shape() // [out, in]; the file holds [in, out]
	out, in := s[0], s[1]
	buf := make([]float32, len(b.dst))
	if err := c.ReadFloat32(b.tensor, buf); err != nil {
		return err
	}
	for i := range in {
		for o := range out {
			b.dst[o*in+i] = buf[i*out+o]
		}
	}
	return nil
}

// checkTied checks that a checkpoint's head equals its embedding, as a
// model that ties them requires: an untied head would be dropped.
func (c *Checkpoint) checkTied(head, embed string) error {
	hi, hfile, _ := c.Tensor(head)
	ei, _, ok := c.Tensor(embed)
	if !ok {
		return fmt.Errorf("%w: %s holds %q but no %q to tie it to", ErrCheckpoint, c.dir, head, embed)
	}
	if !slices.Equal(hi.Shape, ei.Shape) {
		return &ShapeError{Param: "(tied) " + embed, Tensor: head, File: hfile, Want: ei.Shape, Got: hi.Shape}
	}
	if err := weightDType(hi, hfile); err != nil {
		return err
	}
	const chunk = 1 << 18
	hs, err := c.section(head)
	if err != nil {
		return err
	}
	es, err := c.section(embed)
	if err != nil {
		return err
	}
	if hi.DType == ei.DType { // compare bytes as stored
		ab, bb := make([]byte, chunk), make([]byte, chunk)
		for at := int64(0); at < hi.Bytes(); at += chunk {
			n := min(chunk, hi.Bytes()-at)
			if _, err := hs.ReadAt(ab[:n], at); err != nil {
				return err
			}
			if _, err := es.ReadAt(bb[:n], at); err != nil {
				return err
			}
			if !bytes.Equal(ab[:n], bb[:n]) {
				return c.untied(head, embed)
			}
		}
		return nil
	}
	// Different dtypes: compare values (rare; two copies of the
	// embedding for the moment of the check).
	hv, ev := make([]float32, hi.NumElements()), make([]float32, ei.NumElements())
	if err := c.ReadFloat32(head, hv); err != nil {
		return err
	}
	if err := c.ReadFloat32(embed, ev); err != nil {
		return err
	}
	if !slices.Equal(hv, ev) {
		return c.untied(head, embed)
	}
	return nil
}

func (c *Checkpoint) untied(head, embed string) error {
	return fmt.Errorf("%w: %s: %q differs from %q, but the model ties its head to the embedding (tie_word_embeddings)", ErrCheckpoint, c.dir, head, embed)
}

func (c *Checkpoint) section(name string) (io.ReaderAt, error) {
	l := c.where[name]
	return c.files[l.file].Section(name)
}
