// write_kv throughput per codec: 65536 new tokens (8 KV heads x 128 channels, bf16 K and V) into
// scattered slots, beside a device-to-device copy of the same bf16 data measured in the same run.
// Effective bytes = K and V read + codes and scales written. Target: >= 3.5 TB/s.

#include <algorithm>
#include <numeric>
#include <vector>

#include <benchmark/benchmark.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "cuda/bench_cuda_timing.cuh"
#include "kvkit/cuda/write_kv.cuh"
#include "kvkit/layout/page_layout.hpp"
#include "kvkit/quant/codecs.hpp"

namespace {

constexpr std::int32_t tokens = 65536;
constexpr std::int32_t page_size = 16;
constexpr double target = 3.5e12;

template <class Layout>
void BM_write_kv(benchmark::State& state) {
  if (!kvkit_bench::gpu_available()) {
    state.SkipWithError("no CUDA device");
    return;
  }
  const Layout layout(page_size, 8, 128);
  const std::int32_t capacity = tokens / page_size;
  const auto elems = static_cast<std::size_t>(tokens) * 8 * 128;
  __nv_bfloat16 *k = nullptr, *v = nullptr;
  std::byte* cache = nullptr;
  std::int64_t* slots = nullptr;
  float* scales = nullptr;
  cudaMalloc(&k, elems * 2);
  cudaMalloc(&v, elems * 2);
  cudaMalloc(&cache, static_cast<std::size_t>(capacity * layout.bytes_per_page()));
  cudaMalloc(&slots, tokens * sizeof(std::int64_t));
  cudaMalloc(&scales, 16 * sizeof(float));
  std::vector<__nv_bfloat16> host(elems);
  for (std::size_t i = 0; i < elems; ++i) {
    host[i] = __float2bfloat16(static_cast<float>((i * 2654435761U) % 2001) / 1000.0F - 1.0F);
  }
  cudaMemcpy(k, host.data(), elems * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(v, host.data(), elems * 2, cudaMemcpyHostToDevice);
  // Pages in a scattered order, tokens of a page consecutive (a prefill of many sequences).
  std::vector<std::int64_t> page_order(static_cast<std::size_t>(capacity));
  std::iota(page_order.begin(), page_order.end(), 0);
  std::vector<std::int64_t> host_slots(tokens);
  for (std::int32_t t = 0; t < tokens; ++t) {
    host_slots[static_cast<std::size_t>(t)] =
        (page_order[static_cast<std::size_t>((t / page_size) * 7919 % capacity)]) * page_size +
        t % page_size;
  }
  cudaMemcpy(slots, host_slots.data(), tokens * sizeof(std::int64_t), cudaMemcpyHostToDevice);
  const std::vector<float> host_scales(16, 2.0F / 448.0F);
  cudaMemcpy(scales, host_scales.data(), 64, cudaMemcpyHostToDevice);
  const kvkit::cuda::kv_write<Layout, __nv_bfloat16> w{layout, cache, capacity, slots,
                                                       tokens, k,     v,        scales};
  // Peer: device copy of the bf16 K and V.
  const double copy_s = kvkit_bench::median_seconds(
      [&] { cudaMemcpyAsync(k, v, elems * 2, cudaMemcpyDeviceToDevice); });
  const double copy_rate = 2.0 * static_cast<double>(elems) * 2 / copy_s;
  kvkit_bench::time_launches(state, [&] { return kvkit::cuda::write_kv(w, nullptr); });
  const double bytes = 2.0 * static_cast<double>(elems) * 2 +
                       static_cast<double>(capacity) * static_cast<double>(layout.bytes_per_page());
  kvkit_bench::report_bandwidth(state, bytes, copy_rate, target);
  cudaFree(k);
  cudaFree(v);
  cudaFree(cache);
  cudaFree(slots);
  cudaFree(scales);
}

using kvkit::paged_layout;
BENCHMARK(BM_write_kv<paged_layout<kvkit::fp16_codec>>)
    ->Name("write_kv/fp16")
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_write_kv<paged_layout<kvkit::fp8_e4m3_codec>>)
    ->Name("write_kv/fp8_e4m3")
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_write_kv<paged_layout<kvkit::int8_codec>>)
    ->Name("write_kv/int8")
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_write_kv<paged_layout<kvkit::int4_group_codec<32>>>)
    ->Name("write_kv/int4_g32")
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);

} // namespace
