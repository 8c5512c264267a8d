package models_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/exec/cpu"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/internal/ref"
	"github.com/batchfit/batchfit/internal/testutil"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/models"
	"github.com/batchfit/batchfit/nn"
	"github.com/batchfit/batchfit/optim"
	"github.com/batchfit/batchfit/shapeinfer"
)

// torchvisionStateDict lists the keys of torchvision's
// ResNet(block, layers).state_dict() in order, written from torchvision's
// rule independently of package models: conv1, bn1, then per block conv1,
// bn1, conv2, bn2 (conv3, bn3 for a Bottleneck), then downsample.0
// (conv) and downsample.1 (bn) on a block that strides or changes the
// width (the first of each layer but layer1 of a BasicBlock net), then
// fc. Each bn has weight, bias, running_mean, running_var and
// num_batches_tracked.
func torchvisionStateDict(blocks []int, bottleneck bool) []string {
	var keys []string
	conv := func(p string) { keys = append(keys, p+".weight") }
	bn := func(p string) {
		for _, s := range []string{"weight", "bias", "running_mean", "running_var", "num_batches_tracked"} {
			keys = append(keys, p+"."+s)
		}
	}
	conv("conv1")
	bn("bn1")
	convs := 2
	if bottleneck {
		convs = 3
	}
	for l, n := range blocks {
		for b := range n {
			p := fmt.Sprintf("layer%d.%d", l+1, b)
			for c := 1; c <= convs; c++ {
				conv(fmt.Sprintf("%s.conv%d", p, c))
				bn(fmt.Sprintf("%s.bn%d", p, c))
			}
			if b == 0 && (l > 0 || bottleneck) {
				conv(p + ".downsample.0")
				bn(p + ".downsample.1")
			}
		}
	}
	keys = append(keys, "fc.weight", "fc.bias")
	return keys
}

