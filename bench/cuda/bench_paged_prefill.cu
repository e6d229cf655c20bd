// paged_prefill throughput: B sequences of L cached tokens, each with its last Q tokens as queries
// (Q = L: a whole prompt; Q < L: an extend or a speculative verify), 8 KV heads of 128 channels,
// GQA group 4, pages of 16 tokens in a scattered order, bf16 queries. The figure is TFLOP/s of the
// causal attention's useful work (4 * head_dim * query heads per (query, key seen) pair); beside it
// the card's dense 16-bit tensor-core peak (SMs * clock * 4096 FLOP a cycle, Hopper's rate) and the
// ratio, and, where KVKIT_SDPA_PREFILL_CSV names the file bench/cuda/sdpa_prefill_peer.py wrote in
// the same run, PyTorch's scaled_dot_product_attention on contiguous bf16 K/V of the same shape and
// the ratio of its time to ours (x_sdpa > 1: faster than SDPA).

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <map>
#include <numeric>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include <benchmark/benchmark.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "cuda/bench_cuda_timing.cuh"
#include "kvkit/cuda/paged_prefill.cuh"
#include "kvkit/cuda/write_kv.cuh"
#include "kvkit/layout/page_layout.hpp"
#include "kvkit/quant/codecs.hpp"

namespace {

constexpr std::int32_t kv_heads = 8;
constexpr std::int32_t head_dim = 128;
constexpr std::int32_t group = 4;
constexpr std::int32_t q_heads = kv_heads * group;
constexpr std::int32_t page_size = 16;

// PyTorch SDPA seconds per (B, L, Q) from KVKIT_SDPA_PREFILL_CSV ("B,L,Q,seconds,backend").
const std::map<std::tuple<int, int, int>, double>& sdpa_seconds() {
  static const std::map<std::tuple<int, int, int>, double> table = [] {
    std::map<std::tuple<int, int, int>, double> t;
    const char* path = std::getenv("KVKIT_SDPA_PREFILL_CSV");
    if (path == nullptr) {
      return t;
    }
    std::ifstream in(path);
    std::string line;
    while (std::getline(in, line)) {
      std::istringstream row(line);
      int b = 0;
      int l = 0;
      int q = 0;
      double s = 0.0;
      char c1 = 0;
      char c2 = 0;
      char c3 = 0;
      if (row >> b >> c1 >> l >> c2 >> q >> c3 >> s && c1 == ',' && c2 == ',' && c3 == ',' &&
          s > 0.0) {
        t[{b, l, q}] = s;
      }
    }
    return t;
  }();
  return table;
}

// The device's dense 16-bit tensor-core peak in FLOP/s at its maximum SM clock, for compute
// capability 9 (4096 FLOP a cycle an SM with wgmma; mma.sync, which these kernels use, reaches
// part of it); 0 for other devices.
double tensor_peak() {
  int device = 0;
  int major = 0;
  int sms = 0;
  int khz = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, device) != cudaSuccess || major != 9) {
    return 0.0;
  }
  return static_cast<double>(sms) * khz * 1e3 * 4096.0;
}

