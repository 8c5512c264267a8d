package models

import (
	"math"
	"sync"

	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/lazy"
	"github.com/batchfit/batchfit/nn"
)

// Llama is a Llama-family decoder (Hugging Face's LlamaForCausalLM):
// token embeddings, Layers decoder layers of
//
//	h = x + o_proj(attention(rotary(q_proj(n)), rotary(k_proj(n)), v_proj(n))), n = input_layernorm(x)
//	y = h + down_proj(silu(gate_proj(m))·up_proj(m)),                             m = post_attention_layernorm(h)
//
// (RMS norms, causal grouped-query attention with rotary position
// embeddings, a SwiGLU feed-forward block), a final RMS norm and the
// output head (lm_head, or the embedding when tied). Forward maps int64
// tokens [B, T] to logits [B, T, Vocab].
//
// Parameters carry Hugging Face's names ("model.embed_tokens.weight",
// "model.layers.0.self_attn.q_proj.weight", "model.norm.weight",
// "lm_head.weight", absent when tied), linear weights [out, in] as there.
//
// How it runs: q_proj, k_proj and v_proj are one GEMM of their weights
// concatenated each step, whose packed output [B, T, (H + 2·Hkv)·d] is
// rotated in place (lazy.Tensor.RotaryHeads: q's and k's heads, v's
// copied) and read by attention straight from that layout
// (lazy.Tensor.AttentionQKV with KVHeads): no q, k or v copies, and the
// backward pass gives d qkv in one piece for one GEMM back. The residual
// adds compute the RMS norm that follows them in the same pass
// (graph.AddRMSNormProducer), gate and up stay two GEMMs (see
// graph.OpSwiGLU), and the rotary angles are a float32 table [T, d] made
// once per sequence length from the config's rope settings
// (RopeConfig.Table), a constant the planner counts.
type Llama struct {
	nn.Children
	cfg   LlamaConfig
	embed *nn.Embedding
	rope  *ropeTables
	err   error
}

// NewLlama builds a Llama with Hugging Face's initialisation
// (LlamaPreTrainedModel._init_weights): every linear weight and the
// embedding from N(0, 0.02²) (initializer_range), biases zero, RMS norm
// weights one. A bad config is the model's construction error (Err), a
// graph.ErrAttr.
func NewLlama(opt nn.Options, cfg LlamaConfig) *Llama {
	m := &Llama{cfg: cfg, rope: &ropeTables{cfg: cfg.Rope, dim: cfg.HeadDimOrDefault(), byLen: map[int]*lazy.Tensor{}, zeros: &zeroConsts{}}}
	if m.err = cfg.Check(); m.err != nil {
		return m
	}
	const std = 0.02
	m.embed = &nn.Embedding{Weight: opt.Normal("weight", []int{cfg.Vocab, cfg.Hidden}, 0, std)}
	layers := make([]nn.Module, cfg.Layers)
	for i := range layers {
		layers[i] = newDecoderLayer(opt, cfg, m.rope)
	}
	model := &llamaModel{Children: nn.NewChildren(
		nn.Child{Name: "embed_tokens", Module: m.embed},
		nn.Child{Name: "layers", Module: nn.NewSequential(layers...)},
		nn.Child{Name: "norm", Module: rmsNorm(opt, cfg.Hidden, cfg)},
	)}
	children := []nn.Child{{Name: "model", Module: model}}
	if !cfg.TieEmbeddings {
		children = append(children, nn.Child{Name: "lm_head", Module: &nn.Linear{Weight: opt.Normal("weight", []int{cfg.Vocab, cfg.Hidden}, 0, std)}})
	}
	m.Children = nn.NewChildren(children...)
	return m
}

// Config is the model's configuration.
func (m *Llama) Config() LlamaConfig { return m.cfg }

// Err reports a construction error.
func (m *Llama) Err() error {
	if m.err != nil {
		return m.err
	}
	return m.Children.Err()
}

// Params lists the parameters in Hugging Face's order: the embedding, each
// layer's, the final norm's, then lm_head's when untied.
func (m *Llama) Params() []*nn.Param {
	if m.err != nil {
		return nil
	}
	return m.Children.Params()
}