// TestResNetTorchvisionNames checks every parameter and buffer name, in
// order, and the parameter counts against torchvision's, for every depth.
func TestResNetTorchvisionNames(t *testing.T) {
	cases := []struct {
		depth      int
		blocks     []int
		bottleneck bool
		params     int // sum(p.numel() for p in torchvision.models.resnetN().parameters())
		tensors    int // len(list(....parameters()))
		stateDict  int // len(....state_dict())
	}{
		{18, []int{2, 2, 2, 2}, false, 11_689_512, 62, 122},
		{34, []int{3, 4, 6, 3}, false, 21_797_672, 110, 218},
		{50, []int{3, 4, 6, 3}, true, 25_557_032, 161, 320},
		{101, []int{3, 4, 23, 3}, true, 44_549_160, 314, 626},
		{152, []int{3, 8, 36, 3}, true, 60_192_808, 467, 932},
	}
	for _, c := range cases {
		t.Run(fmt.Sprintf("resnet%d", c.depth), func(t *testing.T) {
			m := models.NewResNet(nn.Options{ShapeOnly: true}, models.ResNetConfig{Depth: c.depth, Classes: 1000})
			require.NoError(t, nn.Check(m))
			keys := torchvisionStateDict(c.blocks, c.bottleneck)
			require.Len(t, keys, c.stateDict)
			var wantParams, wantBuffers []string
			for _, k := range keys {
				switch {
				case strings.HasSuffix(k, ".num_batches_tracked"): // not kept by nn
				case strings.HasSuffix(k, ".running_mean"), strings.HasSuffix(k, ".running_var"):
					wantBuffers = append(wantBuffers, k)
				default:
					wantParams = append(wantParams, k)
				}
			}
			assert.Len(t, wantParams, c.tensors)
			assert.Equal(t, wantParams, testutil.ParamNames(m), "parameters in state_dict order")
			var buffers []string
			for _, b := range nn.Buffers(m) {
				buffers = append(buffers, b.Name)
			}
			assert.Equal(t, wantBuffers, buffers, "running statistics in state_dict order")
			assert.Equal(t, c.params, nn.NumParams(m))
			assert.Equal(t, models.ResNetConfig{Depth: c.depth, Blocks: c.blocks, Bottleneck: c.bottleneck, Classes: 1000,
				Width: 64, Channels: 3, ImageSize: 224}, m.Config())
			for _, p := range m.Params() {
				assert.Nil(t, p.Value(), "%s holds data in shape-only mode", p.Name())
				assert.Equal(t, p.Name(), p.Tensor().Name(), "the lazy leaf carries the full name")
			}
		})
	}

	// Spot checks, written out.
	shapes := func(m nn.Module) map[string][]int {
		s := map[string][]int{}
		for _, p := range m.Params() {
			s[p.Name()] = p.Shape()
		}
		return s
	}
	r18 := shapes(models.NewResNet(nn.Options{ShapeOnly: true}, models.ResNet18(1000)))
	for k, want := range map[string][]int{
		"conv1.weight":                 {64, 3, 7, 7},
		"bn1.weight":                   {64},
		"bn1.bias":                     {64},
		"layer1.0.conv1.weight":        {64, 64, 3, 3},
		"layer1.1.bn2.bias":            {64},
		"layer2.0.conv1.weight":        {128, 64, 3, 3},
		"layer2.0.downsample.0.weight": {128, 64, 1, 1},
		"layer2.0.downsample.1.weight": {128},
		"layer2.0.downsample.1.bias":   {128},
		"layer3.0.downsample.0.weight": {256, 128, 1, 1},
		"layer4.0.conv1.weight":        {512, 256, 3, 3},
		"layer4.1.conv2.weight":        {512, 512, 3, 3},
		"fc.weight":                    {1000, 512},
		"fc.bias":                      {1000},
	} {
		assert.Equal(t, want, r18[k], k)
	}
	assert.NotContains(t, r18, "layer1.0.downsample.0.weight", "layer1 of ResNet-18 keeps the shape: no downsample")
	assert.NotContains(t, r18, "conv1.bias", "convs have no bias")

	r50 := shapes(models.NewResNet(nn.Options{ShapeOnly: true}, models.ResNet50(1000)))
	for k, want := range map[string][]int{
		"conv1.weight":                 {64, 3, 7, 7},
		"layer1.0.conv1.weight":        {64, 64, 1, 1},
		"layer1.0.conv2.weight":        {64, 64, 3, 3},
		"layer1.0.conv3.weight":        {256, 64, 1, 1},
		"layer1.0.bn3.weight":          {256},
		"layer1.0.downsample.0.weight": {256, 64, 1, 1},
		"layer1.0.downsample.1.bias":   {256},
		"layer1.1.conv1.weight":        {64, 256, 1, 1},
		"layer2.0.conv1.weight":        {128, 256, 1, 1},
		"layer2.0.conv2.weight":        {128, 128, 3, 3},
		"layer2.0.downsample.0.weight": {512, 256, 1, 1},
		"layer3.5.conv3.weight":        {1024, 256, 1, 1},
		"layer4.2.conv3.weight":        {2048, 512, 1, 1},
		"layer4.2.bn3.bias":            {2048},
		"fc.weight":                    {1000, 2048},
		"fc.bias":                      {1000},
	} {
		assert.Equal(t, want, r50[k], k)
	}
	assert.NotContains(t, r50, "layer1.1.downsample.0.weight")
	assert.NotContains(t, r50, "layer3.6.conv1.weight", "layer3 of ResNet-50 has 6 blocks")

	// The CIFAR stem: conv1 3×3, no max-pool; 11,173,962 parameters at 10
	// classes (ResNet-18 less 64·3·(49−9) in conv1 and 990 outputs of fc).
	cifar := models.NewResNet(nn.Options{ShapeOnly: true}, models.ResNet18CIFAR(10))
	require.NoError(t, nn.Check(cifar))
	assert.Equal(t, 11_689_512-64*3*40-990*513, nn.NumParams(cifar))
	assert.Equal(t, 11_173_962, nn.NumParams(cifar))
	assert.Equal(t, []int{64, 3, 3, 3}, shapes(cifar)["conv1.weight"])
	assert.Nil(t, cifar.Get("maxpool"))
	assert.Equal(t, 32, cifar.Config().ImageSize)
	keys := torchvisionStateDict([]int{2, 2, 2, 2}, false)
	keys = slices.DeleteFunc(keys, func(k string) bool { return strings.Contains(k, "running_") || strings.Contains(k, "num_batches") })
	assert.Equal(t, keys, testutil.ParamNames(cifar), "the CIFAR stem keeps torchvision's names")

	// Explicit blocks and width.
	w := models.NewResNet(nn.Options{ShapeOnly: true}, models.ResNetConfig{Blocks: []int{1, 2, 1, 1}, Bottleneck: true, Width: 8, Classes: 7})
	require.NoError(t, nn.Check(w))
	assert.Equal(t, []int{256, 64, 1, 1}, shapes(w)["layer4.0.conv3.weight"], "layer4: 8·8 wide, ×4 out")
	assert.Equal(t, []int{7, 256}, shapes(w)["fc.weight"])
	assert.Contains(t, shapes(w), "layer2.1.conv3.weight")
}

