package checkpoint

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"math"
	"math/rand/v2"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/data"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/internal/testutil"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/optim"
	"github.com/batchfit/batchfit/precision"
	"github.com/batchfit/batchfit/train"
)

// The training the resume tests interrupt: an MLP with a layer norm and
// dropout (in → 16 → layer norm → GELU → dropout → 4, cross-entropy) on a
// shuffled dataset of 22 samples in batches of 6 (the last of each epoch
// 4), AdamW under cosine warmup with clipping, biases and the norm in a
// no-decay group, and the last bias joining at step 2 (its own step count
// then trails the optimizer's). Under fp16-mixed the scaler starts at
// 2¹⁷ and grows after every three good steps, to 2¹⁸, where the gradients
// overflow: the run skips steps 3, 7 and 11 and backs off each time.
const (
	totalSteps = 12
	inputs     = 8
	samples    = 22
	batchSize  = 6
)

// config is one way of running that training.
type config struct {
	precision string
	maxChunk  int    // Options.MaxChunk: 0 whole
	device    string // Options.Device: "" the CPU
}

func (c config) String() string {
	s := c.precision + "/whole"
	if c.maxChunk != 0 {
		s = fmt.Sprintf("%s/chunks-of-%d", c.precision, c.maxChunk)
	}
	if c.device != "" {
		s = c.device + "/" + s
	}
	return s
}

var configs = []config{
	{precision: "fp32"}, {precision: "fp32", maxChunk: 4},
	{precision: "bf16-mixed"}, {precision: "bf16-mixed", maxChunk: 4},
	{precision: "fp16-mixed"}, {precision: "fp16-mixed", maxChunk: 4},
}

// run is one process's training: model, optimizer, session, data.
type run struct {
	cfg    config
	model  *nn.Sequential
	opt    *optim.Adam
	sess   *batchfit.Session
	ds     *data.Arrays
	loader *data.Loader
	ck     *Training
	losses map[int]float32 // by step
}

// newRun builds the training; seed sets the initial parameters (a resumed
// run's are overwritten by the checkpoint).
func newRun(cfg config, seed uint64) (*run, error) {
	o := nn.Seed(seed)
	drop := nn.NewDropout(0.2)
	drop.Seed = 7
	m := nn.NewSequential(nn.NewLinear(o, inputs, 16, true), nn.NewLayerNorm(o, []int{16}, 1e-5), nn.GELU{Approx: true}, drop, nn.NewLinear(o, 16, 4, true))
	nn.SetTraining(m, true)
	opt := optim.NewAdamW(1e-2)
	opt.Schedule = optim.Cosine{Warmup: 3, Total: totalSteps, MinRatio: 0.1}
	opt.Clip.MaxNorm = 0.5
	_, noDecay := optim.SplitDecay(m.Params())
	opt.AddGroup("no_decay", optim.Keys(noDecay)...).WeightDecay = 0
	device := cfg.device
	if device == "" {
		device = batchfit.DeviceCPU
	}
	sess := batchfit.NewSession(batchfit.Options{Device: device, Precision: cfg.precision, MaxChunk: cfg.maxChunk,
		LossScale: precision.LossScale{Init: 1 << 17, Interval: 3}})
	if err := sess.Err(); err != nil {
		return nil, err
	}
	rng := rand.New(rand.NewPCG(5, 6)) // the data, the same for every run
	ds, err := data.NewArrays([]string{"x", "y"}, testutil.UniformF32(rng, samples, inputs), testutil.Classes(rng, 4, samples))
	if err != nil {
		return nil, err
	}
	r := &run{cfg: cfg, model: m, opt: opt, sess: sess, ds: ds, losses: map[int]float32{}}
	r.ck = &Training{Model: m, Optimizer: opt, Session: sess}
	return r, nil
}

// start opens the loader at the checkpoint's position (the zero one for a
// fresh run).
func (r *run) start() error {
	var err error
	r.loader, err = data.NewLoader(r.ds, data.Options{Batch: batchSize, Shuffle: true, Seed: 3, Start: r.ck.Data})
	return err
}

func (r *run) close() {
	if r.loader != nil {
		r.loader.Close()
	}
	r.sess.Close()
}

// step is training step s.
func (r *run) step(ctx context.Context, s int) (train.Result, error) {
	b, err := r.loader.Next(ctx)
	if err != nil {
		return train.Result{}, err
	}
	x := lazy.Wrap(b.Tensor("x"), 0)
	y := x.Graph().Wrap(b.Tensor("y"), 0)
	loss := r.model.Forward(x).CrossEntropy(y, graph.ReduceMean)
	params := nn.ParamTensors(r.model)
	if s < 2 {
		params = params[:len(params)-1]
	}
	l, err := r.sess.Step(ctx, loss, params, r.opt)
	if err != nil {
		return train.Result{}, err
	}
	r.losses[s] = l
	return train.Result{Loss: l, Samples: b.Size}, nil
}

// train runs steps from…to−1 through train.Run, saving into dir every
// `every` steps (and after the last) when dir is set; after is called
// after each step.
func (r *run) train(ctx context.Context, dir string, from, to, every int, after func(step int)) error {
	cfg := train.Config{Steps: to, Start: from, LogEvery: 1000, Out: discard{}}
	if dir != "" {
		cfg.CheckpointEvery = every
		cfg.Checkpoint = func(ctx context.Context, done int) error {
			r.ck.Step, r.ck.Data = done, r.loader.Position()
			_, err := r.ck.Save(dir)
			return err
		}
	}
	_, err := train.Run(ctx, cfg, func(ctx context.Context, s int) (train.Result, error) {
		res, err := r.step(ctx, s)
		if err == nil && after != nil {
			after(s)
		}
		return res, err
	})
	return err
}

// digest is a SHA-256 of every parameter's float32 bits, in order (on
// CUDA synced from the device first).
func (r *run) digest() string {
	if err := r.sess.SyncParams(); err != nil {
		return err.Error()
	}
	h := sha256.New()
	for _, p := range r.model.Params() {
		for _, v := range p.Value().Data().([]float32) {
			binary.Write(h, binary.LittleEndian, math.Float32bits(v))
		}
	}
	return hex.EncodeToString(h.Sum(nil))
}

type discard struct{}

func (discard) Write(b []byte) (int, error) { return len(b), nil }
