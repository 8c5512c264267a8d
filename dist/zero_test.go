package dist_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/dist"
	"github.com/batchfit/batchfit/optim"
)

// capture is an optimizer that keeps the gradients it is given and
// updates nothing: the reference's way to read one micro-batch's
// gradients.
type capture struct {
	optim.Optimizer
	grads [][]float32
}

func (c *capture) Step(ps []optim.Param) error {
	c.grads = make([][]float32, len(ps))
	for i, p := range ps {
		c.grads[i] = slices.Clone(p.Grad)
	}
	return nil
}

// shardRecorder keeps, per step, the gradient pieces a ZeRO rank's
// optimizer is given, by their shard keys.
type shardRecorder struct {
	optim.Optimizer
	steps []map[dist.ShardKey][]float32
}

func (r *shardRecorder) Step(ps []optim.Param) error {
	m := map[dist.ShardKey][]float32{}
	for _, p := range ps {
		m[p.Key.(dist.ShardKey)] = slices.Clone(p.Grad)
	}
	r.steps = append(r.steps, m)
	return r.Optimizer.Step(ps)
}

// oneRank is the single-process reference over the same micro-batches:
// each rank's shard [lo, hi) of every step's batch run alone (its own
// session, as a rank's), its gradients scaled by n_r/N and summed in rank
// order in float32 (the order the in-process communicator sums in), then
// one AdamW step over the whole parameters. It returns the summed
// gradients of every step and the parameters after the last.
func oneRank(t *testing.T, world, n, hidden, steps int, xs [][]float32, ys [][]int64, lr float64) ([][][]float32, [][]float32) {
	grads, params, _ := oneRankWith(t, world, n, hidden, steps, xs, ys, optim.NewAdamW(lr))
	return grads, params
}

// oneRankWith is oneRank with the given optimizer; it also returns the
// gradient norm of every step when the optimizer clips.
func oneRankWith(t *testing.T, world, n, hidden, steps int, xs [][]float32, ys [][]int64, opt *optim.Adam) ([][][]float32, [][]float32, []float64) {
	ctx := context.Background()
	m := newWide(1, hidden)
	var all [][][]float32
	var norms []float64
	for s := range steps {
		sum := make([][]float32, len(m.data))
		for i, d := range m.data {
			sum[i] = make([]float32, len(d))
		}
		for r := range world {
			lo, hi, err := dist.Shard(n, r, world)
			require.NoError(t, err)
			c := &capture{Optimizer: optim.NewSGD(0, 0)}
			sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU})
			_, err = sess.Step(ctx, m.loss(xs[s], ys[s], lo, hi), m.params, c)
			require.NoError(t, err)
			require.NoError(t, sess.Close())
			scale := float32(hi-lo) / float32(n)
			for i, g := range c.grads {
				for j, v := range g {
					sum[i][j] += v * scale
				}
			}
		}
		ps := make([]optim.Param, len(m.data))
		for i := range m.data {
			ps[i] = optim.Param{Key: i, Name: m.params[i].Name(), Data: m.data[i], Grad: sum[i]}
		}
		require.NoError(t, opt.Step(ps))
		if opt.Clip.On() {
			nm, err := opt.LastGradNorm()
			require.NoError(t, err)
			norms = append(norms, nm)
		}
		all = append(all, sum)
	}
	return all, m.data, norms
}