// avgpoolInput is the shape of the map entering the global average pool.
func avgpoolInput(t *testing.T, logits *lazy.Tensor) []int {
	t.Helper()
	g := logits.Graph().IR()
	for _, nd := range g.Nodes() {
		if nd.Scope == "avgpool" && nd.Op == graph.OpMean {
			return g.Node(nd.Inputs[0]).Type.Shape
		}
	}
	t.Fatal("no mean in scope avgpool")
	return nil
}

func TestResNetShapes(t *testing.T) {
	cases := []struct {
		name    string
		cfg     models.ResNetConfig
		input   []int
		feature []int // entering avgpool
	}{
		{"resnet18 224", models.ResNet18(1000), []int{2, 3, 224, 224}, []int{2, 512, 7, 7}},
		{"resnet50 224", models.ResNet50(1000), []int{2, 3, 224, 224}, []int{2, 2048, 7, 7}},
		{"resnet18-cifar 32", models.ResNet18CIFAR(10), []int{2, 3, 32, 32}, []int{2, 512, 4, 4}},
		{"resnet50 at 160, not its ImageSize", models.ResNet50(1000), []int{3, 3, 160, 160}, []int{3, 2048, 5, 5}},
		{"resnet18 at 32, the smallest", models.ResNet18(10), []int{2, 3, 32, 32}, []int{2, 512, 1, 1}},
		{"resnet18 at 225 (odd)", models.ResNet18(10), []int{1, 3, 225, 225}, []int{1, 512, 8, 8}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			m := models.NewResNet(nn.Options{ShapeOnly: true}, c.cfg)
			x := lazy.Placeholder(c.input, graph.Float32, 0)
			logits := m.Forward(x)
			require.NoError(t, logits.Err())
			assert.Equal(t, []int{c.input[0], c.cfg.Classes}, logits.Shape())
			assert.Equal(t, 0, logits.BatchAxis())
			assert.Equal(t, graph.Float32, logits.DType())
			assert.Equal(t, c.feature, avgpoolInput(t, logits))
		})
	}
}

func TestResNetConfigErrors(t *testing.T) {
	bad := map[string]struct {
		cfg  models.ResNetConfig
		says string
	}{
		"unknown depth":                      {models.ResNetConfig{Depth: 20, Classes: 10}, "unknown depth 20"},
		"negative depth":                     {models.ResNetConfig{Depth: -18, Classes: 10}, "unknown depth"},
		"no depth, no blocks":                {models.ResNetConfig{Classes: 10}, "Blocks"},
		"depth and blocks":                   {models.ResNetConfig{Depth: 18, Blocks: []int{2, 2, 2, 2}, Classes: 10}, "not both"},
		"three stages":                       {models.ResNetConfig{Blocks: []int{2, 2, 2}, Classes: 10}, "four counts"},
		"an empty stage":                     {models.ResNetConfig{Blocks: []int{2, 0, 2, 2}, Classes: 10}, "four counts"},
		"bottleneck on a basic depth":        {models.ResNetConfig{Depth: 34, Bottleneck: true, Classes: 10}, "BasicBlock"},
		"zero classes":                       {models.ResNet18(0), "Classes"},
		"negative classes":                   {models.ResNet50(-1), "Classes"},
		"image too small":                    {models.ResNetConfig{Depth: 18, Classes: 10, ImageSize: 16}, "too small"},
		"image too small for the CIFAR stem": {models.ResNetConfig{Depth: 18, Classes: 10, ImageSize: 4, CIFARStem: true}, "too small"},
		"negative image size":                {models.ResNetConfig{Depth: 18, Classes: 10, ImageSize: -224}, "too small"},
		"negative width":                     {models.ResNetConfig{Depth: 18, Classes: 10, Width: -64}, "Width"},
		"negative channels":                  {models.ResNetConfig{Depth: 18, Classes: 10, Channels: -3}, "Channels"},
	}
	for name, c := range bad {
		t.Run(name, func(t *testing.T) {
			for _, opt := range []nn.Options{nn.Seed(1), {ShapeOnly: true}} {
				m := models.NewResNet(opt, c.cfg)
				err := nn.Check(m)
				assert.ErrorIs(t, err, graph.ErrAttr)
				assert.ErrorContains(t, err, c.says)
				assert.Empty(t, m.Params())
				assert.Empty(t, nn.Buffers(m))
				out := m.Forward(lazy.Placeholder([]int{2, 3, 224, 224}, graph.Float32, 0))
				assert.ErrorIs(t, out.Err(), graph.ErrAttr)
				var oe *graph.OpError
				assert.ErrorAs(t, out.Err(), &oe)
			}
		})
	}

	m := models.NewResNet(nn.Options{ShapeOnly: true}, models.ResNet18(10))
	for _, shape := range [][]int{{2, 3, 16, 16}, {2, 3, 224, 31}, {2, 1, 224, 224}, {3, 224, 224}, {2, 3, 224, 224, 1}} {
		out := m.Forward(lazy.Placeholder(shape, graph.Float32, 0))
		assert.ErrorIs(t, out.Err(), graph.ErrShape, "images %v", shape)
	}
	cifar := models.NewResNet(nn.Options{ShapeOnly: true}, models.ResNet18CIFAR(10))
	assert.NoError(t, cifar.Forward(lazy.Placeholder([]int{2, 3, 8, 8}, graph.Float32, 0)).Err(), "8×8 is the CIFAR stem's least")
	assert.ErrorIs(t, cifar.Forward(lazy.Placeholder([]int{2, 3, 7, 8}, graph.Float32, 0)).Err(), graph.ErrShape)

	// The input's error comes first, as in nn.
	failed := lazy.Param(nil, "images")
	assert.Same(t, failed.Err(), m.Forward(failed).Err())
	assert.Same(t, failed.Err(), models.NewResNet(nn.Options{ShapeOnly: true}, models.ResNetConfig{}).Forward(failed).Err())
}

