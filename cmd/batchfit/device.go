package main

import (
	"errors"
	"flag"
	"fmt"
	"strings"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/exec/cuda"
)

// errConflict is the usage mistake of two flags that exclude each other.
var errConflict = errors.New("conflicting flags")

const mib = 1 << 20

// gibs is x GiB to the MiB: the figures below are known to 0.01 GiB.
func gibs(x float64) int64 { return int64(x*1024+0.5) * mib }

// contextOverhead is the device memory a CUDA session holds outside its
// allocator: the CUDA context, the loaded kernel modules and the cuBLAS
// handle. Measured on an H100 80GB HBM3 (driver 580, CUDA 13) as the
// device's used memory less the allocator's reserved bytes: about 0.58 GiB.
// No other card was measured; every card is assumed to need as much.
const contextOverhead = 594 * mib

// cudnnHandle is the device memory a CUDA session's cuDNN handle takes
// outside its allocator (cuDNN 9.14 on the H100: cuMemGetInfo around
// cudnnCreate, exec/cuda's TestCuDNNLoads), which the session leaves free
// (Executor.Reserve).
const cudnnHandle = 8 * mib

// contextNote says where contextOverhead comes from, for the output.
const contextNote = "≈0.58 GiB measured on an H100 80GB; assumed equal on other cards"

// card is a GPU a dry run can plan for. Total is the device memory the
// CUDA driver reports in total (cuMemGetInfo; PyTorch's "total capacity" in
// its out-of-memory message is the same figure), which is less than the
// nominal size and than nvidia-smi's total.
type card struct {
	name   string
	total  int64
	source string // where total comes from
}

// cards are the GPUs --gpu names. Only the H100's figures were measured
// with batchfit; the others' totals come from the public reports named in
// source, and their context overhead is the H100's (contextOverhead).
var cards = []card{
	{"h100-80gb", 81079 << 20, "cuMemGetInfo's total on batchfit's H100 80GB HBM3 (driver 580, CUDA 13), " +
		"85,017,493,504 B; PyTorch reports 79.11 GiB on one (github.com/vllm-project/vllm/issues/27508)"},
	{"h200", gibs(139.93), "estimate: nvidia-smi's 143,771 MiB on the lent H200, less the 480 MiB by which the H100's nvidia-smi total (81,559 MiB) exceeds its cuMemGetInfo total (81,079 MiB)"},
	{"a100-80gb", gibs(79.14), "PyTorch's total capacity on an A100 80GB (github.com/lianqi1008/Control-GIC/issues/6)"},
	{"a100-40gb", 42298834944, "deviceQuery's total global memory on an A100-SXM4-40GB, 40339 MiB " +
		"(github.com/bottlerocket-os/bottlerocket/pull/3873)"},
	{"l4", gibs(22.21), "estimate: nvidia-smi's 23034 MiB (github.com/modal-labs/modal-client/pull/2797) less the " +
		"295 MiB by which the same 24 GB A10's 23028 MiB there exceeds the 22.20 GiB an A10G reports to CUDA"},
	{"a10g", gibs(22.20), "PyTorch's total capacity on an AWS g5 A10G (github.com/XavierXiao/Dreambooth-Stable-Diffusion/issues/18)"},
	{"rtx4090", gibs(23.64), "PyTorch's total capacity on an RTX 4090 (github.com/3DTopia/Phidias-Diffusion/issues/8; " +
		"others report 23.65 and 23.68 GiB: the smallest is kept)"},
	{"rtx3090", gibs(23.70), "PyTorch's total capacity on an RTX 3090 (github.com/GaoLii/DSP/issues/10)"},
	{"v100-32gb", gibs(31.74), "PyTorch's total capacity on a V100 32GB (github.com/liucongg/ChatGLM-Finetuning/issues/73)"},
	{"v100-16gb", gibs(15.78), "PyTorch's total capacity on a V100 16GB (github.com/kchengiva/Shift-GCN/issues/34)"},
	{"t4", gibs(14.75), "PyTorch's total capacity on a Colab T4 (github.com/hpcaitech/Open-Sora/issues/697)"},
}

func cardNames() []string {
	names := make([]string, len(cards))
	for i, c := range cards {
		names[i] = c.name
	}
	return names
}

