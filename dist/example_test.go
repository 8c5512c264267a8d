package dist_test

import (
	"context"
	"fmt"
	"sync"
	"time"

	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/dist"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/optim"
)

// The in-process communicator: ranks as goroutines, with NCCL's contract
// (every rank calls the same collectives in the same order, each within
// a deadline). Sums come out the same on every rank.
func ExampleNewLocal() {
	comms := dist.NewLocal(3, time.Minute)
	sums := make([][]float32, len(comms))
	var wg sync.WaitGroup
	for _, c := range comms {
		wg.Add(1)
		go func() {
			defer wg.Done()
			buf := []float32{float32(c.Rank()), 1}
			if err := c.AllReduceSum(context.Background(), buf); err != nil {
				fmt.Println(err)
			}
			sums[c.Rank()] = buf
		}()
	}
	wg.Wait()
	fmt.Println(sums)
	// Output:
	// [[3 3] [3 3] [3 3]]
}

// Data parallel on the CPU: two ranks each train on their shard of a
// global batch of 6 (dist.Shard), their gradients summed into the whole
// batch's before every optimizer step, so both report the global batch's
// loss and keep identical parameters. Over NCCL the loop is the same with
// dist.NewNCCL and one process per GPU (batchfit launch or torchrun).
func ExampleTrainer_Step() {
	const world, n, in, classes = 2, 6, 4, 3
	x := make([]float32, n*in)
	for i := range x {
		x[i] = float32(i%5) - 2
	}
	y := []int64{0, 1, 2, 0, 1, 2}
	comms := dist.NewLocal(world, time.Minute)
	losses := make([][]float32, world)
	var wg sync.WaitGroup
	for _, c := range comms {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx := context.Background()
			tr, err := dist.New(c, dist.Options{Session: batchfit.Options{Device: batchfit.DeviceCPU}})
			if err != nil {
				fmt.Println(err)
				return
			}
			defer tr.Close()
			model := nn.MLP(nn.Seed(uint64(1+c.Rank())), []int{in, 8, classes}, nn.ReLU{}) // rank 0's weights win
			params := nn.ParamTensors(model)
			if err := tr.BroadcastParams(ctx, params); err != nil {
				fmt.Println(err)
				return
			}
			opt := optim.NewSGD(0.1, 0)
			lo, hi, _ := tr.Shard(n)
			for range 3 {
				xs := lazy.Wrap(tensor.New(tensor.WithShape(hi-lo, in), tensor.WithBacking(append([]float32(nil), x[lo*in:hi*in]...))), 0)
				ys := xs.Graph().Wrap(tensor.New(tensor.WithShape(hi-lo), tensor.WithBacking(append([]int64(nil), y[lo:hi]...))), 0)
				l, err := tr.Step(ctx, n, model.Forward(xs).CrossEntropy(ys, lazy.Mean), params, opt)
				if err != nil {
					fmt.Println(err)
					return
				}
				losses[c.Rank()] = append(losses[c.Rank()], l)
			}
		}()
	}
	wg.Wait()
	fmt.Println("the same global loss on both ranks:", fmt.Sprint(losses[0]) == fmt.Sprint(losses[1]))
	fmt.Println("falling:", losses[0][2] < losses[0][0])
	// Output:
	// the same global loss on both ranks: true
	// falling: true
}

// The flat layout ZeRO shards: three parameters of 6, 3 and 5 values over
// 4 ranks are 14 values padded to 4 shards of 4; rank 1 owns the last 2
// values of the first parameter and the first 2 of the second.
func ExampleLayout() {
	l, err := dist.NewLayout([]int{6, 3, 5}, 4)
	if err != nil {
		fmt.Println(err)
		return
	}
	lo, hi := l.Shard(1)
	fmt.Println(l.Total, l.ShardLen, lo, hi)
	for _, p := range l.Pieces(lo, hi) {
		fmt.Printf("parameter %d [%d:%d] at %d\n", p.Param, p.Lo, p.Hi, p.Flat)
	}
	// Output:
	// 14 4 4 8
	// parameter 0 [4:6] at 4
	// parameter 1 [0:2] at 6
}

// ZeRO stage 3 over two in-process ranks: each keeps only its shard of
// the parameters and of AdamW's state, yet both step exactly as
// replicated data parallel does; GatherParams makes the parameters whole
// on the host after the last step.
func ExampleOptions_zeRO() {
	const world, n, in, classes = 2, 6, 4, 3
	x := make([]float32, n*in)
	for i := range x {
		x[i] = float32(i%5) - 2
	}
	y := []int64{0, 1, 2, 0, 1, 2}
	final := make([][]float32, 2) // replicated, then ZeRO-3: rank 0's first weight
	for run, stage := range []int{dist.ZeROOff, dist.ZeRO3} {
		comms := dist.NewLocal(world, time.Minute)
		var wg sync.WaitGroup
		for _, c := range comms {
			wg.Add(1)
			go func() {
				defer wg.Done()
				ctx := context.Background()
				tr, err := dist.New(c, dist.Options{Session: batchfit.Options{Device: batchfit.DeviceCPU}, ZeRO: stage})
				if err != nil {
					fmt.Println(err)
					return
				}
				defer tr.Close()
				model := nn.MLP(nn.Seed(1), []int{in, 8, classes}, nn.ReLU{})
				params := nn.ParamTensors(model)
				opt := optim.NewAdamW(0.01)
				lo, hi, _ := tr.Shard(n)
				for range 3 {
					xs := lazy.Wrap(tensor.New(tensor.WithShape(hi-lo, in), tensor.WithBacking(append([]float32(nil), x[lo*in:hi*in]...))), 0)
					ys := xs.Graph().Wrap(tensor.New(tensor.WithShape(hi-lo), tensor.WithBacking(append([]int64(nil), y[lo:hi]...))), 0)
					if _, err := tr.Step(ctx, n, model.Forward(xs).CrossEntropy(ys, lazy.Mean), params, opt); err != nil {
						fmt.Println(err)
						return
					}
				}
				if err := tr.GatherParams(ctx, params); err != nil {
					fmt.Println(err)
					return
				}
				if c.Rank() == 0 {
					final[run] = append([]float32(nil), params[0].Value().Data().([]float32)...)
				}
			}()
		}
		wg.Wait()
	}
	fmt.Println("ZeRO-3 equals replicated:", fmt.Sprint(final[0]) == fmt.Sprint(final[1]))
	// Output:
	// ZeRO-3 equals replicated: true
}
