package recompute

import (
	"math"
	"slices"

	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/planner"
)

// Profile is what the cost model knows about a device: a roofline. A node
// costs max(flops/rate, bytes/Bandwidth) + Launch seconds (a fused loss
// one Launch more per kernel of each further logits chunk), an input
// batch its bytes over HostBandwidth each chunk, and an offloaded
// optimizer OffloadSeconds a step, where rate is,
// by the node's op and dtype:
//   - matrix products and convolutions: MatMulFLOPS for float32
//     (TF32FLOPS when TF32 is on and the profile has it); for 16-bit
//     matrix products HalfFLOPS, or HalfUnalignedFLOPS when a row of an
//     operand or the result is not a whole number of 16-byte vectors
//     (cuBLAS then picks alignment-1 kernels: GPT-2's vocabulary of
//     50,257); for 16-bit convolutions and their gradients HalfConvFLOPS
//     (im2col and GEMMs of a few hundred rows run far below HalfFLOPS);
//   - fused attention: HalfAttentionFLOPS on the fast path (16-bit, head
//     dim 64 or 128, no mask: cuDNN's fused attention, or the tensor-core
//     kernels), AttentionFLOPS on the plain kernels
//     (16-bit otherwise); in float32 the GEMM rate (MatMulFLOPS, or
//     TF32FLOPS under TF32): exec/cuda runs it as cuBLAS GEMMs over blocks
//     of queries, and the scores those GEMMs write and the row kernels
//     between them read and write count as bytes (work);
//   - every other op: VectorFLOPS.
//
// A rate the profile leaves at 0 falls back: HalfFLOPS to TF32FLOPS, then
// MatMulFLOPS; HalfUnalignedFLOPS and HalfConvFLOPS to HalfFLOPS;
// HalfAttentionFLOPS to AttentionFLOPS; AttentionFLOPS to VectorFLOPS.
type Profile struct {
	Name        string  `json:"name"`
	MatMulFLOPS float64 `json:"matmul_flops"`         // FP32 GEMM, flop/s
	TF32FLOPS   float64 `json:"tf32_flops,omitempty"` // TF32 GEMM, flop/s; 0: as MatMulFLOPS
	// HalfFLOPS is a bfloat16 or float16 GEMM's flop/s (float32 sums);
	// HalfUnalignedFLOPS the same with rows not a multiple of 16 bytes.
	HalfFLOPS          float64 `json:"half_flops,omitempty"`
	HalfUnalignedFLOPS float64 `json:"half_unaligned_flops,omitempty"`
	// HalfConvFLOPS is a 16-bit convolution's (or its gradient's) flop/s.
	HalfConvFLOPS float64 `json:"half_conv_flops,omitempty"`
	// AttentionFLOPS and HalfAttentionFLOPS are fused attention's flop/s
	// (FlashAttention's count: the matrix products, halved under causal) on
	// the plain kernels (16-bit with a mask or a head dim other than 64 and
	// 128) and on the tensor-core ones. float32 attention runs on cuBLAS
	// at the GEMM rate.
	AttentionFLOPS     float64 `json:"attention_flops,omitempty"`
	HalfAttentionFLOPS float64 `json:"half_attention_flops,omitempty"`
	VectorFLOPS        float64 `json:"vector_flops"` // non-GEMM flop/s
	Bandwidth          float64 `json:"bandwidth"`    // bytes/s that kernels stream
	Launch             float64 `json:"launch"`       // seconds per kernel launch
	// HostBandwidth is the bytes/s at which a step's input batch goes from
	// host memory to the device, every chunk, and an offloaded optimizer's
	// gradients and weights cross (pinned memory both ways); 0 leaves the
	// upload out and prices offload at NominalHostBandwidth.
	HostBandwidth float64 `json:"host_bandwidth,omitempty"`
	// HostUpdateRate is the parameters/s an offloaded optimizer's host
	// update (optim.Adam.StepOffloadEach on every core) goes through; 0:
	// NominalHostUpdateRate. batchfit calibrate measures it.
	HostUpdateRate float64 `json:"host_update_rate,omitempty"`
	// Sources says where each figure comes from ("measured: ...",
	// "nominal: ..."); informational.
	Sources map[string]string `json:"sources,omitempty"`
}