// Forward maps tokens [B, T] (int64, T ≥ 1) to logits [B, T, Vocab] in
// float32 (16 bits under a mixed precision policy, as its output GEMM's).
// T may exceed MaxPositions: the angles extend as Hugging Face's do.
func (m *Llama) Forward(tokens *lazy.Tensor) *lazy.Tensor {
	if err := firstErr(tokens); err != nil {
		return lazy.ErrorTensor("models.Llama", err)
	}
	if err := m.Err(); err != nil {
		return lazy.ErrorTensor("models.Llama", err, tokens.Shape())
	}
	if g := tokens.Graph(); g != nil { // the caller's site, found once for every op
		g.EnterInternal()
		defer g.LeaveInternal()
	}
	s := tokens.Shape()
	if len(s) != 2 || s[1] < 1 || tokens.DType() != graph.Int64 {
		return lazy.ErrorTensor("models.Llama", graph.Errorf(graph.ErrShape,
			"Llama needs int64 tokens [B, T] with T ≥ 1, got %s%v", tokens.DType(), s), s)
	}
	cs, err := m.rope.table(s[1])
	if err != nil {
		return lazy.ErrorTensor("models.Llama", err, s)
	}
	m.rope.cur = cs
	if m.cfg.WrittenOut {
		if m.rope.cos, m.rope.sin, err = m.rope.written(s[1]); err != nil {
			return lazy.ErrorTensor("models.Llama", err, s)
		}
	}
	x := m.Call("model", tokens)
	if m.cfg.TieEmbeddings {
		return x.Linear(m.embed.Weight.As(x), nil)
	}
	return m.Call("lm_head", x)
}

// CausalLMLoss is Hugging Face's causal language-model loss
// (LlamaForCausalLM's labels=): the logits at position t of [B, T, V]
// score the label at t + 1 of labels [B, T] (the last position scores
// nothing), labels equal to graph.IgnoreLabel (−100) take no part, and
// the loss is the mean over the labels that do (0 when none does, as
// transformers' sum over nothing is).
//
// The shift is done on the labels, on the host, as transformers 5 does
// (ShiftLabels: labels[:, 1:] padded with −100), so the logits are read
// whole by one cross_entropy through a reshape and never copied (a slice
// of them would copy [B, T−1, V]: 4 GiB at Llama 3's vocabulary, B = 4,
// T = 2048 in bfloat16); the shifted labels enter the logits' graph as a
// new input. The mean is the cross-entropy's sum times a float32 constant
// 1/count, so the graph, its signature and its plan stay the same
// whatever the labels hold. labels without data (a placeholder, for a dry
// run) are taken as shifted already, with nothing ignored. An error
// either input already holds is returned as it is, logits' first.
func CausalLMLoss(logits, labels *lazy.Tensor) *lazy.Tensor {
	if err := firstErr(logits, labels); err != nil {
		return lazy.ErrorTensor("models.CausalLMLoss", err)
	}
	s, ls := logits.Shape(), labels.Shape()
	if len(s) != 3 || len(ls) != 2 || s[0] != ls[0] || s[1] != ls[1] || labels.DType() != graph.Int64 {
		return lazy.ErrorTensor("models.CausalLMLoss", graph.Errorf(graph.ErrShape,
			"causal LM loss needs logits [B, T, V] and int64 labels [B, T], got %v and %s%v", s, labels.DType(), ls), s, ls)
	}
	if g := logits.Graph(); g != nil {
		g.EnterInternal()
		defer g.LeaveInternal()
	}
	next, count := labels, s[0]*(s[1]-1)
	if v := labels.Value(); v != nil {
		shifted, n, err := ShiftLabels(v)
		if err != nil {
			return lazy.ErrorTensor("models.CausalLMLoss", err, ls)
		}
		next, count = lazy.Const(shifted), n
		if ax := labels.BatchAxis(); ax >= 0 {
			next = logits.Graph().Wrap(shifted, ax)
		}
	}
	return ShiftedCausalLMLoss(logits, next, count)
}

