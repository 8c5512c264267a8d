package cuda

import (
	"cmp"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"slices"
	"sync"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/planner"
)

// The timed algorithm search (cudnnFindConvolution*AlgorithmEx) and what
// the planner is told of its choice.
//
// When: at compile time. The executor's Workspace (Executor.Workspace)
// declares a convolution node's workspace; the first time it meets a
// convolution shape it times cuDNN's algorithms for it (or reads the
// timings from the disk cache, algocache.go, or from this process's
// earlier searches), chooses one, and declares that algorithm's exact
// workspace, so the plan holds exactly what the chosen algorithm uses and
// the step runs it from the planned block: predicted = measured, to the
// byte, as with every other workspace. No search ever runs during a step.
//
// Memory: the search's tensors (x, w, y at the searched batch) and the
// workspace it offers come from an allocator of its own over the device
// (never from cuDNN, never from the executor's allocator, whose cache and
// peaks stay as they were), and go back to the driver before Workspace
// returns. Together they are at most maxSearchBytes (1 GiB), less when the
// device has less free (less DriverReserve) or the executor's allocator is
// capped (alloc.Allocator.SetLimit: the searches stay within the cap's
// headroom); a shape whose whole batch would need more is searched at the
// largest batch that fits, and its choice declared for the whole batch
// from cuDNN's workspace queries. A convolution too large for cuDNN's
// descriptors, which runs in slices along N (convsplit.go), is searched
// at most at the slice's batch. What the searches leave behind outside
// every allocator (cuDNN's kernels, loaded as it tries them) is measured
// around each (cuMemGetInfo) and counted in DNN.Overhead, so Reserve
// leaves it free.
//
// Candidates: cuDNN's algorithms, and for NCHW convolutions batchfit's own
// im2col + cuBLAS path (im2colAlgo), timed on the same tensors (the median
// of three runs after one to warm up), so that a shape where cuDNN's
// deterministic algorithms are slow runs on the kernels instead, as the
// issue asks of every conv-net op: cuDNN's or ours, whichever measures
// faster.
//
// Choice: among the timed results that succeeded, are deterministic, need
// no more workspace than the search offered (the heuristics path's
// formula, convDNNBytes and the im2col workspace), and whose math the
// policy allows (plain float32: FMA only, no FFT; never float32 rounded to
// 16 bits), the fastest, except that among those within algoTie of the
// fastest the one needing the least workspace leads (timings that close
// are noise; workspace is memory). Ties go to the lower algorithm id. The
// choice is a function of the timings, so a cached entry gives the same
// choice on every run.
//
// Declaration: the chosen algorithm's workspace is asked of cuDNN at every
// chunk size the planner can give the graph's batch (chunkSizes: ⌊N/k⌋
// and ⌊N/k⌋+1, about 4√N sizes), and declared affine in the chunk size b
// as the planner requires: exactly its workspace at the whole batch, and
// at least its workspace at every other of those sizes (affineCover); at
// a size that runs in slices, its workspace is the largest of the slices'
// two shapes (sliceWorkspace). An
// algorithm cuDNN refuses at any of them is passed over for the next in
// the ranking, so every chunk a plan can hold runs the chosen algorithm
// from its block. A chunk of another size (a RunBatch of fewer samples)
// runs the first ranked algorithm that fits its block, else the
// heuristics within it.
//
// Scope: by default the search takes plain float32 convolutions (FMA
// math), where it measured ResNet-50's step at 82.5 against 110.2 ms and
// the ConvNet's at 1.79 against 2.63 on the H100. 16-bit and TF32
// convolutions keep the heuristics unless ExecutorOptions.ConvSearchAll
// (or BATCHFIT_CUDNN_FIND=all): searched, ResNet-50 bf16-mixed
// channels-last measured 38.0 against the heuristics' 31.7 ms, not yet
// understood. ExecutorOptions.ConvHeuristics, or BATCHFIT_CUDNN_FIND=0,
// turns the search off: the static workspace formula and the _v7
// heuristics, as before the search existed.

// im2colAlgo is the result id of batchfit's im2col + cuBLAS path among a
// search's results (cuDNN's algorithms count from 0).
const im2colAlgo = -1

// im2colRuns is how many timed runs of the im2col path a search takes the
// median of, after one to warm up.
const im2colRuns = 3

// im2colVersion names the im2col path's kernels in a search's key
// (algoKey.Im2col): the SHA-256 of conv.cu as NVRTC compiles it, and a
// number to bump when conv.go's launches change, so a change to either
// times the shapes again.
var im2colVersion = sync.OnceValue(func() string {
	src, err := Source("conv.cu")
	if err != nil {
		return ""
	}
	h := sha256.Sum256([]byte(src))
	return "conv.go/1,conv.cu/" + hex.EncodeToString(h[:8])
})

// maxSearchBytes bounds one search's device memory: its tensors and the
// workspace it offers.
const maxSearchBytes = 1 << 30

// algoTie is how close to the fastest a timed algorithm must be for its
// smaller workspace to win.
const algoTie = 0.02

