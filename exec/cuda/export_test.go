package cuda

import (
	"errors"
	"unsafe"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/exec"
	"github.com/batchfit/batchfit/graph"
)

// SetPointwiseIndex64 makes fused_pointwise's generated kernels run their
// 64-bit entry points whatever the size; it returns the previous setting.
func SetPointwiseIndex64(on bool) bool { return forcePW64.Swap(on) }

// FusedPointwiseRuns counts generated-kernel launches that wrote
// companions' outputs too, in every executor of the process.
func FusedPointwiseRuns() int64 { return fusedPointwiseRuns.Load() }

// PointwiseLaunchCompiles counts generated kernels compiled at their
// launch, not before the step, in every executor of the process.
func PointwiseLaunchCompiles() int64 { return pointwiseLaunchCompiles.Load() }

// KernelPrograms lists the executor's NVRTC programs (a kernel file, or
// part of one): name and source.
func KernelPrograms() (names, srcs []string, err error) {
	progs, err := kernelPrograms()
	for _, p := range progs {
		names, srcs = append(names, p.name), append(srcs, p.src)
	}
	return names, srcs, err
}

// ForEach is the kernel set's worker pool.
var ForEach = forEach

// FusedCrossEntropies counts cross_entropy passes that wrote their
// companion gradient too, in every executor of the process.
func FusedCrossEntropies() int64 { return fusedCrossEntropies.Load() }

// FusedLayerNorms counts layer_norm_grad_x passes that computed a
// companion gradient too, in every executor of the process.
func FusedLayerNorms() int64 { return fusedLayerNorms.Load() }

// BatchNormVecPasses counts the channels-last batch norm's vector-path
// launches (sums and maps), and BatchNormBiasGrads the batch_norm_grad_x
// passes that gave their companion bias gradient, in every executor of
// the process.
func BatchNormVecPasses() int64 { return bnVecPasses.Load() }
func BatchNormBiasGrads() int64 { return bnBiasGrads.Load() }

// LayerNormFusedGrid is the fused layer norm pass's grid and row groups
// for rows rows of d float32 elements on e's device, and the blocks the
// device holds at once.
func LayerNormFusedGrid(e *Executor, rows, d int64) (grid, groups, resident int64, err error) {
	block := lnFusedBlock(d)
	resident, err = e.ks.residentBlocks(e.d, typed(kLayerNormFused, graph.Float32), int(block[0]*block[1]))
	grid, groups = lnFusedGroups(rows, d, resident)
	return grid, groups, resident, err
}

// keptOutputs is exec.KeptOutputs, as the tests of the output mapping name it.
var keptOutputs = exec.KeptOutputs

// EarlyReads counts e's chunks whose host outputs were copied as soon as
// they were final.
func (e *Executor) EarlyReads() int64 { return e.earlyReads.Load() }

// TailPending is whether a resident Execute's last kernels may still run
// on d (nothing has waited for them since).
func (d *Device) TailPending() (pending bool) {
	_ = d.do(func() error { pending = d.tail; return nil })
	return pending
}

// Do runs fn on the device goroutine, for tests of the re-entrant path.
func (d *Device) Do(fn func() error) error { return d.do(fn) }

// ResidentData downloads every resident buffer (parameters, constants,
// optimizer state), in allocation order, as 4-byte words.
func (e *Executor) ResidentData() ([][]uint32, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	list := e.resident.List()
	out := make([][]uint32, len(list))
	for i, rb := range list {
		if rb.Blk == nil {
			return nil, ErrClosed
		}
		out[i] = make([]uint32, (rb.Size+3)/4)
		if err := CopyDtoH(e.d, unsafe.Slice((*float32)(unsafe.Pointer(&out[i][0])), len(out[i])), rb.Blk.Ptr()); err != nil {
			return nil, err
		}
	}
	return out, nil
}

// The staging sizes (staging.go), for tests.
const (
	StageMin   = stageMin
	StagePiece = stagePiece
)

// CopyHtoDNoWait is the executor's upload: a large copy may still be
// moving when it returns, ordered before later stream-0 work.
func CopyHtoDNoWait[T Elem](d *Device, dst alloc.Ptr, src []T) error {
	return copyHtoD(d, dst, src, false)
}