// ShiftedCausalLMLoss is CausalLMLoss of labels already shifted
// (ShiftLabels), count of them not graph.IgnoreLabel: the sum of the
// cross-entropy of logits [B, T, V] against shifted [B, T] times the
// float32 constant 1/count (0 when count is 0). It is what CausalLMLoss
// builds, for a training loop that shifts its labels itself (and a
// program compiled once and fed new labels: the constant is part of the
// graph, so count must stay what it was, B·(T − 1) with nothing ignored).
func ShiftedCausalLMLoss(logits, shifted *lazy.Tensor, count int) *lazy.Tensor {
	if err := firstErr(logits, shifted); err != nil {
		return lazy.ErrorTensor("models.ShiftedCausalLMLoss", err)
	}
	s, ls := logits.Shape(), shifted.Shape()
	if len(s) != 3 || len(ls) != 2 || s[0] != ls[0] || s[1] != ls[1] || count < 0 {
		return lazy.ErrorTensor("models.ShiftedCausalLMLoss", graph.Errorf(graph.ErrShape,
			"causal LM loss needs logits [B, T, V], labels [B, T] and a count ≥ 0, got %v, %v and %d", s, ls, count), s, ls)
	}
	if g := logits.Graph(); g != nil {
		g.EnterInternal()
		defer g.LeaveInternal()
	}
	inv := float32(0)
	if count > 0 {
		inv = 1 / float32(count)
	}
	sum := logits.Reshape(-1, s[2]).CrossEntropy(shifted.Reshape(-1), graph.ReduceSum)
	return sum.Mul(lazy.Const(tensor.New(tensor.FromScalar(inv))))
}

// ShiftLabels is labels [B, T] (int64) shifted one position left, the
// last position of each row graph.IgnoreLabel: the label each position's
// logits predict, as transformers 5's ForCausalLMLoss pads and shifts
// them. count is how many of the result are not IgnoreLabel.
func ShiftLabels(labels tensor.Tensor) (shifted *tensor.Dense, count int, err error) {
	d, ok := labels.Data().([]int64)
	s := labels.Shape()
	if !ok || len(s) != 2 {
		return nil, 0, graph.Errorf(graph.ErrShape, "causal LM labels must be int64 [B, T], got %v %v", labels.Dtype(), s)
	}
	b, t := s[0], s[1]
	if t < 1 || len(d) != b*t {
		return nil, 0, graph.Errorf(graph.ErrShape, "causal LM labels %v: want at least one position and %d values, got %d", s, b*t, len(d))
	}
	out := make([]int64, b*t)
	for r := range b {
		row, dst := d[r*t:(r+1)*t], out[r*t:(r+1)*t]
		copy(dst, row[1:])
		dst[t-1] = graph.IgnoreLabel
	}
	for _, y := range out {
		if y != graph.IgnoreLabel {
			count++
		}
	}
	return tensor.New(tensor.WithShape(b, t), tensor.WithBacking(out)), count, nil
}

// ropeTables makes and keeps the model's cos/sin tables, one per sequence
// length: the same tensor every step, so a Session keeps it resident.
// cur is the table of the Forward in progress, for the layers.
type ropeTables struct {
	cfg   RopeConfig
	dim   int
	mu    sync.Mutex
	byLen map[int]*lazy.Tensor
	cur   *lazy.Tensor
	// zeros are the LoRA block matrices' zero constants (packedDelta).
	zeros *zeroConsts
	// The written-out model's tables, [T, 1, dim]: cos and sin of each
	// frequency twice over, as Hugging Face's rotary embedding makes them.
	wByLen   map[int][2]*lazy.Tensor
	cos, sin *lazy.Tensor
}

// written is the cos and sin tables of t positions for the written-out
// model, made from table's once per length.
func (r *ropeTables) written(t int) (cos, sin *lazy.Tensor, err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if c, ok := r.wByLen[t]; ok {
		return c[0], c[1], nil
	}
	tab, err := r.cfg.Table(r.dim, t)
	if err != nil {
		return nil, nil, err
	}
	d, h := r.dim, r.dim/2
	src := tab.Data().([]float32)
	cd, sd := make([]float32, t*d), make([]float32, t*d)
	for p := range t {
		for i := range h {
			c, s := src[p*d+i], src[p*d+h+i]
			cd[p*d+i], cd[p*d+h+i] = c, c
			sd[p*d+i], sd[p*d+h+i] = s, s
		}
	}
	cos = lazy.Const(tensor.New(tensor.WithShape(t, 1, d), tensor.WithBacking(cd)))
	sin = lazy.Const(tensor.New(tensor.WithShape(t, 1, d), tensor.WithBacking(sd)))
	if r.wByLen == nil {
		r.wByLen = map[int][2]*lazy.Tensor{}
	}
	r.wByLen[t] = [2]*lazy.Tensor{cos, sin}
	return cos, sin, nil
}