template <class Layout>
void BM_paged_prefill(benchmark::State& state) {
  if (!kvkit_bench::gpu_available()) {
    state.SkipWithError("no CUDA device");
    return;
  }
  const auto batch = static_cast<std::int32_t>(state.range(0));
  const auto len = static_cast<std::int32_t>(state.range(1));
  const auto queries = static_cast<std::int32_t>(state.range(2));
  const Layout layout(page_size, kv_heads, head_dim);
  const std::int32_t pages_per_seq = (len + page_size - 1) / page_size;
  const std::int32_t capacity = batch * pages_per_seq;
  const std::int64_t tokens = static_cast<std::int64_t>(batch) * len;
  const auto kv_elems = static_cast<std::size_t>(tokens) * kv_heads * head_dim;
  const auto q_elems = static_cast<std::size_t>(batch) * queries * q_heads * head_dim;
  __nv_bfloat16 *k = nullptr, *v = nullptr, *q = nullptr, *out = nullptr;
  std::byte* cache = nullptr;
  std::int64_t* slots = nullptr;
  std::int32_t *indptr = nullptr, *indices = nullptr, *last = nullptr, *qo = nullptr;
  float *scales = nullptr, *lse = nullptr;
  cudaMalloc(&k, kv_elems * 2);
  cudaMalloc(&v, kv_elems * 2);
  cudaMalloc(&q, q_elems * 2);
  cudaMalloc(&out, q_elems * 2);
  cudaMalloc(&lse, q_elems / head_dim * sizeof(float));
  cudaMalloc(&cache, static_cast<std::size_t>(capacity) * layout.bytes_per_page());
  cudaMalloc(&slots, static_cast<std::size_t>(tokens) * sizeof(std::int64_t));
  cudaMalloc(&indptr, (batch + 1) * sizeof(std::int32_t));
  cudaMalloc(&indices, capacity * sizeof(std::int32_t));
  cudaMalloc(&last, batch * sizeof(std::int32_t));
  cudaMalloc(&qo, (batch + 1) * sizeof(std::int32_t));
  cudaMalloc(&scales, 2 * kv_heads * sizeof(float));
  // Values near a unit normal's range, K and V and queries alike, from a fixed hash.
  std::vector<__nv_bfloat16> host(std::max(kv_elems, q_elems));
  for (std::size_t i = 0; i < host.size(); ++i) {
    host[i] = __float2bfloat16(static_cast<float>((i * 2654435761U) % 2001) / 1000.0F - 1.0F);
  }
  cudaMemcpy(k, host.data(), kv_elems * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(v, host.data(), kv_elems * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(q, host.data(), q_elems * 2, cudaMemcpyHostToDevice);
  const std::vector<float> host_scales(2 * kv_heads, 2.0F / 448.0F);
  cudaMemcpy(scales, host_scales.data(), host_scales.size() * sizeof(float),
             cudaMemcpyHostToDevice);
  // Each sequence's pages scattered over the cache; its tokens written there with write_kv.
  std::vector<std::int32_t> h_indptr{0}, h_indices, h_last, h_qo{0};
  std::vector<std::int64_t> h_slots;
  for (std::int32_t b = 0; b < batch; ++b) {
    for (std::int32_t p = 0; p < pages_per_seq; ++p) {
      h_indices.push_back(static_cast<std::int32_t>(
          (static_cast<std::int64_t>(b) * pages_per_seq + p) * 7919 % capacity));
    }
    h_indptr.push_back(static_cast<std::int32_t>(h_indices.size()));
    h_last.push_back(len - (pages_per_seq - 1) * page_size);
    h_qo.push_back(h_qo.back() + queries);
    for (std::int32_t t = 0; t < len; ++t) {
      h_slots.push_back(
          static_cast<std::int64_t>(
              h_indices[static_cast<std::size_t>(b * pages_per_seq + t / page_size)]) *
              page_size +
          t % page_size);
    }
  }
  cudaMemcpy(indptr, h_indptr.data(), h_indptr.size() * 4, cudaMemcpyHostToDevice);
  cudaMemcpy(indices, h_indices.data(), h_indices.size() * 4, cudaMemcpyHostToDevice);
  cudaMemcpy(last, h_last.data(), h_last.size() * 4, cudaMemcpyHostToDevice);
  cudaMemcpy(qo, h_qo.data(), h_qo.size() * 4, cudaMemcpyHostToDevice);
  cudaMemcpy(slots, h_slots.data(), h_slots.size() * 8, cudaMemcpyHostToDevice);
  const kvkit::cuda::kv_write<Layout, __nv_bfloat16> w{
      layout, cache, capacity, slots, static_cast<std::int32_t>(tokens), k, v, scales};
  if (kvkit::cuda::write_kv(w, nullptr) != cudaSuccess || cudaDeviceSynchronize() != cudaSuccess) {
    state.SkipWithError("write_kv failed");
  } else {
    kvkit::cuda::prefill_args<Layout, __nv_bfloat16> a;
    a.layout = layout;
    a.cache = cache;
    a.capacity = capacity;
    a.table = kvkit::csr_page_table{indptr, indices, last, batch, page_size};
    a.qo_indptr = qo;
    a.max_queries = queries;
    a.num_q_heads = q_heads;
    a.q = q;
    a.out = out;
    a.lse = lse;
    a.static_scales = scales;
    const std::vector<double> times =
        kvkit_bench::time_launches(state, [&] { return kvkit::cuda::paged_prefill(a, nullptr); });
    if (!times.empty()) {
      const double t = kvkit_bench::median(times);
      // Keys seen: query i of Q sits at position L - Q + i and sees L - Q + i + 1 keys.
      const double pairs = static_cast<double>(batch) * queries *
                           (static_cast<double>(len) - queries + (queries + 1) / 2.0);
      const double flops = 4.0 * head_dim * q_heads * pairs;
      const double peak = tensor_peak();
      state.counters["TFLOP/s"] = flops / t / 1e12;
      if (peak > 0.0) {
        state.counters["tc_peak_TFLOP/s"] = peak / 1e12;
        state.counters["x_peak"] = flops / t / peak;
      }
      const double kv_bytes =
          static_cast<double>(capacity) * static_cast<double>(layout.bytes_per_page());
      state.counters["cache_GB"] = kv_bytes / 1e9;
      const auto sdpa = sdpa_seconds().find({batch, len, queries});
      if (sdpa != sdpa_seconds().end()) {
        state.counters["sdpa_TFLOP/s"] = flops / sdpa->second / 1e12;
        state.counters["x_sdpa"] = sdpa->second / t; // > 1: faster than SDPA on contiguous KV
      }
    }
  }
  cudaFree(k);
  cudaFree(v);
  cudaFree(q);
  cudaFree(out);
  cudaFree(lse);
  cudaFree(cache);
  cudaFree(slots);
  cudaFree(indptr);
  cudaFree(indices);
  cudaFree(last);
  cudaFree(qo);
  cudaFree(scales);
}

// The shapes (B, L, Q); bench/cuda/sdpa_prefill_peer.py measures the same.
void shapes(benchmark::internal::Benchmark* b) {
  b->Args({1, 1024, 1024})
      ->Args({1, 4096, 4096})
      ->Args({1, 16384, 16384})
      ->Args({8, 2048, 2048})
      ->Args({8, 4096, 512})
      ->Args({64, 2048, 4});
}
void quantized_shapes(benchmark::internal::Benchmark* b) {
  b->Args({8, 2048, 2048})->Args({64, 2048, 4});
}

using kvkit::paged_layout;
BENCHMARK(BM_paged_prefill<paged_layout<kvkit::bf16_codec>>)
    ->Name("paged_prefill/bf16")
    ->Apply(shapes)
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_paged_prefill<paged_layout<kvkit::fp8_e4m3_codec>>)
    ->Name("paged_prefill/fp8_e4m3")
    ->Apply(quantized_shapes)
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_paged_prefill<paged_layout<kvkit::int4_group_codec<32>>>)
    ->Name("paged_prefill/int4_g32")
    ->Apply(quantized_shapes)
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);

} // namespace