// CopyHtoDPageable is one cuMemcpyHtoD from src, unstaged: the baseline
// of BenchmarkUpload.
func CopyHtoDPageable[T Elem](d *Device, dst alloc.Ptr, src []T) error {
	n := uintptr(len(src)) * unsafe.Sizeof(src[0])
	return d.do(func() error {
		return d.drv.check("cuMemcpyHtoD_v2", d.drv.cuMemcpyHtoD(CUdeviceptr(dst), unsafe.Pointer(&src[0]), n))
	})
}

// SetStageCopiers sets the goroutines that copy each staged piece and
// returns the previous number.
func SetStageCopiers(n int) int {
	old := stageCopiers
	stageCopiers = n
	return old
}

// SDPAShape is a cuDNN attention problem (q [B, H, T, D], k and v [B,
// Hkv, S, D], Hkv = H when 0) for the tests and benchmarks of
// dnn_sdpa.go.
type SDPAShape struct {
	DT                 graph.DType
	B, H, Hkv, T, S, D int
	Causal             bool
	Scale              float32
}

func (s SDPAShape) kvHeads() int {
	if s.Hkv == 0 {
		return s.H
	}
	return s.Hkv
}

func (s SDPAShape) geom() attnShape {
	return attnShape{b: s.B, h: s.H, hkv: s.kvHeads(), t: s.T, s: s.S, d: s.D, scale: s.Scale, causal: s.Causal}
}

func (s SDPAShape) dims() sdpaDims {
	return sdpaDims{b: int64(s.B), h: int64(s.H), hkv: int64(s.kvHeads()), t: int64(s.T), s: int64(s.S), d: int64(s.D)}
}

func sdpaPassOf(backward bool) sdpaPass {
	if backward {
		return sdpaBackward
	}
	return sdpaForward
}

// SDPAPlan makes (or finds) the plan of s's forward or backward pass: ok
// when cuDNN gave one, its workspace, the bound nodes declare for it
// (sdpaPlanBytes), cuDNN's engine index and, without a plan, why.
func (n *DNN) SDPAPlan(backward bool, s SDPAShape) (ok bool, ws, bound, engine int64, why string, err error) {
	pass := sdpaPassOf(backward)
	err = n.d.do(func() error {
		x := s.dims()
		key := sdpaKey{pass: pass, dt: s.DT, b: x.b, h: x.h, hkv: x.hkv, t: x.t, s: x.s, d: x.d, causal: s.Causal, scale: s.Scale}
		p, err := n.sdpaPlanFor(key)
		if err != nil {
			return err
		}
		ok, ws, engine, why = p.ok, p.ws, p.engine, p.why
		return nil
	})
	return ok, ws, sdpaPlanBytes(pass, s.dims()), engine, why, err
}

// SDPAWorkspaceBytes is the workspace an attention (forward) or
// attention_grad_q (backward) node of s declares for cuDNN.
func SDPAWorkspaceBytes(backward bool, s SDPAShape) int64 {
	if backward {
		return sdpaBwdBytes(s.dims())
	}
	return sdpaFwdBytes(s.dims())
}

// SDPAForward runs s's forward pass on cuDNN with a workspace of wsBytes
// at ws (lse 0: Stats in the workspace); false when cuDNN did not take it.
func (n *DNN) SDPAForward(s SDPAShape, q, k, v, o, lse, ws alloc.Ptr, wsBytes int64) (done bool, err error) {
	err = n.d.do(func() error {
		done, err = n.sdpaForward(s.DT, s.geom(), false, false, q, k, v, o, lse, ws, wsBytes)
		return err
	})
	return done, err
}

// SDPABackward runs s's backward pass on cuDNN: dq, and dk|dv packed.
func (n *DNN) SDPABackward(s SDPAShape, g, q, k, v, o, lse, dq, dkv, ws alloc.Ptr, wsBytes int64) (done bool, err error) {
	err = n.d.do(func() error {
		done, err = n.sdpaBackward(s.DT, s.geom(), false, false, g, q, k, v, o, lse, dq, dkv, dkv+alloc.Ptr(s.D*s.DT.Size()), ws, wsBytes)
		return err
	})
	return done, err
}

// qkvShape is s as attention_qkv's packed shape (T = S).
func (s SDPAShape) qkvShape() graph.QKVShape {
	return graph.QKVShape{B: s.B, H: s.H, Hkv: s.kvHeads(), T: s.T, D: s.D}
}