// findEnv is the environment variable that overrides
// ExecutorOptions.ConvHeuristics and ConvSearchAll: 0 for the heuristics
// everywhere, 1 for the search of plain float32 convolutions, all for the
// search of every convolution.
const findEnv = "BATCHFIT_CUDNN_FIND"

// findScope is which convolutions the timed search takes.
type findScope int8

const (
	findNone findScope = iota // the heuristics everywhere
	findFP32                  // plain float32 (FMA math) convolutions
	findAll                   // every convolution cuDNN takes
)

// findScopeOf is the search's scope o asks for, under findEnv.
func findScopeOf(o ExecutorOptions) findScope {
	switch os.Getenv(findEnv) {
	case "0":
		return findNone
	case "1":
		return findFP32
	case "all":
		return findAll
	}
	switch {
	case o.ConvHeuristics:
		return findNone
	case o.ConvSearchAll:
		return findAll
	}
	return findFP32
}

// rankAlgos orders the timed results a plan may run, best first (see the
// package notes above): succeeded, deterministic, within limit bytes of
// workspace, with a math type the policy allows (strict: plain float32).
func rankAlgos(pass convPass, dt graph.DType, strict bool, limit int64, rs []algoResult) []algoResult {
	var ok []algoResult
	for _, r := range rs {
		switch {
		case r.Status != 0, !r.Deterministic, r.TimeMS < 0, r.Memory > limit:
			continue
		case dt == graph.Float32 && r.Math == cudnnTensorOpAllowConversion:
			continue // float32 rounded to 16 bits: never
		case strict && (r.Math == cudnnTensorOpMath || fftAlgo(pass, r.Algo)):
			continue
		}
		ok = append(ok, r)
	}
	slices.SortStableFunc(ok, func(a, b algoResult) int {
		return cmp.Or(cmp.Compare(a.TimeMS, b.TimeMS), cmp.Compare(a.Memory, b.Memory),
			cmp.Compare(a.Algo, b.Algo), cmp.Compare(a.Math, b.Math))
	})
	if len(ok) > 1 {
		lead := 0
		for i := 1; i < len(ok) && ok[i].TimeMS <= ok[0].TimeMS*(1+algoTie); i++ {
			if ok[i].Memory < ok[lead].Memory {
				lead = i
			}
		}
		r := ok[lead]
		copy(ok[1:lead+1], ok[:lead])
		ok[0] = r
	}
	return ok
}

// chunkSizes lists every chunk size the planner can give n samples
// (planner.Split: ⌊n/k⌋ and ⌊n/k⌋+1 for k = 1…n), ascending, n last.
func chunkSizes(n int) []int {
	var out []int
	for k := 1; k <= n; {
		q := n / k
		out = append(out, q)
		if q < n {
			out = append(out, q+1)
		}
		k = n/q + 1 // the next k with another quotient
	}
	slices.Sort(out)
	return slices.Compact(out)
}

// wsPoint is a workspace of w bytes at a chunk of b samples.
type wsPoint struct{ b, w int64 }

// affineCover declares the workspaces pts (ascending in b, the whole
// batch last) as fixed + per·b: exactly the last point's at the whole
// batch, at least each other point's, never negative, and as low as that
// allows at smaller chunks (the steepest such line through the last
// point). A workspace larger at a smaller chunk than at the whole batch is
// declared flat at the largest, and so is a single point (a node whose
// shapes do not change with the chunk).
func affineCover(pts []wsPoint) (fixed, per int64) {
	switch len(pts) {
	case 0:
		return 0, 0
	case 1:
		return pts[0].w, 0
	}
	last := pts[len(pts)-1]
	n, wn := last.b, last.w
	most := wn
	for _, p := range pts {
		most = max(most, p.w)
	}
	if most > wn || n <= 0 {
		return most, 0
	}
	per = wn / n // fixed = wn − per·n ≥ 0
	for _, p := range pts[:len(pts)-1] {
		if p.b < n {
			per = min(per, (wn-p.w)/(n-p.b)) // wn − per·(n − b) ≥ w
		}
	}
	return wn - per*n, per
}

// choiceKey names a choice: the convolution at the graph's whole batch,
// and its batch axis's length at one sample (n1), which fixes how the
// declared workspace scales.
type choiceKey struct {
	key convKey // budget 0
	n1  int64
}

// convChoice is what the search chose for a convolution: the ranked
// algorithms from the chosen one on, and the declared workspace fixed +
// per·b for b samples.
type convChoice struct {
	ranked     []algoResult
	fixed, per int64
	source     string // "search", "disk" or "process": where the timings came from
	searchN    int64  // the batch axis's length the timings were taken at
	fastestAny algoResult
}

// ConvChoice describes one timed choice, for reports: the convolution,
// the chosen algorithm, its time (at the searched batch), its declared
// workspace at the whole batch, and the fastest result of any kind
// (non-deterministic and FFT included), for comparison.
type ConvChoice struct {
	Conv             string
	Source           string
	SearchBatch      int64
	Algo             int32
	Math             int32
	TimeMS           float64
	Workspace        int64
	FastestAlgo      int32
	FastestTimeMS    float64
	FastestAllowed   bool
	DeclaredFixed    int64
	DeclaredPerBatch int64
}

