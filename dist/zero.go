package dist

import (
	"context"
	"fmt"
	"math"
	"time"

	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/optim"
)

// ZeRO stages (Options.ZeRO), as DeepSpeed numbers them.
const (
	// ZeROOff replicates everything: every rank holds the whole model, its
	// gradients and the optimizer's state (plain data parallel).
	ZeROOff = 0
	// ZeRO1 shards the optimizer's state: gradients are all-reduced as
	// without ZeRO, each rank updates its shard of the flattened
	// parameters (and holds only that shard's state), then the updated
	// shards are all-gathered.
	ZeRO1 = 1
	// ZeRO2 also shards the gradients: they are reduce-scattered, so each
	// rank receives only its shard of the sum.
	ZeRO2 = 2
	// ZeRO3 also shards the parameters: each rank keeps its shard as the
	// parameters of record, and the whole parameters are all-gathered
	// ahead of each step's forward (GatherParams makes them whole on the
	// host at any time).
	ZeRO3 = 3
)

// Layout is the flattened parameter space ZeRO shards: the trained
// parameters back to back in the order Step is given them, padded with
// zeros to Ranks·ShardLen values, rank r owning [r·ShardLen,
// (r+1)·ShardLen). Every rank's shard has the same length (the last one's
// padding is zeros, as DeepSpeed pads its flat partitions), so every
// collective has equal blocks.
type Layout struct {
	Sizes    []int   // elements of each parameter
	Offsets  []int64 // where each starts in the flat space
	Total    int64   // Σ Sizes
	Ranks    int
	ShardLen int64 // ⌈Total/Ranks⌉
}

// NewLayout lays parameters of the given sizes out over ranks.
func NewLayout(sizes []int, ranks int) (Layout, error) {
	if ranks <= 0 {
		return Layout{}, fmt.Errorf("%w: %d ranks", ErrZeRO, ranks)
	}
	l := Layout{Sizes: append([]int(nil), sizes...), Offsets: make([]int64, len(sizes)), Ranks: ranks}
	for i, n := range sizes {
		if n < 0 {
			return Layout{}, fmt.Errorf("%w: parameter %d has %d elements", ErrZeRO, i, n)
		}
		l.Offsets[i] = l.Total
		l.Total += int64(n)
	}
	l.ShardLen = (l.Total + int64(ranks) - 1) / int64(ranks)
	return l, nil
}

// Shard is rank's range [lo, hi) of the flat space, hi − lo = ShardLen
// (the tail past Total is padding).
func (l Layout) Shard(rank int) (lo, hi int64) {
	return int64(rank) * l.ShardLen, int64(rank+1) * l.ShardLen
}

// Piece is the part of one parameter inside a flat range: elements
// [Lo, Hi) of parameter Param, at Flat in the flat space.
type Piece struct {
	Param  int
	Lo, Hi int
	Flat   int64
}

// Pieces lists the parameters' parts inside the flat range [lo, hi), in
// order.
func (l Layout) Pieces(lo, hi int64) []Piece {
	var ps []Piece
	for i, n := range l.Sizes {
		a, b := max(lo, l.Offsets[i]), min(hi, l.Offsets[i]+int64(n))
		if a < b {
			ps = append(ps, Piece{Param: i, Lo: int(a - l.Offsets[i]), Hi: int(b - l.Offsets[i]), Flat: a})
		}
	}
	return ps
}

// read copies the flat range [lo, lo+len(dst)) of bufs (one per
// parameter, laid out by l) into dst; the padding reads as zeros.
func (l Layout) read(bufs [][]float32, lo int64, dst []float32) {
	clear(dst)
	for _, p := range l.Pieces(lo, lo+int64(len(dst))) {
		copy(dst[p.Flat-lo:], bufs[p.Param][p.Lo:p.Hi])
	}
}

// write copies src into the flat range [lo, lo+len(src)) of bufs; what
// falls on the padding is dropped.
func (l Layout) write(bufs [][]float32, lo int64, src []float32) {
	for _, p := range l.Pieces(lo, lo+int64(len(src))) {
		copy(bufs[p.Param][p.Lo:p.Hi], src[p.Flat-lo:])
	}
}

