// GPU page quantize / dequantize throughput, per codec, beside a device-to-device copy measured in
// the same run. Effective bytes = bytes read + bytes written (input, pages with their scales).
// Target: >= 3.5 TB/s effective (docs/performance.md).

#include <algorithm>
#include <cstdio>
#include <vector>

#include <benchmark/benchmark.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "cuda/bench_cuda_timing.cuh"
#include "kvkit/cuda/quantize_pages.cuh"
#include "kvkit/layout/page_layout.hpp"
#include "kvkit/quant/codecs.hpp"

namespace {

constexpr double target_bytes_per_s = 3.5e12;
constexpr std::int32_t num_pages = 16384; // 16 tokens x 8 heads x 128: 1 GiB of bf16 K+V

__global__ void fill(__nv_bfloat16* x, std::size_t n, unsigned seed) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    unsigned h = static_cast<unsigned>(i) * 2654435761U ^ seed;
    h ^= h >> 15;
    h *= 2246822519U;
    h ^= h >> 13;
    x[i] = __float2bfloat16((static_cast<float>(h & 0xFFFFU) / 32768.0F - 1.0F) * 3.0F);
  }
}

template <class Layout>
void run(benchmark::State& state, bool quantize) {
  if (!kvkit_bench::gpu_available()) {
    state.SkipWithError("no CUDA device");
    return;
  }
  const Layout layout(16, 8, 128);
  const auto elems =
      static_cast<std::size_t>(num_pages) * static_cast<std::size_t>(layout.elements());
  const auto cache_bytes =
      static_cast<std::size_t>(num_pages) * static_cast<std::size_t>(layout.bytes_per_page());
  __nv_bfloat16 *k = nullptr, *v = nullptr;
  std::byte* cache = nullptr;
  std::int32_t* ids = nullptr;
  float* scales = nullptr;
  if (cudaMalloc(&k, elems * 2) != cudaSuccess || cudaMalloc(&v, elems * 2) != cudaSuccess ||
      cudaMalloc(&cache, cache_bytes) != cudaSuccess ||
      cudaMalloc(&ids, num_pages * sizeof(std::int32_t)) != cudaSuccess ||
      cudaMalloc(&scales, 64 * sizeof(float)) != cudaSuccess) {
    state.SkipWithError("cudaMalloc failed");
    return;
  }
  fill<<<2048, 256>>>(k, elems, 1);
  fill<<<2048, 256>>>(v, elems, 2);
  // Pages scattered over the cache, as a block table hands them out.
  std::vector<std::int32_t> host_ids(num_pages);
  for (std::int32_t i = 0; i < num_pages; ++i) {
    host_ids[static_cast<std::size_t>(i)] = static_cast<std::int32_t>((i * 7919LL) % num_pages);
  }
  cudaMemcpy(ids, host_ids.data(), host_ids.size() * 4, cudaMemcpyHostToDevice);
  const std::vector<float> host_scales(64, 3.0F / 448.0F);
  cudaMemcpy(scales, host_scales.data(), 64 * 4, cudaMemcpyHostToDevice);
  const kvkit::cuda::page_batch<Layout, __nv_bfloat16> b{layout,    cache, num_pages, ids,
                                                         num_pages, k,     v,         scales};
  if (kvkit::cuda::quantize_pages(b, nullptr) != cudaSuccess ||
      cudaDeviceSynchronize() != cudaSuccess) {
    state.SkipWithError("launch failed");
    return;
  }
  // The peer: a device-to-device copy of the bf16 K and V, in the same run.
  const double copy_s = kvkit_bench::median_seconds(
      [&] { cudaMemcpyAsync(k, v, elems * 2, cudaMemcpyDeviceToDevice); }, 20);
  fill<<<2048, 256>>>(k, elems, 1);
  const double copy_rate = 2.0 * static_cast<double>(elems) * 2 / copy_s;
  const double bytes = static_cast<double>(elems) * 2 * 2 + static_cast<double>(cache_bytes);
  kvkit_bench::time_launches(state, [&] {
    return quantize ? kvkit::cuda::quantize_pages(b, nullptr)
                    : kvkit::cuda::dequantize_pages(b, nullptr);
  });
  kvkit_bench::report_bandwidth(state, bytes, copy_rate, target_bytes_per_s);
  cudaFree(k);
  cudaFree(v);
  cudaFree(cache);
  cudaFree(ids);
  cudaFree(scales);
}

using kvkit::paged_layout;
template <class Layout>
void BM_quantize_pages(benchmark::State& state) {
  run<Layout>(state, true);
}
template <class Layout>
void BM_dequantize_pages(benchmark::State& state) {
  run<Layout>(state, false);
}

#define KVKIT_PAGE_BENCH(NAME, LAYOUT)                                                             \
  BENCHMARK(BM_quantize_pages<LAYOUT>)                                                             \
      ->Name("quantize_pages/" NAME)                                                               \
      ->UseManualTime()                                                                            \
      ->Unit(benchmark::kMicrosecond);                                                             \
  BENCHMARK(BM_dequantize_pages<LAYOUT>)                                                           \
      ->Name("dequantize_pages/" NAME)                                                             \
      ->UseManualTime()                                                                            \
      ->Unit(benchmark::kMicrosecond);

KVKIT_PAGE_BENCH("fp16", paged_layout<kvkit::fp16_codec>)
KVKIT_PAGE_BENCH("fp8_e4m3", paged_layout<kvkit::fp8_e4m3_codec>)
KVKIT_PAGE_BENCH("int8", paged_layout<kvkit::int8_codec>)
KVKIT_PAGE_BENCH("int4_g32", paged_layout<kvkit::int4_group_codec<32>>)
KVKIT_PAGE_BENCH("int4_g128", paged_layout<kvkit::int4_group_codec<128>>)
using kivi = paged_layout<kvkit::int4_channel_codec, kvkit::int4_group_codec<128>>;
KVKIT_PAGE_BENCH("int4_channel_k+int4_g128_v", kivi)

} // namespace