// SearchStats counts the timed searches' outcomes: shapes timed on the
// device, read from the disk cache or from this process's earlier
// searches, and shapes left to the heuristics, by reason.
type SearchStats struct {
	Searched, FromDisk, FromProcess int
	Heuristics                      map[string]int
	// CacheErrors counts disk entries that could not be used
	// (ErrAlgoCache) and were searched again.
	CacheErrors int
	// MaxBytes is the most device memory one search took (tensors and
	// workspace).
	MaxBytes int64
}

// processFinds holds this process's search results by algoKey text, so a
// second executor does not time a shape again.
var processFinds sync.Map // string → []algoResult

// findState is DNN's part for the search, under its own mutex: the
// choices by key, and the stats. It never holds that mutex across a
// device call.
type findState struct {
	mu      sync.Mutex
	choices map[choiceKey]*convChoice // nil: left to the heuristics
	stats   SearchStats
	info    []ConvChoice
}

// SearchStats is the searches' counts so far.
func (n *DNN) SearchStats() SearchStats {
	n.find.mu.Lock()
	defer n.find.mu.Unlock()
	s := n.find.stats
	s.Heuristics = make(map[string]int, len(n.find.stats.Heuristics))
	for k, v := range n.find.stats.Heuristics {
		s.Heuristics[k] = v
	}
	return s
}

// Choices lists the timed choices made so far, in the order they were made.
func (n *DNN) Choices() []ConvChoice {
	n.find.mu.Lock()
	defer n.find.mu.Unlock()
	return slices.Clone(n.find.info)
}

// convNodeKey is the key of convolution node nd at b samples, false for a
// node that is no convolution cuDNN could take (its kernel reports any
// error at the launch).
func convNodeKey(g *graph.Graph, nd *graph.Node, b int) (convKey, bool) {
	var pass convPass
	var x, y, w []int
	switch nd.Op {
	case graph.OpConv2d:
		pass, x, w, y = convForward, inputAt(g, nd, 0, b), inputAt(g, nd, 1, b), nd.Type.AtBatch(b)
	case graph.OpConv2dGradInput:
		pass, y, w, x = convGradInput, inputAt(g, nd, 0, b), inputAt(g, nd, 1, b), nd.Type.AtBatch(b)
	case graph.OpConv2dGradWeight:
		pass, y, x, w = convGradWeight, inputAt(g, nd, 0, b), inputAt(g, nd, 1, b), nd.Type.AtBatch(b)
	default:
		return convKey{}, false
	}
	dt := nd.Type.DType
	if _, ok := cudnnDType(dt); !ok || len(x) != 4 || len(y) != 4 || len(w) != 4 {
		return convKey{}, false
	}
	a := &nd.Attrs
	geo, err := newConvGeom(nd.Op.String(), a, nchwShape(a, x), nchwShape(a, y), nchwShape(a, w))
	if err != nil || geo.N < 1 {
		return convKey{}, false
	}
	return newConvKey(pass, dt, geo, 0, a.ChannelsLast), true
}

// choiceKeyOf is the choice key of convolution node nd of g, whose key
// at some chunk size is key: the key at the graph's whole batch (the
// length of its first input's leading axis, convImages) and that axis's
// length at one sample. The compile-time search and the launches both
// name a choice by it.
func choiceKeyOf(g *graph.Graph, nd *graph.Node, key convKey) (choiceKey, bool) {
	if len(nd.Inputs) == 0 {
		return choiceKey{}, false
	}
	one := g.Node(nd.Inputs[0]).Type.AtBatch(1)
	if len(one) == 0 {
		return choiceKey{}, false
	}
	full := convImages(g, nd)
	key.budget = 0
	key.x[0], key.y[0] = full, full
	return choiceKey{key: key, n1: int64(one[0])}, true
}

// strict reports whether dt runs as plain float32 (FMA math, no TF32).
func (n *DNN) strict(dt graph.DType) bool { return dt == graph.Float32 && !n.tf32 }

// mathOf is the math type set on dt's descriptors: FMA for plain float32,
// tensor ops (TF32 for float32) otherwise.
func (n *DNN) mathOf(dt graph.DType) int32 {
	if n.strict(dt) {
		return cudnnFMAMath
	}
	return cudnnTensorOpMath
}

