package cuda

import (
	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/half"
)

// An offloaded optimizer (ExecOptions.Offload, ZeRO-Offload): the trained
// parameters and their gradients are bfloat16 on the device; their
// float32 masters and Adam's moments live in page-locked host memory
// (exec.OffloadHost over AllocHost), one allocation per parameter of
// planner.OffloadElementBytes per element, which the plan counts as
// HostPinned. After the last chunk's backward pass each gradient is
// copied into its parameter's staging buffer (a DMA from the device into
// pinned memory), the masters are updated there by optim's StepOffload on
// every core, and the staging buffers, now the new weights rounded to
// bfloat16, are copied straight from pinned memory over the parameters
// (cuMemcpyHtoDAsync on stream 0: the next step's kernels, on stream 0
// too, follow them).
// No device memory beyond the parameters and their gradients is used, so
// device plans need no staging buffer. Each parameter's weights go back
// as soon as its update is done, overlapping the update of the others;
// the gradients' copies follow backward rather than overlap it.

// offloadStep is Finish under ExecOptions.Offload: the queued launches
// are flushed, so the gradients' copies wait for backward.
func (r *runner) offloadStep(kept []*alloc.Block) error {
	params := make([]alloc.Ptr, len(r.p.Trained))
	for i, id := range r.p.Trained {
		pb, err := r.paramBlock(id)
		if err != nil {
			return err
		}
		params[i] = pb.Ptr()
	}
	down := func(i int, dst []half.BF16) error { return CopyDtoH(r.e.d, dst, kept[i].Ptr()) }
	up := func(i int, src []half.BF16) error { return copyHtoD(r.e.d, params[i], src, false) }
	return r.e.offload.Step(r.p, r.source, r.o.Optimizer, down, up)
}

// OffloadPinned is the page-locked host memory the executor holds for an
// offloaded optimizer (ExecOptions.Offload): masters, state and staging.
func (e *Executor) OffloadPinned() int64 { return e.offload.Pinned() }
