// How fast a GPU can bring missed experts over the link, three ways, for a decode step's few experts:
//   copy    cudaMemcpyAsync of each expert from pinned host memory (the copy engine; needs the ids on the host)
//   gather  a kernel copies the experts from mapped host memory into VRAM with 16-byte loads (ids on the GPU)
//   narrow  a kernel reads the experts from mapped host memory with 4-byte loads, as a quantized matrix-vector
//           kernel does, and sums them (what the cache's misses on the GPU do today)
// For 1..32 experts of EXPERT bytes picked at random from a pool larger than any cache, each way's time per
// step (median of the repetitions) and the rate. Decides whether staging the misses in VRAM before the expert
// kernels (gather) would beat reading them in place (narrow).
//
//   nvcc -O2 -arch=sm_90 benchmarks/native/bench_mapped_read.cu -o bench-mapped-read
//   bench-mapped-read [--expert-bytes N] [--pool-gib G] [--reps R] [--blocks B]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#define CHECK(x)                                                                                     \
    do {                                                                                             \
        cudaError_t err_ = (x);                                                                      \
        if (err_ != cudaSuccess) {                                                                   \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(err_));     \
            exit(1);                                                                                 \
        }                                                                                            \
    } while (0)

// blockIdx.y: the expert; the blocks of x stride over its 16-byte words
__global__ void gather_experts(const uint4 * const * src, uint4 * dst, size_t words) {
    const uint4 * s = src[blockIdx.y];
    uint4 * d = dst + (size_t) blockIdx.y * words;
    for (size_t i = (size_t) blockIdx.x * blockDim.x + threadIdx.x; i < words; i += (size_t) gridDim.x * blockDim.x) {
        d[i] = s[i];
    }
}

// 4-byte loads, one running sum per thread, one word per block written (so the loads are not dropped)
__global__ void narrow_read(const uint32_t * const * src, uint32_t * out, size_t words) {
    const uint32_t * s = src[blockIdx.y];
    uint32_t acc = 0;
    for (size_t i = (size_t) blockIdx.x * blockDim.x + threadIdx.x; i < words; i += (size_t) gridDim.x * blockDim.x) {
        acc += s[i];
    }
    __shared__ uint32_t sum;
    if (threadIdx.x == 0) {
        sum = 0;
    }
    __syncthreads();
    atomicAdd(&sum, acc);
    __syncthreads();
    if (threadIdx.x == 0) {
        out[blockIdx.y * gridDim.x + blockIdx.x] = sum;
    }
}

static double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

