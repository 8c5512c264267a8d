package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"runtime"
	"time"

	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/exec/cuda"
	"github.com/batchfit/batchfit/half"
	"github.com/batchfit/batchfit/internal/progress"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/optim"
	"github.com/batchfit/batchfit/recompute"
)

// calibrateSizes are the kernels calibrate times: an n×n GEMM chain, an
// elementwise chain over elems float32s, a chain of one-element ops
// (launch overhead), causal attention over [1, 16, attnT, 64], and (with
// --half) 3×3 convolutions of 64 channels over [convBatch, 64, convSize,
// convSize] images; each
// chain runs at 1 and at chain ops, so the difference divided by chain−1
// cancels the step's fixed costs (upload, download, graph building). The
// input upload is timed as the difference between summing elems float32s
// uploaded from the host and summing one.
type calibrateSizes struct {
	n, elems, chain, repeat, attnT int
	// convBatch images of 64 channels, convSize × convSize, through 3×3
	// convolutions (half_conv_flops).
	convBatch, convSize int
	// hostParams parameters through an offloaded AdamW step on the host
	// (host_update_rate).
	hostParams int
}

var defaultCalibrateSizes = calibrateSizes{n: 4096, elems: 1 << 26, chain: 9, repeat: 3, attnT: 4096, convBatch: 32, convSize: 56, hostParams: 1 << 25}

// ErrNoGPU is calibrate's error without a usable CUDA device.
var ErrNoGPU = errors.New("no GPU: batchfit calibrate times kernels through the CUDA executor")

// calibrateFlagValues are calibrate's flags.
type calibrateFlagValues struct {
	out, name  string
	tf32, half bool
}

func calibrateFlags() (*flag.FlagSet, *calibrateFlagValues) {
	fs := flag.NewFlagSet("calibrate", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	v := &calibrateFlagValues{}
	fs.StringVar(&v.out, "out", "-", "write the profile (JSON) to `FILE`; - is stdout")
	fs.StringVar(&v.name, "name", "", "the profile's `name` (default: the device's)")
	fs.BoolVar(&v.tf32, "tf32", true, "also time TF32 GEMMs (tf32_flops)")
	fs.BoolVar(&v.half, "half", true, "also time bf16 GEMMs, convolutions and attention in bf16-mixed (half_flops, half_unaligned_flops, half_conv_flops, half_attention_flops, and attention_flops: the plain kernels, with a mask)")
	return fs, v
}

func runCalibrate(args []string, stdout, stderr io.Writer) int {
	fs, v := calibrateFlags()
	if _, _, err := parseFlags(fs, args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			fmt.Fprintf(stdout, "Usage:\n  batchfit calibrate [--out FILE] [--name NAME] [--tf32=false] [--half=false]\n\n"+
				"Times GEMMs, elementwise kernels and launches on the GPU through the CUDA executor and writes a cost-model\n"+
				"profile for estimate --profile FILE.\n\nFlags:\n")
			fs.SetOutput(stdout)
			fs.PrintDefaults()
			return exitOK
		}
		return usageFailed(stderr, "calibrate", err)
	}
	sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCUDA})
	if err := sess.Err(); err != nil {
		if errors.Is(err, cuda.ErrNoGPU) {
			err = fmt.Errorf("%w (%v); for dry runs use estimate --profile h100, h200 or default", ErrNoGPU, err)
		}
		fmt.Fprintf(stderr, "batchfit calibrate: %v\n", err)
		return exitPlan
	}
	defer sess.Close()
	var tsess *batchfit.Session
	if v.tf32 {
		tsess = batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCUDA, TF32: true})
		defer tsess.Close()
	}
	var hsess *batchfit.Session
	if v.half {
		hsess = batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCUDA, Precision: "bf16-mixed"})
		defer hsess.Close()
	}
	rep := progress.New(stderr, "batchfit calibrate", calibrateItems(tsess != nil, hsess != nil, defaultCalibrateSizes))
	p, err := measureProfile(context.Background(), sess, tsess, hsess, defaultCalibrateSizes, rep)
	rep.Finish()
	if err != nil {
		fmt.Fprintf(stderr, "batchfit calibrate: %v\n", err)
		return exitPlan
	}
	p.Name = sess.Device()
	if v.name != "" {
		p.Name = v.name
	}
	if _, err := writeFile(v.out, stdout, func(w io.Writer) error { return recompute.WriteProfile(w, p) }); err != nil {
		fmt.Fprintf(stderr, "batchfit calibrate: %v\n", err)
		return exitPlan
	}
	return exitOK
}