// ShardKey is the optimizer's key for one rank's piece of a parameter
// under ZeRO: the parameter's own key and where the piece starts in it.
// The optimizer's state is kept per piece, so it holds only the rank's
// shard.
type ShardKey struct {
	Key any
	Lo  int
}

// clipper is an optimizer that may clip gradients and takes its norm
// from elsewhere (optim.Common).
type clipper interface {
	Clipping() optim.Clip
	SetNormOf(func(grads [][]float32, inf bool) (float64, error))
}

// globalNorm is the total norm of every rank's gradients from this
// rank's shard of them: each rank's part (the sum of squares in float64
// in flat order, or the largest magnitude) is all-gathered bit for bit
// (a float64 as two float32 words, copied, never added) and combined in
// rank order. One process sums the whole in one pass, so the norms agree
// to float64 rounding (TestZeROClipsByGlobalNorm: within 1e-12).
func (r *zeroReducer) globalNorm(grads [][]float32, inf bool) (float64, error) {
	var part float64
	for _, g := range grads {
		for _, x := range g {
			v := float64(x)
			if inf {
				if a := math.Abs(v); a > part || math.IsNaN(a) {
					part = a
				}
			} else {
				part += v * v
			}
		}
	}
	n := r.t.comm.Size()
	bits := math.Float64bits(part)
	send := []float32{math.Float32frombits(uint32(bits >> 32)), math.Float32frombits(uint32(bits))}
	recv := make([]float32, 2*n)
	if err := r.t.comm.AllGather(r.ctx, send, recv); err != nil {
		return 0, err
	}
	var total float64
	for k := range n {
		v := math.Float64frombits(uint64(math.Float32bits(recv[2*k]))<<32 | uint64(math.Float32bits(recv[2*k+1])))
		switch {
		case !inf:
			total += v
		case v > total || math.IsNaN(v):
			total = v
		}
		if inf && math.IsNaN(total) {
			break
		}
	}
	if inf {
		return total, nil
	}
	return math.Sqrt(total), nil
}

// zero is a Trainer's ZeRO state: the layout (fixed at the first step),
// this rank's gradient shard (stages 2 and 3) and parameter shard
// (stage 3).
type zero struct {
	stage  int
	layout *Layout
	grad   []float32 // ShardLen: the reduce-scattered gradient
	master []float32 // ShardLen: the parameters of record (stage 3)
	stale  bool      // stage 3: the host tensors are older than master
}

func checkZeRO(o Options, onCUDA bool) error {
	switch {
	case o.ZeRO < ZeROOff || o.ZeRO > ZeRO3:
		return fmt.Errorf("%w: stage %d (want 0, 1, 2 or 3)", ErrZeRO, o.ZeRO)
	case o.ZeRO == ZeRO3 && onCUDA:
		return fmt.Errorf("%w: stage 3 gathers parameters into their host tensors, which a CUDA session does not read again once uploaded; use stage 1 or 2 there", ErrZeRO)
	}
	return nil
}

// zeroPieces is how many values of each rank's block one collective of a
// ZeRO step moves: BucketBytes over all ranks' blocks.
func (t *Trainer) zeroPiece() int64 {
	b := t.opts.BucketBytes
	if b <= 0 {
		b = DefaultBucketBytes
	}
	return max(b/4/int64(t.comm.Size()), 1)
}

// Layout is the flat parameter layout ZeRO shards, nil before the first
// step of a trainer with Options.ZeRO set.
func (t *Trainer) Layout() *Layout { return t.z.layout }

// GatherParams makes params' host tensors whole from every rank's shard
// (an all-gather; every rank must call it). Under ZeRO stage 3 the
// shards are the parameters of record and the host tensors are
// gathered only ahead of each step's forward: call it after the last step
// to read, evaluate or save the whole parameters. Otherwise, or before
// the first step, it does nothing.
func (t *Trainer) GatherParams(ctx context.Context, params []*lazy.Tensor) error {
	if t.z.stage != ZeRO3 || t.z.layout == nil || !t.z.stale {
		return nil
	}
	bufs, err := hostData(params)
	if err != nil {
		return err
	}
	if err := t.z.layout.check(bufs); err != nil {
		return err
	}
	if err := t.gather(ctx, bufs, t.z.master); err != nil {
		return err
	}
	t.z.stale = false
	return nil
}

