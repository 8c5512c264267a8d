package batchfit

import (
	"errors"
	"fmt"
	"strings"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/data"
	"github.com/batchfit/batchfit/exec"
	"github.com/batchfit/batchfit/exec/cpu"
	"github.com/batchfit/batchfit/exec/cuda"
	"github.com/batchfit/batchfit/graph"
	"github.com/batchfit/batchfit/precision"
)

// Device choices for Options.Device.
const (
	DeviceAuto = "auto" // CUDA when a GPU is usable, the CPU otherwise
	DeviceCPU  = "cpu"
	DeviceCUDA = "cuda"
)

// chooseExecutor makes the executor Options.Device asks for and says
// which and why.
func chooseExecutor(o Options) (exec.Executor, string, error) {
	if o.DryRun != nil {
		return newDry(o)
	}
	switch o.Device {
	case "", DeviceAuto, DeviceCUDA:
	case DeviceCPU:
		return newCPU(o), "cpu: chosen by Options.Device", nil
	default:
		return nil, "", graph.Errorf(graph.ErrAttr, "Options.Device %q: want %q, %q or %q", o.Device, DeviceAuto, DeviceCPU, DeviceCUDA)
	}
	e, err := newCUDA(o)
	if err == nil {
		return e, e.Device().Describe() + "; convolutions: " + e.Convolutions(), nil
	}
	if o.Device == DeviceCUDA {
		return nil, "", err
	}
	if errors.Is(err, cuda.ErrNoGPU) {
		// The reason without ErrNoGPU's own words, which "no GPU" says.
		why := strings.TrimPrefix(err.Error(), cuda.ErrNoGPU.Error()+": ")
		return newCPU(o), fmt.Sprintf("cpu: no GPU (%s)", why), nil
	}
	return newCPU(o), fmt.Sprintf("cpu: CUDA unusable (%v)", err), nil
}

// newCPU accounts on a simulated device of Options.Budget bytes, or an
// unlimited one.
func newCPU(o Options) *cpu.Executor {
	capacity := int64(cpu.Unlimited)
	if o.Budget > 0 {
		capacity = o.Budget
	}
	return cpu.NewOn(alloc.New(alloc.NewSimBackend(capacity), alloc.Options{TraceEntries: o.TraceEntries}))
}

// cudaOwner is a CUDA executor whose Close closes its device too.
type cudaOwner struct{ *cuda.Executor }

func newCUDA(o Options) (cudaOwner, error) {
	d, err := cuda.Open(cuda.Options{})
	if err != nil {
		return cudaOwner{}, err
	}
	e, err := cuda.NewExecutor(d, cuda.ExecutorOptions{TF32: o.TF32 || o.Precision == string(precision.TF32), TraceEntries: o.TraceEntries,
		NoCUDAGraphs: o.NoCUDAGraphs})
	if err != nil {
		return cudaOwner{}, errors.Join(err, d.Close())
	}
	return cudaOwner{e}, nil
}

func (c cudaOwner) Close() error { return errors.Join(c.Executor.Close(), c.Device().Close()) }

// HostMemory is page-locked host memory of the session's GPU
// (cuda.Device.AllocHost), for a data loader's batches (data.Options.Host):
// a batch's upload is then a DMA straight from it, with no staging copy,
// while the loader fills the next. Nil on the CPU and for dry runs, whose
// batches live in Go memory. A loader using it is closed before the
// session (Close frees what is left).
func (s *Session) HostMemory() data.HostMemory {
	if c, ok := s.be.(cudaOwner); ok {
		return c.Device()
	}
	return nil
}