// resnetTrainingGraph builds loss and every gradient of m over shape-only
// images [batch, 3, size, size], and analyses them.
func resnetTrainingGraph(t *testing.T, m *models.ResNet, batch, size int) (*shapeinfer.Result, []*lazy.Tensor) {
	t.Helper()
	x := lazy.Placeholder([]int{batch, 3, size, size}, graph.Float32, 0)
	y := x.Graph().Placeholder([]int{batch}, graph.Int64, 0)
	loss := m.Forward(x).CrossEntropy(y, graph.ReduceMean)
	require.NoError(t, loss.Err())
	grads := lazy.Grad(loss, nn.ParamTensors(m)...)
	outs := []int{loss.ID()}
	for _, gr := range grads {
		require.NoError(t, gr.Err())
		outs = append(outs, gr.ID())
	}
	info, err := shapeinfer.Analyze(x.Graph().IR(), outs...)
	require.NoError(t, err)
	return info, grads
}

// TestResNetChunkability: in training mode (the default) batch norm mixes
// the samples of a batch, so the step cannot run in chunks, and the
// analysis names the first batch_norm node, bn1; in evaluation mode the
// step is per-sample and every gradient sums over chunks.
func TestResNetChunkability(t *testing.T) {
	for _, cfg := range []models.ResNetConfig{models.ResNet18(1000), models.ResNet50(1000), models.ResNet18CIFAR(10)} {
		t.Run(fmt.Sprint(cfg.Depth, cfg.CIFARStem), func(t *testing.T) {
			size := 224
			if cfg.CIFARStem {
				size = 32
			}
			info, _ := resnetTrainingGraph(t, models.NewResNet(nn.Options{ShapeOnly: true}, cfg), 4, size)
			require.False(t, info.Chunkable())
			var ce *shapeinfer.ChunkError
			require.True(t, errors.As(error(info.NotChunkable), &ce))
			assert.ErrorIs(t, info.NotChunkable, graph.ErrNotChunkable)
			assert.Equal(t, "batch_norm", ce.Op)
			assert.Equal(t, "bn1", ce.Scope)
			assert.Contains(t, info.NotChunkable.Error(), "batch_norm in bn1")

			m := models.NewResNet(nn.Options{ShapeOnly: true}, cfg)
			nn.SetTraining(m, false)
			info, grads := resnetTrainingGraph(t, m, 4, size)
			require.True(t, info.Chunkable(), "evaluation mode: %v", info.NotChunkable)
			assert.Equal(t, 4, info.Batch)
			for _, gr := range grads {
				assert.Equal(t, shapeinfer.CombineSum, info.Combine[gr.ID()])
			}
		})
	}
}