// device is what a CUDA session on a card can budget for a step: the
// card's total less the memory outside its allocator (context, modules,
// cuBLAS handle) and less the cuBLAS workspace, which its allocator holds
// outside every plan. A CUDA batchfit.Session budgets the same way: free
// memory plus its allocator's reserved bytes less Executor.Overhead.
type device struct {
	Card            string `json:"card,omitempty"` // empty for --gpu-memory
	Total           int64  `json:"total"`
	TotalSource     string `json:"total_source"`
	Context         int64  `json:"context"` // CUDA context, modules and cuBLAS handle
	ContextMeasured bool   `json:"context_measured"`
	Workspace       int64  `json:"cublas_workspace"`
	DriverReserve   int64  `json:"driver_reserve"` // left free for the driver's mappings (cuda.DriverReserve)
	CuDNN           int64  `json:"cudnn_handle"`   // the cuDNN handle's own memory, left free too
	Budget          int64  `json:"budget"`         // Total − Context − Workspace − DriverReserve − CuDNN
}

func newDevice(name string, total int64, source string) *device {
	d := &device{Card: name, Total: total, TotalSource: source, Context: contextOverhead,
		ContextMeasured: name == "h100-80gb", Workspace: cuda.DefaultWorkspace, DriverReserve: cuda.DriverReserve,
		CuDNN: cudnnHandle}
	d.Budget = d.Total - d.Context - d.Workspace - d.DriverReserve - d.CuDNN
	return d
}

// describe is the device line of the text output.
func (d *device) describe() string {
	name := d.Card
	if name == "" {
		name = "--gpu-memory"
	}
	note := "measured on an H100 80GB"
	if !d.ContextMeasured {
		note = "estimate: " + contextNote
	}
	return fmt.Sprintf("%s: %s total − %s CUDA context and libraries (%s) − %s cuBLAS workspace − %s left free for the driver − %s cuDNN handle = %s; CUDA executor's workspaces",
		name, alloc.FormatBytes(d.Total), alloc.FormatBytes(d.Context), note, alloc.FormatBytes(d.Workspace),
		alloc.FormatBytes(d.DriverReserve), alloc.FormatBytes(d.CuDNN), alloc.FormatBytes(d.Budget))
}

// deviceFlagValues are estimate's flags naming the card to plan for.
type deviceFlagValues struct{ gpu, gpuMemory string }

// addDeviceFlags defines --gpu and --gpu-memory on fs, after the step
// flags, whose --budget they stand in for.
func addDeviceFlags(fs *flag.FlagSet, v *deviceFlagValues) {
	if f := fs.Lookup("budget"); f != nil {
		f.Usage = strings.TrimSuffix(f.Usage, " (required)") + " (required unless --gpu or --gpu-memory)"
	}
	fs.StringVar(&v.gpu, "gpu", "", "plan for a CUDA `card` instead of --budget: "+strings.Join(cardNames(), ", ")+
		"; its total memory less the CUDA context ("+contextNote+") and the cuBLAS workspace ("+
		alloc.FormatBytes(cuda.DefaultWorkspace)+"), with the CUDA executor's workspaces")
	fs.StringVar(&v.gpuMemory, "gpu-memory", "", "plan for another CUDA card with this total memory, a `SIZE` "+
		"(as cuMemGetInfo reports it), as --gpu does")
}

// resolve returns the device the flags in set name, or nil when neither
// --gpu nor --gpu-memory is given; every error is a *usageError.
func (v *deviceFlagValues) resolve(set map[string]bool) (*device, error) {
	var d *device
	switch {
	case set["gpu"] && set["gpu-memory"]:
		return nil, usagef(errConflict, "--gpu and --gpu-memory exclude each other: give one")
	case (set["gpu"] || set["gpu-memory"]) && set["budget"]:
		return nil, usagef(errConflict, "--budget excludes --gpu and --gpu-memory: give one")
	case set["gpu"]:
		for _, c := range cards {
			if c.name == v.gpu {
				d = newDevice(c.name, c.total, c.source)
			}
		}
		if d == nil {
			return nil, usagef(errUnknown, "unknown --gpu %q (want one of %s, or --gpu-memory SIZE)", v.gpu,
				strings.Join(cardNames(), ", "))
		}
	case set["gpu-memory"]:
		total, err := alloc.ParseBytes(v.gpuMemory)
		if err != nil {
			return nil, &usageError{kind: alloc.ErrSize, msg: "--gpu-memory: " + err.Error()}
		}
		d = newDevice("", total, "--gpu-memory")
	default:
		return nil, nil
	}
	if d.Budget <= 0 {
		return nil, usagef(errRange, "--gpu-memory %s leaves nothing after the CUDA context (%s), the cuBLAS workspace (%s), the driver reserve (%s) and the cuDNN handle (%s)",
			alloc.FormatBytes(d.Total), alloc.FormatBytes(d.Context), alloc.FormatBytes(d.Workspace), alloc.FormatBytes(d.DriverReserve), alloc.FormatBytes(d.CuDNN))
	}
	return d, nil
}