// measureProfile times the calibration kernels on sess (tsess, when not
// nil, a TF32 session for tf32_flops; hsess, when not nil, a bf16-mixed
// session for the 16-bit rates), reporting each rate timed to rep (nil:
// silent). vector_flops is not measured: the
// default profile's nominal figure stands, and Sources says so.
func measureProfile(ctx context.Context, sess, tsess, hsess *batchfit.Session, sz calibrateSizes, rep *progress.Reporter) (recompute.Profile, error) {
	timed := func(what string, s *batchfit.Session, build func(k int) *lazy.Tensor, sz calibrateSizes) (float64, error) {
		t, err := perOp(ctx, s, build, sz)
		if err == nil {
			rep.Done(what)
		}
		return t, err
	}
	rng := rand.New(rand.NewPCG(1, 2))
	uniform := func(scale float64, shape ...int) *tensor.Dense {
		n := 1
		for _, d := range shape {
			n *= d
		}
		v := make([]float32, n)
		for i := range v {
			v[i] = float32(scale * (2*rng.Float64() - 1))
		}
		return tensor.New(tensor.WithShape(shape...), tensor.WithBacking(v))
	}
	x1 := uniform(1, 1, 1)
	// The chains start from parameters, which stay on the device between
	// runs: an input would be uploaded every run, and its upload (tens of
	// ms for these sizes) would drown the difference between chains. A
	// one-element input gives each run its batch.
	anchored := func(s *lazy.Tensor) *lazy.Tensor { return s.Add(lazy.Wrap(x1, 0).Sum()) }
	w := lazy.Param(uniform(1/math.Sqrt(float64(sz.n)), sz.n, sz.n), "calibrate.w")
	xg := uniform(1, sz.n, sz.n)
	gemm := func(k int) *lazy.Tensor {
		y := lazy.Param(xg, "calibrate.x")
		for range k {
			y = y.MatMul(w)
		}
		return anchored(y.Sum())
	}
	rows := 1024
	xe := uniform(1, rows, max(sz.elems/rows, 1))
	elementwise := func(k int) *lazy.Tensor {
		y := lazy.Param(xe, "calibrate.elems")
		for range k {
			y = y.MulScalar(1)
		}
		return anchored(y.Sum())
	}
	tiny := func(k int) *lazy.Tensor {
		y := lazy.Wrap(x1, 0)
		for range k {
			y = y.MulScalar(1)
		}
		return y.Sum()
	}
	p := recompute.DefaultProfile()
	p.Sources = map[string]string{"vector_flops": "nominal: the default profile's, not measured"}
	tg, err := timed("FP32 GEMMs", sess, gemm, sz)
	if err != nil {
		return p, fmt.Errorf("timing GEMMs: %w", err)
	}
	p.MatMulFLOPS = 2 * math.Pow(float64(sz.n), 3) / tg
	p.Sources["matmul_flops"] = fmt.Sprintf("measured: %d×%d FP32 GEMM chain through the CUDA executor", sz.n, sz.n)
	if tsess != nil {
		tt, err := timed("TF32 GEMMs", tsess, gemm, sz)
		if err != nil {
			return p, fmt.Errorf("timing TF32 GEMMs: %w", err)
		}
		p.TF32FLOPS = 2 * math.Pow(float64(sz.n), 3) / tt
		p.Sources["tf32_flops"] = "measured: the same chain with TF32 on"
	}
	te, err := timed("elementwise", sess, elementwise, sz)
	if err != nil {
		return p, fmt.Errorf("timing elementwise kernels: %w", err)
	}
	p.Bandwidth = 2 * 4 * float64(xe.Shape().TotalSize()) / te
	p.Sources["bandwidth"] = fmt.Sprintf("measured: mul_scalar over %d float32s, read and written", xe.Shape().TotalSize())
	tl, err := timed("launches", sess, tiny, sz)
	if err != nil {
		return p, fmt.Errorf("timing launches: %w", err)
	}
	p.Launch = max(tl, 1e-9)
	p.Sources["launch"] = "measured: a chain of one-element kernels"

	// Input upload: Σ over elems float32s from the host, less Σ over one.
	upload := func(k int) *lazy.Tensor {
		if k == 1 {
			return lazy.Wrap(x1, 0).Sum()
		}
		return lazy.Wrap(xe, 0).Sum()
	}
	tu, err := timed("input upload", sess, upload, calibrateSizes{chain: 2, repeat: sz.repeat})
	if err != nil {
		return p, fmt.Errorf("timing the input upload: %w", err)
	}
	p.HostBandwidth = 4 * float64(xe.Shape().TotalSize()) / tu
	p.Sources["host_bandwidth"] = fmt.Sprintf("measured: %d float32s uploaded as a step's input", xe.Shape().TotalSize())
	if p.HostUpdateRate, err = hostUpdateRate(sz.hostParams, sz.repeat); err != nil {
		return p, fmt.Errorf("timing the host optimizer update: %w", err)
	}
	rep.Done("host optimizer update")
	p.Sources["host_update_rate"] = fmt.Sprintf("measured: an offloaded AdamW step (optim.Adam.StepOffloadEach) of %d parameters on %d cores, the best of %d",
		sz.hostParams, runtime.GOMAXPROCS(0), sz.repeat)

	// Fused attention, causal, over [1, 16, attnT, 64]: FlashAttention's
	// count, 4·H·T²·d halved. float32 attention runs on cuBLAS and is
	// priced at the GEMM rate; attention_flops is the plain kernels',
	// which serve 16-bit attention with a mask (or a head dim other than 64
	// and 128), so it is timed below in bf16-mixed with a zero mask.
	const heads, hd = 16, 64
	xa := uniform(1, 1, heads, sz.attnT, hd)
	attentionWith := func(mask *tensor.Dense) func(k int) *lazy.Tensor {
		return func(k int) *lazy.Tensor {
			o := lazy.AttentionOptions{Causal: true}
			if mask != nil {
				o.Mask = lazy.Const(mask)
			}
			y := lazy.Param(xa, "calibrate.qkv")
			for range k {
				y = y.Attention(y, y, o)
			}
			return anchored(y.Sum())
		}
	}
	attention := attentionWith(nil)
	attnFlops := 4 * heads * float64(sz.attnT) * float64(sz.attnT) * hd / 2
	if hsess == nil {
		return p, p.Validate()
	}
	tp, err := timed("masked bf16 attention", hsess, attentionWith(tensor.New(tensor.WithShape(sz.attnT, sz.attnT), tensor.WithBacking(make([]float32, sz.attnT*sz.attnT)))), sz)
	if err != nil {
		return p, fmt.Errorf("timing masked bf16 attention: %w", err)
	}
	p.AttentionFLOPS = attnFlops / tp
	p.Sources["attention_flops"] = fmt.Sprintf("measured: bf16-mixed causal attention with a [%d, %d] mask over [1, %d, %d, %d] (the plain kernels), forward",
		sz.attnT, sz.attnT, heads, sz.attnT, hd)
	th, err := timed("bf16 GEMMs", hsess, gemm, sz)
	if err != nil {
		return p, fmt.Errorf("timing bf16 GEMMs: %w", err)
	}
	p.HalfFLOPS = 2 * math.Pow(float64(sz.n), 3) / th
	p.Sources["half_flops"] = "measured: the GEMM chain in bf16-mixed"
	// Rows of n+1 elements, not a whole number of 16-byte vectors:
	// independent products of x by a [n, n+1] weight.
	wu := lazy.Param(uniform(1/math.Sqrt(float64(sz.n)), sz.n, sz.n+1), "calibrate.w_unaligned")
	unaligned := func(k int) *lazy.Tensor {
		x := lazy.Param(xg, "calibrate.x")
		s := x.MatMul(wu).Sum()
		for range k - 1 {
			s = s.Add(x.MatMul(wu).Sum())
		}
		return anchored(s)
	}
	tuh, err := timed("unaligned bf16 GEMMs", hsess, unaligned, sz)
	if err != nil {
		return p, fmt.Errorf("timing unaligned bf16 GEMMs: %w", err)
	}
	p.HalfUnalignedFLOPS = 2 * float64(sz.n) * float64(sz.n) * float64(sz.n+1) / tuh
	if sz.convBatch > 0 {
		// 3×3 convolutions of 64 channels, padding 1, chained: ResNet's
		// first stage at convSize².
		const ch = 64
		xc := uniform(1, sz.convBatch, ch, sz.convSize, sz.convSize)
		wc := lazy.Param(uniform(1/math.Sqrt(9*ch), ch, ch, 3, 3), "calibrate.conv_w")
		conv := func(k int) *lazy.Tensor {
			y := lazy.Param(xc, "calibrate.conv_x")
			for range k {
				y = y.Conv2d(wc, nil, lazy.ConvOptions{Padding: [2]int{1, 1}})
			}
			return anchored(y.Sum())
		}
		tc, err := timed("bf16 convolutions", hsess, conv, sz)
		if err != nil {
			return p, fmt.Errorf("timing bf16 convolutions: %w", err)
		}
		p.HalfConvFLOPS = 2 * float64(sz.convBatch) * float64(sz.convSize*sz.convSize) * ch * ch * 9 / tc
		p.Sources["half_conv_flops"] = fmt.Sprintf("measured: chained bf16 3×3 convolutions of [%d, %d, %d, %d], forward", sz.convBatch, ch, sz.convSize, sz.convSize)
	}
	p.Sources["half_unaligned_flops"] = fmt.Sprintf("measured: bf16 products of [%d, %d] by [%d, %d]", sz.n, sz.n, sz.n, sz.n+1)
	tha, err := timed("bf16 attention", hsess, attention, sz)
	if err != nil {
		return p, fmt.Errorf("timing bf16 attention: %w", err)
	}
	p.HalfAttentionFLOPS = attnFlops / tha
	p.Sources["half_attention_flops"] = "measured: the attention chain in bf16-mixed (tensor cores), forward"
	return p, p.Validate()
}