// Every ZeRO stage over 2 and 4 in-process ranks equals one rank over the
// same micro-batches: every rank's gradient pieces bit for bit the
// reference's (the reduce-scatter and the all-reduce sum in the
// reference's order), and the parameters after 10 AdamW steps within
// 1e-6 of each tensor's largest value (|Δ| ≤ 1e-6·max|want|; they agree
// bit for bit too, AdamW being element-wise, which the test logs). Ranks
// other than 0 start from other parameters (the broadcast is tested), and
// 200-byte buckets make several collectives per step.
func TestZeROEqualsOneRank(t *testing.T) {
	const n, hidden, steps, lr = 12, 16, 10, 0.01
	rng := rand.New(rand.NewPCG(5, 6))
	var xs [][]float32
	var ys [][]int64
	for range steps {
		x, y := batch(rng, n)
		xs, ys = append(xs, x), append(ys, y)
	}
	for _, world := range []int{2, 4} {
		refGrads, refParams := oneRank(t, world, n, hidden, steps, xs, ys, lr)
		for _, stage := range []int{dist.ZeRO1, dist.ZeRO2, dist.ZeRO3} {
			t.Run(fmt.Sprintf("ranks=%d/stage=%d", world, stage), func(t *testing.T) {
				ctx := context.Background()
				comms := dist.NewLocal(world, 10*time.Second)
				models := make([]*model, world)
				recs := make([]*shardRecorder, world)
				layouts := make([]*dist.Layout, world)
				errs := make([]error, world)
				var wg sync.WaitGroup
				for r := range world {
					models[r] = newWide(1+uint64(r), hidden)
					recs[r] = &shardRecorder{Optimizer: optim.NewAdamW(lr)}
					wg.Add(1)
					go func() {
						defer wg.Done()
						errs[r] = zeroRank(ctx, comms[r], stage, n, steps, xs, ys, models[r], recs[r], &layouts[r])
					}()
				}
				wg.Wait()
				for r := range world {
					require.NoError(t, errs[r], "rank %d", r)
				}
				l := layouts[0]
				require.NotNil(t, l)
				for r := range world {
					lo, hi := l.Shard(r)
					covered := int64(0)
					for s := range steps {
						got := recs[r].steps[s]
						pieces := l.Pieces(lo, hi)
						require.Len(t, got, len(pieces), "rank %d step %d: pieces", r, s)
						for _, pc := range pieces {
							g := got[dist.ShardKey{Key: models[r].params[pc.Param].Value(), Lo: pc.Lo}]
							require.Equal(t, refGrads[s][pc.Param][pc.Lo:pc.Hi], g, "rank %d step %d: gradient of parameter %d [%d:%d] bit for bit", r, s, pc.Param, pc.Lo, pc.Hi)
							if s == 0 {
								covered += int64(pc.Hi - pc.Lo)
							}
						}
					}
					require.Equal(t, min(hi, l.Total)-min(lo, l.Total), covered, "rank %d covers its shard", r)
					worst := 0.0
					for i := range refParams {
						close32(t, fmt.Sprintf("rank %d parameter %d", r, i), refParams[i], models[r].data[i])
						for j := range refParams[i] {
							worst = math.Max(worst, math.Abs(float64(refParams[i][j])-float64(models[r].data[i][j])))
						}
					}
					t.Logf("rank %d: largest |Δ| of the parameters after %d steps: %g", r, steps, worst)
				}
			})
		}
	}
}

// zeroRank is one rank of TestZeROEqualsOneRank: broadcast, steps, and
// for stage 3 the final gather.
func zeroRank(ctx context.Context, c dist.Communicator, stage, n, steps int, xs [][]float32, ys [][]int64, m *model, opt optim.Optimizer, layout **dist.Layout) error {
	tr, err := dist.New(c, dist.Options{Session: batchfit.Options{Device: batchfit.DeviceCPU}, BucketBytes: 200, ZeRO: stage})
	if err != nil {
		return err
	}
	defer tr.Close()
	if err := tr.BroadcastParams(ctx, m.params); err != nil {
		return err
	}
	for s := range steps {
		lo, hi, err := tr.Shard(n)
		if err != nil {
			return err
		}
		if _, err := tr.Step(ctx, n, m.loss(xs[s], ys[s], lo, hi), m.params, opt); err != nil {
			return err
		}
	}
	*layout = tr.Layout()
	return tr.GatherParams(ctx, m.params)
}

// Misconfigured ZeRO is a typed error before anything runs.
func TestZeROConfigErrors(t *testing.T) {
	c := dist.NewLocal(1, time.Second)[0]
	_, err := dist.New(c, dist.Options{Session: batchfit.Options{Device: batchfit.DeviceCPU}, ZeRO: 4})
	require.ErrorIs(t, err, dist.ErrZeRO)
	_, err = dist.New(c, dist.Options{Session: batchfit.Options{Device: batchfit.DeviceCPU}, ZeRO: -1})
	require.ErrorIs(t, err, dist.ErrZeRO)
}

