// A kernel that compiles with a warning: `kernel_check` treats warnings as
// errors, so it has to fail on this one too (scripts/gpu-check.sh kernels).
extern "C" __global__ void warns(float* out, int n) {
    int unused = 3;
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = 1.0f;
}
