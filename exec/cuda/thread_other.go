//go:build !linux

package cuda

// gettid reports no thread id where the package has no driver to call
// (libcuda.so.1 is Linux's), so do always hops to the device goroutine.
func gettid() int64 { return 0 }
