#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include <cuda_bf16.h>

#include "cuda/copy_device.hpp"
#include "cuda/device_buffers.hpp"
#include "cuda/validation.hpp"
#include "kvkit/cuda/copy_blocks.cuh"
#include "kvkit/cuda/quantize_pages.cuh"
#include "kvkit/cuda/write_kv.cuh"
#include "kvkit/layout/page_layout.hpp"

namespace kvkit_test {

namespace {

#define KVKIT_CHECK(expr)                                                                          \
  do {                                                                                             \
    const cudaError_t e_ = (expr);                                                                 \
    if (e_ != cudaSuccess) {                                                                       \
      return e_;                                                                                   \
    }                                                                                              \
  } while (false)

__global__ void no_op() {}

} // namespace

cudaError_t leave_pending_error() {
  no_op<<<1, 4096>>>();
  return cudaPeekAtLastError();
}

cudaError_t run_copy_blocks(std::vector<std::vector<std::byte>>& layers,
                            std::int64_t bytes_per_page,
                            const std::vector<kvkit::block_copy>& pairs, std::int32_t* page_check,
                            std::int32_t dst_capacity, std::int32_t max_blocks) {
  device_buffers mem;
  std::vector<std::byte*> ptrs(layers.size(), nullptr);
  for (std::size_t l = 0; l < layers.size(); ++l) {
    KVKIT_CHECK(mem.alloc(ptrs[l], layers[l].size()));
    KVKIT_CHECK(cudaMemcpy(ptrs[l], layers[l].data(), layers[l].size(), cudaMemcpyHostToDevice));
  }
  std::byte** d_ptrs = nullptr;
  kvkit::block_copy* d_pairs = nullptr;
  KVKIT_CHECK(mem.alloc(d_ptrs, ptrs.size()));
  KVKIT_CHECK(mem.alloc(d_pairs, pairs.size()));
  KVKIT_CHECK(
      cudaMemcpy(d_ptrs, ptrs.data(), ptrs.size() * sizeof(std::byte*), cudaMemcpyHostToDevice));
  KVKIT_CHECK(cudaMemcpy(d_pairs, pairs.data(), pairs.size() * sizeof(kvkit::block_copy),
                         cudaMemcpyHostToDevice));
  kvkit::cuda::page_copies c{d_ptrs,         d_ptrs,  static_cast<std::int32_t>(layers.size()),
                             bytes_per_page, d_pairs, static_cast<std::int32_t>(pairs.size())};
  c.max_blocks = max_blocks;
  std::int32_t* d_flag = nullptr;
  if (page_check != nullptr) {
    KVKIT_CHECK(mem.alloc(d_flag, 1));
    KVKIT_CHECK(cudaMemset(d_flag, 0, sizeof(std::int32_t)));
    c.page_check = d_flag;
    c.src_capacity =
        static_cast<std::int32_t>(static_cast<std::int64_t>(layers[0].size()) / bytes_per_page);
    c.dst_capacity = dst_capacity > 0 ? dst_capacity : c.src_capacity;
  }
  KVKIT_CHECK(kvkit::cuda::copy_blocks(c, nullptr));
  KVKIT_CHECK(cudaDeviceSynchronize());
  if (page_check != nullptr) {
    KVKIT_CHECK(cudaMemcpy(page_check, d_flag, sizeof(std::int32_t), cudaMemcpyDeviceToHost));
  }
  for (std::size_t l = 0; l < layers.size(); ++l) {
    KVKIT_CHECK(cudaMemcpy(layers[l].data(), ptrs[l], layers[l].size(), cudaMemcpyDeviceToHost));
  }
  return cudaSuccess;
}

namespace {

// The swap tests' two tiers: each layer's device cache (`d`) and pinned host tier (`h`), allocated
// in `mem` and filled from `device` and `host`.
cudaError_t upload_tiers(device_buffers& mem, const std::vector<std::vector<std::byte>>& device,
                         const std::vector<std::vector<std::byte>>& host,
                         std::vector<std::byte*>& d, std::vector<std::byte*>& h) {
  for (std::size_t l = 0; l < device.size(); ++l) {
    KVKIT_CHECK(mem.alloc(d[l], device[l].size()));
    KVKIT_CHECK(cudaMemcpy(d[l], device[l].data(), device[l].size(), cudaMemcpyHostToDevice));
    KVKIT_CHECK(mem.alloc_pinned(h[l], host[l].size()));
    std::memcpy(h[l], host[l].data(), host[l].size());
  }
  return cudaSuccess;
}

// Both tiers back into `device` and `host`, once the swaps are done.
cudaError_t download_tiers(std::vector<std::vector<std::byte>>& device,
                           std::vector<std::vector<std::byte>>& host,
                           const std::vector<std::byte*>& d, const std::vector<std::byte*>& h) {
  for (std::size_t l = 0; l < device.size(); ++l) {
    KVKIT_CHECK(cudaMemcpy(device[l].data(), d[l], device[l].size(), cudaMemcpyDeviceToHost));
    std::memcpy(host[l].data(), h[l], host[l].size());
  }
  return cudaSuccess;
}

} // namespace

cudaError_t run_swaps(std::vector<std::vector<std::byte>>& device,
                      std::vector<std::vector<std::byte>>& host, std::int64_t bytes_per_page,
                      const std::vector<kvkit::block_copy>& out,
                      const std::vector<kvkit::block_copy>& in, std::int32_t max_blocks) {
  const std::size_t layers = device.size();
  device_buffers mem;
  std::vector<std::byte*> d(layers), h(layers);
  KVKIT_CHECK(upload_tiers(mem, device, host, d, h));
  std::byte** dd = nullptr;
  std::byte** dh = nullptr;
  kvkit::block_copy* pairs = nullptr;
  KVKIT_CHECK(mem.alloc(dd, layers));
  KVKIT_CHECK(mem.alloc(dh, layers));
  KVKIT_CHECK(mem.alloc(pairs, out.size() + in.size()));
  KVKIT_CHECK(cudaMemcpy(dd, d.data(), layers * sizeof(std::byte*), cudaMemcpyHostToDevice));
  KVKIT_CHECK(cudaMemcpy(dh, h.data(), layers * sizeof(std::byte*), cudaMemcpyHostToDevice));
  KVKIT_CHECK(cudaMemcpy(pairs, out.data(), out.size() * sizeof(kvkit::block_copy),
                         cudaMemcpyHostToDevice));
  KVKIT_CHECK(cudaMemcpy(pairs + out.size(), in.data(), in.size() * sizeof(kvkit::block_copy),
                         cudaMemcpyHostToDevice));
  const auto n = static_cast<std::int32_t>(layers);
  kvkit::cuda::page_copies swap_out{
      dd, dh, n, bytes_per_page, pairs, static_cast<std::int32_t>(out.size())};
  swap_out.max_blocks = max_blocks;
  kvkit::cuda::page_copies swap_in{
      dh, dd, n, bytes_per_page, pairs + out.size(), static_cast<std::int32_t>(in.size())};
  swap_in.max_blocks = max_blocks;
  KVKIT_CHECK(kvkit::cuda::swap_blocks(swap_out, nullptr));
  KVKIT_CHECK(kvkit::cuda::swap_blocks(swap_in, nullptr));
  KVKIT_CHECK(cudaDeviceSynchronize());
  return download_tiers(device, host, d, h);
}

cudaError_t run_copy_engine_swaps(std::vector<std::vector<std::byte>>& device,
                                  std::vector<std::vector<std::byte>>& host,
                                  std::int64_t bytes_per_page,
                                  const std::vector<kvkit::block_copy>& out,
                                  const std::vector<kvkit::block_copy>& in, swap_stream how,
                                  copy_engine_report& report) {
  const std::size_t layers = device.size();
  device_buffers mem;
  std::vector<std::byte*> d(layers), h(layers);
  KVKIT_CHECK(upload_tiers(mem, device, host, d, h));
  const auto n = static_cast<std::int32_t>(layers);
  const auto device_pages =
      static_cast<std::int32_t>(static_cast<std::int64_t>(device[0].size()) / bytes_per_page);
  const auto host_pages =
      static_cast<std::int32_t>(static_cast<std::int64_t>(host[0].size()) / bytes_per_page);
  const kvkit::cuda::host_page_copies swap_out{
      d.data(),     h.data(),  n, bytes_per_page, out.data(), static_cast<std::int32_t>(out.size()),
      device_pages, host_pages};
  const kvkit::cuda::host_page_copies swap_in{
      h.data(),   d.data(),    n, bytes_per_page, in.data(), static_cast<std::int32_t>(in.size()),
      host_pages, device_pages};
  cudaStream_t stream = nullptr;
  if (how != swap_stream::legacy) {
    KVKIT_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  }
  kvkit::cuda::copy_batch scratch;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  const auto swap = [&]() -> cudaError_t {
    if (how == swap_stream::captured) {
      KVKIT_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    }
    // The first error, with the capture ended on every path (else the stream stays capturing).
    const auto run = [&](int i, const kvkit::cuda::host_page_copies& c) {
      const cudaError_t r = kvkit::cuda::swap_blocks_copy_engines(c, scratch, stream);
      report.runs[i] = scratch.runs();
      report.copies[i] = scratch.copies();
      report.batched[i] = scratch.batched();
      return r;
    };
    cudaError_t e = run(0, swap_out);
    if (e == cudaSuccess) {
      e = run(1, swap_in);
    }
    if (how == swap_stream::captured) {
      const cudaError_t end = cudaStreamEndCapture(stream, &graph);
      KVKIT_CHECK(e);
      KVKIT_CHECK(end);
      KVKIT_CHECK(cudaGraphInstantiate(&exec, graph, 0));
      KVKIT_CHECK(cudaGraphLaunch(exec, stream));
    }
    KVKIT_CHECK(e);
    return cudaStreamSynchronize(stream);
  };
  const cudaError_t e = swap();
  if (exec != nullptr) {
    cudaGraphExecDestroy(exec);
  }
  if (graph != nullptr) {
    cudaGraphDestroy(graph);
  }
  if (stream != nullptr) {
    cudaStreamDestroy(stream);
  }
  KVKIT_CHECK(e);
  return download_tiers(device, host, d, h);
}

std::size_t expected_runs(std::vector<kvkit::block_copy> pairs) {
  std::sort(pairs.begin(), pairs.end(), [](const kvkit::block_copy& a, const kvkit::block_copy& b) {
    return a.src != b.src ? a.src < b.src : a.dst < b.dst;
  });
  std::size_t runs = 0;
  for (std::size_t i = 0; i < pairs.size(); ++i) {
    const bool joins =
        i > 0 && pairs[i].src == pairs[i - 1].src + 1 && pairs[i].dst == pairs[i - 1].dst + 1;
    runs += joins ? 0 : 1;
  }
  return runs;
}

std::vector<std::string> copy_engine_validation_failures() {
  std::vector<std::string> failed;
  kvkit::cuda::copy_batch scratch;
  const auto check = [&](const char* name, const kvkit::cuda::host_page_copies& c,
                         kvkit::errc want) {
    const kvkit::status s = kvkit::cuda::validate(c);
    if (s.error() != want ||
        !launchers_agree(s.ok(), want == kvkit::errc::ok, c.num_pairs > 0, [&] {
          return kvkit::cuda::swap_blocks_copy_engines(c, scratch, nullptr);
        })) {
      failed.emplace_back(name);
    }
  };
  static std::byte* const layers[2] = {stand_in(), stand_in()};
  static std::byte* const with_null[2] = {stand_in(), nullptr};
  static const kvkit::block_copy pairs[3] = {{0, 1}, {2, 3}, {4, 5}};
  const kvkit::cuda::host_page_copies good{layers, layers, 2, 40, pairs, 3, 5, 6};
  using kvkit::errc;
  check("good (any page size: no multiple of 16 needed)", good, errc::ok);
  check("nothing set", kvkit::cuda::host_page_copies{}, errc::bad_argument);
  auto c = good;
  c.num_pairs = 0;
  c.src_layers = nullptr;
  c.dst_layers = nullptr;
  c.pairs = nullptr;
  check("no pairs, no pointers", c, errc::ok);
  c.src_capacity = 0;
  check("no pairs, no source capacity", c, errc::bad_argument);
  c = good;
  c.num_layers = 0;
  check("no layers", c, errc::bad_argument);
  c = good;
  c.bytes_per_page = 0;
  check("page size 0", c, errc::bad_argument);
  c = good;
  c.num_pairs = -1;
  check("negative pair count", c, errc::bad_argument);
  c = good;
  c.dst_capacity = -3;
  check("negative destination capacity", c, errc::bad_argument);
  c = good;
  c.src_layers = nullptr;
  check("null source layers", c, errc::bad_argument);
  c = good;
  c.dst_layers = nullptr;
  check("null destination layers", c, errc::bad_argument);
  c = good;
  c.pairs = nullptr;
  check("null pairs", c, errc::bad_argument);
  c = good;
  c.dst_layers = with_null;
  check("a null destination layer", c, errc::bad_argument);
  c = good;
  c.src_layers = with_null;
  check("a null source layer", c, errc::bad_argument);
  c = good;
  c.src_capacity = 4; // pair {4, 5}'s source is page 4
  check("a source past the source cache", c, errc::invalid_block);
  c = good;
  c.dst_capacity = 5; // pair {4, 5}'s destination is page 5
  check("a destination past the destination cache", c, errc::invalid_block);
  static const kvkit::block_copy negative[2] = {{0, 1}, {-1, 2}};
  c = good;
  c.pairs = negative;
  c.num_pairs = 2;
  check("a negative source", c, errc::invalid_block);
  static const kvkit::block_copy negative_dst[2] = {{0, 1}, {3, -2}};
  c.pairs = negative_dst;
  check("a negative destination", c, errc::invalid_block);
  return failed;
}

std::vector<std::string> copy_validation_failures() {
  std::vector<std::string> failed;
  const auto check = [&](const char* name, const kvkit::cuda::page_copies& c, bool expect_ok) {
    if (!launchers_agree(
            kvkit::cuda::validate(c).ok(), expect_ok, c.num_pairs > 0,
            [&] { return kvkit::cuda::copy_blocks(c, nullptr); },
            [&] { return kvkit::cuda::swap_blocks(c, nullptr); })) {
      failed.emplace_back(name);
    }
  };
  static std::byte* const layer[1] = {stand_in()};
  static const kvkit::block_copy pairs[3] = {{0, 1}, {2, 3}, {4, 5}};
  static std::int32_t flag = 0;
  const kvkit::cuda::page_copies good{layer, layer, 1, 64, pairs, 3};
  check("good", good, true);
  check("nothing set", kvkit::cuda::page_copies{}, false);
  auto c = good;
  c.num_pairs = 0;
  c.src_layers = nullptr;
  c.dst_layers = nullptr;
  c.pairs = nullptr;
  check("no pairs, no pointers", c, true);
  c = good;
  c.num_layers = 0;
  check("no layers", c, false);
  c.num_layers = 65536; // no grid dimension bounds the layers: the grid is one row of pages
  check("65536 layers", c, true);
  c = good;
  c.max_blocks = -1;
  check("negative block limit", c, false);
  c.max_blocks = 1;
  check("a block limit of 1", c, true);
  c = good;
  c.bytes_per_page = 40;
  check("page size not a multiple of 16", c, false);
  c = good;
  c.bytes_per_page = 0;
  check("page size 0", c, false);
  c = good;
  c.num_pairs = -1;
  check("negative pair count", c, false);
  c = good;
  c.src_layers = nullptr;
  check("null source layers", c, false);
  c = good;
  c.dst_layers = nullptr;
  check("null destination layers", c, false);
  c = good;
  c.pairs = nullptr;
  check("null pairs", c, false);
  // The debug mode needs both capacities.
  c = good;
  c.page_check = &flag;
  c.src_capacity = 8;
  check("debug mode without a destination capacity", c, false);
  c.src_capacity = 0;
  c.dst_capacity = 8;
  check("debug mode without a source capacity", c, false);
  c.src_capacity = 8;
  check("debug mode with both capacities", c, true);
  c.page_check = reinterpret_cast<std::int32_t*>(reinterpret_cast<std::byte*>(&flag) + 2);
  check("misaligned debug flag", c, false);
  c = good;
  c.num_pairs = 0;
  c.page_check = &flag;
  check("debug mode without capacities and no pairs", c, false);
  // The kernel reads pairs and layer pointers an element at a time.
  c = good;
  c.pairs =
      reinterpret_cast<const kvkit::block_copy*>(reinterpret_cast<const std::byte*>(pairs) + 2);
  check("misaligned pairs", c, false);
  c = good;
  c.dst_layers = reinterpret_cast<std::byte* const*>(reinterpret_cast<const std::byte*>(layer) + 4);
  check("misaligned destination layers", c, false);
  return failed;
}

std::vector<std::string> page_check_dispatch_failures() {
  using kvkit::cuda::detail::with_page_check;
  std::vector<std::string> failed;
  const auto build = [](auto checked) {
    return decltype(checked)::value ? 1 : 2;
  };
  const std::int32_t flag = 0;
  if (with_page_check(nullptr, build) != 2) {
    failed.emplace_back("no flag, yet not the ordinary build");
  }
  if (with_page_check(&flag, build) != 1) {
    failed.emplace_back("a flag, yet not the checked build");
  }
  int calls = 0;
  with_page_check(&flag, [&](auto) { ++calls; });
  with_page_check(nullptr, [&](auto) { ++calls; });
  if (calls != 2) {
    failed.emplace_back("a launch returning nothing was not called once each time");
  }
  return failed;
}

std::vector<std::string> pending_error_failures() {
  std::vector<std::string> failed;
  // Two bf16 pages of 16 tokens, 2 KV heads of 64 channels: page 0 holds 0x11 bytes, page 1 (the
  // one each launcher writes) 0xA5 until written.
  using layout_t = kvkit::paged_layout<kvkit::bf16_codec>;
  const layout_t layout(16, 2, 64);
  const auto page = static_cast<std::size_t>(layout.bytes_per_page());
  const std::size_t elems = 16 * 2 * 64;
  std::byte* cache = nullptr;
  __nv_bfloat16* kv = nullptr;
  std::int64_t* slots = nullptr;
  std::int32_t* ids = nullptr;
  kvkit::block_copy* pair = nullptr;
  std::byte** layers = nullptr;
  device_buffers mem;
  const auto setup = [&]() -> cudaError_t {
    KVKIT_CHECK(mem.alloc(cache, 2 * page));
    KVKIT_CHECK(mem.alloc(kv, elems));
    KVKIT_CHECK(cudaMemset(kv, 0x3F, elems * sizeof(__nv_bfloat16)));
    std::vector<std::int64_t> s(16);
    for (std::size_t i = 0; i < s.size(); ++i) {
      s[i] = 16 + static_cast<std::int64_t>(i); // page 1
    }
    KVKIT_CHECK(mem.alloc(slots, s.size()));
    KVKIT_CHECK(
        cudaMemcpy(slots, s.data(), s.size() * sizeof(std::int64_t), cudaMemcpyHostToDevice));
    const std::int32_t one = 1;
    KVKIT_CHECK(mem.alloc(ids, 1));
    KVKIT_CHECK(cudaMemcpy(ids, &one, sizeof(std::int32_t), cudaMemcpyHostToDevice));
    const kvkit::block_copy p{0, 1};
    KVKIT_CHECK(mem.alloc(pair, 1));
    KVKIT_CHECK(cudaMemcpy(pair, &p, sizeof(kvkit::block_copy), cudaMemcpyHostToDevice));
    KVKIT_CHECK(mem.alloc(layers, 1));
    return cudaMemcpy(layers, &cache, sizeof(std::byte*), cudaMemcpyHostToDevice);
  };
  // Whether page 1 was written (any byte but 0xA5), after the stream's work.
  const auto page_written = [&](bool& written) -> cudaError_t {
    KVKIT_CHECK(cudaDeviceSynchronize());
    std::vector<std::byte> host(page);
    KVKIT_CHECK(cudaMemcpy(host.data(), cache + page, page, cudaMemcpyDeviceToHost));
    written =
        std::any_of(host.begin(), host.end(), [](std::byte b) { return b != std::byte{0xA5}; });
    return cudaSuccess;
  };
  const auto check = [&](const char* name, auto launch) -> cudaError_t {
    KVKIT_CHECK(cudaMemset(cache, 0x11, page));
    KVKIT_CHECK(cudaMemset(cache + page, 0xA5, page));
    KVKIT_CHECK(cudaDeviceSynchronize());
    const cudaError_t pending = leave_pending_error();
    if (pending == cudaSuccess) {
      failed.push_back(std::string(name) + ": no pending error to begin with");
      return cudaSuccess;
    }
    const cudaError_t first = launch();
    // Taken here, so that an error the launcher left pending cannot reach a later launch.
    const cudaError_t left = cudaGetLastError();
    bool written = false;
    KVKIT_CHECK(page_written(written));
    if (first != pending) {
      failed.push_back(std::string(name) + ": returned " + cudaGetErrorName(first));
    }
    if (written) {
      failed.push_back(std::string(name) + ": wrote the cache");
    }
    if (left != cudaSuccess) {
      failed.push_back(std::string(name) + ": left the error pending");
    }
    const cudaError_t again = launch();
    KVKIT_CHECK(page_written(written));
    if (again != cudaSuccess || !written) {
      failed.push_back(std::string(name) + ": did not run when called again");
    }
    return cudaSuccess;
  };
  cudaError_t e = setup();
  // The arguments hold the pointers setup() set, so they are made after it.
  const kvkit::cuda::kv_write<layout_t, __nv_bfloat16> w{layout, cache, 2, slots, 16, kv, kv};
  const kvkit::cuda::page_batch<layout_t, __nv_bfloat16> b{layout, cache, 2, ids, 1, kv, kv};
  const kvkit::cuda::page_copies c{layers, layers, 1, static_cast<std::int64_t>(page), pair, 1};
  // Each launcher's arguments are valid, so that what it returns first is the pending error and
  // not a rejection of its own (which may have the same code).
  const bool valid = kvkit::cuda::validate(w).ok() && kvkit::cuda::validate(b).ok() &&
                     kvkit::cuda::validate(c).ok();
  if (e == cudaSuccess && !valid) {
    failed.emplace_back("the launchers' arguments are not valid");
  }
  if (e == cudaSuccess && valid) {
    e = check("write_kv", [&] { return kvkit::cuda::write_kv(w, nullptr); });
  }
  if (e == cudaSuccess && valid) {
    e = check("quantize_pages", [&] { return kvkit::cuda::quantize_pages(b, nullptr); });
  }
  if (e == cudaSuccess && valid) {
    e = check("copy_blocks", [&] { return kvkit::cuda::copy_blocks(c, nullptr); });
  }
  if (e != cudaSuccess) {
    failed.push_back(std::string("CUDA error ") + cudaGetErrorName(e));
  }
  return failed;
}

} // namespace kvkit_test