// Clipping by the global norm under every stage over 2 and 4 ranks: the
// ranks combine their shards' parts of the norm, so each step's
// LastGradNorm equals one process's within 1e-12 relative (float64 sums
// in another association) and the parameters after 10 clipped AdamW
// steps agree within 1e-6 of each tensor's largest value; the clip is
// active (max norm 0.05 under every step's norm) for the 2-norm and the
// largest magnitude alike.
func TestZeROClipsByGlobalNorm(t *testing.T) {
	const n, hidden, steps, lr = 12, 16, 10, 0.01
	rng := rand.New(rand.NewPCG(15, 16))
	var xs [][]float32
	var ys [][]int64
	for range steps {
		x, y := batch(rng, n)
		xs, ys = append(xs, x), append(ys, y)
	}
	clipped := func(normType float64) *optim.Adam {
		o := optim.NewAdamW(lr)
		o.Clip = optim.Clip{MaxNorm: 0.05, NormType: normType}
		return o
	}
	for _, normType := range []float64{2, math.Inf(1)} {
		for _, world := range []int{2, 4} {
			_, refParams, refNorms := oneRankWith(t, world, n, hidden, steps, xs, ys, clipped(normType))
			for _, nm := range refNorms {
				require.Greater(t, nm, 0.05, "the clip must be active")
			}
			for _, stage := range []int{dist.ZeRO1, dist.ZeRO2, dist.ZeRO3} {
				t.Run(fmt.Sprintf("norm=%v/ranks=%d/stage=%d", normType, world, stage), func(t *testing.T) {
					ctx := context.Background()
					comms := dist.NewLocal(world, 10*time.Second)
					models := make([]*model, world)
					norms := make([][]float64, world)
					errs := make([]error, world)
					var wg sync.WaitGroup
					for r := range world {
						models[r] = newWide(1, hidden)
						wg.Add(1)
						go func() {
							defer wg.Done()
							errs[r] = func() error {
								tr, err := dist.New(comms[r], dist.Options{Session: batchfit.Options{Device: batchfit.DeviceCPU}, BucketBytes: 200, ZeRO: stage})
								if err != nil {
									return err
								}
								defer tr.Close()
								opt := clipped(normType)
								for s := range steps {
									lo, hi, _ := tr.Shard(n)
									if _, err := tr.Step(ctx, n, models[r].loss(xs[s], ys[s], lo, hi), models[r].params, opt); err != nil {
										return err
									}
									nm, err := opt.LastGradNorm()
									if err != nil {
										return err
									}
									norms[r] = append(norms[r], nm)
								}
								return tr.GatherParams(ctx, models[r].params)
							}()
						}()
					}
					wg.Wait()
					for r := range world {
						require.NoError(t, errs[r], "rank %d", r)
						for s, nm := range norms[r] {
							require.InEpsilon(t, refNorms[s], nm, 1e-12, "rank %d step %d: the global norm", r, s)
						}
						for i := range refParams {
							close32(t, fmt.Sprintf("rank %d parameter %d", r, i), refParams[i], models[r].data[i])
						}
					}
				})
			}
		}
	}
}

// The in-process collectives: reduce-scatter gives each rank its block of
// the all-reduce's sum bit for bit, all-gather concatenates in rank
// order, and blocks of the wrong size are ErrMismatch.
func TestLocalReduceScatterAllGather(t *testing.T) {
	const world, m = 3, 5
	comms := dist.NewLocal(world, 5*time.Second)
	rng := rand.New(rand.NewPCG(8, 9))
	send := make([][]float32, world)
	for r := range send {
		send[r] = make([]float32, world*m)
		for i := range send[r] {
			send[r][i] = float32(rng.NormFloat64())
		}
	}
	sum := make([]float32, world*m)
	for r := range world {
		for i, v := range send[r] {
			sum[i] += v
		}
	}
	recv := make([][]float32, world)
	gathered := make([][]float32, world)
	errs := make([]error, world)
	var wg sync.WaitGroup
	for r := range world {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx := context.Background()
			recv[r] = make([]float32, m)
			if errs[r] = comms[r].ReduceScatterSum(ctx, send[r], recv[r]); errs[r] != nil {
				return
			}
			gathered[r] = make([]float32, world*m)
			errs[r] = comms[r].AllGather(ctx, recv[r], gathered[r])
		}()
	}
	wg.Wait()
	for r := range world {
		require.NoError(t, errs[r])
		require.Equal(t, sum[r*m:(r+1)*m], recv[r], "rank %d's block", r)
		require.Equal(t, sum, gathered[r], "rank %d's gather", r)
	}
	err := comms[0].AllGather(context.Background(), make([]float32, 2), make([]float32, 5))
	require.ErrorIs(t, err, dist.ErrMismatch)
}