// calibrateItems is the number of rates measureProfile times: FP32
// GEMMs, elementwise kernels, launches, the input upload and the host
// optimizer update, TF32 GEMMs
// with tf32, and with half masked attention, bf16 GEMMs aligned and not,
// attention, and convolutions when sz has a batch of them.
func calibrateItems(tf32, half bool, sz calibrateSizes) int {
	n := 5
	if tf32 {
		n++
	}
	if half {
		n += 4
		if sz.convBatch > 0 {
			n++
		}
	}
	return n
}

// hostUpdateRate is the parameters/s of an offloaded optimizer's host
// update, as exec.OffloadHost runs it (AdamW over float32 masters and
// moments from bfloat16 gradients, on every core): the best of repeat
// steps over n parameters, after one that makes the state.
func hostUpdateRate(n, repeat int) (float64, error) {
	r := rand.New(rand.NewPCG(7, 7))
	master, grad := make([]float32, n), make([]half.BF16, n)
	for i := range master {
		master[i], grad[i] = float32(r.NormFloat64()), half.BF16From(float32(r.NormFloat64()*0.01))
	}
	stage := make([]half.BF16, n)
	o, key := optim.NewAdamW(1e-3), new(int)
	best := math.Inf(1)
	for range repeat + 1 {
		copy(stage, grad)
		start := time.Now()
		if err := o.StepOffloadEach([]optim.OffloadParam{{Key: key, Name: "calibrate.w", Master: master, Grad: stage, Weight: stage}}, 0, nil); err != nil {
			return 0, err
		}
		best = min(best, time.Since(start).Seconds())
	}
	return float64(n) / best, nil
}

