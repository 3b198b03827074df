// A recorded graph's small memset nodes as kernel nodes (andrea/engines/graphs.py): cuBLASLt records a memset of a
// few bytes of its workspace before some of its products, and a memset node between two kernels leaves the
// device idle for microseconds about it, where one kernel after another leaves it none.
#include "common.cuh"

#define MEMSET_THREADS 256

// The memset node's own arguments (CUDA_MEMSET_NODE_PARAMS): `height` rows of `width` elements of `element_size`
// bytes (1, 2 or 4) each set to `value`, a row `pitch` bytes after the one before. Grid-stride.
extern "C" __global__ void __launch_bounds__(MEMSET_THREADS)
k_memset(unsigned char* dst, unsigned long long pitch, unsigned value, unsigned element_size, unsigned long long width,
         unsigned long long height) {
    GRID_STRIDE_LOOP(i, static_cast<long long>(width * height)) {
        unsigned char* p = dst + (i / width) * pitch + (i % width) * element_size;
        if (element_size == 4) *reinterpret_cast<unsigned*>(p) = value;
        else if (element_size == 2) *reinterpret_cast<unsigned short*>(p) = static_cast<unsigned short>(value);
        else *p = static_cast<unsigned char>(value);
    }
}
