package main

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"runtime"
	"time"

	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/models"
	"github.com/batchfit/batchfit/nn"
)

// rebuild makes model m's training graph over the given input tensors (as
// m.build does over drawn data), as a training loop does every step.
func rebuild(m benchModel, mod nn.Module, inputs []tensor.Tensor) (*lazy.Tensor, error) {
	var loss *lazy.Tensor
	switch m.name {
	case "mlp", "conv", "resnet50":
		x := lazy.Wrap(inputs[0], 0)
		y := x.Graph().Wrap(inputs[1], 0)
		loss = mod.Forward(x).CrossEntropy(y, graph.ReduceMean)
	case "gpt", "gpt-written", "gpt-unpacked":
		tok := lazy.Wrap(inputs[0], 0)
		tgt := tok.Graph().Wrap(inputs[1], 0)
		loss = models.Loss(mod.(*models.GPT).Forward(tok), tgt)
	case "llama", "llama-written":
		// inputs[1] holds the labels shifted (models.ShiftLabels), as build
		// makes them.
		tok := lazy.Wrap(inputs[0], 0)
		labels := tok.Graph().Wrap(inputs[1], 0)
		s := inputs[0].Shape()
		loss = models.ShiftedCausalLMLoss(mod.(*models.Llama).Forward(tok), labels, s[0]*(s[1]-1))
	default:
		return nil, graph.Errorf(graph.ErrAttr, "gobench: no session run for model %q", m.name)
	}
	return loss, loss.Err()
}

// sessionThroughput times what a user's training loop costs: every step
// builds the model's graph again over the step's data and calls
// batchfit.Session.Step (autodiff, the analysis and plan caches, the CUDA
// executor, the device optimizer and the loss download), timed with the
// host clock around the whole.
func sessionThroughput(c config, m benchModel) (Record, error) {
	l, err := newSessionLoop(c, m)
	if err != nil {
		return *l.r, err
	}
	defer l.close()
	return *l.r, runLoop(l, c)
}

// newSessionLoop sets up sessionThroughput's loop.
func newSessionLoop(c config, m benchModel) (*stepLoop, error) {
	r := &Record{Kind: "session", Model: m.name, About: m.about, Batch: m.batch, Seq: m.seq, Optimizer: m.optName,
		Warmup: c.warmup, Steps: c.steps, TF32: c.tf32, Precision: c.precision, ChannelsLast: c.nhwc()}
	l := &stepLoop{r: r, close: func() {}}
	mod := m.module(nn.Seed(1))
	if err := nn.Check(mod); err != nil {
		return l, err
	}
	r.Params = int64(nn.NumParams(mod))
	rng := rand.New(rand.NewPCG(2, 3))
	feeds := make([][]tensor.Tensor, 4)
	for i := range feeds {
		_, in := m.build(mod, m.batch, rng)
		feeds[i] = []tensor.Tensor{in[0].Value(), in[1].Value()}
	}
	sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCUDA, TF32: c.tf32, Precision: c.precision,
		NoCUDAGraphs: !c.cudaGraphs, NoChannelsLast: !c.channelsLast, NoPointwiseFusion: c.noPointwise,
		NoFusedLoss: c.noFusedLoss, LossChunk: c.lossChunk})
	if err := sess.Err(); err != nil {
		return l, err
	}
	opt := m.optimizer()
	params := nn.ParamTensors(mod)
	stopProfile := func() {}
	l.close = func() {
		stopProfile()
		_ = sess.Close() // the records are written; a close error changes none of them
	}
	var builds, hosts, execs, afters []float64
	var gc0 runtime.MemStats
	var st0 alloc.Stats
	l.step = func(i int) error {
		if i == c.warmup {
			runtime.ReadMemStats(&gc0)
			st0 = sess.Allocator().Stats()
		}
		if i == c.warmup && c.cpuProfile != "" {
			stop, err := startCPUProfile(c.cpuProfile, m.name+"-session")
			if err != nil {
				return err
			}
			stopProfile = stop
		}
		t0 := time.Now()
		loss, err := rebuild(m, mod, feeds[i%len(feeds)])
		if err != nil {
			return err
		}
		built := time.Since(t0).Seconds()
		lv, err := sess.Step(context.Background(), loss, params, opt)
		dt := time.Since(t0).Seconds()
		if err != nil {
			return fmt.Errorf("%s session step %d: %w", m.name, i, err)
		}
		if i == 0 {
			r.FirstLoss = float64(lv)
		}
		r.LastLoss = float64(lv)
		if c.sessionTrace {
			st, pl := sess.Allocator().Stats(), sess.LastPlan()
			fmt.Fprintf(os.Stderr, "%s session step %d: %.3f ms, plan %p budget %d peak %d, device allocs %d frees %d, reserved %d\n",
				m.name, i, 1e3*dt, pl, pl.Budget, pl.PeakReserved, st.NumDeviceAlloc, st.NumDeviceFree, st.ReservedBytes[alloc.All].Current)
		}
		if i >= c.warmup {
			builds = append(builds, built)
			t := sess.LastStepTimes()
			hosts = append(hosts, t.Host.Seconds())
			execs = append(execs, t.Execute.Seconds())
			afters = append(afters, (t.Total - t.Host - t.Execute).Seconds())
		}
		return nil
	}
	l.end = func() error {
		stopProfile()
		var gc1 runtime.MemStats
		runtime.ReadMemStats(&gc1)
		r.GCs = gc1.NumGC - gc0.NumGC
		st1 := sess.Allocator().Stats()
		r.DeviceAllocs, r.DeviceFrees = st1.NumDeviceAlloc-st0.NumDeviceAlloc, st1.NumDeviceFree-st0.NumDeviceFree
		r.MedianBuildSeconds, r.MedianHostSeconds = median(builds), median(hosts)
		r.MedianExecuteSeconds, r.MedianAfterSeconds = median(execs), median(afters)
		r.Chunks, r.LossChunk = len(sess.LastPlan().Chunks), sess.LastPlan().LossChunk
		r.setRates(m.batch)
		return nil
	}
	return l, nil
}