// check refuses parameters other than those the layout was made of.
func (l *Layout) check(bufs [][]float32) error {
	if len(bufs) != len(l.Sizes) {
		return fmt.Errorf("%w: %d parameters; the ZeRO layout holds %d", ErrZeRO, len(bufs), len(l.Sizes))
	}
	for i, b := range bufs {
		if len(b) != l.Sizes[i] {
			return fmt.Errorf("%w: parameter %d has %d elements; the ZeRO layout's has %d", ErrZeRO, i, len(b), l.Sizes[i])
		}
	}
	return nil
}

// gather all-gathers every rank's shard (this rank's is mine) into bufs,
// a piece of each block per collective.
func (t *Trainer) gather(ctx context.Context, bufs [][]float32, mine []float32) error {
	l, n := t.z.layout, t.comm.Size()
	k := t.zeroPiece()
	recv := make([]float32, min(k, l.ShardLen)*int64(n))
	for off := int64(0); off < l.ShardLen; off += k {
		m := min(k, l.ShardLen-off)
		rv := recv[:m*int64(n)]
		if err := t.comm.AllGather(ctx, mine[off:off+m], rv); err != nil {
			return err
		}
		for r := range n {
			lo, _ := l.Shard(r)
			l.write(bufs, lo+off, rv[int64(r)*m:int64(r+1)*m])
		}
	}
	return nil
}

// reduceScatter sums the gradients grads (scaled by scale, as
// reduceBuckets does) over the ranks into this rank's shard dst, a piece
// of each block per collective. Each block's sum runs in the order an
// all-reduce's does, so dst is bit for bit the all-reduced gradient's
// shard on the in-process communicator.
func (t *Trainer) reduceScatter(ctx context.Context, grads [][]float32, scale float32, dst []float32) error {
	l, n := t.z.layout, t.comm.Size()
	k := t.zeroPiece()
	send := make([]float32, min(k, l.ShardLen)*int64(n))
	for off := int64(0); off < l.ShardLen; off += k {
		m := min(k, l.ShardLen-off)
		sd := send[:m*int64(n)]
		for r := range n {
			lo, _ := l.Shard(r)
			l.read(grads, lo+off, sd[int64(r)*m:int64(r+1)*m])
		}
		if scale != 1 {
			for i := range sd {
				sd[i] *= scale
			}
		}
		if err := t.comm.ReduceScatterSum(ctx, sd, dst[off:off+m]); err != nil {
			return err
		}
	}
	return nil
}

// zeroReducer is the optimizer a ZeRO step's session runs: it makes this
// rank's shard of the global batch's gradient, steps the caller's
// optimizer on this rank's shard of the flattened parameters, and (stages
// 1 and 2) all-gathers the updated shards.
type zeroReducer struct {
	optim.Optimizer
	ctx     context.Context
	t       *Trainer
	scale   float32
	wait    time.Duration
	applied bool // the caller's optimizer has updated this rank's shard
	params  []*lazy.Tensor
}

