// Command finetune fine-tunes a Hugging Face checkpoint on a text file and
// saves it in the same format: it loads a local checkpoint directory
// (config.json and model.safetensors, or shards with
// model.safetensors.index.json, package hf) of a LlamaForCausalLM,
// MistralForCausalLM, Qwen2ForCausalLM or GPT2LMHeadModel and its
// tokenizer.json (package tokenizer), tokenizes the text, trains on
// windows of it (data.Windows) with AdamW under a cosine schedule with
// warmup, gradient clipping and no weight decay on biases and norms, saves
// the result with hf.Save (with the source's tokenizer files and
// generation_config.json beside it: a directory as complete as the one it
// came from), and greedy-generates a few tokens from a prompt.
//
//	go run ./examples/finetune -model ./Llama-3.2-1B -data corpus.txt -out ./tuned -steps 200 -seq 512 -batch 4 -precision bf16-mixed
//	go run ./examples/finetune -model ./gpt2 -data corpus.txt -out ./tuned -prompt "Once upon a time" -generate 20
//
// It runs on the GPU when one is usable and on the CPU otherwise
// (-device). The checkpoint's weights may be float32, bfloat16 or float16;
// they train in float32 (-precision bf16-mixed runs the matrix products in
// bfloat16 from float32 master weights) and are saved in the checkpoint's
// dtype unless -save-dtype says otherwise. Generation runs the whole
// growing sequence through Session.Eval at every token, with no key/value
// cache: simple and exact, quadratic in the length, meant for a few
// tokens. It stops early at the config's eos_token_id.
//
// Each log line is train.Run's (the step, the interval's mean loss, the
// learning rate, tokens/s, the allocator's memory, the time left).
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/data"
	"github.com/batchfit/batchfit/hf"
	"github.com/batchfit/batchfit/internal/safefile"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/models"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/optim"
	"github.com/batchfit/batchfit/precision"
	"github.com/batchfit/batchfit/tokenizer"
	"github.com/batchfit/batchfit/train"
)

// maxTextBytes bounds the text file: it is read whole and tokenized in
// memory.
const maxTextBytes = 1 << 30

type options struct {
	model, tokenizer, data, out string
	prompt, saveDType           string
	steps, batch, seq, stride   int
	warmup, logEvery, generate  int
	lr, minRatio, clip, wd      float64
	seed                        uint64
	precision, device           string
}

func main() {
	o, err := parseFlags(os.Args[1:], os.Stderr)
	switch {
	case errors.Is(err, flag.ErrHelp):
		os.Exit(0)
	case err != nil:
		os.Exit(2)
	}
	if _, err := run(context.Background(), os.Stdout, o); err != nil {
		fmt.Fprintln(os.Stderr, "finetune:", err)
		os.Exit(1)
	}
}

func parseFlags(args []string, stderr io.Writer) (options, error) {
	o := options{}
	fs := flag.NewFlagSet("finetune", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&o.model, "model", "", "Hugging Face checkpoint directory: config.json and model.safetensors (or model.safetensors.index.json and shards) (required)")
	fs.StringVar(&o.tokenizer, "tokenizer", "", "tokenizer.json (default: the one in -model)")
	fs.StringVar(&o.data, "data", "", "UTF-8 text file to fine-tune on (required)")
	fs.StringVar(&o.out, "out", "", "directory to save the fine-tuned checkpoint in, Hugging Face's format (required)")
	fs.StringVar(&o.saveDType, "save-dtype", "", "dtype of the saved weights: float32, bfloat16 or float16 (default: the checkpoint's)")
	fs.StringVar(&o.prompt, "prompt", "", "text to continue after training (empty: the first tokens of -data)")
	fs.IntVar(&o.generate, "generate", 16, "tokens to greedy-generate after training (0: none)")
	fs.IntVar(&o.steps, "steps", 100, "training steps")
	fs.IntVar(&o.batch, "batch", 4, "sequences per step")
	fs.IntVar(&o.seq, "seq", 128, "tokens per sequence")
	fs.IntVar(&o.stride, "stride", 0, "tokens between the starts of consecutive sequences (0: -seq, so they tile the text)")
	fs.Float64Var(&o.lr, "lr", 5e-5, "peak learning rate")
	fs.IntVar(&o.warmup, "warmup", 10, "linear warmup steps of the cosine schedule")
	fs.Float64Var(&o.minRatio, "min-lr-ratio", 0.1, "the cosine's floor, as a fraction of -lr")
	fs.Float64Var(&o.clip, "clip", 1, "gradient clipping's max global norm (0: off)")
	fs.Float64Var(&o.wd, "wd", 0.01, "AdamW weight decay of weight matrices and embeddings (biases and norms: none)")
	fs.IntVar(&o.logEvery, "log-every", 10, "log a line every this many steps")
	fs.Uint64Var(&o.seed, "seed", 1, "seed of the data order")
	fs.StringVar(&o.precision, "precision", "fp32", "precision policy: "+precision.Names())
	fs.StringVar(&o.device, "device", batchfit.DeviceAuto, "auto (CUDA when a GPU is usable), cpu or cuda")
	if err := fs.Parse(args); err != nil {
		return o, err
	}
	if fs.NArg() > 0 {
		err := fmt.Errorf("unexpected argument %q", fs.Arg(0))
		fmt.Fprintln(stderr, err)
		fs.Usage()
		return o, err
	}
	return o, nil
}