int main(int argc, char ** argv) {
    size_t expert_bytes = 2654208; // one expert of the 30B shape at Q4_0: 3 x 768 x 2048 weights
    double pool_gib = 4.0;
    int reps = 100;
    int blocks = 0; // per expert; 0: enough for every SM to hold a few
    for (int i = 1; i < argc; i++) {
        const std::string a = argv[i];
        if (i + 1 >= argc) {
            fprintf(stderr, "%s needs a value\n", a.c_str());
            return 2;
        }
        if (a == "--expert-bytes") {
            expert_bytes = strtoull(argv[++i], nullptr, 10);
        } else if (a == "--pool-gib") {
            pool_gib = atof(argv[++i]);
        } else if (a == "--reps") {
            reps = atoi(argv[++i]);
        } else if (a == "--blocks") {
            blocks = atoi(argv[++i]);
        } else {
            fprintf(stderr, "unknown option %s (--expert-bytes N, --pool-gib G, --reps R, --blocks B)\n", a.c_str());
            return 2;
        }
    }
    expert_bytes = (expert_bytes + 15) / 16 * 16;
    const size_t pool_experts = (size_t) (pool_gib * (1ull << 30)) / expert_bytes;
    const int max_n = 32;
    if (pool_experts < (size_t) max_n || reps < 1) {
        fprintf(stderr, "the pool must hold at least %d experts and --reps be >= 1\n", max_n);
        return 2;
    }
    cudaDeviceProp prop{};
    CHECK(cudaGetDeviceProperties(&prop, 0));
    if (blocks <= 0) {
        blocks = 2 * prop.multiProcessorCount;
    }

    uint8_t * host = nullptr;
    CHECK(cudaHostAlloc((void **) &host, pool_experts * expert_bytes, cudaHostAllocMapped));
    for (size_t i = 0; i < pool_experts * expert_bytes; i += 4096) {
        host[i] = (uint8_t) i; // touch every page
    }
    uint8_t * host_dev = nullptr;
    CHECK(cudaHostGetDevicePointer((void **) &host_dev, host, 0));
    uint8_t * staging = nullptr;
    CHECK(cudaMalloc((void **) &staging, (size_t) max_n * expert_bytes));
    const void ** ptrs_dev = nullptr;
    CHECK(cudaMalloc((void **) &ptrs_dev, max_n * sizeof(void *)));
    uint32_t * out = nullptr;
    CHECK(cudaMalloc((void **) &out, (size_t) max_n * blocks * sizeof(uint32_t)));
    cudaStream_t stream;
    CHECK(cudaStreamCreate(&stream));
    cudaEvent_t t0, t1;
    CHECK(cudaEventCreate(&t0));
    CHECK(cudaEventCreate(&t1));

    printf("device: %s (%d SMs); expert %zu bytes; pool %zu experts (%.1f GiB pinned, mapped); %d blocks per "
           "expert; median of %d steps\n", prop.name, prop.multiProcessorCount, expert_bytes, pool_experts,
           pool_experts * (double) expert_bytes / (1ull << 30), blocks, reps);
    printf("| experts | copy us | copy GB/s | gather us | gather GB/s | narrow us | narrow GB/s |\n");
    printf("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n");

    std::mt19937_64 rng(42);
    std::uniform_int_distribution<size_t> pick(0, pool_experts - 1);
    const size_t words16 = expert_bytes / 16, words4 = expert_bytes / 4;
    for (int n : {1, 2, 4, 8, 16, 32}) {
        std::vector<double> copy_us, gather_us, narrow_us;
        for (int r = 0; r < reps + 2; r++) { // the first two warm up
            std::vector<const void *> ids(n);
            std::vector<size_t> idx(n);
            for (int k = 0; k < n; k++) {
                idx[k] = pick(rng);
                ids[k] = host_dev + idx[k] * expert_bytes;
            }
            CHECK(cudaMemcpyAsync(ptrs_dev, ids.data(), n * sizeof(void *), cudaMemcpyHostToDevice, stream));
            CHECK(cudaStreamSynchronize(stream));
            float ms = 0.0f;

            CHECK(cudaEventRecord(t0, stream));
            for (int k = 0; k < n; k++) {
                CHECK(cudaMemcpyAsync(staging + (size_t) k * expert_bytes, host + idx[k] * expert_bytes, expert_bytes,
                                      cudaMemcpyHostToDevice, stream));
            }
            CHECK(cudaEventRecord(t1, stream));
            CHECK(cudaEventSynchronize(t1));
            CHECK(cudaEventElapsedTime(&ms, t0, t1));
            if (r >= 2) copy_us.push_back(ms * 1e3);

            CHECK(cudaEventRecord(t0, stream));
            gather_experts<<<dim3(blocks, n), 256, 0, stream>>>((const uint4 * const *) ptrs_dev, (uint4 *) staging, words16);
            CHECK(cudaEventRecord(t1, stream));
            CHECK(cudaEventSynchronize(t1));
            CHECK(cudaGetLastError());
            CHECK(cudaEventElapsedTime(&ms, t0, t1));
            if (r >= 2) gather_us.push_back(ms * 1e3);

            CHECK(cudaEventRecord(t0, stream));
            narrow_read<<<dim3(blocks, n), 256, 0, stream>>>((const uint32_t * const *) ptrs_dev, out, words4);
            CHECK(cudaEventRecord(t1, stream));
            CHECK(cudaEventSynchronize(t1));
            CHECK(cudaGetLastError());
            CHECK(cudaEventElapsedTime(&ms, t0, t1));
            if (r >= 2) narrow_us.push_back(ms * 1e3);
        }
        const double bytes = (double) n * expert_bytes;
        const double c = median(copy_us), g = median(gather_us), w = median(narrow_us);
        printf("| %d | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f |\n", n, c, bytes / c / 1e3, g, bytes / g / 1e3, w,
               bytes / w / 1e3);
    }
    // the gather's copy must be the host's bytes (else its rate means nothing)
    {
        std::vector<const void *> ids = {host_dev + 3 * expert_bytes, host_dev + 1 * expert_bytes};
        for (size_t i = 0; i < 4 * expert_bytes; i++) {
            host[i] = (uint8_t) (i * 2654435761u >> 13);
        }
        CHECK(cudaMemcpy(ptrs_dev, ids.data(), 2 * sizeof(void *), cudaMemcpyHostToDevice));
        gather_experts<<<dim3(blocks, 2), 256, 0, stream>>>((const uint4 * const *) ptrs_dev, (uint4 *) staging, words16);
        CHECK(cudaStreamSynchronize(stream));
        std::vector<uint8_t> back(2 * expert_bytes);
        CHECK(cudaMemcpy(back.data(), staging, back.size(), cudaMemcpyDeviceToHost));
        if (memcmp(back.data(), host + 3 * expert_bytes, expert_bytes) != 0 ||
            memcmp(back.data() + expert_bytes, host + expert_bytes, expert_bytes) != 0) {
            fprintf(stderr, "the gathered experts differ from the host's bytes\n");
            return 1;
        }
        printf("gathered bytes checked against the host's: equal\n");
    }
    CHECK(cudaDeviceSynchronize());
    CHECK(cudaFreeHost(host));
    CHECK(cudaFree(staging));
    CHECK(cudaFree((void *) ptrs_dev));
    CHECK(cudaFree(out));
    return 0;
}