// choiceFor returns the timed choice for convolution node nd of g, making
// it on first use (searching, or reading the timings from a cache); nil
// leaves the node to the static workspace and the heuristics. static is
// the heuristics path's workspace rule; capBytes bounds the search's
// device memory.
func (n *DNN) choiceFor(g *graph.Graph, nd *graph.Node, static func(*graph.Graph, *graph.Node, int) int64, capBytes int64) *convChoice {
	if n.lib.find == nil {
		return nil
	}
	whole := max(g.Batch(), 1)
	keyN, ok := convNodeKey(g, nd, whole)
	if !ok {
		return nil
	}
	key1, _ := convNodeKey(g, nd, 1)
	ck, ok := choiceKeyOf(g, nd, keyN)
	if !ok {
		return nil
	}
	n.find.mu.Lock()
	ch, seen := n.find.choices[ck]
	n.find.mu.Unlock()
	if seen {
		return ch
	}
	ch, why, info := n.makeChoice(g, nd, whole, keyN, key1, static, capBytes)
	n.find.mu.Lock()
	defer n.find.mu.Unlock()
	if prev, seen := n.find.choices[ck]; seen { // another goroutine chose first
		return prev
	}
	if n.find.choices == nil {
		n.find.choices = map[choiceKey]*convChoice{}
	}
	n.find.choices[ck] = ch
	if ch == nil {
		if n.find.stats.Heuristics == nil {
			n.find.stats.Heuristics = map[string]int{}
		}
		n.find.stats.Heuristics[why]++
	} else {
		n.find.info = append(n.find.info, info)
	}
	return ch
}

// choiceAt is the choice made for convolution node nd of g, whose key at
// the chunk's size is key; nil when there is none.
func (n *DNN) choiceAt(g *graph.Graph, nd *graph.Node, key convKey) *convChoice {
	if g == nil || nd == nil {
		return nil
	}
	ck, ok := choiceKeyOf(g, nd, key)
	if !ok {
		return nil
	}
	n.find.mu.Lock()
	defer n.find.mu.Unlock()
	return n.find.choices[ck]
}

// makeChoice searches (or reads) the timings of nd's convolution and
// chooses; nil and the reason when the node is left to the heuristics.
func (n *DNN) makeChoice(g *graph.Graph, nd *graph.Node, whole int, keyN, key1 convKey,
	static func(*graph.Graph, *graph.Node, int) int64, capBytes int64) (*convChoice, string, ConvChoice) {
	size := elemSize(keyN.dt)
	tensors := func(k convKey) int64 {
		return size * (k.x[0]*k.x[1]*k.x[2]*k.x[3] + k.w[0]*k.w[1]*k.w[2]*k.w[3] + k.y[0]*k.y[1]*k.y[2]*k.y[3])
	}
	need := func(b int) int64 { // affine in b
		k, _ := convNodeKey(g, nd, b)
		return tensors(k) + static(g, nd, b)
	}
	var free int64
	if err := n.d.do(func() error {
		f, _, err := n.d.Backend().MemInfo()
		free = f
		return err
	}); err != nil {
		return nil, "device memory unknown", ConvChoice{}
	}
	capBytes = min(capBytes, maxSearchBytes, free-DriverReserve)
	// The largest batch whose search fits the cap: need is affine in b.
	b := whole
	if need(b) > capBytes {
		n1, slope := need(1), need(2)-need(1)
		if n1 > capBytes || slope <= 0 {
			return nil, "too large to search", ConvChoice{}
		}
		b = int(min(int64(whole), 1+(capBytes-n1)/slope))
	}
	// A convolution too large for cuDNN's descriptors runs in slices
	// (convsplit.go): its search times at most the slice's shape, which
	// is what runs.
	if s := convSlice(keyN); s < keyN.x[0] {
		if s == 0 {
			return nil, "too large for cuDNN's descriptors", ConvChoice{}
		}
		if keyN.x[0] != key1.x[0] { // batched: key1.x[0] images a sample
			b = min(b, int(s/key1.x[0]))
		}
		if k, _ := convNodeKey(g, nd, b); b < 1 || convSlice(k) < k.x[0] {
			return nil, "too large for cuDNN's descriptors", ConvChoice{}
		}
	}
	keyF, _ := convNodeKey(g, nd, b)
	limitF, limitN := static(g, nd, b), static(g, nd, whole)
	ak := algoKey{Pass: keyF.pass, DType: keyF.dt, X: keyF.x, W: keyF.w, Y: keyF.y, Pad: keyF.pad, Stride: keyF.stride,
		Dil: keyF.dil, Groups: keyF.groups, NHWC: keyF.nhwc, Math: n.mathOf(keyF.dt), Limit: limitF,
		Device: n.d.Name(), Arch: n.d.Arch(), CUDNN: n.lib.version}
	var im2col func(x, w, y, ws alloc.Ptr, wsBytes int64) (algoResult, bool, error)
	if !keyF.nhwc && n.ks != nil && n.blas != nil && im2colVersion() != "" {
		ak.Im2col = im2colVersion()
		im2col = func(x, w, y, ws alloc.Ptr, wsBytes int64) (algoResult, bool, error) {
			return n.timeIm2col(g, nd, b, keyF, x, w, y, ws, wsBytes)
		}
	}
	rs, source, searched, err := n.timings(ak, keyF, im2col)
	if err != nil {
		return nil, "search failed: " + errorClass(err), ConvChoice{}
	}
	ranked := rankAlgos(keyF.pass, keyF.dt, n.strict(keyF.dt), ak.Limit, rs)
	sizes := []int{whole}
	if keyN.x[0] != key1.x[0] { // batched: every chunk size a plan can hold
		sizes = chunkSizes(whole)
	}
	keys := make([]convKey, len(sizes))
	for i, b := range sizes {
		keys[i], _ = convNodeKey(g, nd, b)
	}
	var ch *convChoice
	err = n.d.do(func() error {
		for i, r := range ranked {
			if r.Algo == im2colAlgo { // its workspace is this graph's, the same at every chunk size
				ws := im2colBytes(g, nd)
				if ws > limitN {
					continue
				}
				ranked = slices.Clone(ranked)
				ranked[i].Memory = ws
				ch = &convChoice{ranked: ranked[i:], source: source, searchN: keyF.x[0], fixed: ws}
				return nil
			}
			pts := make([]wsPoint, 0, len(sizes))
			memo := map[convKey]int64{}
			for j, b := range sizes {
				w, err := n.sliceWorkspace(keys[j], r, memo)
				if err != nil { // refused at some chunk size: the next
					break
				}
				pts = append(pts, wsPoint{int64(b), w})
			}
			if len(pts) < len(sizes) || pts[len(pts)-1].w > limitN {
				continue
			}
			ch = &convChoice{ranked: ranked[i:], source: source, searchN: keyF.x[0]}
			ch.fixed, ch.per = affineCover(pts)
			return nil
		}
		return nil
	})
	if err != nil {
		return nil, "workspace query failed: " + errorClass(err), ConvChoice{}
	}
	if ch == nil {
		return nil, "no timed algorithm within the workspace", ConvChoice{}
	}
	var fastest algoResult
	fastest.TimeMS = -1
	for _, r := range rs {
		if r.Status == 0 && r.TimeMS >= 0 && (fastest.TimeMS < 0 || r.TimeMS < fastest.TimeMS) {
			fastest = r
		}
	}
	ch.fastestAny = fastest
	n.find.mu.Lock()
	switch source {
	case "disk":
		n.find.stats.FromDisk++
	case "process":
		n.find.stats.FromProcess++
	default:
		n.find.stats.Searched++
		n.find.stats.MaxBytes = max(n.find.stats.MaxBytes, searched)
	}
	n.find.mu.Unlock()
	c := ch.ranked[0]
	info := ConvChoice{Conv: fmt.Sprintf("%s %s x%v w%v y%v pad%v stride%v dil%v groups %d nhwc %t", keyN.pass, keyN.dt,
		keyN.x, keyN.w, keyN.y, keyN.pad, keyN.stride, keyN.dil, keyN.groups, keyN.nhwc),
		Source: source, SearchBatch: ch.searchN, Algo: c.Algo, Math: c.Math, TimeMS: c.TimeMS,
		Workspace: ch.fixed + ch.per*int64(whole), FastestAlgo: fastest.Algo, FastestTimeMS: fastest.TimeMS,
		FastestAllowed: fastest == c, DeclaredFixed: ch.fixed, DeclaredPerBatch: ch.per}
	return ch, "", info
}

