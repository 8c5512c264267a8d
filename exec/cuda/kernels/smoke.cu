// Smoke-test kernels: they prove that NVRTC compilation, module loading and
// launches work. Compiled with -default-device, --std=c++17.

// y = a*x + y over n elements, with a grid-stride loop so any grid covers n.
extern "C" __global__ void axpy(float a, const float* x, float* y, long long n) {
    long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        y[i] = a * x[i] + y[i];
    }
}

// An empty kernel, to time launch overhead.
extern "C" __global__ void noop() {}
