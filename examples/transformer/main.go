// Command transformer trains a small GPT-style language model
// (models.NewGPT: 2 layers, 2 heads, width 32, 32 tokens, 32 positions)
// with AdamW on a generated corpus and prints the loss as it falls.
//
// The corpus is a seeded Markov chain over the vocabulary: every token has
// a likely successor (probability 0.7), a second one (0.2), and with
// probability 0.1 any token follows (noise). Predicting well means learning
// the transition table; the best achievable loss is the chain's entropy,
// which the program prints next to ln 32 ≈ 3.47, the loss of a uniform
// guess and about where an untrained model starts.
//
//	go run ./examples/transformer -steps 200 -batch 16 -seq 32 -seed 1 -lr 3e-3
//
// -precision picks the session's precision policy (fp32, the default;
// tf32, bf16-mixed or fp16-mixed: batchfit.Options.Precision) and -device
// its executor (auto, the default, as the other examples: CUDA when a GPU
// is usable; cpu or cuda). Another name for either is a usage error (exit
// status 2).
//
// # Dump
//
// -dump DIR writes what PyTorch needs to replay the run exactly
// (bench/torch_losses.py reads it; bench/loss-match runs both). Format
// "batchfit-gpt-dump/1":
//
//	DIR/config.json          the manifest, written last (a directory
//	                         without it is a run that did not finish)
//	DIR/params/NAME.npy      each initial parameter, float32 ('<f4'), by its
//	                         Hugging Face GPT-2 name (wte.weight, wpe.weight,
//	                         h.0.ln_1.weight, h.0.attn.c_attn.weight, ...,
//	                         ln_f.bias), written before the first step
//	DIR/tokens.npy           int64 ('<i8') [steps, batch, seq]: step i's inputs
//	DIR/targets.npy          int64 [steps, batch, seq]: step i's next tokens
//	DIR/losses.npy           float32 [steps]: batchfit's loss at each step,
//	                         computed before that step's update
//
// The .npy files are NumPy's format version 1.0, little-endian, C order
// (numpy.load reads them). Linear weights keep batchfit's (and
// torch.nn.Linear's) [out, in] layout: Hugging Face's Conv1D stores the
// transpose. config.json holds:
//
//	format       "batchfit-gpt-dump/1"
//	model        vocab, context, layers, heads, dim, fused_attention,
//	             layer_norm_eps and gelu ("tanh" or "erf"), read from the
//	             built model; tied_head (logits = ln_f(x)·wteᵀ, no bias);
//	             attn_scale; linear_layout
//	precision    the policy: fp32, tf32, bf16-mixed or fp16-mixed
//	device       the session's Device line
//	seed, steps, batch, seq
//	loss         mean next-token cross-entropy over batch×seq positions
//	optimizer    name "adamw", lr, beta1, beta2, eps, weight_decay,
//	             decoupled (AdamW's p ← p·(1 − lr·wd) before the Adam
//	             update), decay_all_params (true: optim.AdamW decays every
//	             parameter it is given, biases, norms and embeddings too)
//	params       [{name, shape, file}] in models.GPT's Params order
//	tokens, targets  the batch files
//	losses       {file, values}: the .npy file and the same float32 losses
//	             as JSON numbers
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"os"

	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/models"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/optim"
	"github.com/batchfit/batchfit/precision"
	"github.com/batchfit/batchfit/shapeinfer"
)

const (
	vocab   = 32
	maxSeq  = 32 // rows of the position embedding: the longest -seq
	pFirst  = 0.7
	pSecond = 0.2
	pNoise  = 1 - pFirst - pSecond
)

func config() models.GPTConfig {
	return models.GPTConfig{Vocab: vocab, Context: maxSeq, Layers: 2, Heads: 2, Dim: 32}
}

type options struct {
	steps     int     // training steps
	batch     int     // sequences per step
	seq       int     // tokens per sequence
	seed      uint64  // seeds the corpus and the initial weights
	lr        float64 // AdamW learning rate
	every     int     // print the loss every this many steps (0: ten lines)
	precision string  // batchfit.Options.Precision: "" or "fp32", "tf32", "bf16-mixed", "fp16-mixed"
	device    string  // batchfit.Options.Device: "" or "auto", "cpu", "cuda"
	dump      string  // directory to write the run to for replaying elsewhere ("": none)
}

