// Host encode/decode throughput per codec: the CPU reference quantizing and dequantizing one page
// (16 tokens x 8 KV heads x 128 channels, K and V) at a time, beside a memcpy of the same float
// input measured in the same run.

#include <cstring>
#include <random>
#include <vector>

#include <benchmark/benchmark.h>

#include "host/bench_report.hpp"
#include "kvkit/layout/page_layout.hpp"
#include "kvkit/quant/codecs.hpp"
#include "kvkit/reference/quantize.hpp"

namespace {

template <class Layout>
void run(benchmark::State& state, bool encode) {
  const Layout layout(16, 8, 128);
  const auto n = static_cast<std::size_t>(layout.elements());
  std::vector<float> k(n), v(n), k2(n), v2(n);
  std::mt19937 rng(1);
  std::normal_distribution<float> dist;
  for (std::size_t i = 0; i < n; ++i) {
    k[i] = dist(rng);
    v[i] = dist(rng);
  }
  const std::vector<float> scales(16, 4.0F / 448.0F);
  std::vector<std::byte> page(static_cast<std::size_t>(layout.bytes_per_page()));
  (void)kvkit::reference::quantize_page(layout, k.data(), v.data(), 16, page.data(), scales.data());
  const double memcpy_us = kvkit_bench::median_us([&] {
    std::memcpy(k2.data(), k.data(), n * sizeof(float));
    std::memcpy(v2.data(), v.data(), n * sizeof(float));
    benchmark::ClobberMemory();
  });
  for (auto _ : state) {
    if (encode) {
      benchmark::DoNotOptimize(kvkit::reference::quantize_page(layout, k.data(), v.data(), 16,
                                                               page.data(), scales.data()));
    } else {
      benchmark::DoNotOptimize(kvkit::reference::dequantize_page(layout, page.data(), 16, k2.data(),
                                                                 v2.data(), scales.data()));
    }
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations()) *
                          static_cast<std::int64_t>(2 * n));
  kvkit_bench::report_peer_time(state, "memcpy", memcpy_us);
}

template <class Layout>
void BM_encode(benchmark::State& state) {
  run<Layout>(state, true);
}
template <class Layout>
void BM_decode(benchmark::State& state) {
  run<Layout>(state, false);
}

#define KVKIT_CODEC_BENCH(NAME, LAYOUT)                                                            \
  BENCHMARK(BM_encode<LAYOUT>)->Name("reference_encode/" NAME);                                    \
  BENCHMARK(BM_decode<LAYOUT>)->Name("reference_decode/" NAME);

using kvkit::paged_layout;
KVKIT_CODEC_BENCH("fp16", paged_layout<kvkit::fp16_codec>)
KVKIT_CODEC_BENCH("bf16", paged_layout<kvkit::bf16_codec>)
KVKIT_CODEC_BENCH("fp8_e4m3", paged_layout<kvkit::fp8_e4m3_codec>)
KVKIT_CODEC_BENCH("int8", paged_layout<kvkit::int8_codec>)
KVKIT_CODEC_BENCH("int4_g32", paged_layout<kvkit::int4_group_codec<32>>)
using kivi = paged_layout<kvkit::int4_channel_codec, kvkit::int4_group_codec<128>>;
KVKIT_CODEC_BENCH("int4_channel_k+int4_g128_v", kivi)

} // namespace
