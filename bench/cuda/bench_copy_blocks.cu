// copy_blocks and swap_blocks beside cudaMemcpyAsync of the same bytes in the same run
// (targets: >= 90% of a device memcpy, >= 90% of a pinned host<->device memcpy), and beside the
// copy engines moving the same scattered pages in one cudaMemcpyBatchAsync (x_batch).
// swap_blocks_copy_engines' rows (BM_swap_*_copy_engines) put the library's copy-engine swap beside
// the same peers, on scattered pages and on one run of consecutive pages (which it moves as one
// copy a layer). Every row also prints the host's time in each call (host_us).
// Pages of 64 KiB (16 tokens x 8 KV heads x 128 channels, fp16 K and V): 32 layers.

#include <algorithm>
#include <cstddef>
#include <limits>
#include <vector>

#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

#include "cuda/bench_cuda_timing.cuh"
#include "kvkit/cuda/copy_blocks.cuh"

namespace {

constexpr std::int64_t page_bytes = 65536;
constexpr std::int32_t layers = 32;

// Copies `pairs` pages in every layer: device to device (copy), device to host (swap out) or host
// to device (swap in); by the kernel, or (`engines`) by swap_blocks_copy_engines, on scattered
// pages or (`run_of_pages`) on pages i -> pairs + i.
void run(benchmark::State& state, int kind, bool engines = false, bool run_of_pages = false) {
  if (!kvkit_bench::gpu_available()) {
    state.SkipWithError("no CUDA device");
    return;
  }
  const auto pairs = static_cast<std::int32_t>(state.range(0));
  const std::int32_t pages = 2 * pairs;
  const std::size_t layer_bytes = static_cast<std::size_t>(pages) * page_bytes;
  std::vector<std::byte*> dev(layers), host(layers);
  for (auto& p : dev) {
    cudaMalloc(&p, layer_bytes);
    cudaMemset(p, 0x3C, layer_bytes);
  }
  if (kind != 0) {
    for (auto& p : host) {
      cudaHostAlloc(&p, layer_bytes, cudaHostAllocDefault);
    }
  }
  std::byte** d_dev = nullptr;
  std::byte** d_host = nullptr;
  kvkit::block_copy* d_pairs = nullptr;
  cudaMalloc(&d_dev, layers * sizeof(std::byte*));
  cudaMalloc(&d_host, layers * sizeof(std::byte*));
  cudaMemcpy(d_dev, dev.data(), layers * sizeof(std::byte*), cudaMemcpyHostToDevice);
  cudaMemcpy(d_host, host.data(), layers * sizeof(std::byte*), cudaMemcpyHostToDevice);
  std::vector<kvkit::block_copy> list;
  for (std::int32_t i = 0; i < pairs; ++i) {
    if (run_of_pages) {
      list.push_back({i, pairs + i});
    } else {
      list.push_back({(i * 7) % pairs, pairs + (i * 13) % pairs}); // scattered, disjoint halves
    }
  }
  cudaMalloc(&d_pairs, list.size() * sizeof(kvkit::block_copy));
  cudaMemcpy(d_pairs, list.data(), list.size() * sizeof(kvkit::block_copy), cudaMemcpyHostToDevice);
  kvkit::cuda::page_copies c{d_dev, d_dev, layers, page_bytes, d_pairs, pairs};
  if (kind == 1) {
    c = {d_dev, d_host, layers, page_bytes, d_pairs, pairs};
  } else if (kind == 2) {
    c = {d_host, d_dev, layers, page_bytes, d_pairs, pairs};
  }
  const double moved = static_cast<double>(pairs) * layers * page_bytes;
  // The peer: one cudaMemcpyAsync per layer of the same number of contiguous bytes.
  const auto half = static_cast<std::size_t>(pairs) * page_bytes;
  const double peer_s = kvkit_bench::median_seconds([&] {
    for (std::int32_t l = 0; l < layers; ++l) {
      if (kind == 0) {
        cudaMemcpyAsync(dev[static_cast<std::size_t>(l)] + half, dev[static_cast<std::size_t>(l)],
                        half, cudaMemcpyDeviceToDevice);
      } else if (kind == 1) {
        cudaMemcpyAsync(host[static_cast<std::size_t>(l)], dev[static_cast<std::size_t>(l)], half,
                        cudaMemcpyDeviceToHost);
      } else {
        cudaMemcpyAsync(dev[static_cast<std::size_t>(l)], host[static_cast<std::size_t>(l)], half,
                        cudaMemcpyHostToDevice);
      }
    }
  });
  // A second peer, the copy engines on the same scattered pages: one cudaMemcpyBatchAsync of every
  // (pair, layer) page, as an engine without a copy kernel would queue them (on a stream of its
  // own: the batch call takes no legacy default stream). NaN where the call fails.
  std::vector<void*> batch_dst;
  std::vector<const void*> batch_src;
  for (std::int32_t l = 0; l < layers; ++l) {
    const auto li = static_cast<std::size_t>(l);
    std::byte* const from = kind == 2 ? host[li] : dev[li];
    std::byte* const to = kind == 1 ? host[li] : dev[li];
    for (const kvkit::block_copy& pc : list) {
      batch_src.push_back(from + static_cast<std::ptrdiff_t>(pc.src) * page_bytes);
      batch_dst.push_back(to + static_cast<std::ptrdiff_t>(pc.dst) * page_bytes);
    }
  }
  const std::vector<std::size_t> batch_sizes(batch_dst.size(), page_bytes);
  cudaStream_t batch_stream = nullptr;
  cudaStreamCreateWithFlags(&batch_stream, cudaStreamNonBlocking);
  // The batch call's CUDA 13 form (12.8 and 12.9 take one argument more): NaN before 13.
  bool batch_ok = CUDART_VERSION >= 13000;
  const double batch_s = kvkit_bench::median_seconds(
      [&] {
#if CUDART_VERSION >= 13000
        cudaMemcpyAttributes batch_attr{}; // what swap_blocks_copy_engines sets
        batch_attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
        batch_attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
        std::size_t batch_attr_index = 0;
        batch_ok =
            batch_ok && cudaMemcpyBatchAsync(batch_dst.data(), batch_src.data(), batch_sizes.data(),
                                             batch_dst.size(), &batch_attr, &batch_attr_index, 1,
                                             batch_stream) == cudaSuccess;
#endif
      },
      15, batch_stream);
  (void)cudaGetLastError(); // a failed batch call is the peer's, not the row's
  // The host's seconds in each call (`host_us`): the launch, or the copy-engine swap's lists and
  // batch call. The row's time runs from an event recorded before the call, so it holds this
  // time too where the copies start only once the call has queued them.
  std::vector<double> host_s;
  if (engines) {
    // The same swap described by host arrays, on a stream of its own (as the batch peer).
    const kvkit::cuda::host_page_copies h{kind == 2 ? host.data() : dev.data(),
                                          kind == 1 ? host.data() : dev.data(),
                                          layers,
                                          page_bytes,
                                          list.data(),
                                          pairs,
                                          pages,
                                          pages};
    kvkit::cuda::copy_batch scratch;
    kvkit_bench::time_launches(
        state, [&] { return kvkit::cuda::swap_blocks_copy_engines(h, scratch, batch_stream); }, 1,
        batch_stream, &host_s);
    state.counters["copies"] = static_cast<double>(scratch.copies());
  } else {
    kvkit_bench::time_launches(
        state,
        [&] {
          return kind == 0 ? kvkit::cuda::copy_blocks(c, nullptr)
                           : kvkit::cuda::swap_blocks(c, nullptr);
        },
        1, nullptr, &host_s);
  }
  cudaStreamDestroy(batch_stream);
  if (!host_s.empty()) {
    state.counters["host_us"] = kvkit_bench::median(host_s) * 1e6;
  }
  // Device copies count bytes read and written, as the memcpy figure of docs/performance.md does;
  // swaps count bytes crossing the bus.
  const double bytes = kind == 0 ? 2 * moved : moved;
  state.counters["bytes/s"] =
      benchmark::Counter(bytes, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["memcpy_GB/s"] = bytes / peer_s / 1e9;
  state.counters["x_memcpy"] =
      benchmark::Counter(bytes / (bytes / peer_s), benchmark::Counter::kIsIterationInvariantRate);
  const double batch = batch_ok ? batch_s : std::numeric_limits<double>::quiet_NaN();
  state.counters["batch_GB/s"] = bytes / batch / 1e9;
  state.counters["x_batch"] =
      benchmark::Counter(batch, benchmark::Counter::kIsIterationInvariantRate);
  for (auto p : dev) {
    cudaFree(p);
  }
  if (kind != 0) {
    for (auto p : host) {
      cudaFreeHost(p);
    }
  }
  cudaFree(d_dev);
  cudaFree(d_host);
  cudaFree(d_pairs);
}

void BM_copy_blocks(benchmark::State& state) {
  run(state, 0);
}
void BM_swap_out(benchmark::State& state) {
  run(state, 1);
}
void BM_swap_in(benchmark::State& state) {
  run(state, 2);
}
// swap_blocks_copy_engines: range(1) 0 for scattered pages, 1 for one run of consecutive pages.
void BM_swap_out_copy_engines(benchmark::State& state) {
  run(state, 1, true, state.range(1) == 1);
}
void BM_swap_in_copy_engines(benchmark::State& state) {
  run(state, 2, true, state.range(1) == 1);
}
BENCHMARK(BM_copy_blocks)->Arg(64)->Arg(512)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_swap_out)->Arg(64)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_swap_in)->Arg(64)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_swap_out_copy_engines)
    ->Args({64, 0})
    ->Args({64, 1})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_swap_in_copy_engines)
    ->Args({64, 0})
    ->Args({64, 1})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);

} // namespace
