// Command train-lm trains a small GPT (models.NewGPT) on a token file,
// as nanoGPT and llm.c write them, with AdamW under a cosine schedule
// with warmup, gradient clipping and a no-decay group for biases and
// norms (optim.SplitDecay); it saves a checkpoint every -ckpt-every
// steps and resumes from the latest with -resume, bit for bit as if it
// had never stopped, even after kill -9.
//
//	go run ./examples/train-lm                        # generates -dir/tokens.bin, trains 200 steps
//	go run ./examples/train-lm -resume                # after an interruption: on from the latest checkpoint
//	go run ./examples/train-lm -data train.bin -vocab 50257 -seq 256 -dim 384 -layers 6 -heads 6
//
// Without -data it writes a corpus of its own into -dir/tokens.bin (once;
// a resumed run reads the same file): 65,536 tokens of a seeded Markov
// chain over -vocab tokens, in llm.c's format. With -data it maps the file
// (data.OpenTokens, either format); every token must be below -vocab.
//
// Each log line is train.Run's (the step, the interval's mean loss, the
// learning rate, tokens/s, the allocator's memory, the time left), and
// each checkpoint is announced; the last line is the SHA-256 of the
// trained parameters' float32 bits, which an interrupted and resumed run
// repeats. Checkpoints go to -dir (package checkpoint: ckpt-NNNNNNNN
// directories and a latest pointer; the two newest are kept). A -dir that
// holds checkpoints already is refused without -resume, so that a new run
// does not mix with an old one.
//
// The defaults (a 2-layer GPT of width 64 over 64 tokens, 200 steps of 8
// sequences of 64 tokens) run in well under a minute on two CPU cores.
package main

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/checkpoint"
	"github.com/batchfit/batchfit/data"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/models"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/optim"
	"github.com/batchfit/batchfit/precision"
	"github.com/batchfit/batchfit/train"
)

type options struct {
	data, dir           string
	resume              bool
	steps, batch, seq   int
	vocab, layers       int
	heads, dim          int
	lr, minRatio        float64
	warmup              int
	clip, weightDecay   float64
	ckptEvery, logEvery int
	seed                uint64
	precision, device   string
}

func main() {
	o, err := parseFlags(os.Args[1:], os.Stderr)
	switch {
	case errors.Is(err, flag.ErrHelp):
		os.Exit(0)
	case err != nil:
		os.Exit(2)
	}
	if err := run(context.Background(), os.Stdout, o); err != nil {
		fmt.Fprintln(os.Stderr, "train-lm:", err)
		os.Exit(1)
	}
}

