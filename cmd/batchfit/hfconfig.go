package main

import (
	"fmt"
	"strings"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/hf"
	"github.com/batchfit/batchfit/models"
)

// maxHFSeqDefault caps the --seq default of a Hugging Face config, its
// max_position_embeddings: Llama 3.2's 131,072 positions would make a
// step of 131,072 tokens per sample unless --seq says otherwise.
const maxHFSeqDefault = 8192

// maxHFLayers bounds a config's layer count: the graph grows with it
// (about 40 nodes a layer, three times that with backward), and the
// deepest real checkpoints have 126 layers (Llama 3.1 405B).
const maxHFLayers = 1024

// modelFileError is a model file (--hf-config) that cannot be read or
// describes no model batchfit builds: exit 1, as for a file that cannot
// be read, not a usage mistake. Err is hf's (errors.Is with
// hf.ErrConfig, hf.ErrUnsupported, hf.ErrTooLarge, …; errors.As with
// *hf.UnsupportedArchitectureError).
type modelFileError struct {
	Flag string
	Err  error
}

func (e *modelFileError) Error() string { return fmt.Sprintf("--%s: %v", e.Flag, e.Err) }
func (e *modelFileError) Unwrap() error { return e.Err }

// buildError is a model that does not build (a Hugging Face config's
// head_dim that rotary embedding cannot pair, say), found while the
// command line is checked: exit 1, as when estimate's build fails.
type buildError struct {
	model string
	err   error
}

func (e *buildError) Error() string { return fmt.Sprintf("building %s: %v", e.model, e.err) }
func (e *buildError) Unwrap() error { return e.err }

// hfModel is the model a Hugging Face config.json at path describes (or
// the one in the checkpoint directory path), as a zoo entry named after
// its architecture. Every error is a *modelFileError.
func hfModel(path string) (zooModel, error) {
	cfg, err := hf.ReadConfig(path)
	if err != nil {
		return zooModel{}, &modelFileError{Flag: "hf-config", Err: err}
	}
	name := string(cfg.Architecture)
	switch {
	case cfg.GPT != nil:
		g := *cfg.GPT
		if g.Layers > maxHFLayers {
			return zooModel{}, &modelFileError{Flag: "hf-config", Err: fmt.Errorf("%s: %w: n_layer %d, more than the %d layers batchfit plans", path, hf.ErrUnsupported, g.Layers, maxHFLayers)}
		}
		about := fmt.Sprintf("Hugging Face config %s: GPT-2, %d layers, width %d, %d heads, %d positions, vocab %d, tied head",
			path, g.Layers, g.Dim, g.Heads, g.Context, g.Vocab)
		return gptEntry(name, about, g), nil
	case cfg.Llama != nil:
		l := *cfg.Llama
		if l.Layers > maxHFLayers {
			return zooModel{}, &modelFileError{Flag: "hf-config", Err: fmt.Errorf("%s: %w: num_hidden_layers %d, more than the %d layers batchfit plans", path, hf.ErrUnsupported, l.Layers, maxHFLayers)}
		}
		m := llamaEntry(name, "Hugging Face config "+path+": "+describeLlama(l, cfg.SlidingWindow), l, l.MaxPositions)
		if l.MaxPositions > maxHFSeqDefault {
			m.seqDefault = maxHFSeqDefault
		}
		return withRopeCheck(m, l), nil
	}
	return zooModel{}, &modelFileError{Flag: "hf-config", Err: fmt.Errorf("%s: %w: architecture %s has no model", path, hf.ErrUnsupported, name)}
}

// maxRopeTableBytes bounds the rotary cos/sin table models.Llama
// computes on the host when it is built, [seq, head_dim] float32, even
// shape-only: 64 MiB for Llama 3's 131,072 positions of 128.
const maxRopeTableBytes = 1 << 30

// checkRopeTable refuses a sequence length whose rotary table would pass
// maxRopeTableBytes.
func checkRopeTable(l models.LlamaConfig, seq int) error {
	hd := l.HeadDim
	if hd == 0 {
		hd = l.Hidden / l.Heads
	}
	if b := int64(seq) * int64(hd) * 4; b > maxRopeTableBytes {
		return usagef(errRange, "--seq %d with head_dim %d: the rotary table [%d, %d] would take %s of host memory, more than %s",
			seq, hd, seq, hd, alloc.FormatBytes(b), alloc.FormatBytes(maxRopeTableBytes))
	}
	return nil
}

// withRopeCheck gives a Llama entry of l the rotary table's bound, here
// and in the entry --context makes.
func withRopeCheck(m zooModel, l models.LlamaConfig) zooModel {
	m.input = fmt.Sprintf("tokens [≤%d] int64", m.context)
	m.checkSeq = func(seq int) error { return checkRopeTable(l, seq) }
	withContext := m.withContext
	m.withContext = func(n int) zooModel { return withRopeCheck(withContext(n), l) }
	return m
}

// hfArchitectures lists the architectures --hf-config reads.
func hfArchitectures() string {
	var names []string
	for _, a := range hf.Architectures() {
		names = append(names, string(a))
	}
	return strings.Join(names, ", ")
}

// describeLlama says what a Llama-family config is, in the zoo's words.
func describeLlama(l models.LlamaConfig, window int) string {
	kv := l.KVHeads
	if kv == 0 {
		kv = l.Heads
	}
	hd := l.HeadDim
	if hd == 0 {
		hd = l.Hidden / l.Heads
	}
	parts := []string{
		fmt.Sprintf("%d layers", l.Layers),
		fmt.Sprintf("width %d", l.Hidden),
		fmt.Sprintf("%d query and %d key/value heads of %d", l.Heads, kv, hd),
		fmt.Sprintf("SwiGLU %d", l.Intermediate),
		fmt.Sprintf("vocab %d", l.Vocab),
	}
	if l.TieEmbeddings {
		parts = append(parts, "tied head")
	} else {
		parts = append(parts, "untied head")
	}
	var bias []string
	if l.QKVBias {
		bias = append(bias, "q, k, v")
	}
	if l.OutBias {
		bias = append(bias, "output")
	}
	if l.MLPBias {
		bias = append(bias, "MLP")
	}
	if len(bias) > 0 {
		parts = append(parts, strings.Join(bias, ", ")+" biases")
	}
	rope := fmt.Sprintf("rope theta %g", l.Rope.Theta)
	switch l.Rope.Type {
	case "linear":
		rope += fmt.Sprintf(" with linear scaling (factor %g)", l.Rope.Factor)
	case "llama3":
		rope += fmt.Sprintf(" with llama3 scaling (factor %g)", l.Rope.Factor)
	}
	parts = append(parts, rope, fmt.Sprintf("%d positions", l.MaxPositions))
	if window > 0 {
		// models.Llama has no window: it attends over the whole causal
		// context, the same attention for sequences up to the window.
		parts = append(parts, fmt.Sprintf("sliding window %d planned as whole causal attention (the same up to %d tokens)", window, window))
	}
	return strings.Join(parts, ", ")
}