func (r *zeroReducer) Step(ps []optim.Param) error {
	t, z := r.t, &r.t.z
	if len(ps) != len(r.params) {
		return fmt.Errorf("%w: the session updates %d parameters; Step was given %d", ErrZeRO, len(ps), len(r.params))
	}
	for i, p := range ps {
		if p.Key != any(r.params[i].Value()) {
			return fmt.Errorf("%w: the session's parameter %d (%q) is not Step's parameter %d (%q): the layout needs them in one order",
				ErrZeRO, i, p.Name, i, r.params[i].Name())
		}
	}
	data := make([][]float32, len(ps))
	grads := make([][]float32, len(ps))
	for i, p := range ps {
		data[i], grads[i] = p.Data, p.Grad
	}
	if z.layout == nil {
		sizes := make([]int, len(ps))
		for i, p := range ps {
			sizes[i] = len(p.Data)
		}
		l, err := NewLayout(sizes, t.comm.Size())
		if err != nil {
			return err
		}
		z.layout = &l
	} else if err := z.layout.check(data); err != nil {
		return err
	}
	l := z.layout
	lo, hi := l.Shard(t.comm.Rank())
	if z.stage == ZeRO3 && z.master == nil { // the first step: the broadcast parameters' shard
		z.master = make([]float32, l.ShardLen)
		l.read(data, lo, z.master)
	}
	start := time.Now()
	var err error
	if z.stage == ZeRO1 {
		err = reduceBuckets(r.ctx, t.comm, grads, r.scale, t.opts.BucketBytes)
	} else {
		if z.grad == nil {
			z.grad = make([]float32, l.ShardLen)
		}
		err = t.reduceScatter(r.ctx, grads, r.scale, z.grad)
	}
	r.wait = time.Since(start)
	if err != nil {
		return err
	}
	// The caller's optimizer on this rank's pieces: each piece's data is
	// the host tensor's (stages 1, 2) or the master shard's (stage 3), its
	// gradient the all-reduced one's or the reduced shard's.
	pieces := l.Pieces(lo, hi)
	sp := make([]optim.Param, len(pieces))
	for i, pc := range pieces {
		p := ps[pc.Param]
		q := optim.Param{Key: ShardKey{Key: p.Key, Lo: pc.Lo}, Name: fmt.Sprintf("%s[%d:%d]", p.Name, pc.Lo, pc.Hi)}
		at := pc.Flat - lo
		if z.stage == ZeRO3 {
			q.Data = z.master[at : at+int64(pc.Hi-pc.Lo)]
		} else {
			q.Data = p.Data[pc.Lo:pc.Hi]
		}
		if z.stage == ZeRO1 {
			q.Grad = p.Grad[pc.Lo:pc.Hi]
		} else {
			q.Grad = z.grad[at : at+int64(pc.Hi-pc.Lo)]
		}
		sp[i] = q
	}
	if c, ok := r.Optimizer.(clipper); ok && c.Clipping().On() {
		// The clip coefficient needs every rank's gradients' norm.
		c.SetNormOf(r.globalNorm)
		defer c.SetNormOf(nil)
	}
	if err := r.Optimizer.Step(sp); err != nil {
		return err
	}
	r.applied = true
	if z.stage == ZeRO3 {
		z.stale = true // gathered ahead of the next step's forward
		return nil
	}
	mine := make([]float32, l.ShardLen)
	l.read(data, lo, mine)
	start = time.Now()
	err = t.gather(context.WithoutCancel(r.ctx), data, mine)
	r.wait += time.Since(start)
	return err
}

// zeroStep is Step under ZeRO: the host path (the session's gradients on
// the host, the sums through the communicator's host collectives).
func (t *Trainer) zeroStep(ctx context.Context, loss *lazy.Tensor, params []*lazy.Tensor, opt optim.Optimizer, scale float32) (float32, time.Duration, error) {
	if c, ok := opt.(interface{ Clipping() optim.Clip }); ok && c.Clipping().On() {
		if _, ok := opt.(clipper); !ok {
			return 0, 0, fmt.Errorf("%w: the optimizer clips gradients by their global norm and cannot take it from the ranks (optim.Common.SetNormOf)", ErrZeRO)
		}
	}
	var gathered time.Duration
	if t.z.stage == ZeRO3 && t.z.stale {
		// The whole parameters, gathered from the shards ahead of the
		// forward that reads them.
		start := time.Now()
		if err := t.GatherParams(ctx, params); err != nil {
			return 0, 0, err
		}
		gathered = time.Since(start)
	}
	r := &zeroReducer{Optimizer: opt, ctx: ctx, t: t, scale: scale, params: params}
	l, err := t.sess.Step(ctx, loss, params, r)
	if err != nil && r.applied {
		err = fmt.Errorf("%w (do not retry it): %w", ErrStepApplied, err)
	}
	return l, gathered + r.wait, err
}