func parseFlags(args []string, stderr io.Writer) (options, error) {
	o := options{}
	fs := flag.NewFlagSet("train-lm", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&o.data, "data", "", "token file (nanoGPT's raw uint16 or llm.c's format); empty: generate DIR/tokens.bin")
	fs.StringVar(&o.dir, "dir", "train-lm-out", "checkpoint directory")
	fs.BoolVar(&o.resume, "resume", false, "continue from the latest checkpoint in -dir (none: start at step 0)")
	fs.IntVar(&o.steps, "steps", 200, "training steps in all, a resumed run's included")
	fs.IntVar(&o.batch, "batch", 8, "sequences per step")
	fs.IntVar(&o.seq, "seq", 64, "tokens per sequence (the model's context)")
	fs.IntVar(&o.vocab, "vocab", 64, "vocabulary size; every token of -data must be below it")
	fs.IntVar(&o.layers, "layers", 2, "transformer blocks")
	fs.IntVar(&o.heads, "heads", 2, "attention heads")
	fs.IntVar(&o.dim, "dim", 64, "model width (a multiple of -heads)")
	fs.Float64Var(&o.lr, "lr", 3e-3, "peak learning rate")
	fs.IntVar(&o.warmup, "warmup", 20, "linear warmup steps of the cosine schedule")
	fs.Float64Var(&o.minRatio, "min-lr-ratio", 0.1, "the cosine's floor, as a fraction of -lr")
	fs.Float64Var(&o.clip, "clip", 1, "gradient clipping's max global norm (0: off)")
	fs.Float64Var(&o.weightDecay, "wd", 0.1, "AdamW weight decay of weight matrices and embeddings (biases and norms: none)")
	fs.IntVar(&o.ckptEvery, "ckpt-every", 50, "save a checkpoint every this many steps (and after the last)")
	fs.IntVar(&o.logEvery, "log-every", 10, "log a line every this many steps")
	fs.Uint64Var(&o.seed, "seed", 1, "seed of the initial weights, the data order and a generated corpus")
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

// run trains as o says, printing to out.
func run(ctx context.Context, out io.Writer, o options) error {
	switch {
	case o.steps < 1 || o.batch < 1 || o.seq < 2 || o.vocab < 2 || o.ckptEvery < 1 || o.logEvery < 1 || o.warmup < 0:
		return fmt.Errorf("steps %d, batch %d, seq %d, vocab %d, ckpt-every %d, log-every %d, warmup %d: out of range",
			o.steps, o.batch, o.seq, o.vocab, o.ckptEvery, o.logEvery, o.warmup)
	case o.dir == "":
		return errors.New("-dir is empty")
	}
	if _, err := checkpoint.Latest(o.dir); err == nil && !o.resume {
		return fmt.Errorf("%s holds checkpoints: pass -resume to continue that run, or choose another -dir", o.dir)
	}
	if err := os.MkdirAll(o.dir, 0o755); err != nil {
		return err
	}
	path := o.data
	if path == "" {
		path = filepath.Join(o.dir, "tokens.bin")
		if err := ensureCorpus(path, o.vocab, o.seed); err != nil {
			return err
		}
	}
	tf, err := data.OpenTokens(path, data.FormatAuto)
	if err != nil {
		return err
	}
	defer tf.Close()
	ds, err := data.NewWindows(tf.Tokens, o.seq, data.WindowOptions{Vocab: o.vocab})
	if err != nil {
		return err
	}
	fmt.Fprintf(out, "data: %s: %d tokens, %d sequences of %d\n", path, tf.Tokens.Len(), ds.Len(), o.seq)

	sess := batchfit.NewSession(batchfit.Options{Device: o.device, Precision: o.precision})
	if err := sess.Err(); err != nil {
		return err
	}
	defer sess.Close()
	fmt.Fprintln(out, "device:", sess.Device())

	model := models.NewGPT(nn.Seed(o.seed), models.GPTConfig{Vocab: o.vocab, Context: o.seq, Layers: o.layers, Heads: o.heads, Dim: o.dim})
	if err := model.Err(); err != nil {
		return err
	}
	opt := optim.NewAdamW(o.lr)
	opt.WeightDecay = o.weightDecay
	opt.Schedule = optim.Cosine{Warmup: o.warmup, Total: o.steps, MinRatio: o.minRatio}
	opt.Clip.MaxNorm = o.clip
	decay, noDecay := optim.SplitDecay(model.Params())
	opt.AddGroup("no_decay", optim.Keys(noDecay)...).WeightDecay = 0
	fmt.Fprintf(out, "model: GPT %d layers, %d heads, width %d: %d parameters; AdamW, cosine schedule (warmup %d), clip %g, weight decay %g on %d tensors, none on %d\n",
		o.layers, o.heads, o.dim, nn.NumParams(model), o.warmup, o.clip, o.weightDecay, len(decay), len(noDecay))

	ck := &checkpoint.Training{Model: model, Optimizer: opt, Session: sess, Meta: map[string]string{"data": path}}
	if o.resume {
		switch err := ck.Load(o.dir); {
		case errors.Is(err, checkpoint.ErrNoCheckpoint):
			fmt.Fprintf(out, "no checkpoint in %s: starting at step 0\n", o.dir)
		case err != nil:
			return err
		default:
			fmt.Fprintf(out, "resumed at step %d\n", ck.Step)
		}
	}
	if ck.Step > o.steps {
		return fmt.Errorf("the checkpoint is at step %d, past -steps %d", ck.Step, o.steps)
	}
	loader, err := data.NewLoader(ds, data.Options{Batch: o.batch, DropLast: true, Shuffle: true, Seed: o.seed, Start: ck.Data, Host: sess.HostMemory()})
	if err != nil {
		return err
	}
	defer loader.Close()

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
		return train.Result{Loss: l, Tokens: b.Size * o.seq, LR: lr}, err
	}
	cfg := train.Config{Steps: o.steps, Start: ck.Step, LogEvery: o.logEvery, CheckpointEvery: o.ckptEvery, Allocator: sess.Allocator(), Out: out,
		Checkpoint: func(ctx context.Context, done int) error {
			ck.Step, ck.Data = done, loader.Position()
			path, err := ck.Save(o.dir)
			if err == nil {
				fmt.Fprintf(out, "checkpoint %s\n", path)
			}
			return err
		}}
	if _, err := train.Run(ctx, cfg, step); err != nil {
		return err
	}
	if err := sess.SyncParams(); err != nil {
		return err
	}
	fmt.Fprintln(out, "params sha256", digest(model))
	return nil
}

// digest is the SHA-256 of every parameter's float32 bits, in order.
func digest(m nn.Module) string {
	h := sha256.New()
	var b [4]byte
	for _, p := range m.Params() {
		for _, v := range p.Value().Data().([]float32) {
			binary.LittleEndian.PutUint32(b[:], math.Float32bits(v))
			h.Write(b[:])
		}
	}
	return hex.EncodeToString(h.Sum(nil))
}

// ensureCorpus writes 65,536 tokens of a seeded Markov chain over vocab
// tokens to path in llm.c's format, unless the file exists: each token's
// successor is its own likely one (probability 0.7), a second one (0.2),
// or any (0.1). The file is written beside and renamed into place.
func ensureCorpus(path string, vocab int, seed uint64) error {
	if _, err := os.Stat(path); err == nil {
		return nil
	}
	if vocab > math.MaxUint16+1 {
		return fmt.Errorf("a generated corpus holds uint16 tokens; -vocab %d is too large", vocab)
	}
	rng := rand.New(rand.NewPCG(seed, 0x5eed))
	first, second := rng.Perm(vocab), rng.Perm(vocab)
	toks := make([]uint16, 1<<16)
	cur := 0
	for i := range toks {
		toks[i] = uint16(cur)
		switch u := rng.Float64(); {
		case u < 0.7:
			cur = first[cur]
		case u < 0.9:
			cur = second[cur]
		default:
			cur = rng.IntN(vocab)
		}
	}
	f, err := os.CreateTemp(filepath.Dir(path), ".tokens-*.bin")
	if err != nil {
		return err
	}
	defer os.Remove(f.Name())
	err = data.WriteTokens(f, data.Tokens16(toks), data.FormatLLMC)
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return err
	}
	return os.Rename(f.Name(), path)
}
