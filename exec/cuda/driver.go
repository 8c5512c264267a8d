package cuda

import (
	"fmt"
	"sync"
	"unsafe"

	"github.com/ebitengine/purego"
)

// Opaque driver handles.
type (
	// CUdeviceptr is a device address (CUdeviceptr).
	CUdeviceptr uintptr
	// CUcontext is a context handle.
	CUcontext uintptr
	// CUmodule is a loaded module.
	CUmodule uintptr
	// CUfunction is a kernel of a loaded module.
	CUfunction uintptr
	// CUevent is an event in a stream.
	CUevent uintptr

	cuDevice int32 // CUdevice: an ordinal-like int
	cuResult int32 // CUresult
)

// CUdevice_attribute values.
const (
	attrMultiprocessorCount    = 16
	attrComputeCapabilityMajor = 75
	attrComputeCapabilityMinor = 76
)

// driver holds the libcuda.so.1 entry points. C signatures are in the
// comments; size_t is uintptr, int is int32, unsigned int is uint32.
type driver struct {
	// CUresult cuInit(unsigned int Flags)
	cuInit func(flags uint32) cuResult
	// CUresult cuDriverGetVersion(int *driverVersion)
	cuDriverGetVersion func(version *int32) cuResult
	// CUresult cuDeviceGetCount(int *count)
	cuDeviceGetCount func(count *int32) cuResult
	// CUresult cuDeviceGet(CUdevice *device, int ordinal)
	cuDeviceGet func(dev *cuDevice, ordinal int32) cuResult
	// CUresult cuDeviceGetAttribute(int *pi, CUdevice_attribute attrib, CUdevice dev)
	cuDeviceGetAttribute func(v *int32, attr int32, dev cuDevice) cuResult
	// CUresult cuDeviceGetName(char *name, int len, CUdevice dev)
	cuDeviceGetName func(name *byte, n int32, dev cuDevice) cuResult
	// CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev)
	cuDeviceTotalMem func(bytes *uintptr, dev cuDevice) cuResult
	// CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev)
	cuDevicePrimaryCtxRetain func(ctx *CUcontext, dev cuDevice) cuResult
	// CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev)
	cuDevicePrimaryCtxRelease func(dev cuDevice) cuResult
	// CUresult cuCtxSetCurrent(CUcontext ctx)
	cuCtxSetCurrent func(ctx CUcontext) cuResult
	// CUresult cuCtxGetCurrent(CUcontext *pctx)
	cuCtxGetCurrent func(ctx *CUcontext) cuResult
	// CUresult cuCtxSynchronize(void)
	cuCtxSynchronize func() cuResult
	// CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)
	cuMemAlloc func(p *CUdeviceptr, size uintptr) cuResult
	// CUresult cuMemFree_v2(CUdeviceptr dptr)
	cuMemFree func(p CUdeviceptr) cuResult
	// CUresult cuMemGetInfo_v2(size_t *free, size_t *total)
	cuMemGetInfo func(free, total *uintptr) cuResult
	// CUresult cuMemcpyHtoD_v2(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount)
	cuMemcpyHtoD func(dst CUdeviceptr, src unsafe.Pointer, n uintptr) cuResult
	// CUresult cuMemcpyDtoH_v2(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount)
	cuMemcpyDtoH func(dst unsafe.Pointer, src CUdeviceptr, n uintptr) cuResult
	// CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount, CUstream hStream)
	cuMemcpyHtoDAsync func(dst CUdeviceptr, src unsafe.Pointer, n uintptr, stream uintptr) cuResult
	// CUresult cuMemcpyDtoHAsync_v2(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount, CUstream hStream)
	cuMemcpyDtoHAsync func(dst unsafe.Pointer, src CUdeviceptr, n uintptr, stream uintptr) cuResult
	// CUresult cuMemHostAlloc(void **pp, size_t bytesize, unsigned int Flags)
	cuMemHostAlloc func(p *unsafe.Pointer, size uintptr, flags uint32) cuResult
	// CUresult cuMemFreeHost(void *p)
	cuMemFreeHost func(p unsafe.Pointer) cuResult
	// CUresult cuMemsetD8_v2(CUdeviceptr dstDevice, unsigned char uc, size_t N)
	cuMemsetD8 func(dst CUdeviceptr, v uint8, n uintptr) cuResult
	// CUresult cuModuleLoadData(CUmodule *module, const void *image)
	cuModuleLoadData func(m *CUmodule, image unsafe.Pointer) cuResult
	// CUresult cuModuleGetFunction(CUfunction *hfunc, CUmodule hmod, const char *name)
	cuModuleGetFunction func(f *CUfunction, m CUmodule, name string) cuResult
	// CUresult cuFuncGetParamInfo(CUfunction func, size_t paramIndex,
	//                             size_t *paramOffset, size_t *paramSize)
	// (CUDA 12.4 on): nil on an older driver, which skips the check it
	// serves (Module.ParamCount).
	cuFuncGetParamInfo func(f CUfunction, index uintptr, offset, size *uintptr) cuResult
	// CUresult cuOccupancyMaxActiveBlocksPerMultiprocessor(int *numBlocks,
	//     CUfunction func, int blockSize, size_t dynamicSMemSize)
	cuOccupancyMaxActiveBlocksPerMultiprocessor func(n *int32, f CUfunction, blockSize int32, dynSmem uintptr) cuResult
	// CUresult cuModuleUnload(CUmodule hmod)
	cuModuleUnload func(m CUmodule) cuResult
	// CUresult cuLaunchKernel(CUfunction f, unsigned gridDimX, gridDimY, gridDimZ,
	//     unsigned blockDimX, blockDimY, blockDimZ, unsigned sharedMemBytes,
	//     CUstream hStream, void **kernelParams, void **extra)
	cuLaunchKernel func(f CUfunction, gx, gy, gz, bx, by, bz, sharedMem uint32,
		stream uintptr, params *unsafe.Pointer, extra unsafe.Pointer) cuResult
	// CUresult cuGetErrorName(CUresult error, const char **pStr)
	cuGetErrorName func(r cuResult, name **byte) cuResult
	// CUresult cuEventCreate(CUevent *phEvent, unsigned int Flags)
	cuEventCreate func(ev *CUevent, flags uint32) cuResult
	// CUresult cuEventRecord(CUevent hEvent, CUstream hStream)
	cuEventRecord func(ev CUevent, stream uintptr) cuResult
	// CUresult cuEventElapsedTime_v2(float *pMilliseconds, CUevent hStart, CUevent hEnd)
	cuEventElapsedTime func(ms *float32, start, end CUevent) cuResult
	// CUresult cuEventSynchronize(CUevent hEvent)
	cuEventSynchronize func(ev CUevent) cuResult
	// CUresult cuEventDestroy_v2(CUevent hEvent)
	cuEventDestroy func(ev CUevent) cuResult
}