// errorClass is a short, stable name for why a search failed, for the
// stats' reasons.
func errorClass(err error) string {
	var ce *CUDNNError
	switch {
	case errors.Is(err, alloc.ErrOutOfMemory), errors.Is(err, alloc.ErrDeviceOOM):
		return "out of memory"
	case errors.As(err, &ce):
		return ce.Name
	case errors.Is(err, ErrClosed):
		return "closed"
	}
	return "error"
}

// timings returns the results of ak's search: from this process's earlier
// searches, from the disk cache, or timed now on the device (then stored in
// both). searched is the device memory a search took (0 without one).
func (n *DNN) timings(ak algoKey, key convKey, im2col func(x, w, y, ws alloc.Ptr, wsBytes int64) (algoResult, bool, error)) (rs []algoResult, source string, searched int64, err error) {
	text := ak.String()
	if v, ok := processFinds.Load(text); ok {
		return v.([]algoResult), "process", 0, nil
	}
	dir := n.d.algoCacheDir()
	if dir != "" {
		rs, err := readAlgoEntry(dir, ak)
		switch {
		case err == nil:
			processFinds.Store(text, rs)
			return rs, "disk", 0, nil
		case errors.Is(err, ErrAlgoCache):
			n.find.mu.Lock()
			n.find.stats.CacheErrors++
			n.find.mu.Unlock()
		}
	}
	var offered int64
	err = n.d.do(func() error {
		var err error
		rs, offered, searched, err = n.search(key, ak.Limit, im2col)
		return err
	})
	if err != nil {
		return nil, "", 0, err
	}
	if offered < ak.Limit { // a smaller workspace than the key names: keep it out of the caches
		ak.Limit = offered
		rs = slices.DeleteFunc(slices.Clone(rs), func(r algoResult) bool { return r.Memory > offered })
		return rs, "search", searched, nil
	}
	processFinds.Store(text, rs)
	if dir != "" {
		_ = writeAlgoEntry(dir, ak, rs) // best effort: an unwritable cache costs a search next time
	}
	return rs, "search", searched, nil
}