// DefaultProfile is the model when no device is named: a mid-range GPU
// (10 TFLOP/s FP32 GEMM, 10 TFLOP/s vector, 500 GB/s, 10 µs per launch).
// Its absolute times are nominal; its ranking of plans is what matters:
// GEMMs are compute bound, elementwise ops bandwidth bound, and many small
// chunks pay launches.
func DefaultProfile() Profile {
	return Profile{Name: "default", MatMulFLOPS: 10e12, VectorFLOPS: 10e12, Bandwidth: 500e9, Launch: 10e-6,
		Sources: map[string]string{"all": "nominal: a generic mid-range GPU"}}
}

// H100Profile is the NVIDIA H100 80GB HBM3 (SXM). FP32 (no TF32) GEMM
// 51.7 TFLOP/s and TF32 338 TFLOP/s were measured from Go through cuBLAS
// in this project; elementwise kernels stream about 2.3 TB/s (measured;
// HBM3's nominal figure is 3.35 TB/s); non-GEMM FP32 is the nominal
// 67 TFLOP/s; a launch costs about 5 µs (measured order of magnitude).
// The 16-bit, convolution, attention and upload rates are the CUDA
// executor's per-node profiles of GPT-2 small and ResNet-50 in bf16-mixed
// and its attention benchmarks (bench/RESULTS.md, third and sixth
// sessions).
func H100Profile() Profile {
	return Profile{Name: "NVIDIA H100 80GB HBM3", MatMulFLOPS: 51.7e12, TF32FLOPS: 338e12,
		HalfFLOPS: 600e12, HalfUnalignedFLOPS: 120e12, HalfConvFLOPS: 81e12, AttentionFLOPS: 2e12, HalfAttentionFLOPS: 200e12,
		VectorFLOPS: 67e12, Bandwidth: 2.3e12, Launch: 5e-6, HostBandwidth: 13.6e9, Sources: map[string]string{
			"matmul_flops":         "measured: FP32 cuBLAS SGEMM from Go, no TF32",
			"tf32_flops":           "measured: cuBLAS TF32 GEMM from Go",
			"half_flops":           "measured: GPT-2 small's bf16 GEMMs (8192 rows, 768–3072 wide) in the executor's node profile, 356–704 TFLOP/s",
			"half_unaligned_flops": "measured: GPT-2's bf16 LM head and its gradients (50,257 columns), 95–147 TFLOP/s",
			"half_conv_flops":      "measured: ResNet-50's bf16 convolutions at 224², batch 64, on cuDNN: 19.4 ms a step (forward 6.0, input gradient 6.5, weight gradient 6.9) for about 1.57 TFLOP (bench/RESULTS.md, 2026-11-27)",
			"attention_flops":      "measured: the plain-FMA attention kernels, float32 1.6–4.2 TFLOP/s and bf16 forward 2–4 (they now serve 16-bit attention with a mask or an odd head dim only)",
			"half_attention_flops": "measured: bf16 attention forward + backward on cuDNN's fused attention, [8, 12, 1024, 64] causal, 207 TFLOP/s (396 at T = 4096); batchfit's own tensor-core kernels (ExecutorOptions.NoCuDNNAttention) 65",
			"vector_flops":         "nominal: H100 SXM FP32 non-tensor peak",
			"bandwidth":            "measured: elementwise kernels (HBM3 nominal 3.35 TB/s)",
			"launch":               "measured: kernel launch and return through the driver API, about 5 µs",
			"host_bandwidth":       "measured: ResNet-50's 38.5 MB float32 input batch uploaded through the pinned staging buffers in 2.83 ms",
		}}
}

// H200Profile is the NVIDIA H200 (141 GB HBM3e): the H100's chip with
// faster memory. The 16-bit GEMM, attention and bandwidth figures were
// measured on the H200 in this project (bench/RESULTS.md, 2026-12-02);
// the rest are the H100's, the compute being the same GH100's.
func H200Profile() Profile {
	p := H100Profile()
	p.Name = "NVIDIA H200"
	p.HalfFLOPS, p.HalfAttentionFLOPS, p.Bandwidth = 720e12, 315e12, 3.2e12
	src := map[string]string{}
	for k, v := range p.Sources {
		src[k] = "as the H100 (the same GH100 chip): " + v
	}
	src["half_flops"] = "measured: Llama-3.2-1B's bf16 GEMMs (8192 rows, 2048–8192 wide) in the executor's node profile, 623–813 TFLOP/s"
	src["half_attention_flops"] = "measured: grouped-query attention forward + backward on cuDNN, bf16, B4 H32 KV8 T2048 d64 causal, 315 TFLOP/s (bench/attention-gqa)"
	src["bandwidth"] = "measured: the swiglu kernel, 138 MB in 43.5 µs (HBM3e nominal 4.8 TB/s)"
	p.Sources = src
	return p
}