func main() {
	o, err := parseFlags(os.Args[1:], os.Stderr)
	switch {
	case errors.Is(err, flag.ErrHelp):
		os.Exit(0)
	case err != nil:
		os.Exit(2) // the flag package has printed the error and the usage
	}
	if _, err := run(os.Stdout, o); err != nil {
		fmt.Fprintln(os.Stderr, "transformer:", err)
		os.Exit(1)
	}
}

// parseFlags reads the command line. A malformed flag, an unknown
// -precision or -device, or a positional argument is a usage error: it is
// printed to stderr with the usage and returned (main exits with status 2).
func parseFlags(args []string, stderr io.Writer) (options, error) {
	o := options{precision: string(precision.FP32), device: batchfit.DeviceAuto}
	fs := flag.NewFlagSet("transformer", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.IntVar(&o.steps, "steps", 200, "training steps")
	fs.IntVar(&o.batch, "batch", 16, "sequences per step")
	fs.IntVar(&o.seq, "seq", maxSeq, fmt.Sprintf("tokens per sequence (at most %d)", maxSeq))
	fs.Uint64Var(&o.seed, "seed", 1, "seed for the corpus and the initial weights")
	fs.Float64Var(&o.lr, "lr", 3e-3, "AdamW learning rate")
	fs.IntVar(&o.every, "every", 0, "print the loss every this many steps (0: ten lines in all)")
	fs.Func("precision", "precision policy: "+precision.Names()+" (default fp32)", func(s string) error {
		p, err := precision.Parse(s)
		o.precision = string(p)
		return err
	})
	fs.Func("device", "auto (CUDA when a GPU is usable), cpu or cuda (default auto)", func(s string) error {
		switch s {
		case batchfit.DeviceAuto, batchfit.DeviceCPU, batchfit.DeviceCUDA:
			o.device = s
			return nil
		}
		return fmt.Errorf("want %s, %s or %s", batchfit.DeviceAuto, batchfit.DeviceCPU, batchfit.DeviceCUDA)
	})
	fs.StringVar(&o.dump, "dump", "", "write the model config, initial weights, batches, AdamW settings and losses to this directory, for bench/torch_losses.py")
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

// run trains for o.steps steps, printing as it goes, and returns the loss
// of every step.
func run(w io.Writer, o options) ([]float32, error) {
	switch {
	case o.steps < 0:
		return nil, fmt.Errorf("-steps must be at least 0, got %d", o.steps)
	case o.batch < 1:
		return nil, fmt.Errorf("-batch must be at least 1, got %d", o.batch)
	case o.seq < 2 || o.seq > maxSeq:
		return nil, fmt.Errorf("-seq must lie in [2, %d], got %d", maxSeq, o.seq)
	case !(o.lr > 0):
		return nil, fmt.Errorf("-lr must be positive, got %g", o.lr)
	}
	cfg := config()
	model := models.NewGPT(nn.Seed(o.seed), cfg)
	if err := nn.Check(model); err != nil {
		return nil, err
	}
	chain := newChain(o.seed)
	sess := batchfit.NewSession(batchfit.Options{Device: o.device, Precision: o.precision})
	if err := sess.Err(); err != nil {
		return nil, err
	}
	defer sess.Close() // a failed Close of an example's GPU has nothing left to lose
	fmt.Fprintf(w, "device: %s\n", sess.Device())
	fmt.Fprintf(w, "model: GPT, %d layers, %d heads, width %d, vocab %d, context %d: %d parameters\n",
		cfg.Layers, cfg.Heads, cfg.Dim, cfg.Vocab, cfg.Context, nn.NumParams(model))
	if err := printBytes(w, model, o); err != nil {
		return nil, err
	}
	fmt.Fprintf(w, "corpus: Markov chain, entropy %.3f nats/token (the best loss); ln %d = %.3f (a uniform guess)\n",
		chain.entropy(), vocab, math.Log(vocab))
	fmt.Fprintf(w, "training: AdamW lr %g, batch %d × %d tokens, %d steps, precision %s\n", o.lr, o.batch, o.seq, o.steps, policy(o))

	opt := optim.NewAdamW(o.lr)
	var rec *recorder
	if o.dump != "" {
		var err error
		if rec, err = newRecorder(o.dump, model, opt, o, sess.Device()); err != nil {
			return nil, err
		}
	}
	every := o.every
	if every <= 0 {
		every = max(o.steps/10, 1)
	}
	ctx := context.Background()
	params := nn.ParamTensors(model)
	losses := make([]float32, 0, o.steps)
	for step := range o.steps {
		tokens, targets := chain.batch(o.seed, uint64(step), o.batch, o.seq)
		if rec != nil {
			rec.batch(tokens, targets)
		}
		x := lazy.Wrap(tokens, 0)
		loss := models.Loss(model.Forward(x), x.Graph().Wrap(targets, 0))
		l, err := sess.Step(ctx, loss, params, opt)
		if err != nil {
			return losses, fmt.Errorf("step %d: %w", step+1, err)
		}
		losses = append(losses, l)
		if step == 0 || (step+1)%every == 0 || step+1 == o.steps {
			fmt.Fprintf(w, "step %4d  loss %.4f\n", step+1, l)
		}
	}
	if rec != nil {
		if err := rec.finish(losses); err != nil {
			return losses, err
		}
		fmt.Fprintf(w, "dump: %s\n", o.dump)
	}
	return losses, nil
}

// policy is o's precision policy by name, "fp32" when unset.
func policy(o options) string {
	if o.precision == "" {
		return string(precision.FP32)
	}
	return o.precision
}

// printBytes analyses one training step (forward, loss, every gradient)
// without data and prints the sum of its tensors' sizes, split into the
// part that does not depend on the batch and the part per sequence. It is
// the sum over all nodes, not a peak: liveness frees most of them early.
func printBytes(w io.Writer, model *models.GPT, o options) error {
	tokens := lazy.Placeholder([]int{o.batch, o.seq}, graph.Int64, 0)
	targets := tokens.Graph().Placeholder([]int{o.batch, o.seq}, graph.Int64, 0)
	loss := models.Loss(model.Forward(tokens), targets)
	outs := []int{loss.ID()}
	for _, g := range lazy.Grad(loss, nn.ParamTensors(model)...) {
		if err := g.Err(); err != nil {
			return err
		}
		outs = append(outs, g.ID())
	}
	info, err := shapeinfer.Analyze(tokens.Graph().IR(), outs...)
	if err != nil {
		return err
	}
	fixed, perSample := info.Totals()
	fmt.Fprintf(w, "training graph: %d nodes; sum of tensor sizes (not a peak): %d B fixed + %d B per sequence = %d B at batch %d\n",
		len(info.Fixed), fixed, perSample, fixed+perSample*int64(o.batch), o.batch)
	return nil
}

// chain is a first-order Markov chain over the vocabulary.
type chain struct {
	next [vocab][2]int // likely and second successor of each token
}

// newChain draws the transition table from seed. The two successors of a
// token differ, so every row has the same probabilities and the chain's
// entropy is the same from every state.
func newChain(seed uint64) *chain {
	r := rand.New(rand.NewPCG(seed, 0xc0de))
	c := &chain{}
	for t := range c.next {
		a := r.IntN(vocab)
		b := (a + 1 + r.IntN(vocab-1)) % vocab
		c.next[t] = [2]int{a, b}
	}
	return c
}

// entropy is the conditional entropy of the next token in nats.
func (c *chain) entropy() float64 {
	h := 0.0
	for _, p := range []float64{pFirst + pNoise/vocab, pSecond + pNoise/vocab} {
		h -= p * math.Log(p)
	}
	p := pNoise / vocab
	return h - (vocab-2)*p*math.Log(p)
}

// batch draws n sequences of seq+1 tokens for training step step and
// returns tokens [n, seq] and next-token targets [n, seq].
func (c *chain) batch(seed, step uint64, n, seq int) (tokens, targets *tensor.Dense) {
	r := rand.New(rand.NewPCG(seed^0x5eed, step))
	tok := make([]int64, n*seq)
	tgt := make([]int64, n*seq)
	for s := range n {
		cur := r.IntN(vocab)
		for i := range seq {
			u := r.Float64()
			nxt := r.IntN(vocab) // noise
			switch {
			case u < pFirst:
				nxt = c.next[cur][0]
			case u < pFirst+pSecond:
				nxt = c.next[cur][1]
			}
			tok[s*seq+i], tgt[s*seq+i] = int64(cur), int64(nxt)
			cur = nxt
		}
	}
	return tensor.New(tensor.WithShape(n, seq), tensor.WithBacking(tok)),
		tensor.New(tensor.WithShape(n, seq), tensor.WithBacking(tgt))
}