func (r *ropeTables) table(t int) (*lazy.Tensor, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if c, ok := r.byLen[t]; ok {
		return c, nil
	}
	tab, err := r.cfg.Table(r.dim, t)
	if err != nil {
		return nil, err
	}
	c := lazy.Const(tab)
	r.byLen[t] = c
	return c, nil
}

// llamaModel is Hugging Face's LlamaModel: embed_tokens, layers, norm.
type llamaModel struct{ nn.Children }

func (l *llamaModel) Forward(tokens *lazy.Tensor) *lazy.Tensor {
	return l.Call("norm", l.Call("layers", l.Call("embed_tokens", tokens)))
}

// decoderLayer is LlamaDecoderLayer: pre-norm attention and MLP, each
// added to the residual stream.
type decoderLayer struct{ nn.Children }

func newDecoderLayer(opt nn.Options, cfg LlamaConfig, rope *ropeTables) *decoderLayer {
	h, f, d, kv := cfg.Hidden, cfg.Intermediate, cfg.HeadDimOrDefault(), cfg.KVHeadsOrDefault()
	attn := &llamaAttention{heads: cfg.Heads, kvHeads: kv, headDim: d, rope: rope, zeros: rope.zeros, written: cfg.WrittenOut, Children: nn.NewChildren(
		nn.Child{Name: "q_proj", Module: hfLinear(opt, h, cfg.Heads*d, cfg.QKVBias)},
		nn.Child{Name: "k_proj", Module: hfLinear(opt, h, kv*d, cfg.QKVBias)},
		nn.Child{Name: "v_proj", Module: hfLinear(opt, h, kv*d, cfg.QKVBias)},
		nn.Child{Name: "o_proj", Module: hfLinear(opt, cfg.Heads*d, h, cfg.OutBias)},
	)}
	mlp := &llamaMLP{written: cfg.WrittenOut, Children: nn.NewChildren(
		nn.Child{Name: "gate_proj", Module: hfLinear(opt, h, f, cfg.MLPBias)},
		nn.Child{Name: "up_proj", Module: hfLinear(opt, h, f, cfg.MLPBias)},
		nn.Child{Name: "down_proj", Module: hfLinear(opt, f, h, cfg.MLPBias)},
	)}
	return &decoderLayer{nn.NewChildren(
		nn.Child{Name: "self_attn", Module: attn},
		nn.Child{Name: "mlp", Module: mlp},
		nn.Child{Name: "input_layernorm", Module: rmsNorm(opt, h, cfg)},
		nn.Child{Name: "post_attention_layernorm", Module: rmsNorm(opt, h, cfg)},
	)}
}

// rmsNorm is the model's RMS norm: nn.RMSNorm, or written out.
func rmsNorm(opt nn.Options, h int, cfg LlamaConfig) nn.Module {
	n := nn.NewRMSNorm(opt, h, cfg.RMSNormEps)
	if cfg.WrittenOut {
		return writtenRMSNorm{n}
	}
	return n
}

// writtenRMSNorm is an RMS norm as a user writes it:
// x·(mean(x²) + ε)^−½·w.
type writtenRMSNorm struct{ *nn.RMSNorm }

func (n writtenRMSNorm) Forward(x *lazy.Tensor) *lazy.Tensor {
	r := x.Mul(x).MeanKeepDim(-1).AddScalar(n.Eps).PowScalar(-0.5)
	return x.Mul(r).Mul(n.Weight.Tensor())
}

func (l *decoderLayer) Forward(x *lazy.Tensor) *lazy.Tensor {
	h := x.Add(l.Call("self_attn", l.Call("input_layernorm", x)))
	return h.Add(l.Call("mlp", l.Call("post_attention_layernorm", h)))
}

// hfLinear is a Linear layer [out, in] with N(0, 0.02²) weights and, when
// bias, a zero bias.
func hfLinear(opt nn.Options, in, out int, bias bool) *nn.Linear {
	l := &nn.Linear{Weight: opt.Normal("weight", []int{out, in}, 0, 0.02)}
	if bias {
		l.Bias = opt.Full("bias", []int{out}, 0)
	}
	return l
}

