package cuda

import (
	"errors"
	"time"

	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/planner"
)

// nodeTiming is one node's run in one chunk, bracketed by two events; nd
// is nil for the step's update (ExecOptions.UpdateTime).
type nodeTiming struct {
	nd         *graph.Node
	c          planner.Chunk
	start, end CUevent
}

// startTiming creates a node's two events and records the first; the
// caller records the second after the node's launches. On the device
// thread.
func (r *runner) startTiming(nd *graph.Node, c planner.Chunk) (nodeTiming, error) {
	d := r.e.d
	t := nodeTiming{nd: nd, c: c}
	if err := d.drv.check("cuEventCreate", d.drv.cuEventCreate(&t.start, 0)); err != nil {
		return t, err
	}
	if err := d.drv.check("cuEventCreate", d.drv.cuEventCreate(&t.end, 0)); err != nil {
		return t, errors.Join(err, d.drv.check("cuEventDestroy", d.drv.cuEventDestroy(t.start)))
	}
	r.timed = append(r.timed, t)
	return t, d.record(t.start)
}

// record records ev on the default stream. On the device thread.
func (d *Device) record(ev CUevent) error {
	if d.capture != 0 {
		return ErrHostInCapture
	}
	return d.drv.check("cuEventRecord", d.drv.cuEventRecord(ev, 0))
}

// reportTimes passes each timed node's device time to ExecOptions.OpTime,
// and the update's to UpdateTime, when the step completed (the device is
// synchronised) and destroys the events. On the device thread.
func (r *runner) reportTimes(completed bool) error {
	drv := r.e.d.drv
	var errs []error
	for _, t := range r.timed {
		if completed {
			var ms float32
			if err := drv.check("cuEventElapsedTime", drv.cuEventElapsedTime(&ms, t.start, t.end)); err != nil {
				errs = append(errs, err)
				completed = false
			} else if d := time.Duration(float64(ms) * float64(time.Millisecond)); t.nd == nil {
				r.o.UpdateTime(d)
			} else {
				r.o.OpTime(t.nd, t.c, d)
			}
		}
		errs = append(errs, drv.check("cuEventDestroy", drv.cuEventDestroy(t.start)),
			drv.check("cuEventDestroy", drv.cuEventDestroy(t.end)))
	}
	r.timed = nil
	return errors.Join(errs...)
}