// SDPAForwardPacked runs s's forward pass on cuDNN as attention_qkv does:
// q, k and v read in place from qkv [B, T, (H + 2·Hkv)·D], o [B, T, H·D].
func (n *DNN) SDPAForwardPacked(s SDPAShape, qkv, o, lse, ws alloc.Ptr, wsBytes int64) (done bool, err error) {
	err = n.d.do(func() error {
		q, k, v := qkvParts(qkv, s.DT, s.qkvShape())
		done, err = n.sdpaForward(s.DT, s.geom(), false, true, q, k, v, o, lse, ws, wsBytes)
		return err
	})
	return done, err
}

// SDPABackwardPacked runs s's backward pass on cuDNN as attention_qkv_grad
// does: d qkv laid out as qkv.
func (n *DNN) SDPABackwardPacked(s SDPAShape, g, qkv, o, lse, dqkv, ws alloc.Ptr, wsBytes int64) (done bool, err error) {
	err = n.d.do(func() error {
		sh := s.qkvShape()
		q, k, v := qkvParts(qkv, s.DT, sh)
		dq, dk, dv := qkvParts(dqkv, s.DT, sh)
		done, err = n.sdpaBackward(s.DT, s.geom(), false, true, g, q, k, v, o, lse, dq, dk, dv, ws, wsBytes)
		return err
	})
	return done, err
}

// CapSDPAWorkspace caps the plan workspace every later call may use at
// bytes (below what the nodes declare: the refusal path).
func (n *DNN) CapSDPAWorkspace(bytes int64) {
	n.mu.Lock()
	n.sdpaWSCap, n.sdpaWSCapped = bytes, true
	n.mu.Unlock()
}

// EpilogueGEMMs counts the GEMMs cuBLASLt ran with a fused epilogue.
func EpilogueGEMMs() int64 { return epilogueGEMMs.Load() }

// AddLayerNorms counts the adds that ran with their layer norm.
func AddLayerNorms() int64 { return addLayerNorms.Load() }

// AddRMSNorms, FusedRMSNorms and FusedSwiGLUGrads count the fused passes
// of a Llama block that ran: adds that normalised their result, RMS norm
// backward passes that gave the weight's gradient, gate gradients that
// gave up's.
func AddRMSNorms() int64      { return addRMSNorms.Load() }
func FusedRMSNorms() int64    { return fusedRMSNorms.Load() }
func FusedSwiGLUGrads() int64 { return fusedSwiGLUGrads.Load() }

// ForgetSearches drops this process's timed searches (convfind.go), so the
// next executor reads them from the disk cache or times them again.
func ForgetSearches() { processFinds.Clear() }

// DeviceJobs is the number of requests the process's device goroutines
// have run (deviceJobs).
func DeviceJobs() uint64 { return deviceJobs.Load() }

// SetCuDNNMaxElems sets the most elements a cuDNN descriptor is taken to
// describe (convsplit.go: 2³¹ − 1) and returns the previous limit. A lower
// one makes small convolutions run in slices along N, and small batch
// norms on the kernels. Set it before an executor meets the shapes: plans
// and timed choices made before keep the slices they were made with.
func SetCuDNNMaxElems(n int64) int64 { return cudnnMaxElems.Swap(n) }

// ConvDescribeErrors makes, on n's device thread, the descriptors of a
// forward convolution of x and w into y (stride 1, no padding, one group)
// in dtype dt, a workspace query of algorithm 0 on them and a plan (the
// heuristics within 1 GiB), as the timed search and the launches do, and
// returns the three errors.
func (n *DNN) ConvDescribeErrors(dt graph.DType, x, w, y [4]int64) (descs, query, plan error) {
	key := convKey{pass: convForward, dt: dt, x: x, w: w, y: y, stride: [2]int64{1, 1}, dil: [2]int64{1, 1}, groups: 1, budget: 1 << 30}
	err := n.d.do(func() error {
		p, err := n.newConvDescs(key)
		descs = errors.Join(err, n.destroy(p))
		_, query = n.queryWorkspace(key, algoResult{Algo: 0, Math: n.mathOf(dt)})
		_, plan = n.plan(key, nil)
		return nil
	})
	return errors.Join(descs, err), query, plan
}

// HostWaits counts the times the host waited for e's device: synchronous
// copies, synchronisations and event waits.
func HostWaits(e *Executor) int64 { return e.d.waits.Load() }

// FusedLinearCEs counts linear_cross_entropy launches that computed their
// gradients too.
func FusedLinearCEs() int64 { return fusedLinearCEs.Load() }
