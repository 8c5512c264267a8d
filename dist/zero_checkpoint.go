package dist

import (
	"context"
	"errors"
	"fmt"

	"github.com/batchfit/batchfit/checkpoint"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/optim"
)

// ErrPeerCheckpoint: a sharded checkpoint's save failed on another rank
// (this rank's own failure is returned as it is); nothing was committed.
var ErrPeerCheckpoint = errors.New("dist: another rank's part of the sharded checkpoint failed")

// errReplicated refuses a sharded checkpoint of a replicated trainer,
// whose every rank holds the whole training (package checkpoint's
// Training saves it).
var errReplicated = fmt.Errorf("%w: sharded checkpoints are for trainers with Options.ZeRO set; a replicated one saves with checkpoint.Training", ErrZeRO)

// stateful is the optimizer state access a sharded checkpoint needs
// (optim.Common's).
type stateful interface {
	ParamStep(key any) int
	SetState(key any, n, step int, slots [][]float32) error
	SetSteps(n int) error
	ResetState()
}

// slotNames names an optimizer's state slots as the checkpoint package
// does.
func slotNames(opt optim.Optimizer) []string {
	switch n := opt.StateSlots(); {
	case n == 2 && (opt.Name() == "adam" || opt.Name() == "adamw"):
		return []string{"exp_avg", "exp_avg_sq"}
	case n == 1 && opt.Name() == "sgd":
		return []string{"momentum_buffer"}
	default:
		names := make([]string, n)
		for i := range names {
			names[i] = fmt.Sprintf("slot%d", i)
		}
		return names
	}
}

// SaveSharded saves a sharded checkpoint of the training at step in dir
// (a directory of checkpoints, package checkpoint's): every rank writes
// its shard of the flattened parameters and of the optimizer's state, and
// rank 0 commits the directory once all have (every rank must call it,
// after the same step). Any world size loads it back (LoadSharded). meta
// is kept in the manifest. It returns the checkpoint's path on every rank.
//
// The optimizer must keep its state per parameter as optim.Common does,
// with every piece at the optimizer's own step count (one schedule for
// all). A rank's own failure is returned as it is; the others' steps then
// return ErrPeerCheckpoint, and nothing is committed.
func (t *Trainer) SaveSharded(ctx context.Context, dir string, step int, params []*lazy.Tensor, opt optim.Optimizer, meta map[string]string) (string, error) {
	if t.z.stage == ZeROOff {
		return "", errReplicated
	}
	st, ok := opt.(stateful)
	if !ok {
		return "", fmt.Errorf("%w: optimizer %s does not expose its state per parameter", ErrZeRO, opt.Name())
	}
	data, err := hostData(params)
	if err != nil {
		return "", err
	}
	if t.z.layout == nil {
		sizes := make([]int, len(data))
		for i, d := range data {
			sizes[i] = len(d)
		}
		l, err := NewLayout(sizes, t.comm.Size())
		if err != nil {
			return "", err
		}
		t.z.layout = &l
	}
	l, rank, world := t.z.layout, t.comm.Rank(), t.comm.Size()
	if err := l.check(data); err != nil {
		return "", err
	}
	names := slotNames(opt)
	lo, hi := l.Shard(rank)
	// This rank's shard: the parameters of record and the state of its
	// pieces, zeros on the padding.
	ps := make([]float32, l.ShardLen)
	if t.z.stage == ZeRO3 && t.z.master != nil {
		copy(ps, t.z.master)
	} else {
		l.read(data, lo, ps)
	}
	slots := make([][]float32, len(names))
	for i := range slots {
		slots[i] = make([]float32, l.ShardLen)
	}
	var own error
	for _, pc := range l.Pieces(lo, hi) {
		key := ShardKey{Key: any(params[pc.Param].Value()), Lo: pc.Lo}
		s := opt.State(key)
		if s == nil {
			continue
		}
		if got := st.ParamStep(key); got != opt.Steps() {
			own = fmt.Errorf("%w: %s[%d:%d] is at step %d, the optimizer at %d: a sharded checkpoint holds one step count",
				ErrZeRO, params[pc.Param].Name(), pc.Lo, pc.Hi, got, opt.Steps())
			break
		}
		for i := range min(len(s), len(slots)) {
			copy(slots[i][pc.Flat-lo:], s[i])
		}
	}

	// Rank 0 prepares the directory; everyone writes; rank 0 commits;
	// each stage's outcome is summed so every rank knows it.
	agree := func(err error) error {
		flag := []float32{0}
		if err != nil {
			flag[0] = 1
		}
		if cerr := t.comm.AllReduceSum(ctx, flag); cerr != nil {
			return errors.Join(err, cerr)
		}
		if err != nil {
			return err
		}
		if flag[0] != 0 {
			return ErrPeerCheckpoint
		}
		return nil
	}
	if rank == 0 && own == nil {
		_, own = checkpoint.PrepareShards(dir, step)
	}
	if err := agree(own); err != nil {
		return "", err
	}
	tmp := checkpoint.ShardTemp(dir, step)
	if err := agree(checkpoint.WriteShard(tmp, rank, world, ps, names, slots)); err != nil {
		return "", err
	}
	var path string
	if rank == 0 {
		m := &checkpoint.ShardedManifest{Step: step, Meta: meta, World: world, ShardLen: l.ShardLen, Total: l.Total,
			Optimizer: opt.Name(), Steps: opt.Steps(), Slots: names}
		for i, p := range params {
			m.Params = append(m.Params, checkpoint.FlatParam{Name: p.Name(), Shape: p.Shape(), Offset: l.Offsets[i]})
		}
		path, own = checkpoint.CommitShards(dir, tmp, m, 0)
	}
	if err := agree(own); err != nil {
		return path, err
	}
	if rank != 0 {
		return checkpoint.Latest(dir)
	}
	return path, nil
}