// newConvDescs makes the descriptors of key, with the policy's math type
// set; on failure it destroys what it made and returns a nil plan. A shape
// cuDNN's descriptors cannot take fails with a *CUDNNError (9.14:
// NOT_SUPPORTED from cudnnSetTensor4dDescriptor): the convolutions split
// theirs first (convSlice).
func (n *DNN) newConvDescs(key convKey) (*convPlan, error) {
	l := n.lib
	dt, ok := cudnnDType(key.dt)
	if !ok {
		return nil, graph.Errorf(graph.ErrDType, "cudnn convolution of %s", key.dt)
	}
	p := &convPlan{}
	// fail destroys p itself, not a named result that a return may have
	// set to nil first.
	fail := func(err error) (*convPlan, error) { return nil, errors.Join(err, n.destroy(p)) }
	if err := l.check("cudnnCreateTensorDescriptor", l.cudnnCreateTensorDescriptor(&p.xd)); err != nil {
		return fail(err)
	}
	if err := l.check("cudnnCreateTensorDescriptor", l.cudnnCreateTensorDescriptor(&p.yd)); err != nil {
		return fail(err)
	}
	if err := l.check("cudnnCreateFilterDescriptor", l.cudnnCreateFilterDescriptor(&p.wd)); err != nil {
		return fail(err)
	}
	if err := l.check("cudnnCreateConvolutionDescriptor", l.cudnnCreateConvolutionDescriptor(&p.cd)); err != nil {
		return fail(err)
	}
	x, w, y := key.x, key.w, key.y
	format := int32(cudnnNCHW)
	if key.nhwc {
		format = cudnnNHWC // the sizes stay n, c, h, w (k, c, r, s for the filter)
	}
	if err := l.check("cudnnSetTensor4dDescriptor", l.cudnnSetTensor4dDescriptor(p.xd, format, dt,
		int32(x[0]), int32(x[1]), int32(x[2]), int32(x[3]))); err != nil {
		return fail(err)
	}
	if err := l.check("cudnnSetTensor4dDescriptor", l.cudnnSetTensor4dDescriptor(p.yd, format, dt,
		int32(y[0]), int32(y[1]), int32(y[2]), int32(y[3]))); err != nil {
		return fail(err)
	}
	if err := l.check("cudnnSetFilter4dDescriptor", l.cudnnSetFilter4dDescriptor(p.wd, dt, format,
		int32(w[0]), int32(w[1]), int32(w[2]), int32(w[3]))); err != nil {
		return fail(err)
	}
	if err := l.check("cudnnSetConvolution2dDescriptor", l.cudnnSetConvolution2dDescriptor(p.cd,
		int32(key.pad[0]), int32(key.pad[1]), int32(key.stride[0]), int32(key.stride[1]),
		int32(key.dil[0]), int32(key.dil[1]), cudnnCrossCorrelation, cudnnDataFloat)); err != nil {
		return fail(err)
	}
	if err := l.check("cudnnSetConvolutionGroupCount", l.cudnnSetConvolutionGroupCount(p.cd, int32(key.groups))); err != nil {
		return fail(err)
	}
	if err := n.setMath(p, n.mathOf(key.dt)); err != nil {
		return fail(err)
	}
	return p, nil
}

func (n *DNN) setMath(p *convPlan, math int32) error {
	return n.lib.check("cudnnSetConvolutionMathType", n.lib.cudnnSetConvolutionMathType(p.cd, math))
}

// workspaceSize asks cuDNN for algo's workspace on p's descriptors.
func (n *DNN) workspaceSize(p *convPlan, pass convPass, algo int32) (int64, error) {
	f := n.lib.find
	var ws uintptr
	var fn string
	var s cudnnStatus
	switch pass {
	case convForward:
		fn, s = "cudnnGetConvolutionForwardWorkspaceSize", f.cudnnGetConvolutionForwardWorkspaceSize(n.h, p.xd, p.wd, p.cd, p.yd, algo, &ws)
	case convGradInput:
		fn, s = "cudnnGetConvolutionBackwardDataWorkspaceSize", f.cudnnGetConvolutionBackwardDataWorkspaceSize(n.h, p.wd, p.yd, p.cd, p.xd, algo, &ws)
	default:
		fn, s = "cudnnGetConvolutionBackwardFilterWorkspaceSize", f.cudnnGetConvolutionBackwardFilterWorkspaceSize(n.h, p.xd, p.yd, p.cd, p.wd, algo, &ws)
	}
	if err := n.lib.check(fn, s); err != nil {
		return 0, err
	}
	return int64(ws), nil
}

// queryWorkspace is r's workspace on key's shapes (r's math type set where
// the policy lets the plan pick it). On the device thread.
func (n *DNN) queryWorkspace(key convKey, r algoResult) (ws int64, err error) {
	if n.gone.Load() {
		return 0, fmt.Errorf("%w: cudnn handle", ErrClosed)
	}
	p, err := n.newConvDescs(key)
	if err != nil {
		return 0, err
	}
	defer func() { err = errors.Join(err, n.destroy(p)) }()
	if !n.strict(key.dt) {
		if err := n.setMath(p, r.Math); err != nil {
			return 0, err
		}
	}
	return n.workspaceSize(p, key.pass, r.Algo)
}