func (d *driver) symbols() []symbol {
	return []symbol{
		sym(&d.cuInit, "cuInit"),
		sym(&d.cuDriverGetVersion, "cuDriverGetVersion"),
		sym(&d.cuDeviceGetCount, "cuDeviceGetCount"),
		sym(&d.cuDeviceGet, "cuDeviceGet"),
		sym(&d.cuDeviceGetAttribute, "cuDeviceGetAttribute"),
		sym(&d.cuDeviceGetName, "cuDeviceGetName"),
		sym(&d.cuDeviceTotalMem, "cuDeviceTotalMem_v2"),
		sym(&d.cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain"),
		sym(&d.cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2", "cuDevicePrimaryCtxRelease"),
		sym(&d.cuCtxSetCurrent, "cuCtxSetCurrent"),
		sym(&d.cuCtxGetCurrent, "cuCtxGetCurrent"),
		sym(&d.cuCtxSynchronize, "cuCtxSynchronize"),
		sym(&d.cuMemAlloc, "cuMemAlloc_v2"),
		sym(&d.cuMemFree, "cuMemFree_v2"),
		sym(&d.cuMemGetInfo, "cuMemGetInfo_v2"),
		sym(&d.cuMemcpyHtoD, "cuMemcpyHtoD_v2"),
		sym(&d.cuMemcpyDtoH, "cuMemcpyDtoH_v2"),
		sym(&d.cuMemsetD8, "cuMemsetD8_v2"),
		sym(&d.cuModuleLoadData, "cuModuleLoadData"),
		sym(&d.cuModuleGetFunction, "cuModuleGetFunction"),
		sym(&d.cuModuleUnload, "cuModuleUnload"),
		sym(&d.cuOccupancyMaxActiveBlocksPerMultiprocessor, "cuOccupancyMaxActiveBlocksPerMultiprocessor"),
		sym(&d.cuLaunchKernel, "cuLaunchKernel"),
		sym(&d.cuGetErrorName, "cuGetErrorName"),
		sym(&d.cuEventCreate, "cuEventCreate"),
		sym(&d.cuEventRecord, "cuEventRecord"),
		sym(&d.cuEventElapsedTime, "cuEventElapsedTime_v2", "cuEventElapsedTime"),
		sym(&d.cuEventDestroy, "cuEventDestroy_v2", "cuEventDestroy"),
		sym(&d.cuEventSynchronize, "cuEventSynchronize"),
		sym(&d.cuMemcpyHtoDAsync, "cuMemcpyHtoDAsync_v2"),
		sym(&d.cuMemcpyDtoHAsync, "cuMemcpyDtoHAsync_v2"),
		sym(&d.cuMemHostAlloc, "cuMemHostAlloc"),
		sym(&d.cuMemFreeHost, "cuMemFreeHost"),
	}
}

// check turns a CUresult into nil or a *CUDAError naming fn.
func (d *driver) check(fn string, r cuResult) error {
	if r == cudaSuccess {
		return nil
	}
	return &CUDAError{Func: fn, Code: int(r), Name: d.errorName(r)}
}

func (d *driver) errorName(r cuResult) string {
	var p *byte
	if d.cuGetErrorName(r, &p) == cudaSuccess && p != nil {
		return goString(p)
	}
	return fmt.Sprintf("CUDA_ERROR_%d", int(r))
}

// The driver is loaded and initialised once per process, on first Open.
var driverOnce struct {
	sync.Once
	d   *driver
	err error
}

// loadDriver dlopens libcuda.so.1, binds its functions and calls cuInit.
// Every failure wraps ErrNoGPU.
func loadDriver() (*driver, error) {
	driverOnce.Do(func() {
		lib, err := dlopen("libcuda.so.1")
		if err != nil {
			driverOnce.err = fmt.Errorf("%w: cannot load libcuda.so.1: %v", ErrNoGPU, err)
			return
		}
		d := new(driver)
		if err := bind(lib, d.symbols()); err != nil {
			driverOnce.err = fmt.Errorf("%w: libcuda.so.1: %v", ErrNoGPU, err)
			return
		}
		if a, err := purego.Dlsym(lib, "cuFuncGetParamInfo"); err == nil {
			purego.RegisterFunc(&d.cuFuncGetParamInfo, a)
		}
		if err := d.check("cuInit", d.cuInit(0)); err != nil {
			driverOnce.err = fmt.Errorf("%w: %w", ErrNoGPU, err)
			return
		}
		driverOnce.d = d
	})
	return driverOnce.d, driverOnce.err
}
