package train_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"time"

	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit"
	"github.com/batchfit/batchfit/data"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/optim"
	"github.com/batchfit/batchfit/train"
)

// A training loop on the CPU: an MLP learns which quarter of its input
// holds the largest values, from a shuffled loader over arrays in memory,
// 40 steps logged every 10 with the loader's position saved every 20 (a
// checkpoint would store it with the parameters). The clock is a fake
// one, a second per log line, so the output is the same on
// every machine.
func ExampleRun() {
	const n, in, classes = 2048, 16, 4
	rng := rand.New(rand.NewPCG(1, 2))
	x, y := make([]float32, n*in), make([]int64, n)
	for i := range y {
		y[i] = int64(rng.IntN(classes))
		for j := range in {
			x[i*in+j] = float32(rng.NormFloat64())
			if j/(in/classes) == int(y[i]) {
				x[i*in+j] += 2
			}
		}
	}
	ds, err := data.NewArrays([]string{"x", "y"}, tensor.New(tensor.WithShape(n, in), tensor.WithBacking(x)),
		tensor.New(tensor.WithShape(n), tensor.WithBacking(y)))
	if err != nil {
		fmt.Println(err)
		return
	}
	sess := batchfit.NewSession(batchfit.Options{Device: batchfit.DeviceCPU, Budget: 4 << 20})
	defer sess.Close()
	loader, err := data.NewLoader(ds, data.Options{Batch: 256, Shuffle: true, Seed: 7, Host: sess.HostMemory()})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer loader.Close()
	model := nn.MLP(nn.Seed(1), []int{in, 64, classes}, nn.ReLU{})
	opt := optim.NewAdam(1e-2)

	var saved data.Position
	step := func(ctx context.Context, _ int) (train.Result, error) {
		b, err := loader.Next(ctx)
		if err != nil {
			return train.Result{}, err
		}
		xs := lazy.Wrap(b.Tensor("x"), 0)
		loss := model.Forward(xs).CrossEntropy(xs.Graph().Wrap(b.Tensor("y"), 0), graph.ReduceMean)
		l, err := sess.Step(ctx, loss, nn.ParamTensors(model), opt)
		return train.Result{Loss: l, Samples: b.Size, LR: float64(opt.LR)}, err
	}
	t := time.Unix(0, 0)
	_, err = train.Run(context.Background(), train.Config{Steps: 40, LogEvery: 10, CheckpointEvery: 20, Out: os.Stdout,
		Allocator: sess.Allocator(), Now: func() time.Time { t = t.Add(time.Second); return t },
		Checkpoint: func(_ context.Context, done int) error { saved = loader.Position(); return nil }}, step)
	if err != nil {
		fmt.Println(err)
	}
	fmt.Printf("saved at epoch %d, sample %d\n", saved.Epoch, saved.Index)
	// Output:
	// step 10/40  loss 0.7902  lr 1.00e-02  2.56k samples/s  mem 2.00 MiB (peak 2.00 MiB)  eta 3s
	// step 20/40  loss 0.0840  lr 1.00e-02  2.56k samples/s  mem 2.00 MiB (peak 2.00 MiB)  eta 2s
	// step 30/40  loss 0.0237  lr 1.00e-02  2.56k samples/s  mem 2.00 MiB (peak 2.00 MiB)  eta 1s
	// step 40/40  loss 0.0128  lr 1.00e-02  2.56k samples/s  mem 2.00 MiB (peak 2.00 MiB)
	// saved at epoch 5, sample 0
}