// result is what a run did, for tests.
type result struct {
	Config hf.Config
	Model  nn.Module // the fine-tuned model, its host tensors synced
	Losses []float32 // every step's loss
	// Predicted and Measured are the last step's peak reserved bytes, the
	// plan's (with the executor's overhead) and the allocator's.
	Predicted, Measured int64
	Prompt              []int
	Generated           []int // the prompt's continuation, without the prompt
}

// run fine-tunes as o says, printing to out.
func run(ctx context.Context, out io.Writer, o options) (*result, error) {
	switch {
	case o.model == "" || o.data == "" || o.out == "":
		return nil, errors.New("-model, -data and -out are required")
	case o.steps < 1 || o.batch < 1 || o.seq < 1 || o.stride < 0 || o.warmup < 0 || o.logEvery < 1 || o.generate < 0:
		return nil, fmt.Errorf("steps %d, batch %d, seq %d, stride %d, warmup %d, log-every %d, generate %d: out of range",
			o.steps, o.batch, o.seq, o.stride, o.warmup, o.logEvery, o.generate)
	}
	if abs(o.out) == abs(o.model) {
		return nil, fmt.Errorf("-out %s is the -model directory: save into another", o.out)
	}
	tokPath := o.tokenizer
	if tokPath == "" {
		tokPath = filepath.Join(o.model, "tokenizer.json")
	}
	tok, err := tokenizer.Load(tokPath)
	if err != nil {
		return nil, err
	}
	cfg, model, err := load(o.model)
	if err != nil {
		return nil, err
	}
	vocab, positions := dims(cfg)
	if o.seq > positions {
		return nil, fmt.Errorf("-seq %d is longer than the model's %d positions", o.seq, positions)
	}
	fmt.Fprintf(out, "model: %s %s: %d parameters (%s weights); tokenizer %s: %d tokens\n",
		cfg.Architecture, o.model, nn.NumParams(model), dtypeName(cfg.DType), tokPath, tok.VocabSize())

	text, err := safefile.ReadAll(o.data, maxTextBytes)
	if err != nil {
		return nil, err
	}
	ids, err := tok.Encode(string(text), true)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", o.data, err)
	}
	if err := checkIDs(ids, vocab); err != nil {
		return nil, fmt.Errorf("%s: %w", o.data, err)
	}
	stream := make([]uint32, len(ids))
	for i, id := range ids {
		stream[i] = uint32(id)
	}
	ds, err := data.NewWindows(data.Tokens32(stream), o.seq, data.WindowOptions{Stride: o.stride, Vocab: vocab})
	if err != nil {
		return nil, err
	}
	if ds.Len() < o.batch {
		return nil, fmt.Errorf("%s: %d tokens make %d sequences of %d (and its next token), fewer than a batch of %d", o.data, len(ids), ds.Len(), o.seq, o.batch)
	}
	fmt.Fprintf(out, "data: %s: %d tokens, %d sequences of %d\n", o.data, len(ids), ds.Len(), o.seq)

	sess := batchfit.NewSession(batchfit.Options{Device: o.device, Precision: o.precision})
	if err := sess.Err(); err != nil {
		return nil, err
	}
	defer sess.Close()
	fmt.Fprintln(out, "device:", sess.Device())

	opt := optim.NewAdamW(o.lr)
	opt.WeightDecay = o.wd
	opt.Schedule = optim.Cosine{Warmup: o.warmup, Total: o.steps, MinRatio: o.minRatio}
	opt.Clip.MaxNorm = o.clip
	_, noDecay := optim.SplitDecay(model.Params())
	opt.AddGroup("no_decay", optim.Keys(noDecay)...).WeightDecay = 0

	loader, err := data.NewLoader(ds, data.Options{Batch: o.batch, DropLast: true, Shuffle: true, Seed: o.seed, Host: sess.HostMemory()})
	if err != nil {
		return nil, err
	}
	defer loader.Close()
	res := &result{Config: cfg, Model: model}
	params := nn.ParamTensors(model)
	step := func(ctx context.Context, s int) (train.Result, error) {
		b, err := loader.Next(ctx)
		if err != nil {
			return train.Result{}, err
		}
		x := lazy.Wrap(b.Tensor("inputs"), 0)
		loss := models.Loss(model.Forward(x), x.Graph().Wrap(b.Tensor("targets"), 0))
		lr := opt.Schedule.LR(opt.LR, opt.Steps())
		l, err := sess.Step(ctx, loss, params, opt)
		res.Losses = append(res.Losses, l)
		return train.Result{Loss: l, Tokens: b.Size * o.seq, LR: lr}, err
	}
	if _, err := train.Run(ctx, train.Config{Steps: o.steps, LogEvery: o.logEvery, Allocator: sess.Allocator(), Out: out}, step); err != nil {
		return nil, err
	}
	if pl := sess.LastPlan(); pl != nil {
		res.Predicted, res.Measured = pl.PeakReserved+sess.Overhead(), sess.LastUsage().PeakReserved
		fmt.Fprintf(out, "last step: batch %d as %s chunks, peak %s predicted, %s measured\n", o.batch, pl.Split,
			batchfit.FormatSize(res.Predicted), batchfit.FormatSize(res.Measured))
	}
	if err := sess.SyncParams(); err != nil {
		return nil, err
	}

	saved := cfg
	if o.saveDType != "" {
		saved.DType = o.saveDType
	}
	if err := hf.Save(o.out, saved, model.Params()); err != nil {
		return nil, err
	}
	copied, err := copyBeside(o.out, tokPath, o.model)
	if err != nil {
		return nil, err
	}
	fmt.Fprintf(out, "saved %s (%s weights; %s)\n", o.out, dtypeName(saved.DType), strings.Join(copied, ", "))

	if o.generate == 0 {
		return res, nil
	}
	if o.prompt != "" {
		if res.Prompt, err = tok.Encode(o.prompt, true); err != nil {
			return nil, fmt.Errorf("-prompt: %w", err)
		}
		if err := checkIDs(res.Prompt, vocab); err != nil {
			return nil, fmt.Errorf("-prompt: %w", err)
		}
	} else {
		res.Prompt = ids[:min(len(ids), 8)]
	}
	if len(res.Prompt) == 0 {
		return nil, errors.New("-prompt: no tokens")
	}
	if res.Generated, err = generate(ctx, sess, model, res.Prompt, o.generate, positions, cfg.EOS); err != nil {
		return nil, err
	}
	prompt, err := tok.Decode(res.Prompt, true)
	if err != nil {
		return nil, err
	}
	cont, err := tok.Decode(res.Generated, false)
	if err != nil {
		return nil, err
	}
	fmt.Fprintf(out, "prompt %q\ngenerated %v\n%q\n", prompt, res.Generated, cont)
	return res, nil
}