// sliceWorkspace is r's workspace for a convolution of key, which runs in
// slices when its tensors are too large for cuDNN's descriptors
// (convsplit.go): the largest over its slices' shapes, each queried once
// (memo holds r's answers by shape). On the device thread.
func (n *DNN) sliceWorkspace(key convKey, r algoResult, memo map[convKey]int64) (int64, error) {
	s := convSlice(key)
	if s == 0 {
		return 0, errTooLarge(key)
	}
	var most int64
	for _, m := range sliceSizes(key.x[0], s) {
		k := sliceKey(key, m)
		w, ok := memo[k]
		if !ok {
			var err error
			if w, err = n.queryWorkspace(k, r); err != nil {
				return 0, err
			}
			memo[k] = w
		}
		most = max(most, w)
	}
	return most, nil
}

// search times every algorithm of key's pass on the device: tensors of
// key's shapes (zeros) and a workspace of up to limit bytes (halved while
// the device refuses it), all from an allocator of its own that gives
// everything back to the driver before search returns. It returns the
// results, the workspace it offered and the device memory it took, and
// adds what the device lost across it (cuDNN's loaded kernels) to the
// overhead. On the device thread.
func (n *DNN) search(key convKey, limit int64, im2col func(x, w, y, ws alloc.Ptr, wsBytes int64) (algoResult, bool, error)) (rs []algoResult, offered, took int64, err error) {
	if n.gone.Load() {
		return nil, 0, 0, fmt.Errorf("%w: cudnn handle", ErrClosed)
	}
	p, err := n.newConvDescs(key)
	if err != nil {
		return nil, 0, 0, err
	}
	defer func() { err = errors.Join(err, n.destroy(p)) }()
	be := n.d.Backend()
	free0, _, err := be.MemInfo()
	if err != nil {
		return nil, 0, 0, err
	}
	a := alloc.New(be, alloc.Options{})
	var blocks []*alloc.Block
	defer func() {
		for _, b := range blocks {
			err = errors.Join(err, a.Free(b))
		}
		err = errors.Join(err, a.EmptyCache())
		if free1, _, merr := be.MemInfo(); merr == nil {
			n.overhead.Add(max(0, free0-free1))
		}
	}()
	size := elemSize(key.dt)
	tensor := func(s [4]int64) (alloc.Ptr, error) {
		bytes := size * s[0] * s[1] * s[2] * s[3]
		b, err := a.Malloc(bytes, alloc.Tag{Node: -1, Op: "cudnn_find"})
		if err != nil {
			return 0, err
		}
		blocks = append(blocks, b)
		took += b.Size()
		return b.Ptr(), n.d.Memzero(b.Ptr(), bytes)
	}
	x, err := tensor(key.x)
	if err != nil {
		return nil, 0, 0, err
	}
	w, err := tensor(key.w)
	if err != nil {
		return nil, 0, 0, err
	}
	y, err := tensor(key.y)
	if err != nil {
		return nil, 0, 0, err
	}
	var ws alloc.Ptr
	for offered = limit; offered > 0; offered /= 2 {
		b, err := a.Malloc(offered, alloc.Tag{Node: -1, Op: "cudnn_find.workspace"})
		if err == nil {
			blocks = append(blocks, b)
			took += b.Size()
			ws = b.Ptr()
			break
		}
		if !errors.Is(err, alloc.ErrOutOfMemory) {
			return nil, 0, 0, err
		}
		if offered < 1<<20 {
			offered = 0
			break
		}
	}
	var perf [maxAlgoResults]cudnnAlgoPerf
	var got int32
	f, l := n.lib.find, n.lib
	px, pw, py, pws := CUdeviceptr(x), CUdeviceptr(w), CUdeviceptr(y), CUdeviceptr(ws)
	var fn string
	var s cudnnStatus
	switch key.pass {
	case convForward:
		fn, s = "cudnnFindConvolutionForwardAlgorithmEx", f.cudnnFindConvolutionForwardAlgorithmEx(n.h, p.xd, px, p.wd, pw, p.cd,
			p.yd, py, int32(len(perf)), &got, &perf[0], pws, uintptr(offered))
	case convGradInput:
		fn, s = "cudnnFindConvolutionBackwardDataAlgorithmEx", f.cudnnFindConvolutionBackwardDataAlgorithmEx(n.h, p.wd, pw, p.yd, py,
			p.cd, p.xd, px, int32(len(perf)), &got, &perf[0], pws, uintptr(offered))
	default:
		fn, s = "cudnnFindConvolutionBackwardFilterAlgorithmEx", f.cudnnFindConvolutionBackwardFilterAlgorithmEx(n.h, p.xd, px, p.yd, py,
			p.cd, p.wd, pw, int32(len(perf)), &got, &perf[0], pws, uintptr(offered))
	}
	if err := l.check(fn, s); err != nil {
		return nil, 0, 0, err
	}
	if err := n.d.Synchronize(); err != nil {
		return nil, 0, 0, err
	}
	for _, c := range perf[:min(max(int(got), 0), len(perf))] {
		if c.Algo < 0 || c.Algo >= algoCount(key.pass) || c.MathType < cudnnDefaultMath || c.MathType > cudnnFMAMath {
			continue // nothing cuDNN documents
		}
		r := algoResult{Algo: c.Algo, Status: int32(c.Status), TimeMS: float64(c.Time), Memory: int64(min(c.Memory, maxAlgoMemory)),
			Deterministic: c.Determinism == cudnnDeterministic, Math: c.MathType}
		if r.Status < 0 || (r.Status == 0 && !(r.TimeMS >= 0 && r.TimeMS < 1e9)) {
			r.Status = 1 // a success without a time is no result
		}
		if r.Status != 0 {
			r.TimeMS = -1
		}
		rs = append(rs, r)
	}
	if im2col != nil {
		r, ok, err := im2col(x, w, y, ws, offered)
		if err != nil {
			return nil, 0, 0, err
		}
		if ok {
			rs = append(rs, r)
		}
	}
	// The entry lists results by algorithm, whatever order the timings
	// gave: rankAlgos orders them.
	slices.SortStableFunc(rs, func(a, b algoResult) int { return cmp.Or(cmp.Compare(a.Algo, b.Algo), cmp.Compare(a.Math, b.Math)) })
	return rs, offered, took, nil
}