// A ZeRO rank that dies mid-step (it aborts at its first reduce-scatter)
// or is gone (it never steps) gives the others a typed error within the
// communicator's deadline: ErrAborted, or ErrTimeout for the rank that
// never comes.
func TestZeRORankDies(t *testing.T) {
	for _, mode := range []string{"aborts", "gone"} {
		for _, stage := range []int{dist.ZeRO1, dist.ZeRO2, dist.ZeRO3} {
			t.Run(fmt.Sprintf("%s/stage=%d", mode, stage), func(t *testing.T) {
				const world, n, timeout = 3, 6, 500 * time.Millisecond
				comms := dist.NewLocal(world, timeout)
				if mode == "aborts" {
					comms[1] = abortingComm{comms[1]}
				}
				x, y := batch(rand.New(rand.NewPCG(3, 3)), n)
				errs := make([]error, world)
				took := make([]time.Duration, world)
				var wg sync.WaitGroup
				for r := range world {
					if mode == "gone" && r == 1 {
						continue
					}
					wg.Add(1)
					go func() {
						defer wg.Done()
						m := newModel(1)
						tr, err := dist.New(comms[r], dist.Options{Session: batchfit.Options{Device: batchfit.DeviceCPU}, ZeRO: stage})
						if err != nil {
							errs[r] = err
							return
						}
						defer tr.Close()
						lo, hi, _ := tr.Shard(n)
						start := time.Now()
						_, errs[r] = tr.Step(context.Background(), n, m.loss(x, y, lo, hi), m.params, optim.NewAdamW(0.01))
						took[r] = time.Since(start)
					}()
				}
				wg.Wait()
				for r := range world {
					if r == 1 {
						continue
					}
					require.Error(t, errs[r], "rank %d", r)
					want := dist.ErrAborted
					if mode == "gone" {
						require.True(t, errors.Is(errs[r], dist.ErrTimeout) || errors.Is(errs[r], dist.ErrAborted), "rank %d: %v", r, errs[r])
					} else {
						require.ErrorIs(t, errs[r], want, "rank %d", r)
					}
					var re *dist.RankError
					require.ErrorAs(t, errs[r], &re)
					require.Less(t, took[r], 2*timeout+time.Second, "rank %d's error came after %v", r, took[r])
					t.Logf("rank %d after %v: %v", r, took[r].Round(time.Millisecond), errs[r])
				}
			})
		}
	}
}

// abortingComm dies at its first reduce-scatter or all-gather: it aborts
// the group and fails, as a rank that crashed there would.
type abortingComm struct{ dist.Communicator }

func (c abortingComm) ReduceScatterSum(ctx context.Context, send, recv []float32) error {
	_ = c.Abort()
	return errDied
}

func (c abortingComm) AllGather(ctx context.Context, send, recv []float32) error {
	_ = c.Abort()
	return errDied
}

func (c abortingComm) AllReduceSum(ctx context.Context, buf []float32) error {
	_ = c.Abort()
	return errDied
}

// gatherDies dies at its first all-gather: after the update of stages 1
// and 2.
type gatherDies struct{ dist.Communicator }

func (c gatherDies) AllGather(ctx context.Context, send, recv []float32) error {
	_ = c.Abort()
	return errDied
}

// A peer that dies in the all-gather of stages 1 and 2, after every rank
// updated its shard: the others' errors wrap ErrStepApplied (do not
// retry) and ErrAborted.
func TestZeROGatherFailsAfterUpdate(t *testing.T) {
	for _, stage := range []int{dist.ZeRO1, dist.ZeRO2} {
		const world, n = 2, 4
		comms := dist.NewLocal(world, 5*time.Second)
		comms[1] = gatherDies{comms[1]}
		x, y := batch(rand.New(rand.NewPCG(6, 6)), n)
		errs := make([]error, world)
		var wg sync.WaitGroup
		for r := range world {
			wg.Add(1)
			go func() {
				defer wg.Done()
				tr, err := dist.New(comms[r], dist.Options{Session: batchfit.Options{Device: batchfit.DeviceCPU}, ZeRO: stage})
				if err != nil {
					errs[r] = err
					return
				}
				defer tr.Close()
				m := newModel(1)
				lo, hi, _ := tr.Shard(n)
				_, errs[r] = tr.Step(context.Background(), n, m.loss(x, y, lo, hi), m.params, optim.NewAdamW(0.01))
			}()
		}
		wg.Wait()
		require.ErrorIs(t, errs[0], dist.ErrStepApplied, "stage %d", stage)
		require.ErrorIs(t, errs[0], dist.ErrAborted, "stage %d", stage)
		require.ErrorIs(t, errs[1], dist.ErrStepApplied, "stage %d", stage)
	}
}
