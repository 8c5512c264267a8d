package models

import (
	"fmt"
	"math"
	"slices"

	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/nn"
)

// ResNetConfig sizes a ResNet in torchvision's layout (torchvision.models.
// resnet18 … resnet152, v1.5: a Bottleneck strides on its 3×3 conv).
type ResNetConfig struct {
	// Depth picks torchvision's block counts and block type: 18 and 34
	// BasicBlock, 50, 101 and 152 Bottleneck. Leave it 0 when Blocks is
	// set.
	Depth int
	// Blocks is the number of blocks of layer1 … layer4, four counts of at
	// least 1, for a ResNet of no standard depth; Bottleneck picks the
	// block. Set Depth or Blocks, not both.
	Blocks     []int
	Bottleneck bool
	Classes    int // outputs of fc
	// Width is the stem's output channels and layer1's block width;
	// layer k has Width·2^(k−1), times 4 at a Bottleneck's output. 0 means
	// torchvision's 64.
	Width int
	// Channels is the input's channels; 0 means 3 (RGB).
	Channels int
	// ImageSize is the input's height and width, for the zoo's inputs and
	// the size check; 0 means 224, or 32 with CIFARStem. It must be at
	// least the net's total stride, 32 (8 with CIFARStem), so that every
	// stride-2 stage halves a map of at least 2×2. (torchvision runs
	// smaller images, their last stages on 1×1 maps; batchfit takes them
	// for a mistake.) Forward takes any height and width of at least that:
	// the global average pool adapts, as torchvision's AdaptiveAvgPool2d
	// does.
	ImageSize int
	// CIFARStem replaces torchvision's stem (conv 7×7 stride 2, max-pool
	// 3×3 stride 2) with a 3×3 stride-1 conv and no max-pool, as the
	// common CIFAR ports of ResNet-18 do (kuangliu/pytorch-cifar's, 11.17M
	// parameters at 10 classes): 32×32 images keep a 4×4 map at layer4.
	// Names stay torchvision's. It is not He et al.'s 3-stage CIFAR ResNet
	// (ResNet-20/32/56).
	CIFARStem bool
}

// resnetDepths are torchvision's block counts per depth.
var resnetDepths = map[int]struct {
	blocks     []int
	bottleneck bool
}{
	18:  {[]int{2, 2, 2, 2}, false},
	34:  {[]int{3, 4, 6, 3}, false},
	50:  {[]int{3, 4, 6, 3}, true},
	101: {[]int{3, 4, 23, 3}, true},
	152: {[]int{3, 8, 36, 3}, true},
}

// ResNet18 is torchvision's resnet18 over 224×224 RGB images (11,689,512
// parameters at 1000 classes).
func ResNet18(classes int) ResNetConfig { return ResNetConfig{Depth: 18, Classes: classes} }

// ResNet50 is torchvision's resnet50 over 224×224 RGB images (25,557,032
// parameters at 1000 classes).
func ResNet50(classes int) ResNetConfig { return ResNetConfig{Depth: 50, Classes: classes} }

// ResNet18CIFAR is ResNet-18 with the CIFAR stem over 32×32 RGB images
// (11,173,962 parameters at 10 classes).
func ResNet18CIFAR(classes int) ResNetConfig {
	return ResNetConfig{Depth: 18, Classes: classes, CIFARStem: true}
}

// resolve fills in the defaults and checks cfg.
func (cfg ResNetConfig) resolve() (ResNetConfig, error) {
	bad := func(format string, args ...any) (ResNetConfig, error) {
		return cfg, graph.Errorf(graph.ErrAttr, "ResNet config: "+format, args...)
	}
	switch {
	case cfg.Depth != 0 && cfg.Blocks != nil:
		return bad("set Depth (%d) or Blocks (%v), not both", cfg.Depth, cfg.Blocks)
	case cfg.Depth != 0:
		d, ok := resnetDepths[cfg.Depth]
		if !ok {
			return bad("unknown depth %d (want 18, 34, 50, 101 or 152, or Blocks)", cfg.Depth)
		}
		if cfg.Bottleneck && !d.bottleneck {
			return bad("Bottleneck is set by Depth; ResNet-%d uses BasicBlock", cfg.Depth)
		}
		cfg.Blocks, cfg.Bottleneck = slices.Clone(d.blocks), d.bottleneck
	case len(cfg.Blocks) != 4 || slices.ContainsFunc(cfg.Blocks, func(n int) bool { return n < 1 }):
		return bad("Blocks %v: want four counts of at least 1 (or a Depth)", cfg.Blocks)
	default:
		cfg.Blocks = slices.Clone(cfg.Blocks)
	}
	if cfg.Classes < 1 {
		return bad("Classes must be at least 1, got %d", cfg.Classes)
	}
	if cfg.Width == 0 {
		cfg.Width = 64
	}
	if cfg.Channels == 0 {
		cfg.Channels = 3
	}
	if cfg.ImageSize == 0 {
		cfg.ImageSize = 224
		if cfg.CIFARStem {
			cfg.ImageSize = 32
		}
	}
	if cfg.Width < 1 || cfg.Channels < 1 {
		return bad("Width %d and Channels %d must be positive (0 for the defaults)", cfg.Width, cfg.Channels)
	}
	if least := cfg.minSize(); cfg.ImageSize < least {
		return bad("image size %d is too small: the net strides by %d in all, so images need at least %d×%d",
			cfg.ImageSize, least, least, least)
	}
	return cfg, nil
}