// tinyResNets are small enough for the float64 reference: every stage,
// the projection shortcuts, and both stems, at batch 2. Layer4's map is
// 2×2, so its training-mode batch norms normalise over 8 values per
// channel (over 2, the batch norm's output would be ±1 and its gradient
// nearly zero).
var tinyResNets = []struct {
	name string
	cfg  models.ResNetConfig
}{
	{"basic, CIFAR stem, 16×16", models.ResNetConfig{Blocks: []int{1, 1, 1, 1}, Width: 4, ImageSize: 16, Classes: 5, CIFARStem: true}},
	{"bottleneck, ImageNet stem, 64×64", models.ResNetConfig{Blocks: []int{1, 1, 1, 1}, Bottleneck: true, Width: 2, ImageSize: 64, Classes: 5}},
}

type tinyStep struct {
	g       *graph.Graph
	loss    *lazy.Tensor
	params  []*lazy.Tensor
	outputs []int // logits, loss, gradients
}

func buildTinyStep(t *testing.T, m *models.ResNet, rng *rand.Rand, b int) tinyStep {
	t.Helper()
	cfg := m.Config()
	img := make([]float32, b*cfg.Channels*cfg.ImageSize*cfg.ImageSize)
	for i := range img {
		img[i] = float32(rng.NormFloat64())
	}
	labels := make([]int64, b)
	for i := range labels {
		labels[i] = int64(rng.IntN(cfg.Classes))
	}
	x := lazy.Wrap(tensor.New(tensor.WithShape(b, cfg.Channels, cfg.ImageSize, cfg.ImageSize), tensor.WithBacking(img)), 0)
	y := x.Graph().Wrap(int64s([]int{b}, labels), 0)
	logits := m.Forward(x)
	loss := logits.CrossEntropy(y, graph.ReduceMean)
	params := nn.ParamTensors(m)
	s := tinyStep{g: x.Graph().IR(), loss: loss, params: params, outputs: []int{logits.ID(), loss.ID()}}
	for _, gr := range lazy.Grad(loss, params...) {
		require.NoError(t, gr.Err())
		s.outputs = append(s.outputs, gr.ID())
	}
	return s
}

// resnetGradTol is the normwise coefficient of the bound on the
// gradients of the tiny ResNets (see cpuTol in gpt_test.go; logits and
// loss keep cpuTol). A batch norm's weight gradient sums g·x̂ over N·H·W
// values (2048 per channel for the ImageNet stem's bn1 here) whose signs
// cancel, since x̂ has zero mean per channel, so float32 rounding in g
// shows larger relative to the sum than in a GEMM. Measured: at most
// 1.22e-5·max|ref| (bn1.weight of the bottleneck net in training mode),
// other gradients at most 6e-6; the bound leaves a margin of 8 while a
// wrong stride, padding, shortcut or statistic is off by order one.
const resnetGradTol = 1e-4

// TestTinyResNetMatchesReference runs logits, loss and every gradient of
// seeded tiny ResNets, in training mode (batch statistics) and in
// evaluation mode (running statistics), on the CPU executor and on the
// float64 reference: logits and loss with cpuTol, gradients with
// resnetGradTol.
func TestTinyResNetMatchesReference(t *testing.T) {
	for i, c := range tinyResNets {
		for _, training := range []bool{true, false} {
			t.Run(fmt.Sprintf("%s/training=%v", c.name, training), func(t *testing.T) {
				rng := rand.New(rand.NewPCG(31, uint64(i)))
				m := models.NewResNet(nn.Seed(31), c.cfg)
				require.NoError(t, nn.Check(m))
				nn.SetTraining(m, training)
				const b = 2
				s := buildTinyStep(t, m, rng, b)
				got, err := cpu.New().Run(context.Background(), s.g, s.outputs...)
				require.NoError(t, err)
				want, err := ref.Eval(s.g, nil, s.outputs...)
				require.NoError(t, err)

				assert.Equal(t, []int{b, c.cfg.Classes}, want[0].Shape)
				assertClose(t, want[0], got[0], "logits")
				assertClose(t, want[1], got[1], "loss")
				require.False(t, math.IsNaN(want[1].Data[0]) || math.IsInf(want[1].Data[0], 0))
				for k, p := range s.params {
					assertCloseTol(t, want[k+2], got[k+2], "gradient of "+p.Name(), resnetGradTol, cpuTol.RTol)
				}
			})
		}
	}
}