// errUntimed is a chain that ran no slower than one op of it, again and
// again: its ops are too quick for the timer, and a rate from them would
// be anything (a profile refuses rates past recompute.MaxRate).
var errUntimed = errors.New("the chain's ops are too quick to time")

// untimedAttempts is how often perOp times a chain whose ops it could not
// measure before it gives up.
const untimedAttempts = 4

// perOp is the seconds one op of build's chain takes: the best of repeat
// runs at chain ops less the best at one, over chain−1. A difference that
// is not positive (noise larger than the ops) is timed again, and after
// untimedAttempts is errUntimed.
func perOp(ctx context.Context, sess *batchfit.Session, build func(k int) *lazy.Tensor, sz calibrateSizes) (float64, error) {
	best := func(k int) (float64, error) {
		b := math.Inf(1)
		for range sz.repeat + 1 { // the first run compiles and uploads
			out := build(k)
			start := time.Now()
			if _, err := sess.Eval(ctx, out); err != nil {
				return 0, err
			}
			b = min(b, time.Since(start).Seconds())
		}
		return b, nil
	}
	var one, many float64
	for range untimedAttempts {
		var err error
		if one, err = best(1); err != nil {
			return 0, err
		}
		if many, err = best(sz.chain); err != nil {
			return 0, err
		}
		if many > one {
			return (many - one) / float64(sz.chain-1), nil
		}
	}
	return 0, fmt.Errorf("%w: %d ops took %.3g s and one %.3g s, %d times", errUntimed, sz.chain, many, one, untimedAttempts)
}