// minSize is the net's total stride: the smallest input side it takes.
func (cfg ResNetConfig) minSize() int {
	if cfg.CIFARStem {
		return 8 // layer2, layer3, layer4
	}
	return 32 // conv1, maxpool, layer2, layer3, layer4
}

// ResNet is a residual image classifier; Forward maps images [N, C, H, W]
// to logits [N, Classes]. Its batch norms start in training mode, as
// PyTorch's modules do: the training graph then runs its batch in one
// piece (each sample is normalised with the batch's statistics), and
// nn.SetTraining(m, false) gives a per-sample, chunkable graph.
type ResNet struct {
	nn.Children
	cfg ResNetConfig
	err error
}

// NewResNet builds the model with torchvision's initialisation: convs
// kaiming-normal with mode fan_out for ReLU (N(0, 2/(out·kh·kw))), batch
// norms weight 1 and bias 0, fc as nn.Linear's default (uniform in ±1/√in
// for weight and bias, which is PyTorch's). Children and parameter names
// are torchvision's: conv1, bn1, relu, maxpool (absent with the CIFAR
// stem), layer1 … layer4, avgpool, fc; so are the running statistics'
// names (nn.Buffers), which with the parameters make the state_dict less
// its num_batches_tracked counters.
func NewResNet(opt nn.Options, cfg ResNetConfig) *ResNet {
	rc, err := cfg.resolve()
	if err != nil {
		return &ResNet{cfg: cfg, err: err}
	}
	m := &ResNet{cfg: rc}
	w := rc.Width
	stem := lazy.ConvOptions{Stride: [2]int{2, 2}, Padding: [2]int{3, 3}}
	kernel := 7
	if rc.CIFARStem {
		stem, kernel = lazy.ConvOptions{Padding: [2]int{1, 1}}, 3
	}
	cs := []nn.Child{
		{Name: "conv1", Module: kaimingConv(opt, rc.Channels, w, kernel, stem)},
		{Name: "bn1", Module: batchNorm(opt, w)},
		{Name: "relu", Module: nn.ReLU{}},
	}
	if !rc.CIFARStem {
		cs = append(cs, nn.Child{Name: "maxpool", Module: nn.MaxPool2d{Kernel: [2]int{3, 3}, Stride: [2]int{2, 2}, Padding: [2]int{1, 1}}})
	}
	in := w
	for i, n := range rc.Blocks {
		planes, stride := w<<i, min(i, 1)+1
		blocks := make([]nn.Module, n)
		for j := range blocks {
			if rc.Bottleneck {
				blocks[j] = newBottleneck(opt, in, planes, stride)
				in = 4 * planes
			} else {
				blocks[j] = newBasicBlock(opt, in, planes, stride)
				in = planes
			}
			stride = 1
		}
		cs = append(cs, nn.Child{Name: fmt.Sprintf("layer%d", i+1), Module: nn.NewSequential(blocks...)})
	}
	cs = append(cs,
		nn.Child{Name: "avgpool", Module: globalAvgPool{}},
		nn.Child{Name: "fc", Module: nn.NewLinear(opt, in, rc.Classes, true)})
	m.Children = nn.NewChildren(cs...)
	return m
}

// Config is the model's configuration, defaults filled in and Blocks set
// from Depth.
func (m *ResNet) Config() ResNetConfig { return m.cfg }

// Err reports a construction error.
func (m *ResNet) Err() error {
	if m.err != nil {
		return m.err
	}
	return m.Children.Err()
}

// Params lists the parameters in torchvision's state_dict order.
func (m *ResNet) Params() []*nn.Param {
	if m.err != nil {
		return nil
	}
	return m.Children.Params()
}

// Forward maps images [N, Channels, H, W], H and W at least the net's
// total stride, to logits [N, Classes].
func (m *ResNet) Forward(x *lazy.Tensor) *lazy.Tensor {
	if err := firstErr(x); err != nil { // the input's error first, as in nn
		return lazy.ErrorTensor("models.ResNet", err)
	}
	if err := m.Err(); err != nil {
		return lazy.ErrorTensor("models.ResNet", err, x.Shape())
	}
	if g := x.Graph(); g != nil { // the caller's site, found once for every op
		g.EnterInternal()
		defer g.LeaveInternal()
	}
	s, least := x.Shape(), m.cfg.minSize()
	if len(s) != 4 || s[1] != m.cfg.Channels || s[2] < least || s[3] < least {
		return lazy.ErrorTensor("models.ResNet", graph.Errorf(graph.ErrShape,
			"ResNet needs images [N, %d, H, W] with H, W ≥ %d, got %v", m.cfg.Channels, least, s), s)
	}
	for _, ch := range m.List() {
		x = m.Call(ch.Name, x)
	}
	return x
}