// Profiles are the built-in profiles by name.
func Profiles() map[string]Profile {
	return map[string]Profile{"default": DefaultProfile(), "h100": H100Profile(), "h200": H200Profile()}
}

// nodeCost is a node's work at chunk size b: flops(b) = F0 + F1·b,
// bytes(b) = B0 + B1·b, at the rate of its kind. A fused loss
// (linear_cross_entropy) runs rows(b) = R0 + R1·b token rows in chunks of
// LossChunk rows, each chunk's kernels launched anew (LossChunkLaunches).
type nodeCost struct {
	F0, F1, B0, B1 float64
	kind           rateKind
	R0, R1         float64 // a fused loss's token rows
	lossChunk      int     // its tokens per logits chunk; 0: not a fused loss
	chunkLaunches  int     // launches per logits chunk
}

// LossChunkLaunches are the kernels exec/cuda's fused loss launches per
// chunk of tokens: the logits GEMM, the rows' loss and softmax kernel and
// the loss's sum, then with the gradients the hidden states' and the
// weight's GEMMs.
const (
	LossChunkLaunches      = 3
	LossChunkGradsLaunches = 5
)

// Nominal host figures price an offloaded optimizer where a profile has
// no measured one: pinned copies over PCIe 4 x16 (about 25 GB/s), and the
// host AdamW on 16 cores at the 45 M parameters/s a core that
// optim's BenchmarkStepOffload measures (91 M/s on two cores).
const (
	NominalHostBandwidth  = 25e9
	NominalHostUpdateRate = 7e8
)

// rateKind says which of a profile's rates prices a node (Profile).
type rateKind uint8

const (
	rateUpload rateKind = iota // an input's bytes from the host, at HostBandwidth
	rateVector
	rateGEMM
	rateHalfGEMM
	rateHalfUnalignedGEMM
	rateHalfConv
	rateAttention
	rateHalfAttention
)

// kindOf is nd's rate kind.
func kindOf(g *graph.Graph, nd *graph.Node) rateKind {
	if graph.IsLinearCrossEntropy(nd.Op) { // its GEMMs over rows of LossChunkPitch, 16-byte aligned
		if graph.LossChunkDType(&nd.Attrs).IsHalf() {
			return rateHalfGEMM
		}
		return rateGEMM
	}
	switch nd.Op {
	case graph.OpMatMul, graph.OpMatMulGeluGrad, graph.OpLinear, graph.OpConv2d, graph.OpConv2dGradInput, graph.OpConv2dGradWeight:
		if !g.Node(nd.Inputs[0]).Type.DType.IsHalf() {
			return rateGEMM
		}
		if nd.Op != graph.OpMatMul && nd.Op != graph.OpMatMulGeluGrad && nd.Op != graph.OpLinear {
			return rateHalfConv
		}
		// A row of 16 bytes or a multiple: the last axis of every operand
		// and of the result, in elements of 2 bytes.
		rows := [][]int{nd.Type.Shape}
		for _, in := range nd.Inputs {
			rows = append(rows, g.Node(in).Type.Shape)
		}
		for _, s := range rows {
			if len(s) > 0 && s[len(s)-1]%8 != 0 {
				return rateHalfUnalignedGEMM
			}
		}
		return rateHalfGEMM
	case graph.OpAttention, graph.OpAttentionLSE, graph.OpAttentionGradQ, graph.OpAttentionGradKV:
		q := nd.Inputs[0] // attention, attention_lse: q, k[, v][, mask]
		masked := len(nd.Inputs) > 3 || nd.Op == graph.OpAttentionLSE && len(nd.Inputs) > 2
		if nd.Op == graph.OpAttentionGradQ || nd.Op == graph.OpAttentionGradKV { // g, q, k, v, o, lse[, mask]
			q, masked = nd.Inputs[1], len(nd.Inputs) > 6
		}
		t := g.Node(q).Type
		return attentionRate(t.DType, t.Shape[len(t.Shape)-1], masked)
	case graph.OpAttentionQKV, graph.OpAttentionQKVLSE, graph.OpAttentionQKVGrad:
		t := g.Node(nd.Inputs[0]).Type // attention_qkv, attention_qkv_lse: qkv
		if nd.Op == graph.OpAttentionQKVGrad {
			t = g.Node(nd.Inputs[1]).Type
		}
		d := 0
		if s, err := graph.QKVDims(nd.Op, nd.Attrs, t); err == nil {
			d = s.D
		}
		return attentionRate(t.DType, d, false)
	}
	return rateVector
}