// load reads a checkpoint directory's config, builds its model and fills
// the model's parameters from the checkpoint's weights.
func load(dir string) (hf.Config, nn.Module, error) {
	cfg, err := hf.ReadConfig(dir)
	if err != nil {
		return hf.Config{}, nil, err
	}
	model, err := newModel(cfg)
	if err != nil {
		return hf.Config{}, nil, err
	}
	ck, err := hf.OpenCheckpoint(dir)
	if err != nil {
		return hf.Config{}, nil, err
	}
	defer ck.Close()
	if err := ck.LoadInto(cfg.Architecture, model.Params()); err != nil {
		return hf.Config{}, nil, err
	}
	return cfg, model, nil
}

// newModel builds the model cfg describes; its parameters' initial values
// are overwritten by the checkpoint's.
func newModel(cfg hf.Config) (nn.Module, error) {
	var m interface {
		nn.Module
		Err() error
	}
	switch {
	case cfg.Llama != nil:
		m = models.NewLlama(nn.Seed(1), *cfg.Llama)
	case cfg.GPT != nil:
		m = models.NewGPT(nn.Seed(1), *cfg.GPT)
	default:
		return nil, fmt.Errorf("%w: %s has no model", hf.ErrUnsupported, cfg.Architecture)
	}
	if err := m.Err(); err != nil {
		return nil, err
	}
	return m, nil
}

