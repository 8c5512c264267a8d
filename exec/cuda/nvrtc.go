package cuda

import (
	"fmt"
	"runtime"
	"sync"
	"unsafe"
)

type (
	nvrtcProgram uintptr // opaque program handle
	nvrtcResult  int32
)

const nvrtcSuccess = 0

// nvrtcLib holds the libnvrtc entry points; C signatures in the comments.
type nvrtcLib struct {
	// nvrtcResult nvrtcVersion(int *major, int *minor)
	nvrtcVersion func(major, minor *int32) nvrtcResult
	// nvrtcResult nvrtcCreateProgram(nvrtcProgram *prog, const char *src, const char *name,
	//     int numHeaders, const char * const *headers, const char * const *includeNames)
	nvrtcCreateProgram func(prog *nvrtcProgram, src, name string, numHeaders int32,
		headers, includeNames unsafe.Pointer) nvrtcResult
	// nvrtcResult nvrtcCompileProgram(nvrtcProgram prog, int numOptions, const char * const *options)
	nvrtcCompileProgram func(prog nvrtcProgram, numOptions int32, options unsafe.Pointer) nvrtcResult
	// nvrtcResult nvrtcGetProgramLogSize(nvrtcProgram prog, size_t *logSizeRet)
	nvrtcGetProgramLogSize func(prog nvrtcProgram, size *uintptr) nvrtcResult
	// nvrtcResult nvrtcGetProgramLog(nvrtcProgram prog, char *log)
	nvrtcGetProgramLog func(prog nvrtcProgram, log *byte) nvrtcResult
	// nvrtcResult nvrtcGetCUBINSize(nvrtcProgram prog, size_t *cubinSizeRet)
	nvrtcGetCUBINSize func(prog nvrtcProgram, size *uintptr) nvrtcResult
	// nvrtcResult nvrtcGetCUBIN(nvrtcProgram prog, char *cubin)
	nvrtcGetCUBIN func(prog nvrtcProgram, cubin *byte) nvrtcResult
	// nvrtcResult nvrtcDestroyProgram(nvrtcProgram *prog)
	nvrtcDestroyProgram func(prog *nvrtcProgram) nvrtcResult
	// const char *nvrtcGetErrorString(nvrtcResult result)
	nvrtcGetErrorString func(r nvrtcResult) string

	version string // "13.0"
}

func (n *nvrtcLib) symbols() []symbol {
	return []symbol{
		sym(&n.nvrtcVersion, "nvrtcVersion"),
		sym(&n.nvrtcCreateProgram, "nvrtcCreateProgram"),
		sym(&n.nvrtcCompileProgram, "nvrtcCompileProgram"),
		sym(&n.nvrtcGetProgramLogSize, "nvrtcGetProgramLogSize"),
		sym(&n.nvrtcGetProgramLog, "nvrtcGetProgramLog"),
		sym(&n.nvrtcGetCUBINSize, "nvrtcGetCUBINSize"),
		sym(&n.nvrtcGetCUBIN, "nvrtcGetCUBIN"),
		sym(&n.nvrtcDestroyProgram, "nvrtcDestroyProgram"),
		sym(&n.nvrtcGetErrorString, "nvrtcGetErrorString"),
	}
}

func (n *nvrtcLib) check(fn string, r nvrtcResult) error {
	if r == nvrtcSuccess {
		return nil
	}
	return &NVRTCError{Func: fn, Code: int(r), Name: n.nvrtcGetErrorString(r)}
}

var nvrtcOnce struct {
	sync.Once
	n   *nvrtcLib
	err error
}

// loadNVRTC dlopens libnvrtc, newest first, and binds its functions.
func loadNVRTC() (*nvrtcLib, error) {
	nvrtcOnce.Do(func() {
		lib, err := dlopen("libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so.11.2", "libnvrtc.so")
		if err != nil {
			nvrtcOnce.err = fmt.Errorf("%w: cannot load libnvrtc: %v", ErrNoLibrary, err)
			return
		}
		n := new(nvrtcLib)
		if err := bind(lib, n.symbols()); err != nil {
			nvrtcOnce.err = fmt.Errorf("%w: libnvrtc: %v", ErrNoLibrary, err)
			return
		}
		var major, minor int32
		if err := n.check("nvrtcVersion", n.nvrtcVersion(&major, &minor)); err != nil {
			nvrtcOnce.err = err
			return
		}
		n.version = fmt.Sprintf("%d.%d", major, minor)
		nvrtcOnce.n = n
	})
	return nvrtcOnce.n, nvrtcOnce.err
}

// compile turns CUDA C source into a cubin. NVRTC needs no context, so
// this runs on the caller's goroutine.
func (n *nvrtcLib) compile(name, src string, options []string) ([]byte, error) {
	var prog nvrtcProgram
	if err := n.check("nvrtcCreateProgram", n.nvrtcCreateProgram(&prog, src, name, 0, nil, nil)); err != nil {
		return nil, err
	}
	defer n.nvrtcDestroyProgram(&prog)

	// options is a const char *const *: NUL-terminated copies and an array
	// of pointers to them, all Go memory kept alive across the call.
	bufs := make([][]byte, len(options))
	ptrs := make([]*byte, len(options)+1)
	for i, o := range options {
		bufs[i] = cString(o)
		ptrs[i] = &bufs[i][0]
	}
	r := n.nvrtcCompileProgram(prog, int32(len(options)), unsafe.Pointer(&ptrs[0]))
	runtime.KeepAlive(bufs)
	runtime.KeepAlive(ptrs)
	if r != nvrtcSuccess {
		e := n.check("nvrtcCompileProgram", r).(*NVRTCError)
		e.Log = n.programLog(prog)
		return nil, e
	}
	var size uintptr
	if err := n.check("nvrtcGetCUBINSize", n.nvrtcGetCUBINSize(prog, &size)); err != nil {
		return nil, err
	}
	if size == 0 {
		return nil, &NVRTCError{Func: "nvrtcGetCUBINSize", Name: "empty cubin (was a virtual architecture given?)"}
	}
	cubin := make([]byte, size)
	if err := n.check("nvrtcGetCUBIN", n.nvrtcGetCUBIN(prog, &cubin[0])); err != nil {
		return nil, err
	}
	return cubin, nil
}

// programLog returns the compiler's log, without its trailing NUL.
func (n *nvrtcLib) programLog(prog nvrtcProgram) string {
	var size uintptr
	if n.nvrtcGetProgramLogSize(prog, &size) != nvrtcSuccess || size <= 1 {
		return ""
	}
	buf := make([]byte, size)
	if n.nvrtcGetProgramLog(prog, &buf[0]) != nvrtcSuccess {
		return ""
	}
	return goString(&buf[0])
}
