package batchfit

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"gorgonia.org/tensor"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/exec/cpu"
	"github.com/batchfit/batchfit/exec/cuda"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/optim"
	"github.com/batchfit/batchfit/planner"
)

// Device choices for Options.Device.
const (
	DeviceAuto = "auto" // CUDA when a GPU is usable, the CPU otherwise
	DeviceCPU  = "cpu"
	DeviceCUDA = "cuda"
)

// backend is what a Session needs of an executor: the two executors differ
// in how a training step updates parameters (the CPU calls the optimizer on
// host tensors; CUDA runs it on the device) and in where the planner's
// budget comes from.
type backend interface {
	// workspace is the executor's kernel workspace rule, compiled into
	// every program.
	workspace() planner.WorkspaceFunc
	// budget is the memory a plan may reserve when Options.Budget is 0.
	budget() (int64, error)
	// run executes p in chunks, keeping parameters and state resident.
	// With opt set it is a training step of params (p.Trained), whose
	// gradients are p.Kept.
	run(ctx context.Context, p *planner.Program, chunks []planner.Chunk, st *stepArgs, timeline bool) ([]*tensor.Dense, planner.Usage, error)
	allocator() *alloc.Allocator
	overhead() int64
	// syncParams brings trained parameters' host tensors up to date.
	syncParams() error
	yield() error
	restore() error
	yielded() bool
	close() error
}

// stepArgs is a training step's optimizer and its parameters' host data.
type stepArgs struct {
	opt    optim.Optimizer
	params []optim.Param // Key, Name and Data; Grad is filled in by the CPU
}

// chooseBackend picks the executor Options.Device asks for and says which
// and why.
func chooseBackend(o Options) (backend, string, error) {
	switch o.Device {
	case "", DeviceAuto, DeviceCUDA:
	case DeviceCPU:
		return newCPUBackend(o), "cpu: chosen by Options.Device", nil
	default:
		return nil, "", graph.Errorf(graph.ErrAttr, "Options.Device %q: want %q, %q or %q", o.Device, DeviceAuto, DeviceCPU, DeviceCUDA)
	}
	b, err := newCUDABackend(o)
	if err == nil {
		return b, b.d.Describe(), nil
	}
	if o.Device == DeviceCUDA {
		return nil, "", err
	}
	if errors.Is(err, cuda.ErrNoGPU) {
		// The reason without ErrNoGPU's own words, which "no GPU" says.
		why := strings.TrimPrefix(err.Error(), cuda.ErrNoGPU.Error()+": ")
		return newCPUBackend(o), fmt.Sprintf("cpu: no GPU (%s)", why), nil
	}
	return newCPUBackend(o), fmt.Sprintf("cpu: CUDA unusable (%v)", err), nil
}

type cpuBackend struct{ e *cpu.Executor }

func newCPUBackend(o Options) *cpuBackend {
	capacity := int64(cpu.Unlimited)
	if o.Budget > 0 {
		capacity = o.Budget
	}
	return &cpuBackend{cpu.NewOn(alloc.New(alloc.NewSimBackend(capacity), alloc.Options{TraceEntries: o.TraceEntries}))}
}

func (b *cpuBackend) workspace() planner.WorkspaceFunc { return cpu.Workspace }

// budget is what the simulated device has free plus what the allocator
// already reserves, as on CUDA: memory taken by anyone else is not there.
func (b *cpuBackend) budget() (int64, error) {
	a := b.e.Allocator()
	free, _, err := a.Backend().MemInfo()
	if err != nil {
		return 0, err
	}
	return free + a.Stats().ReservedBytes[alloc.All].Current, nil
}

func (b *cpuBackend) allocator() *alloc.Allocator { return b.e.Allocator() }
func (b *cpuBackend) overhead() int64             { return 0 }
func (b *cpuBackend) syncParams() error           { return nil } // the optimizer updates the host tensors
func (b *cpuBackend) yield() error                { return b.e.Yield() }
func (b *cpuBackend) restore() error              { return b.e.Restore() }
func (b *cpuBackend) yielded() bool               { return b.e.Yielded() }
func (b *cpuBackend) close() error                { return nil }

func (b *cpuBackend) run(ctx context.Context, p *planner.Program, chunks []planner.Chunk, st *stepArgs, timeline bool) ([]*tensor.Dense, planner.Usage, error) {
	o := cpu.ExecOptions{Resident: true, Timeline: timeline}
	if st != nil {
		o.Update = func(kept [][]float32) error {
			for i := range st.params {
				st.params[i].Grad = kept[i]
			}
			return st.opt.Step(st.params)
		}
	}
	res, err := b.e.Execute(ctx, p, chunks, o)
	if err != nil {
		return nil, planner.Usage{}, err
	}
	return res.Outputs, res.Usage, nil
}

type cudaBackend struct {
	d      *cuda.Device
	e      *cuda.Executor
	closed bool // Close once done: nothing left to sync
}

func newCUDABackend(o Options) (*cudaBackend, error) {
	d, err := cuda.Open(cuda.Options{})
	if err != nil {
		return nil, err
	}
	e, err := cuda.NewExecutor(d, cuda.ExecutorOptions{TF32: o.TF32, TraceEntries: o.TraceEntries})
	if err != nil {
		return nil, errors.Join(err, d.Close())
	}
	return &cudaBackend{d: d, e: e}, nil
}

func (b *cudaBackend) workspace() planner.WorkspaceFunc { return cuda.Workspace }
func (b *cudaBackend) allocator() *alloc.Allocator      { return b.e.Allocator() }
func (b *cudaBackend) overhead() int64                  { return b.e.Overhead() }
func (b *cudaBackend) syncParams() error {
	if b.closed {
		return nil
	}
	return b.e.SyncParams()
}
func (b *cudaBackend) yield() error   { return b.e.Yield() }
func (b *cudaBackend) restore() error { return b.e.Restore() }
func (b *cudaBackend) yielded() bool  { return b.e.Yielded() }
func (b *cudaBackend) close() error {
	b.closed = true
	return errors.Join(b.e.Close(), b.d.Close())
}

// budget is the device memory a step can have: what the driver reports
// free plus what the executor's allocator reserves already (its cache and
// its resident blocks, which a plan counts again), less the cuBLAS
// workspace, which is reserved but outside every plan.
func (b *cudaBackend) budget() (int64, error) {
	free, _, err := b.d.Backend().MemInfo()
	if err != nil {
		return 0, err
	}
	return free + b.e.Allocator().Stats().ReservedBytes[alloc.All].Current - b.e.Overhead(), nil
}

func (b *cudaBackend) run(ctx context.Context, p *planner.Program, chunks []planner.Chunk, st *stepArgs, timeline bool) ([]*tensor.Dense, planner.Usage, error) {
	o := cuda.ExecOptions{Resident: true, Timeline: timeline}
	if st != nil {
		// Parameters, gradients and optimizer state stay on the device;
		// Session.SyncParams brings the host tensors up to date.
		o.Optimizer, o.KeptOnDevice = st.opt, true
	}
	res, err := b.e.Execute(ctx, p, chunks, o)
	if err != nil {
		return nil, planner.Usage{}, err
	}
	return res.Outputs, res.Usage, nil
}
