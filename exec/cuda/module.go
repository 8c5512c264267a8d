package cuda

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"sync"
	"unsafe"

	"github.com/batchfit/batchfit/alloc"
	"github.com/batchfit/batchfit/graph"
)

// Module is a loaded cubin.
type Module struct {
	d      *Device
	name   string
	mod    CUmodule
	cached bool

	mu     sync.Mutex
	closed bool
}

// compileOptions are the NVRTC flags for arch: a real architecture, so
// NVRTC emits a cubin (SASS) rather than PTX alone.
func compileOptions(arch string) []string {
	return []string{"--gpu-architecture=" + arch, "-default-device", "--std=c++17"}
}

// Compile builds CUDA C source for the device with NVRTC and loads it. The
// cubin is cached on disk, keyed by the source, name, options and NVRTC
// version, so a second Compile of the same source only loads it.
func (d *Device) Compile(name, src string) (*Module, error) {
	nv, err := loadNVRTC()
	if err != nil {
		return nil, err
	}
	opts := compileOptions(d.Arch())
	path := d.cubinPath(cubinKey(name, src, nv.version, opts))
	if path != "" {
		if cubin, ok := readCachedCubin(path); ok {
			if m, err := d.LoadModule(name, cubin); err == nil {
				m.cached = true
				return m, nil
			}
			// An entry the driver rejects is damaged: drop it and compile.
			os.Remove(path)
		}
	}
	cubin, err := nv.compile(name, src, opts)
	if err != nil {
		return nil, err
	}
	if path != "" {
		// Best effort: a cache that cannot be written only costs a
		// recompile next time.
		_ = writeFileAtomic(path, cubin)
	}
	return d.LoadModule(name, cubin)
}

// cubinKey hashes everything that determines the cubin.
func cubinKey(name, src, nvrtcVersion string, opts []string) string {
	h := sha256.New()
	for _, s := range append([]string{name, src, nvrtcVersion}, opts...) {
		h.Write([]byte(s))
		h.Write([]byte{0})
	}
	return hex.EncodeToString(h.Sum(nil))
}

// cubinPath is the cache file for key, or "" when caching is off or there
// is no cache directory.
func (d *Device) cubinPath(key string) string {
	if d.opts.NoCache {
		return ""
	}
	dir := d.opts.CacheDir
	if dir == "" {
		base, err := os.UserCacheDir()
		if err != nil {
			return ""
		}
		dir = filepath.Join(base, "batchfit", "cubin")
	}
	return filepath.Join(dir, key+".cubin")
}

// maxCubinBytes caps what the cache may hand the driver. A cubin of the
// kernels here is well under a MiB; anything over 64 MiB is not one.
const maxCubinBytes = 64 << 20

// readCachedCubin reads the cache file at path and reports whether it holds
// what could be a cubin: a regular file of at most maxCubinBytes that
// starts with the header of a 64-bit little-endian ELF image for CUDA
// (EM_CUDA). Anything else (missing, unreadable, oversized, truncated or
// garbled) is a miss: the caller compiles and rewrites the entry, so a
// damaged cache costs a recompile and never reaches the driver.
func readCachedCubin(path string) ([]byte, bool) {
	fi, err := os.Stat(path)
	if err != nil || !fi.Mode().IsRegular() || fi.Size() > maxCubinBytes {
		return nil, false
	}
	f, err := os.Open(path)
	if err != nil {
		return nil, false
	}
	defer f.Close()
	// The file may have grown since Stat: read one byte past the cap to see.
	b, err := io.ReadAll(io.LimitReader(f, maxCubinBytes+1))
	if err != nil || len(b) > maxCubinBytes || !cubinHeader(b) {
		if err == nil {
			os.Remove(path)
		}
		return nil, false
	}
	return b, true
}

// cubinHeader reports whether b starts with an ELF64 little-endian header
// whose machine is EM_CUDA (190), as NVRTC's cubins do.
func cubinHeader(b []byte) bool {
	const (
		elf64HeaderSize = 64
		emCUDA          = 190
	)
	return len(b) >= elf64HeaderSize && string(b[:4]) == "\x7fELF" &&
		b[4] == 2 && b[5] == 1 && // ELFCLASS64, ELFDATA2LSB
		uint16(b[18])|uint16(b[19])<<8 == emCUDA // e_machine
}

// writeFileAtomic writes through a temporary file and a rename, so a
// concurrent reader never sees half a cubin.
func writeFileAtomic(path string, data []byte) error {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	f, err := os.CreateTemp(filepath.Dir(path), ".cubin-*")
	if err != nil {
		return err
	}
	_, werr := f.Write(data)
	cerr := f.Close()
	if werr != nil || cerr != nil {
		os.Remove(f.Name())
		if werr != nil {
			return werr
		}
		return cerr
	}
	return os.Rename(f.Name(), path)
}

// LoadModule loads a cubin (or PTX, or fatbin) image.
func (d *Device) LoadModule(name string, image []byte) (*Module, error) {
	if len(image) == 0 {
		return nil, graph.Errorf(graph.ErrAttr, "cuda: empty module image for %q", name)
	}
	m := &Module{d: d, name: name}
	err := d.do(func() error {
		return d.drv.check("cuModuleLoadData", d.drv.cuModuleLoadData(&m.mod, unsafe.Pointer(&image[0])))
	})
	if err != nil {
		return nil, err
	}
	return m, nil
}

// Name is the name the module was compiled or loaded under.
func (m *Module) Name() string { return m.name }

// Cached reports whether Compile took the cubin from the disk cache.
func (m *Module) Cached() bool { return m.cached }