// llamaAttention is LlamaAttention: causal grouped-query attention with
// rotary embeddings on q and k, its projections as Hugging Face names
// them.
type llamaAttention struct {
	nn.Children
	heads, kvHeads, headDim int
	rope                    *ropeTables
	zeros                   *zeroConsts
	written                 bool
}

// rotateWritten is Hugging Face's apply_rotary_pos_emb of x [B, T, H, d]
// written out: x·cos + rotate_half(x)·sin, rotate_half(x) = [−x₂, x₁].
func (a *llamaAttention) rotateWritten(x *lazy.Tensor) *lazy.Tensor {
	h := a.headDim / 2
	rot := lazy.Concat(-1, x.Slice(-1, h, a.headDim).Neg(), x.Slice(-1, 0, h))
	return x.Mul(a.rope.cos).Add(rot.Mul(a.rope.sin))
}

// Forward: q, k and v from one GEMM of the three weights side by side,
// q's and k's heads rotated in the packed result, attention reading it in
// place, o_proj.
func (a *llamaAttention) Forward(x *lazy.Tensor) *lazy.Tensor {
	if err := firstErr(x); err != nil {
		return lazy.ErrorTensor("llama attention", err)
	}
	s := x.Shape()
	if len(s) != 3 {
		return lazy.ErrorTensor("llama attention", graph.Errorf(graph.ErrShape, "attention needs [B, T, hidden], got %v", s), s)
	}
	if a.rope.cur == nil || a.rope.cur.Shape()[0] != s[1] {
		return lazy.ErrorTensor("llama attention", graph.Errorf(graph.ErrAttr,
			"attention of %d positions without their rotary table: run it inside models.Llama.Forward", s[1]), s)
	}
	if a.written {
		t := s[1]
		heads := func(name string, n int) *lazy.Tensor { return a.Call(name, x).Reshape(-1, t, n, a.headDim) }
		q := a.rotateWritten(heads("q_proj", a.heads)).Permute(0, 2, 1, 3)
		k := a.rotateWritten(heads("k_proj", a.kvHeads)).Permute(0, 2, 1, 3)
		v := heads("v_proj", a.kvHeads).Permute(0, 2, 1, 3)
		o := q.Attention(k, v, lazy.AttentionOptions{Causal: true, KVHeads: a.kvHeads, Scale: 1 / math.Sqrt(float64(a.headDim))})
		return a.Call("o_proj", o.Permute(0, 2, 1, 3).Reshape(-1, t, a.heads*a.headDim))
	}
	var lins [3]*nn.Linear
	var adapters [3]*nn.LoRALinear
	for i, name := range [3]string{"q_proj", "k_proj", "v_proj"} {
		switch l := a.Get(name).(type) {
		case *nn.Linear:
			lins[i] = l
		case *nn.LoRALinear:
			lins[i], adapters[i] = l.Base, l
		default:
			return lazy.ErrorTensor("llama attention", graph.Errorf(graph.ErrAttr,
				"attention's %s is a %T: it must be an nn.Linear or an nn.LoRALinear", name, l), s)
		}
	}
	q, k, v := lins[0], lins[1], lins[2]
	w := packed(x, q.Weight, k.Weight, v.Weight)
	var b *lazy.Tensor
	if q.Bias != nil {
		b = packed(x, q.Bias, k.Bias, v.Bias)
	}
	proj := x.Linear(w, b)
	if adapters != [3]*nn.LoRALinear{} {
		proj = proj.Add(a.packedDelta(x, lins, adapters))
	}
	t, n := s[1], a.heads+2*a.kvHeads
	qkv := proj.Reshape(-1, t, n, a.headDim).RotaryHeads(a.rope.cur, a.heads+a.kvHeads).Reshape(-1, t, n*a.headDim)
	o := qkv.AttentionQKV(a.heads, lazy.AttentionOptions{Causal: true, KVHeads: a.kvHeads, Scale: 1 / math.Sqrt(float64(a.headDim))})
	return a.Call("o_proj", o)
}

// llamaMLP is LlamaMLP: down_proj(silu(gate_proj(x))·up_proj(x)).
type llamaMLP struct {
	nn.Children
	written bool
}

func (m *llamaMLP) Forward(x *lazy.Tensor) *lazy.Tensor {
	if m.written {
		return m.Call("down_proj", m.Call("gate_proj", x).Silu().Mul(m.Call("up_proj", x)))
	}
	return m.Call("down_proj", m.Call("gate_proj", x).SwiGLU(m.Call("up_proj", x)))
}