// LoadSharded restores the training from the sharded checkpoint at path
// (a checkpoint directory, or a directory of them whose latest it loads),
// saved by any world size: it re-shards on load. Every rank reads the
// whole parameters into params' host tensors and its own shard of the
// optimizer's state (under this world's layout) into opt, whose earlier
// state is dropped; under stage 3 the rank's parameter shard too. It
// returns the checkpoint's step and meta. Call it before the first Step
// (a CUDA session keeps the parameters it uploaded). The checkpoint is
// verified first (checkpoint.OpenSharded); parameters of other names or
// sizes, or another optimizer, are checkpoint.ErrMismatch, and then
// nothing has changed. No collective runs: every rank reads on its own.
func (t *Trainer) LoadSharded(path string, params []*lazy.Tensor, opt optim.Optimizer) (int, map[string]string, error) {
	if t.z.stage == ZeROOff {
		return 0, nil, errReplicated
	}
	st, ok := opt.(stateful)
	if !ok {
		return 0, nil, fmt.Errorf("%w: optimizer %s does not expose its state per parameter", ErrZeRO, opt.Name())
	}
	s, err := checkpoint.OpenSharded(path)
	if err != nil {
		return 0, nil, err
	}
	defer s.Close()
	m := s.Manifest
	data, err := hostData(params)
	if err != nil {
		return 0, nil, err
	}
	if len(params) != len(m.Params) {
		return 0, nil, fmt.Errorf("%w: %s holds %d parameters, the training %d", checkpoint.ErrMismatch, s.Dir, len(m.Params), len(params))
	}
	sizes := make([]int, len(data))
	for i, p := range params {
		sizes[i] = len(data[i])
		n := 1
		for _, d := range m.Params[i].Shape {
			n *= d
		}
		if p.Name() != m.Params[i].Name || n != sizes[i] {
			return 0, nil, fmt.Errorf("%w: %s: parameter %d is %q %v there, %q %v here", checkpoint.ErrMismatch, s.Dir, i,
				m.Params[i].Name, m.Params[i].Shape, p.Name(), p.Shape())
		}
	}
	names := slotNames(opt)
	if opt.Name() != m.Optimizer || len(names) != len(m.Slots) {
		return 0, nil, fmt.Errorf("%w: %s holds %s's state (%v), the training uses %s (%v)", checkpoint.ErrMismatch, s.Dir, m.Optimizer, m.Slots, opt.Name(), names)
	}
	l, err := NewLayout(sizes, t.comm.Size())
	if err != nil {
		return 0, nil, err
	}
	lo, hi := l.Shard(t.comm.Rank())
	// Everything is read before anything changes.
	whole := make([][]float32, len(data))
	for i := range data {
		whole[i] = make([]float32, len(data[i]))
		if err := s.Read(checkpoint.ShardParams, l.Offsets[i], whole[i]); err != nil {
			return 0, nil, err
		}
	}
	type pieceState struct {
		key   ShardKey
		n     int
		slots [][]float32
	}
	var states []pieceState
	if m.Steps > 0 {
		for _, pc := range l.Pieces(lo, hi) {
			ps := pieceState{key: ShardKey{Key: any(params[pc.Param].Value()), Lo: pc.Lo}, n: pc.Hi - pc.Lo}
			for _, name := range m.Slots {
				buf := make([]float32, ps.n)
				if err := s.Read(name, pc.Flat, buf); err != nil {
					return 0, nil, err
				}
				ps.slots = append(ps.slots, buf)
			}
			states = append(states, ps)
		}
	}
	for i := range data {
		copy(data[i], whole[i])
	}
	st.ResetState()
	for _, ps := range states {
		if err := st.SetState(ps.key, ps.n, m.Steps, ps.slots); err != nil {
			return 0, nil, err
		}
	}
	if err := st.SetSteps(m.Steps); err != nil {
		return 0, nil, err
	}
	t.z.layout, t.z.grad, t.z.stale = &l, nil, false
	if t.z.stage == ZeRO3 {
		t.z.master = make([]float32, l.ShardLen)
		l.read(whole, lo, t.z.master)
	}
	return m.Step, m.Meta, nil
}