// attentionRate is the rate of fused attention of dtype dt at head dim d:
// cuBLAS for float32, tensor cores (or cuDNN) for 16-bit d 64 or 128
// without a mask, the plain kernels otherwise.
func attentionRate(dt graph.DType, d int, masked bool) rateKind {
	if dt == graph.Float32 { // cuBLAS over blocks of queries (exec/cuda's attention32.go)
		return rateGEMM
	}
	if dt.IsHalf() && (d == 64 || d == 128) && !masked {
		return rateHalfAttention
	}
	return rateAttention
}

// rate is the flop/s of kind under p (tf32: float32 GEMMs on TF32 tensor
// cores), with Profile's fallbacks.
func (p Profile) rate(kind rateKind, tf32 bool) float64 {
	or := func(v, fallback float64) float64 {
		if v > 0 {
			return v
		}
		return fallback
	}
	gemm := p.MatMulFLOPS
	if tf32 && p.TF32FLOPS > 0 {
		gemm = p.TF32FLOPS
	}
	half := or(p.HalfFLOPS, or(p.TF32FLOPS, p.MatMulFLOPS))
	attention := or(p.AttentionFLOPS, p.VectorFLOPS)
	switch kind {
	case rateGEMM:
		return gemm
	case rateHalfGEMM:
		return half
	case rateHalfUnalignedGEMM:
		return or(p.HalfUnalignedFLOPS, half)
	case rateHalfConv:
		return or(p.HalfConvFLOPS, half)
	case rateAttention:
		return attention
	case rateHalfAttention:
		return or(p.HalfAttentionFLOPS, attention)
	}
	return p.VectorFLOPS
}

// UpdateTensors is how many parameters one launch of the optimizer's update
// takes: exec/cuda's sgd_multi_f32 and adam_multi_f32 update a list of up
// to 64 parameters each (OPTIM_TENSORS in exec/cuda/kernels/optim.cu).
const UpdateTensors = 64

// UpdateLaunches is the launches of the optimizer's update over trained
// parameters: one per UpdateTensors.
func UpdateLaunches(trained int) int { return (trained + UpdateTensors - 1) / UpdateTensors }

// Cost prices a program's step.
type Cost struct {
	prof    Profile
	tf32    bool
	nodes   []nodeCost
	launch  int     // kernels per chunk
	perStep float64 // optimizer update, seconds per step
	accum   float64 // gradient accumulation, seconds per chunk after the first
	FLOPs   float64 // flops of one whole-batch chunk, for reports
	// Offload is the seconds per step of an offloaded optimizer (the
	// program compiled with planner.CompileOptions.Offload), in perStep:
	// OffloadSeconds. 0 otherwise.
	Offload float64
}