// packed is the three parameters side by side along their first axis, as
// x's linear reads them: concatenated as stored, then widened once to x's
// dtype when they are 16-bit frozen ones (nn.FreezeAs) of one dtype (the
// widening a mixed precision policy drops, so its product reads the
// 16-bit concatenation itself), each widened first when their dtypes
// differ.
func packed(x *lazy.Tensor, ps ...*nn.Param) *lazy.Tensor {
	ts := make([]*lazy.Tensor, len(ps))
	same := true
	for i, p := range ps {
		ts[i] = p.Tensor()
		same = same && ts[i].DType() == ts[0].DType()
	}
	if !same {
		for i, p := range ps {
			ts[i] = p.As(x)
		}
		return lazy.Concat(0, ts...)
	}
	c := lazy.Concat(0, ts...)
	if dt := x.DType(); ps[0].Frozen() && c.DType().IsHalf() && dt.IsFloat() && dt != c.DType() {
		c = c.Cast(dt)
	}
	return c
}

// packedDelta is the adapters' updates of the packed projection
// [B, T, (H + 2·Hkv)·d], exactly as each adapted projection adds its own
// (nn.LoRALinear.Delta) and the others add nothing: the adapters' down
// products u = [u_q, u_k, u_v] side by side, [B, T, R] (R the sum of their
// ranks; one product of A_q, A_k and A_v concatenated when no adapter
// drops its input), times a block matrix whose rows for projection i hold
// B_i in i's columns and zeros elsewhere (the zero blocks are constants
// shared by every layer). Two thin products whatever the adapted subset,
// and the unadapted projections' product stays the one packed GEMM.
func (a *llamaAttention) packedDelta(x *lazy.Tensor, lins [3]*nn.Linear, ls [3]*nn.LoRALinear) *lazy.Tensor {
	var (
		as    []*lazy.Tensor
		downs []*lazy.Tensor
		ranks [3]int
		plain = true // no dropout and one scale: one product of the A's
		scale = 0.0
		total = 0
	)
	for i, l := range ls {
		if l == nil {
			continue
		}
		ranks[i] = l.Rank
		total += l.Rank
		if scale == 0 {
			scale = l.Scale()
		}
		plain = plain && (l.Dropout == nil || l.Dropout.P == 0 || !l.Dropout.Training) && l.Scale() == scale
		as = append(as, l.A.As(x))
	}
	var u *lazy.Tensor
	if plain {
		u = x.Linear(lazy.Concat(0, as...), nil)
		if scale != 1 {
			u = u.MulScalar(scale)
		}
	} else {
		for _, l := range ls {
			if l != nil {
				downs = append(downs, l.Down(x))
			}
		}
		u = lazy.Concat(len(x.Shape())-1, downs...)
	}
	rows := make([]*lazy.Tensor, 0, 3)
	off := 0
	for i, l := range ls {
		out := lins[i].Weight.Shape()[0]
		if l == nil {
			rows = append(rows, a.zeros.of(out, total))
			continue
		}
		var parts []*lazy.Tensor
		if off > 0 {
			parts = append(parts, a.zeros.of(out, off))
		}
		parts = append(parts, l.B.As(x))
		if rest := total - off - ranks[i]; rest > 0 {
			parts = append(parts, a.zeros.of(out, rest))
		}
		off += ranks[i]
		if len(parts) == 1 {
			rows = append(rows, parts[0])
		} else {
			rows = append(rows, lazy.Concat(1, parts...))
		}
	}
	return u.Linear(lazy.Concat(0, rows...), nil)
}

// zeroConsts keeps float32 zero constants by shape, shared by a model's
// layers: the same tensor every step, so a Session keeps it resident.
type zeroConsts struct {
	mu sync.Mutex
	by map[[2]int]*lazy.Tensor
}

func (z *zeroConsts) of(rows, cols int) *lazy.Tensor {
	z.mu.Lock()
	defer z.mu.Unlock()
	k := [2]int{rows, cols}
	if c, ok := z.by[k]; ok {
		return c
	}
	if z.by == nil {
		z.by = map[[2]int]*lazy.Tensor{}
	}
	c := lazy.Const(tensor.New(tensor.WithShape(rows, cols), tensor.WithBacking(make([]float32, rows*cols))))
	z.by[k] = c
	return c
}
