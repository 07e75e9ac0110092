// A kernel that must not compile: `kernel_check` run on it has to fail,
// which proves the check can fail (scripts/gpu-check.sh kernels).
extern "C" __global__ void broken(float* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = undefined_value;
}