// dims are a config's vocabulary and its longest sequence.
func dims(cfg hf.Config) (vocab, positions int) {
	if cfg.Llama != nil {
		return cfg.Llama.Vocab, cfg.Llama.MaxPositions
	}
	return cfg.GPT.Vocab, cfg.GPT.Context
}

// checkIDs makes sure every id indexes the model's embedding: a tokenizer
// larger than the model's vocabulary is another model's.
func checkIDs(ids []int, vocab int) error {
	for i, id := range ids {
		if id < 0 || id >= vocab {
			return fmt.Errorf("token %d is id %d, outside the model's vocabulary of %d (is the tokenizer this model's?)", i, id, vocab)
		}
	}
	return nil
}

// generate greedy-decodes n tokens after prompt: at every step the whole
// sequence so far (its last positions tokens) runs through the model with
// Session.Eval, and the next token is the argmax of the last position's
// logits (the first of equal ones, as torch.argmax). It stops after a
// token of eos. It returns the new tokens.
func generate(ctx context.Context, sess *batchfit.Session, model nn.Module, prompt []int, n, positions int, eos []int) ([]int, error) {
	seq := slices.Clone(prompt)
	for range n {
		window := seq[max(0, len(seq)-positions):]
		x := make([]int64, len(window))
		for i, id := range window {
			x[i] = int64(id)
		}
		t := len(x)
		logits := model.Forward(lazy.Wrap(tensor.New(tensor.WithShape(1, t), tensor.WithBacking(x)), 0))
		vals, err := sess.Eval(ctx, logits.Slice(1, t-1, t))
		if err != nil {
			return nil, err
		}
		last, ok := vals[0].Data().([]float32)
		if !ok || len(last) == 0 {
			return nil, fmt.Errorf("generate: logits of %v %s, want float32", vals[0].Shape(), vals[0].Dtype())
		}
		next := 0
		for i, v := range last {
			if v > last[next] {
				next = i
			}
		}
		seq = append(seq, next)
		if slices.Contains(eos, next) {
			break
		}
	}
	return seq[len(prompt):], nil
}

func dtypeName(s string) string {
	if s == "" {
		return "float32"
	}
	return s
}

func abs(p string) string {
	a, err := filepath.Abs(p)
	if err != nil {
		return p
	}
	return filepath.Clean(a)
}

// copyBeside copies into dir what transformers loads besides the weights:
// the tokenizer file (as tokenizer.json) and the tokenizer_config.json and
// special_tokens_map.json beside it, for AutoTokenizer, and the model
// directory's generation_config.json (eos and sampling defaults for
// generate), each when present. Files are read within tokenizer's bound.
// It returns the names copied.
func copyBeside(dir, tokPath, modelDir string) ([]string, error) {
	files := []struct{ src, name string }{
		{tokPath, "tokenizer.json"},
		{filepath.Join(filepath.Dir(tokPath), "tokenizer_config.json"), "tokenizer_config.json"},
		{filepath.Join(filepath.Dir(tokPath), "special_tokens_map.json"), "special_tokens_map.json"},
		{filepath.Join(modelDir, "generation_config.json"), "generation_config.json"},
	}
	var copied []string
	for i, f := range files {
		b, err := safefile.ReadAll(f.src, tokenizer.MaxFileBytes)
		if i > 0 && errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil {
			return copied, err
		}
		if err := os.WriteFile(filepath.Join(dir, f.name), b, 0o644); err != nil {
			return copied, fmt.Errorf("saving %s: %w", f.name, err)
		}
		copied = append(copied, f.name)
	}
	return copied, nil
}