// Function looks up a kernel by its (extern "C") name.
func (m *Module) Function(name string) (CUfunction, error) {
	if err := m.live(); err != nil {
		return 0, err
	}
	var f CUfunction
	err := m.d.do(func() error {
		return m.d.drv.check("cuModuleGetFunction", m.d.drv.cuModuleGetFunction(&f, m.mod, name))
	})
	return f, err
}

// ParamCount is how many parameters kernel fn takes, or −1 when the
// driver cannot say (before CUDA 12.4).
func (m *Module) ParamCount(fn CUfunction) (int, error) {
	if err := m.live(); err != nil {
		return 0, err
	}
	get := m.d.drv.cuFuncGetParamInfo
	if get == nil {
		return -1, nil
	}
	n := 0
	err := m.d.do(func() error {
		var off, size uintptr
		for n < maxKernelParams && get(fn, uintptr(n), &off, &size) == cudaSuccess {
			n++
		}
		return nil
	})
	return n, err
}

// Occupancy is how many blocks of threads threads (no dynamic shared
// memory) of kernel fn one multiprocessor holds at once: its registers',
// shared memory's and threads' limit.
func (m *Module) Occupancy(fn CUfunction, threads int) (int, error) {
	if err := m.live(); err != nil {
		return 0, err
	}
	var n int32
	err := m.d.do(func() error {
		return m.d.drv.check("cuOccupancyMaxActiveBlocksPerMultiprocessor",
			m.d.drv.cuOccupancyMaxActiveBlocksPerMultiprocessor(&n, fn, int32(threads), 0))
	})
	return int(n), err
}

// maxKernelParams bounds ParamCount's probe; no kernel here takes half as
// many.
const maxKernelParams = 64

// Launch queues fn on the device's default stream with the given grid and
// block dimensions and dynamic shared memory. Arguments are passed by value
// in kernel-parameter order; accepted types are CUdeviceptr, alloc.Ptr,
// *alloc.Block (its address), int32, uint32, int64, uint64, float32,
// float64 and the kernel structs Strided, Strided2, ReduceGeom and Window. Launch returns before the kernel runs: errors inside the kernel
// surface at the next synchronising call.
func (m *Module) Launch(fn CUfunction, grid, block [3]uint32, sharedMem uint32, args ...any) error {
	if err := m.live(); err != nil {
		return err
	}
	p, err := packParams(args)
	if err != nil {
		return err
	}
	return m.d.do(func() error { return m.d.launch(fn, grid, block, sharedMem, p) })
}

// launch calls cuLaunchKernel on stream 0, or on the capture stream while
// the executor captures a CUDA graph; it runs on the device thread.
func (d *Device) launch(fn CUfunction, grid, block [3]uint32, sharedMem uint32, p *kernelParams) error {
	var pp *unsafe.Pointer
	if len(p.ptrs) > 0 {
		pp = &p.ptrs[0]
	}
	return d.drv.check("cuLaunchKernel", d.drv.cuLaunchKernel(fn,
		grid[0], grid[1], grid[2], block[0], block[1], block[2], sharedMem, d.capture, pp, nil))
}

// Close unloads the module. Its functions must not be launched afterwards.
func (m *Module) Close() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return nil
	}
	m.closed = true
	return m.d.do(func() error { return m.d.drv.check("cuModuleUnload", m.d.drv.cuModuleUnload(m.mod)) })
}

func (m *Module) live() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return fmt.Errorf("%w: module %q", ErrClosed, m.name)
	}
	return nil
}

// kernelParams is cuLaunchKernel's void **kernelParams: one pointer per
// argument to a copy of its value. A scalar fits 8 bytes and is stored at
// the start of its slot, which is where a smaller value lies on a
// little-endian host (all CUDA hosts); a struct is copied to memory of its
// own, which ptrs keeps alive. The driver copies the values during
// cuLaunchKernel, so they need to live only until it returns.
type kernelParams struct {
	vals []uint64
	ptrs []unsafe.Pointer
}

func packParams(args []any) (*kernelParams, error) {
	p := &kernelParams{vals: make([]uint64, len(args)), ptrs: make([]unsafe.Pointer, len(args))}
	for i, a := range args {
		switch v := a.(type) {
		case CUdeviceptr:
			p.vals[i] = uint64(v)
		case alloc.Ptr:
			p.vals[i] = uint64(v)
		case *alloc.Block:
			if v == nil {
				return nil, graph.Errorf(graph.ErrNilTensor, "cuda: kernel argument %d is a nil block", i)
			}
			p.vals[i] = uint64(v.Ptr())
		case int32:
			p.vals[i] = uint64(uint32(v))
		case uint32:
			p.vals[i] = uint64(v)
		case int64:
			p.vals[i] = uint64(v)
		case uint64:
			p.vals[i] = v
		case float32:
			p.vals[i] = uint64(math.Float32bits(v))
		case float64:
			p.vals[i] = math.Float64bits(v)
		case Strided:
			p.ptrs[i] = unsafe.Pointer(&v)
			continue
		case Strided2:
			p.ptrs[i] = unsafe.Pointer(&v)
			continue
		case ReduceGeom:
			p.ptrs[i] = unsafe.Pointer(&v)
			continue
		case Window:
			p.ptrs[i] = unsafe.Pointer(&v)
			continue
		case unscaleList:
			p.ptrs[i] = unsafe.Pointer(&v)
			continue
		case optimList:
			p.ptrs[i] = unsafe.Pointer(&v)
			continue
		case scalarList:
			p.ptrs[i] = unsafe.Pointer(&v)
			continue
		default:
			return nil, graph.Errorf(graph.ErrDType, "cuda: kernel argument %d has unsupported type %T", i, a)
		}
		p.ptrs[i] = unsafe.Pointer(&p.vals[i])
	}
	return p, nil
}