// im2colBytes is the workspace the im2col path of convolution node nd of
// g takes (the static rule less convDNNBytes): the same at every chunk
// size, fixed by the graph's whole batch.
func im2colBytes(g *graph.Graph, nd *graph.Node) int64 {
	a := &nd.Attrs
	switch nd.Op {
	case graph.OpConv2d:
		return convColBytes(nchwShape(a, inputAt(g, nd, 1, 1)), nchwShape(a, nd.Type.AtBatch(1)), convImages(g, nd), a, elemSize(nd.Type.DType))
	case graph.OpConv2dGradInput:
		return convColBytes(nchwShape(a, inputAt(g, nd, 1, 1)), nchwShape(a, inputAt(g, nd, 0, 1)), convImages(g, nd), a, 4)
	case graph.OpConv2dGradWeight:
		return newGradWeightLayout(nchwShape(a, nd.Type.AtBatch(1)), nchwShape(a, inputAt(g, nd, 0, 1)), convImages(g, nd),
			a.Groups, nd.Type.DType).bytes
	}
	return 0
}

// timeIm2col times node nd's im2col path at b samples on the search's
// tensors (x, w, y: key's shapes, NCHW) with a workspace of up to wsBytes
// at ws: the median of im2colRuns runs after one to warm up (cuBLAS picks
// its kernels, the launches load), bracketed by events on stream 0. False
// when the workspace offered is too small. On the device thread.
func (n *DNN) timeIm2col(g *graph.Graph, nd *graph.Node, b int, key convKey, x, w, y, ws alloc.Ptr, wsBytes int64) (algoResult, bool, error) {
	need := im2colBytes(g, nd)
	if need > wsBytes {
		return algoResult{}, false, nil
	}
	dt := key.dt
	shape := func(s [4]int64) []int { return []int{int(s[0]), int(s[1]), int(s[2]), int(s[3])} }
	xo, wo, yo := operand{x, shape(key.x), dt}, operand{w, shape(key.w), dt}, operand{y, shape(key.y), dt}
	var in []operand
	var out operand
	switch nd.Op {
	case graph.OpConv2d:
		in, out = []operand{xo, wo}, yo
	case graph.OpConv2dGradInput:
		in, out = []operand{yo, wo}, xo
	default:
		in, out = []operand{yo, xo}, wo
	}
	k := &kctx{d: n.d, ks: n.ks, blas: n.blas, g: g, nd: nd, c: planner.Chunk{Size: b}, ws: &wsView{p: ws, n: need}}
	run := kernelTable[nd.Op].run
	if err := run(k, in, out); err != nil {
		return algoResult{}, false, err
	}
	drv := n.d.drv
	var start, end CUevent
	if err := drv.check("cuEventCreate", drv.cuEventCreate(&start, 0)); err != nil {
		return algoResult{}, false, err
	}
	defer drv.cuEventDestroy(start)
	if err := drv.check("cuEventCreate", drv.cuEventCreate(&end, 0)); err != nil {
		return algoResult{}, false, err
	}
	defer drv.cuEventDestroy(end)
	times := make([]float64, 0, im2colRuns)
	for range im2colRuns {
		if err := n.d.record(start); err != nil {
			return algoResult{}, false, err
		}
		if err := run(k, in, out); err != nil {
			return algoResult{}, false, err
		}
		if err := n.d.record(end); err != nil {
			return algoResult{}, false, err
		}
		if err := drv.check("cuEventSynchronize", drv.cuEventSynchronize(end)); err != nil {
			return algoResult{}, false, err
		}
		var ms float32
		if err := drv.check("cuEventElapsedTime", drv.cuEventElapsedTime(&ms, start, end)); err != nil {
			return algoResult{}, false, err
		}
		times = append(times, float64(ms))
	}
	slices.Sort(times)
	return algoResult{Algo: im2colAlgo, TimeMS: times[len(times)/2], Memory: need, Deterministic: true, Math: n.mathOf(dt)}, true, nil
}