// NewCost prices p's nodes under prof. slots is the optimizer's state
// tensors per parameter (its update reads and writes them).
func NewCost(p *planner.Program, prof Profile, tf32 bool) *Cost {
	c := &Cost{prof: prof, tf32: tf32}
	g := p.Graph
	nodes := g.Nodes()
	// A companion computed in its producer's pass (Program.Companion) costs
	// nothing of its own when it falls out of that pass (attention_lse,
	// batch_norm_grad_w, layer_norm_grad_w and a layer norm's or a batch
	// norm's bias gradient); attention_grad_kv's products are done whoever does them
	// (cuDNN's backward call, or its own kernels), so it is priced.
	companion := make([]bool, len(nodes))
	for id := range nodes {
		for m := range p.Companions(id) {
			if nodes[m].Op != graph.OpAttentionGradKV {
				companion[m] = true
			}
		}
	}
	for id := range nodes {
		nd := &nodes[id]
		if nd.Op == graph.OpInput && p.Info.LastUse[id] >= 0 { // uploaded every chunk
			_, b0 := work(g, nd, 0)
			_, b1 := work(g, nd, 1)
			c.nodes = append(c.nodes, nodeCost{B0: b0, B1: b1 - b0, kind: rateUpload})
			continue
		}
		if p.Info.LastUse[id] < 0 || nd.Op.Category() == graph.CatSource || nd.Op == graph.OpReshape || companion[id] {
			continue
		}
		nc := priced(g, nd)
		c.nodes = append(c.nodes, nc)
		c.launch++
		c.FLOPs += nc.F0 + nc.F1*float64(p.Batch)
	}
	var state, kept float64
	for _, bi := range p.Persistent {
		if b := p.Buffers[bi]; b.Kind == planner.BufState {
			state += float64(b.Fixed)
		}
	}
	for _, id := range p.Kept {
		kept += float64(nodes[id].Type.Bytes())
	}
	// The update reads gradients, parameters and state and writes
	// parameters and state; accumulation reads and writes the sums.
	c.perStep = (3*kept+2*state)/prof.Bandwidth + float64(UpdateLaunches(len(p.Trained)))*prof.Launch
	if p.Offloaded {
		var params int64
		for _, id := range p.Trained {
			params += int64(nodes[id].Type.Numel())
		}
		c.Offload = prof.OffloadSeconds(params)
		c.perStep = c.Offload
	}
	c.accum = 3*kept/prof.Bandwidth + float64(len(p.Kept))*prof.Launch
	return c
}

// OffloadSeconds is the host's share of an offloaded optimizer step over
// params parameters, as exec.OffloadHost runs it: the bfloat16 gradients
// copied down (2 bytes each), then the float32 update on every core with
// each parameter's new bfloat16 weights copied back as soon as it is done,
// so the update and the upload overlap and the slower of the two counts.
func (p Profile) OffloadSeconds(params int64) float64 {
	bw, rate := p.HostBandwidth, p.HostUpdateRate
	if bw <= 0 {
		bw = NominalHostBandwidth
	}
	if rate <= 0 {
		rate = NominalHostUpdateRate
	}
	n := float64(params)
	return 2*n/bw + max(n/rate, 2*n/bw)
}

// priced is node nd's cost.
func priced(g *graph.Graph, nd *graph.Node) nodeCost {
	f0, b0 := work(g, nd, 0)
	f1, b1 := work(g, nd, 1)
	nc := nodeCost{F0: f0, F1: f1 - f0, B0: b0, B1: b1 - b0, kind: kindOf(g, nd)}
	if nd.Op == graph.OpLinearCrossEntropy && len(nd.Inputs) >= 3 {
		h := g.Node(nd.Inputs[0]).Type
		if c := h.Shape[len(h.Shape)-1]; c > 0 {
			r0, r1 := float64(graph.Numel(h.AtBatch(0))/c), float64(graph.Numel(h.AtBatch(1))/c)
			nc.R0, nc.R1, nc.lossChunk = r0, r1-r0, max(nd.Attrs.LossChunk, 1)
			nc.chunkLaunches = LossChunkLaunches
			if lceHasGrads(g, nd.ID) {
				nc.chunkLaunches = LossChunkGradsLaunches
			}
		}
	}
	return nc
}

// Plus returns c with the given nodes of g added to every chunk (the
// copies a recompute set makes).
func (c *Cost) Plus(g *graph.Graph, ids []int) *Cost {
	d := *c
	d.nodes = append(slices.Clip(c.nodes), make([]nodeCost, 0, len(ids))...)
	batch := float64(g.Batch())
	for _, id := range ids {
		nd := g.Node(id)
		if nd.Op.Category() == graph.CatSource || nd.Op == graph.OpReshape {
			continue
		}
		nc := priced(g, nd)
		d.nodes = append(d.nodes, nc)
		d.launch++
		d.FLOPs += nc.F0 + nc.F1*batch
	}
	return &d
}