// TestTinyResNetGradientFiniteDifferences holds a few gradient elements
// of every kind of parameter (the stem, a block's conv and batch norm, a
// projection shortcut, fc) to central finite differences of the
// training-mode loss, both in float64 through the reference. Tolerance as
// in TestTiedHeadGradient.
func TestTinyResNetGradientFiniteDifferences(t *testing.T) {
	const h, tol = 1e-6, 1e-6
	for i, c := range tinyResNets {
		t.Run(c.name, func(t *testing.T) {
			rng := rand.New(rand.NewPCG(41, uint64(i)))
			m := models.NewResNet(nn.Seed(41), c.cfg)
			s := buildTinyStep(t, m, rng, 2)
			names := []string{"conv1.weight", "bn1.weight", "layer1.0.conv2.weight", "layer2.0.bn1.bias",
				"layer3.0.downsample.0.weight", "layer4.0.downsample.1.weight", "fc.weight", "fc.bias"}
			checked := 0
			for k, p := range s.params {
				if !slices.Contains(names, p.Name()) {
					continue
				}
				id := s.g.NodeNamed(p.Name())
				require.GreaterOrEqual(t, id, 0, p.Name())
				vals, err := ref.Eval(s.g, nil, s.outputs[k+2], id)
				require.NoError(t, err)
				grad, base := vals[0], vals[1]
				for _, e := range rng.Perm(len(base.Data))[:min(3, len(base.Data))] {
					lossAt := func(v float64) float64 {
						moved := base.Clone()
						moved.Data[e] = v
						out, err := ref.Eval(s.g, map[int]ref.Value{id: moved}, s.loss.ID())
						require.NoError(t, err)
						return out[0].Data[0]
					}
					fd := (lossAt(base.Data[e]+h) - lossAt(base.Data[e]-h)) / (2 * h)
					assert.LessOrEqual(t, math.Abs(fd-grad.Data[e]), tol*max(math.Abs(grad.Data[e]), 1e-2),
						"d loss/d %s element %d: autodiff %v, finite difference %v", p.Name(), e, grad.Data[e], fd)
				}
				checked++
			}
			assert.Equal(t, len(names), checked)
		})
	}
}

// TestTinyResNetTrainsOneStep takes one SGD step with momentum on the CPU
// executor, in training mode, and checks that the loss and gradients were
// finite and that the loss fell; then it folds the batch statistics into
// the running ones.
func TestTinyResNetTrainsOneStep(t *testing.T) {
	for i, c := range tinyResNets {
		t.Run(c.name, func(t *testing.T) {
			rng := rand.New(rand.NewPCG(51, uint64(i)))
			m := models.NewResNet(nn.Seed(51), c.cfg)
			s := buildTinyStep(t, m, rng, 2)
			got, err := cpu.New().Run(context.Background(), s.g, s.outputs[1:]...)
			require.NoError(t, err)
			before := float64(got[0].Float32s()[0])
			require.False(t, math.IsNaN(before) || math.IsInf(before, 0), "loss %v", before)

			var ps []optim.Param
			for k, p := range m.Params() {
				g := got[k+1].Float32s()
				for _, v := range g {
					require.False(t, math.IsNaN(float64(v)) || math.IsInf(float64(v), 0), "gradient of %s", p.Name())
				}
				ps = append(ps, optim.Param{Key: p, Name: p.Name(), Data: p.Value().(*tensor.Dense).Float32s(), Grad: g})
			}
			require.NoError(t, optim.NewSGD(0.01, 0.9).Step(ps))
			// The parameters changed in place: the same graph reads them.
			after, err := cpu.New().Run(context.Background(), s.g, s.loss.ID())
			require.NoError(t, err)
			a := float64(after[0].Float32s()[0])
			t.Logf("loss %.6f → %.6f", before, a)
			assert.Less(t, a, before, "one small step down the gradient lowers the loss")

			// The running statistics are buffers that nn.Buffers names;
			// BatchStats and UpdateRunning fold a batch into them.
			bn := m.Get("bn1").(*nn.BatchNorm2d)
			buf := nn.Buffers(m)
			require.Equal(t, "bn1.running_mean", buf[0].Name)
			require.Same(t, bn.RunningMean, buf[0].Tensor)
			mean, variance := bn.BatchStats()
			stats, err := cpu.New().Run(context.Background(), s.g, mean.ID(), variance.ID())
			require.NoError(t, err)
			require.NoError(t, bn.UpdateRunning(stats[0], stats[1]))
			rm := buf[0].Tensor.Value().(*tensor.Dense).Float32s()
			for k, v := range stats[0].Float32s() {
				assert.InDelta(t, 0.1*v, rm[k], 1e-6, "running_mean[%d]", k)
			}
		})
	}
}