// basicBlock is torchvision's BasicBlock: conv 3×3 (stride) → bn → relu →
// conv 3×3 → bn, plus the shortcut, then relu.
type basicBlock struct{ nn.Children }

func newBasicBlock(opt nn.Options, in, planes, stride int) *basicBlock {
	three := func(stride int) lazy.ConvOptions {
		return lazy.ConvOptions{Stride: [2]int{stride, stride}, Padding: [2]int{1, 1}}
	}
	cs := []nn.Child{
		{Name: "conv1", Module: kaimingConv(opt, in, planes, 3, three(stride))},
		{Name: "bn1", Module: batchNorm(opt, planes)},
		{Name: "relu", Module: nn.ReLU{}},
		{Name: "conv2", Module: kaimingConv(opt, planes, planes, 3, three(1))},
		{Name: "bn2", Module: batchNorm(opt, planes)},
	}
	if d := downsample(opt, in, planes, stride); d != nil {
		cs = append(cs, nn.Child{Name: "downsample", Module: d})
	}
	return &basicBlock{nn.NewChildren(cs...)}
}

func (b *basicBlock) Forward(x *lazy.Tensor) *lazy.Tensor {
	out := b.Call("relu", b.Call("bn1", b.Call("conv1", x)))
	out = b.Call("bn2", b.Call("conv2", out))
	return b.Call("relu", out.Add(shortcut(&b.Children, x)))
}

// bottleneck is torchvision's Bottleneck (v1.5): conv 1×1 → bn → relu →
// conv 3×3 (stride) → bn → relu → conv 1×1 to 4·planes → bn, plus the
// shortcut, then relu.
type bottleneck struct{ nn.Children }

func newBottleneck(opt nn.Options, in, planes, stride int) *bottleneck {
	cs := []nn.Child{
		{Name: "conv1", Module: kaimingConv(opt, in, planes, 1, lazy.ConvOptions{})},
		{Name: "bn1", Module: batchNorm(opt, planes)},
		{Name: "conv2", Module: kaimingConv(opt, planes, planes, 3,
			lazy.ConvOptions{Stride: [2]int{stride, stride}, Padding: [2]int{1, 1}})},
		{Name: "bn2", Module: batchNorm(opt, planes)},
		{Name: "conv3", Module: kaimingConv(opt, planes, 4*planes, 1, lazy.ConvOptions{})},
		{Name: "bn3", Module: batchNorm(opt, 4*planes)},
		{Name: "relu", Module: nn.ReLU{}},
	}
	if d := downsample(opt, in, 4*planes, stride); d != nil {
		cs = append(cs, nn.Child{Name: "downsample", Module: d})
	}
	return &bottleneck{nn.NewChildren(cs...)}
}

func (b *bottleneck) Forward(x *lazy.Tensor) *lazy.Tensor {
	out := b.Call("relu", b.Call("bn1", b.Call("conv1", x)))
	out = b.Call("relu", b.Call("bn2", b.Call("conv2", out)))
	out = b.Call("bn3", b.Call("conv3", out))
	return b.Call("relu", out.Add(shortcut(&b.Children, x)))
}

// downsample is the projection shortcut, conv 1×1 (stride, no bias) → bn,
// when the block changes the shape; nil for the identity.
func downsample(opt nn.Options, in, out, stride int) *nn.Sequential {
	if stride == 1 && in == out {
		return nil
	}
	return nn.NewSequential(
		kaimingConv(opt, in, out, 1, lazy.ConvOptions{Stride: [2]int{stride, stride}}),
		batchNorm(opt, out))
}

// shortcut is x through the block's downsample, or x.
func shortcut(c *nn.Children, x *lazy.Tensor) *lazy.Tensor {
	if c.Get("downsample") == nil {
		return x
	}
	return c.Call("downsample", x)
}

// kaimingConv is a bias-free k×k conv with weights from N(0, 2/fan_out),
// fan_out = out·k·k: torchvision's kaiming_normal_(mode="fan_out",
// nonlinearity="relu").
func kaimingConv(opt nn.Options, in, out, k int, co lazy.ConvOptions) *nn.Conv2d {
	std := math.Sqrt(2 / float64(max(out*k*k, 1)))
	return &nn.Conv2d{Weight: opt.Normal("weight", []int{out, in, k, k}, 0, std), Options: co}
}

// batchNorm is PyTorch's default BatchNorm2d: eps 1e-5, momentum 0.1.
func batchNorm(opt nn.Options, channels int) *nn.BatchNorm2d {
	return nn.NewBatchNorm2d(opt, channels, 1e-5, 0.1)
}

// globalAvgPool averages each channel over H and W, [N, C, H, W] → [N, C]:
// torchvision's avgpool (AdaptiveAvgPool2d to 1×1) and its flatten in one.
// A mean over axes 2 and 3 is per sample, so it chunks along the batch.
type globalAvgPool struct{}

func (globalAvgPool) Forward(x *lazy.Tensor) *lazy.Tensor { return x.Mean(2, 3) }
func (globalAvgPool) Params() []*nn.Param                 { return nil }