// Chunk is the predicted seconds of one chunk of b samples.
func (c *Cost) Chunk(b int) float64 {
	x := float64(b)
	var t float64
	for _, n := range c.nodes {
		if n.kind == rateUpload {
			if c.prof.HostBandwidth > 0 {
				t += (n.B0 + n.B1*x) / c.prof.HostBandwidth
			}
			continue
		}
		t += max((n.F0+n.F1*x)/c.prof.rate(n.kind, c.tf32), (n.B0+n.B1*x)/c.prof.Bandwidth)
		if n.lossChunk > 0 { // the launches of every logits chunk after the first
			chunks := math.Ceil((n.R0 + n.R1*x) / float64(n.lossChunk))
			t += max(chunks-1, 0) * float64(n.chunkLaunches) * c.prof.Launch
		}
	}
	return t + float64(c.launch)*c.prof.Launch
}

// Step is the predicted seconds of a step run in split's chunks.
func (c *Cost) Step(s planner.Split) float64 {
	t := c.perStep
	for _, r := range s.Runs() {
		t += float64(r.Count) * c.Chunk(r.Size)
	}
	if s.K > 1 {
		t += float64(s.K) * c.accum
	}
	return t
}

// work is a node's flops and bytes (inputs read, output written) at chunk
// size b.
func work(g *graph.Graph, nd *graph.Node, b int) (flops, bytes float64) {
	size := func(t graph.Type) float64 { return float64(graph.Numel(t.AtBatch(b)) * t.DType.Size()) }
	numel := func(t graph.Type) float64 { return float64(graph.Numel(t.AtBatch(b))) }
	out := nd.Type
	bytes = size(out)
	in := make([]graph.Type, len(nd.Inputs))
	for i, id := range nd.Inputs {
		in[i] = g.Node(id).Type
		bytes += size(in[i])
	}
	switch nd.Op {
	case graph.OpMatMul, graph.OpMatMulGeluGrad:
		a := in[0].Shape
		ka := len(a) - 1
		if nd.Attrs.TransA && len(a) >= 2 {
			ka--
		}
		k := a[ka]
		if in[0].BatchAxis == ka { // the contraction runs over the chunk
			k = b * in[0].PerSample
		}
		flops = 2 * numel(out) * float64(k)
	case graph.OpLinear:
		x := in[0].Shape
		flops = 2 * numel(out) * float64(x[len(x)-1])
	case graph.OpLinearCrossEntropy, graph.OpLinearCrossEntropyGradH, graph.OpLinearCrossEntropyGradW:
		// Products of 2·N·V·C flops: the logits; with the gradients (a
		// pass that gives both, as the forward one does when paired)
		// dh and dW too. Counted on the node that runs them: the loss
		// with 3, a gradient with none when its producer computes it.
		k := 0
		if nd.Op != graph.OpLinearCrossEntropy {
			k = 1
		}
		h, w := in[k], in[k+1]
		products := 1.0
		switch {
		case graph.LinearCrossEntropyGradProducer(g, nd.ID) >= 0:
			products = 0
		case nd.Op == graph.OpLinearCrossEntropy && lceHasGrads(g, nd.ID):
			products = 3
		case nd.Op != graph.OpLinearCrossEntropy:
			products = 3
		}
		flops = products * 2 * numel(h) * float64(w.Shape[0])
		bytes = size(h) + size(w)
	case graph.OpConv2d, graph.OpConv2dGradInput:
		w := in[1]
		flops = 2 * numel(out) * float64(graph.Numel(w.Shape)) / float64(max(w.Shape[0], 1))
		if nd.Op == graph.OpConv2dGradInput { // per input element: O·kh·kw/g
			flops = 2 * numel(in[0]) * float64(graph.Numel(w.Shape)) / float64(max(w.Shape[0], 1))
		}
	case graph.OpConv2dGradWeight:
		flops = 2 * numel(in[0]) * float64(graph.Numel(out.Shape)) / float64(max(out.Shape[0], 1))
	case graph.OpAttention, graph.OpAttentionLSE, graph.OpAttentionGradQ, graph.OpAttentionGradKV:
		// Fused attention: 2·T·S·d flops per product of a [T, d] and a
		// [d, S] tile per query head: q·kᵀ and p·v forward; q·kᵀ for the
		// log-sum-exp; q·kᵀ, g·vᵀ and dS·k for dq; q·kᵀ, g·vᵀ, dSᵀ·q and
		// pᵀ·g for dk|dv. Causal attention does half. Priced at the
		// attention rates (Profile).
		q, k := in[0], in[1]
		if nd.Op == graph.OpAttentionGradQ || nd.Op == graph.OpAttentionGradKV {
			q, k = in[1], in[2]
		}
		products := map[graph.Op]float64{graph.OpAttention: 2, graph.OpAttentionLSE: 1,
			graph.OpAttentionGradQ: 3, graph.OpAttentionGradKV: 4}[nd.Op]
		qs := q.AtBatch(b)
		flops = products * 2 * float64(graph.Numel(qs)) * float64(k.Shape[2])
		if nd.Attrs.Causal {
			flops /= 2
		}
		if q.DType == graph.Float32 && len(qs) == 4 {
			// float32 runs on cuBLAS over blocks of queries: the float32
			// scores of every (query, key) pair pass through memory,
			// written by a GEMM, read and rewritten by the row kernel, read
			// by the next GEMM: 4 passes for attention (s, p), 2 for
			// attention_lse, 6 for dq (s, dp, ds), 8 for dk|dv (s, dp, p,
			// ds). Halved under causal, as the flops.
			passes := map[graph.Op]float64{graph.OpAttention: 4, graph.OpAttentionLSE: 2,
				graph.OpAttentionGradQ: 6, graph.OpAttentionGradKV: 8}[nd.Op]
			scores := float64(graph.Numel(qs[:3])) * float64(k.Shape[2])
			if nd.Attrs.Causal {
				scores /= 2
			}
			bytes += passes * 4 * scores
		}
	case graph.OpAttentionQKV, graph.OpAttentionQKVLSE, graph.OpAttentionQKVGrad:
		// As attention's (above) on q [B, H, T, d] of B·T·H·d elements: 2
		// products forward, 1 for the log-sum-exp, 7 for d qkv (dq's 3
		// and dk|dv's 4); the float32 fallback's score passes likewise
		// (4, 2, 14).
		qkv := in[0]
		if nd.Op == graph.OpAttentionQKVGrad {
			qkv = in[1]
		}
		s, err := graph.QKVDims(nd.Op, nd.Attrs, graph.Type{Shape: qkv.AtBatch(b), DType: qkv.DType, BatchAxis: -1})
		if err != nil {
			break
		}
		products := map[graph.Op]float64{graph.OpAttentionQKV: 2, graph.OpAttentionQKVLSE: 1, graph.OpAttentionQKVGrad: 7}[nd.Op]
		elems := float64(s.B) * float64(s.T) * float64(s.C()) // q's
		flops = products * 2 * elems * float64(s.T)
		if nd.Attrs.Causal {
			flops /= 2
		}
		if qkv.DType == graph.Float32 {
			passes := map[graph.Op]float64{graph.OpAttentionQKV: 4, graph.OpAttentionQKVLSE: 2, graph.OpAttentionQKVGrad: 14}[nd.Op]
			scores := float64(s.B*s.H*s.T) * float64(s.T)
			if nd.Attrs.Causal {
				scores /= 2
			}
			bytes += passes * 4 * scores
		}
	case graph.OpLayerNorm, graph.OpSoftmax, graph.OpLogSoftmax, graph.OpLayerNormGradX, graph.OpLayerNormGradXAdd, graph.OpLayerNormGradW,
		graph.OpRMSNorm, graph.OpRMSNormGradX, graph.OpRMSNormGradXAdd, graph.OpRMSNormGradW, graph.OpRotary, graph.OpRotaryGrad,
		graph.OpSwiGLU, graph.OpSwiGLUGrad,
		graph.OpSoftmaxGrad, graph.OpLogSoftmaxGrad, graph.OpCrossEntropy, graph.OpCrossEntropyGrad, graph.OpGelu, graph.OpGeluGrad:
		flops = 8 * max(numel(out), numel(in[0]))
	default:
		m := numel(out)
		for _, t := range in {
			m = max(m, numel(t))
		}
		flops = m
	}
	return flops, bytes
}

// lceHasGrads reports whether linear_cross_entropy node id computes its
// gradients in its pass (graph.LinearCrossEntropyGradProducer pairs one
// with it).
func lceHasGrads(g *graph.Graph, id int) bool {
	for m := id + 1; m < g.Len(); m++ {
		if graph.IsLinearCrossEntropy(g.Node(m).Op) && graph.LinearCrossEntropyGradProducer(g, m) == id {
			return true
		}
	}
	return false
}
