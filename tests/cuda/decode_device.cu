#include <algorithm>
#include <cstring>
#include <limits>
#include <span>
#include <string>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "cuda/copy_device.hpp"
#include "cuda/cuda_try.hpp"
#include "cuda/decode_device.hpp"
#include "cuda/device_buffers.hpp"
#include "cuda/validation.hpp"
#include "kvkit/cuda/paged_decode.cuh"
#include "kvkit/layout/page_layout.hpp"
#include "kvkit/quant/codecs.hpp"

namespace kvkit_test {

namespace {

// Which caches have the two-tile kernel. It runs where the warps get two tiles or more, on a grid
// of at most one block per SM of an 8-bit cache and on every grid of a plan with
// decode_plan::two_tiles (int8 from 2048 keys; int8 and int4 where two blocks per SM make one
// wave); in the tests, the launches with one split or a few. The GPU tests reach both kernels for
// these codecs (the one-tile one through many splits, or many short sequences), the one-tile
// kernel alone for the others.
namespace kd = kvkit::cuda::detail;
static_assert(kd::decode_two_tiles_fit<kvkit::fp8_e4m3_codec, kvkit::fp8_e4m3_codec, 128, 1>());
static_assert(kd::decode_two_tiles_fit<kvkit::fp8_e5m2_codec, kvkit::fp8_e5m2_codec, 64, 1>());
static_assert(kd::decode_two_tiles_fit<kvkit::int8_codec, kvkit::int8_codec, 128, 1>());
static_assert(!kd::decode_two_tiles_fit<kvkit::int8_codec, kvkit::int8_codec, 128, 2>());
static_assert(!kd::decode_two_tiles_fit<kvkit::int8_codec, kvkit::int8_codec, 256, 1>());
static_assert(!kd::decode_two_tiles_fit<kvkit::bf16_codec, kvkit::bf16_codec, 128, 1>());
static_assert(
    kd::decode_two_tiles_fit<kvkit::int4_group_codec<32>, kvkit::int4_group_codec<32>, 128, 1>());
static_assert(
    !kd::decode_two_tiles_fit<kvkit::int4_group_codec<32>, kvkit::int4_group_codec<32>, 256, 1>());
static_assert(!kd::decode_two_tiles_fit<kvkit::int8_codec, kvkit::int4_group_codec<64>, 128, 1>());

// The two-tile kernel's second build for long blocks (decode_long_ring_fit): int4 and fp8 at head
// dim 128 only, at four stages where the other keeps eight (int4) or six (fp8); not int8.
using int4_g32 = kvkit::int4_group_codec<32>;
static_assert(kd::decode_long_ring_fit<int4_g32, int4_g32, 128, 1>());
static_assert(
    kd::decode_long_ring_fit<kvkit::int4_group_codec<128>, kvkit::int4_group_codec<128>, 128, 1>());
static_assert(!kd::decode_long_ring_fit<int4_g32, int4_g32, 64, 1>());
static_assert(!kd::decode_long_ring_fit<int4_g32, int4_g32, 128, 2>());
static_assert(!kd::decode_long_ring_fit<kvkit::int8_codec, kvkit::int8_codec, 128, 1>());
static_assert(kd::decode_long_ring_fit<kvkit::fp8_e4m3_codec, kvkit::fp8_e4m3_codec, 128, 1>());
static_assert(!kd::decode_long_ring_fit<kvkit::fp8_e5m2_codec, kvkit::fp8_e5m2_codec, 64, 1>());
static_assert(!kd::decode_long_ring_fit<kvkit::int8_codec, kvkit::fp8_e4m3_codec, 128, 1>());
static_assert(kd::decode_long_block_keys<int4_g32> == 2048);
static_assert(kd::decode_long_block_keys<kvkit::fp8_e4m3_codec> == 8192);
static_assert(kd::decode_paired_block_keys == 2048);
static_assert(kd::decode_stages<kvkit::fp8_e4m3_codec, kvkit::fp8_e4m3_codec, 128, 1, 2>() == 6);
static_assert(kd::decode_stages<kvkit::fp8_e4m3_codec, kvkit::fp8_e4m3_codec, 128, 1, 2,
                                kd::decode_warps, kd::decode_long_ring>() == 4);
static_assert(kd::decode_stages<int4_g32, int4_g32, 128, 1, 2>() == 8);
// The reset case's kernel (bf16 at head dim 128, one query tile) needs more shared memory than a
// kernel gets by default (48 KB): its launch after the reset runs only if the limit the launcher
// raised before the reset still holds.
static_assert(kd::decode_smem_bytes<kvkit::bf16_codec, kvkit::bf16_codec, 128, 1>() > 48 * 1024);
// The short-ring build (decode_short_ring_fit): the 16-bit caches at head dim 256 only, whose
// three stages (192 KB a block) an A100 cannot hold; two take 128 KB.
static_assert(kd::decode_short_ring_fit<kvkit::bf16_codec, kvkit::bf16_codec, 256, 1>());
static_assert(kd::decode_short_ring_fit<kvkit::fp16_codec, kvkit::fp16_codec, 256, 2>());
static_assert(kd::decode_smem_bytes<kvkit::bf16_codec, kvkit::bf16_codec, 256, 1>() == 192 * 1024);
static_assert(kd::decode_smem_bytes<kvkit::bf16_codec, kvkit::bf16_codec, 256, 1, 1,
                                    kd::decode_warps, kd::decode_short_ring>() == 128 * 1024);
static_assert(!kd::decode_short_ring_fit<kvkit::bf16_codec, kvkit::bf16_codec, 128, 1>());
static_assert(!kd::decode_short_ring_fit<kvkit::fp8_e4m3_codec, kvkit::fp8_e4m3_codec, 256, 1>());
static_assert(!kd::decode_short_ring_fit<kvkit::int8_codec, kvkit::int8_codec, 256, 2>());
static_assert(!kd::decode_short_ring_fit<int4_g32, int4_g32, 256, 1>());
// The narrow build (decode_narrow_fit): the same caches, two warps of three stages, 96 KB, for
// devices that allow 99 KB a block, where the short ring's 128 KB do not fit.
static_assert(kd::decode_narrow_fit<kvkit::bf16_codec, kvkit::bf16_codec, 256, 1>());
static_assert(kd::decode_narrow_fit<kvkit::fp16_codec, kvkit::fp16_codec, 256, 2>());
static_assert(kd::decode_smem_bytes<kvkit::bf16_codec, kvkit::bf16_codec, 256, 2, 1,
                                    kd::decode_narrow_warps>() == 96 * 1024);
static_assert(
    kd::decode_stages<kvkit::bf16_codec, kvkit::bf16_codec, 256, 1, 1, kd::decode_narrow_warps>() ==
    3);
static_assert(!kd::decode_narrow_fit<kvkit::bf16_codec, kvkit::bf16_codec, 128, 1>());
static_assert(!kd::decode_narrow_fit<kvkit::fp8_e4m3_codec, kvkit::fp8_e4m3_codec, 256, 1>());
static_assert(!kd::decode_narrow_fit<kvkit::int8_codec, kvkit::bf16_codec, 256, 2>());
static_assert(!kd::decode_narrow_fit<int4_g32, int4_g32, 256, 1>());
// The launcher's choice (decode_build_for) for those caches: the narrow build at 99 KB and where
// the device's limit is unknown (0), the short ring at an A100's 163 KB, the own ring at Hopper's
// 227 KB; every other cache keeps its own ring.
constexpr std::int32_t optin_8_9 = kd::decode_least_smem_optin;
constexpr std::int32_t optin_8_0 = 163 * 1024;
constexpr std::int32_t optin_9_0 = 227 * 1024;
template <class K, class V, int D, int NT>
constexpr kd::decode_build build_at(std::int32_t optin) {
  return kd::decode_build_for<K, V, D, NT>(optin);
}
using bf16c = kvkit::bf16_codec;
static_assert(build_at<bf16c, bf16c, 256, 1>(0) == kd::decode_build::narrow);
static_assert(build_at<bf16c, bf16c, 256, 2>(optin_8_9) == kd::decode_build::narrow);
static_assert(build_at<bf16c, bf16c, 256, 1>(optin_8_0) == kd::decode_build::short_ring);
static_assert(build_at<bf16c, bf16c, 256, 2>(optin_9_0) == kd::decode_build::own);
static_assert(build_at<bf16c, bf16c, 128, 1>(0) == kd::decode_build::own);
static_assert(build_at<int4_g32, int4_g32, 256, 2>(optin_8_9) == kd::decode_build::own);
// On a device of 99 KB a block the narrow build's cluster mailboxes do not fit: its splits merge
// through the workspace there.
static_assert(kd::decode_cluster_smem_bytes<bf16c, bf16c, 256, 1, 1, kd::decode_narrow_warps>() >
              optin_8_9);

// The shared memory of the one-tile build the launcher chooses at `optin`.
template <class K, class V, int D, int NT>
constexpr int chosen_bytes(std::int32_t optin) {
  switch (kd::decode_build_for<K, V, D, NT>(optin)) {
  case kd::decode_build::narrow:
    return kd::decode_smem_bytes<K, V, D, NT, 1, kd::decode_narrow_warps>();
  case kd::decode_build::short_ring:
    return kd::decode_short_ring_bytes<K, V, D, NT>();
  case kd::decode_build::own:
    break;
  }
  return kd::decode_smem_bytes<K, V, D, NT>();
}
// Whether every kernel the launcher may choose for a cache at head dim D fits every device of
// compute capability 8.0 or later: the one-tile build chosen for each group size at 99, 163 and
// 227 KB a block, and the two-tile kernel (chosen whatever the device) at 99 KB. (The wide kernel
// is chosen only where the device's limit holds it.)
template <class K, class V, int D>
constexpr bool fits_every_device() {
  for (const std::int32_t optin : {optin_8_9, optin_8_0, optin_9_0}) {
    if (chosen_bytes<K, V, D, 1>(optin) > optin || chosen_bytes<K, V, D, 2>(optin) > optin) {
      return false;
    }
  }
  if constexpr (kd::decode_two_tiles_fit<K, V, D, 1>()) {
    return kd::decode_smem_bytes<K, V, D, 1, 2>() <= optin_8_9;
  }
  return true;
}
template <class K, class V>
constexpr bool fits_every_device_all_dims() {
  return fits_every_device<K, V, 64>() && fits_every_device<K, V, 128>() &&
         fits_every_device<K, V, 256>();
}
static_assert(fits_every_device_all_dims<bf16c, bf16c>());
static_assert(fits_every_device_all_dims<kvkit::fp16_codec, bf16c>());
static_assert(fits_every_device_all_dims<kvkit::fp8_e4m3_codec, kvkit::fp8_e4m3_codec>());
static_assert(fits_every_device_all_dims<kvkit::fp8_e5m2_codec, bf16c>());
static_assert(fits_every_device_all_dims<kvkit::int8_codec, kvkit::int8_codec>());
static_assert(fits_every_device_all_dims<kvkit::int8_codec, bf16c>());
static_assert(fits_every_device_all_dims<kvkit::int8_codec, int4_g32>());
static_assert(fits_every_device_all_dims<int4_g32, int4_g32>());
static_assert(
    fits_every_device_all_dims<kvkit::int4_group_codec<128>, kvkit::int4_group_codec<128>>());
static_assert(
    kd::decode_stages<int4_g32, int4_g32, 128, 1, 2, kd::decode_warps, kd::decode_long_ring>() ==
    4);

// Shared memory without bank conflicts, checked lane by lane at compile time (stage_layout): the
// K and V fragment reads of every kernel (a static_assert in stage_layout itself), and the block
// merge's stores of these caches, with one query tile and with two. An int4 V cache at head dim
// 256 keeps a 2-way conflict in those stores (once a block), which no swizzle by the row removes.
template <class K, class V, int D>
constexpr bool merge_stores_conflict_free() {
  return kd::stage_layout<K, V, D, 1>::red_stores_conflict_free &&
         kd::stage_layout<K, V, D, 2>::red_stores_conflict_free;
}
template <class C>
constexpr bool merge_stores_conflict_free_all_dims() {
  return merge_stores_conflict_free<C, C, 64>() && merge_stores_conflict_free<C, C, 128>() &&
         merge_stores_conflict_free<C, C, 256>();
}
static_assert(merge_stores_conflict_free_all_dims<kvkit::bf16_codec>());
static_assert(merge_stores_conflict_free_all_dims<kvkit::fp16_codec>());
static_assert(merge_stores_conflict_free_all_dims<kvkit::fp8_e4m3_codec>());
static_assert(merge_stores_conflict_free_all_dims<kvkit::int8_codec>());
static_assert(
    merge_stores_conflict_free<kvkit::int4_group_codec<32>, kvkit::int4_group_codec<32>, 64>());
static_assert(
    merge_stores_conflict_free<kvkit::int4_group_codec<32>, kvkit::int4_group_codec<32>, 128>());
static_assert(
    !merge_stores_conflict_free<kvkit::int4_group_codec<32>, kvkit::int4_group_codec<32>, 256>());
static_assert(merge_stores_conflict_free<kvkit::fp8_e4m3_codec, kvkit::bf16_codec, 128>());
static_assert(merge_stores_conflict_free<kvkit::int8_codec, kvkit::int4_group_codec<64>, 128>());

// The plan (plain C++, decode_plan.hpp) chooses the two-tile kernel only for caches the kernel
// has a two-tile form of (the launcher falls back to the one-tile kernel otherwise, whose splits
// the plan did not size): its rule, kvkit::detail::two_tiles_cache, and the kernel's,
// decode_two_tiles_fit, are stated apart, so every layout the library ships is checked here at
// every head dim and a group of each kernel width.
template <class Layout, int D, int Group>
constexpr bool plan_two_tiles_has_kernel() {
  const kvkit::decode_shape shape{
      1, Group, 1, D, 0, kvkit::decode_kv_bits<Layout>, kvkit::decode_kv_scaled_one_width<Layout>};
  constexpr int nt = Group <= 8 ? 1 : 2; // the kernel's head tiles of 8
  return !kvkit::detail::two_tiles_cache(shape) ||
         kd::decode_two_tiles_fit<typename Layout::k_codec, typename Layout::v_codec, D, nt>();
}
template <class Layout>
constexpr bool plan_two_tiles_has_kernel_all() {
  return plan_two_tiles_has_kernel<Layout, 64, 1>() && plan_two_tiles_has_kernel<Layout, 64, 8>() &&
         plan_two_tiles_has_kernel<Layout, 64, 16>() &&
         plan_two_tiles_has_kernel<Layout, 128, 4>() &&
         plan_two_tiles_has_kernel<Layout, 128, 8>() &&
         plan_two_tiles_has_kernel<Layout, 128, 16>() &&
         plan_two_tiles_has_kernel<Layout, 256, 4>() &&
         plan_two_tiles_has_kernel<Layout, 256, 16>();
}
template <class... Layouts>
constexpr bool plan_two_tiles_has_kernel_each() {
  return (plan_two_tiles_has_kernel_all<Layouts>() && ...);
}
using kvkit::paged_layout;
static_assert(plan_two_tiles_has_kernel_each<
              paged_layout<kvkit::bf16_codec>, paged_layout<kvkit::fp16_codec>,
              paged_layout<kvkit::fp8_e4m3_codec>, paged_layout<kvkit::fp8_e5m2_codec>,
              paged_layout<kvkit::int8_codec>, paged_layout<kvkit::int4_group_codec<32>>,
              paged_layout<kvkit::int4_group_codec<64>>, paged_layout<kvkit::int4_group_codec<128>>,
              paged_layout<kvkit::int8_codec, kvkit::int4_group_codec<64>>,
              paged_layout<kvkit::int8_codec, kvkit::bf16_codec>,
              paged_layout<kvkit::int8_codec, kvkit::fp8_e4m3_codec>,
              paged_layout<kvkit::fp8_e4m3_codec, kvkit::int8_codec>,
              paged_layout<kvkit::int4_group_codec<32>, kvkit::int4_group_codec<128>>>());
// And the plan does choose it where the kernel has it (int8 and int4 at head dim 128, group 8).
static_assert(kvkit::detail::two_tiles_cache(
    {1, 8, 1, 128, 0, 8, kvkit::decode_kv_scaled_one_width<paged_layout<kvkit::int8_codec>>}));
static_assert(kvkit::detail::two_tiles_cache(
    {1, 8, 1, 128, 0, 4,
     kvkit::decode_kv_scaled_one_width<paged_layout<kvkit::int4_group_codec<32>>>}));

// A stream and the graph executable made on it, destroyed on every way out of run_decode.
struct stream_and_graph {
  cudaStream_t stream = nullptr;
  cudaGraphExec_t exec = nullptr;
  stream_and_graph() = default;
  stream_and_graph(const stream_and_graph&) = delete;
  stream_and_graph& operator=(const stream_and_graph&) = delete;
  ~stream_and_graph() {
    if (exec != nullptr) {
      cudaGraphExecDestroy(exec);
    }
    if (stream != nullptr) {
      cudaStreamDestroy(stream);
    }
  }
};

// Copies n 16-bit values late, and pages [pages[i]] of a cache from a staged copy of it: the
// kernel signals its programmatic dependents at once, waits about 20 us, then copies with one
// block.
__global__ void copy_late(const std::uint16_t* src, std::uint16_t* dst, std::size_t n,
                          const uint4* cache_src, uint4* cache_dst, const std::int32_t* pages,
                          std::int32_t num_pages, std::int64_t page_words) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
  for (int k = 0; k < 20; ++k) {
    __nanosleep(1000);
  }
  for (std::size_t i = threadIdx.x; i < n; i += blockDim.x) {
    dst[i] = src[i];
  }
  for (std::int32_t k = 0; k < num_pages; ++k) {
    const std::int64_t at = pages[k] * page_words;
    for (std::int64_t i = threadIdx.x; i < page_words; i += blockDim.x) {
      cache_dst[at + i] = cache_src[at + i];
    }
  }
}

} // namespace

template <int HeadDim, class Layout, class T>
decode_outcome run_decode(const Layout& layout, const std::vector<std::byte>& cache,
                          std::int32_t capacity, const kvkit::decode_shape& shape,
                          const std::vector<decode_step>& steps,
                          const std::vector<float>& static_scales,
                          const kvkit::attention_options& options, const decode_mode& mode) {
  decode_outcome out;
  device_buffers mem;
  std::byte* d_cache = nullptr;
  KVKIT_TRY(mem.alloc(d_cache, cache.size()));
  KVKIT_TRY(cudaMemcpy(d_cache, cache.data(), cache.size(), cudaMemcpyHostToDevice));
  // late_last_pages: the cache as it should be, copied to d_cache's last pages late.
  std::byte* d_cache_staged = nullptr;
  if (mode.late_last_pages) {
    KVKIT_TRY(mem.alloc(d_cache_staged, cache.size()));
    KVKIT_TRY(cudaMemcpy(d_cache_staged, cache.data(), cache.size(), cudaMemcpyHostToDevice));
  }
  std::size_t max_indices = 1;
  std::size_t max_batch = 1;
  for (const decode_step& s : steps) {
    max_indices = std::max(max_indices, s.indices.size());
    max_batch = std::max(max_batch, s.last_page_len.size());
  }
  const auto rows = max_batch * static_cast<std::size_t>(shape.num_q_heads);
  const auto elems = rows * HeadDim;
  std::int32_t *d_indptr = nullptr, *d_indices = nullptr, *d_last = nullptr, *d_check = nullptr;
  T *d_q = nullptr, *d_out = nullptr;
  std::uint16_t* d_q_staged = nullptr;
  float *d_lse = nullptr, *d_scales = nullptr;
  KVKIT_TRY(mem.alloc(d_indptr, max_batch + 1));
  KVKIT_TRY(mem.alloc(d_indices, max_indices));
  KVKIT_TRY(mem.alloc(d_last, max_batch));
  std::int32_t* d_last_ids = nullptr; // each sequence's last page (late_last_pages)
  KVKIT_TRY(mem.alloc(d_last_ids, max_batch));
  KVKIT_TRY(mem.alloc(d_check, 1));
  KVKIT_TRY(mem.alloc(d_q, elems));
  KVKIT_TRY(mem.alloc(d_q_staged, 2 * elems)); // and after it, the queries after a decode
  KVKIT_TRY(mem.alloc(d_out, elems));
  KVKIT_TRY(mem.alloc(d_lse, rows));
  KVKIT_TRY(mem.alloc(d_scales, static_scales.size()));
  KVKIT_TRY(cudaMemset(d_check, 0, sizeof(std::int32_t)));
  if (!static_scales.empty()) {
    KVKIT_TRY(cudaMemcpy(d_scales, static_scales.data(), static_scales.size() * sizeof(float),
                         cudaMemcpyHostToDevice));
  }

  // Plans: one graph-safe plan for every step, or one per step from its lengths.
  const auto lengths = [&](const decode_step& s) {
    std::vector<std::int32_t> lens;
    for (std::size_t b = 0; b + 1 < s.indptr.size(); ++b) {
      const std::int32_t pages = s.indptr[b + 1] - s.indptr[b];
      lens.push_back(pages == 0 ? 0 : (pages - 1) * layout.page_size() + s.last_page_len[b]);
    }
    return lens;
  };
  std::vector<kvkit::decode_plan> plans;
  for (const decode_step& s : steps) {
    // Without a graph each step is planned for its own batch (shape.batch_size is the largest).
    kvkit::decode_shape step_shape = shape;
    step_shape.batch_size = static_cast<std::int32_t>(s.last_page_len.size());
    auto plan = mode.graph || mode.graph_safe_plan
                    ? kvkit::plan_decode_graph_safe(shape, mode.max_seq_len, mode.sm_count)
                    : kvkit::plan_decode(step_shape, lengths(s), mode.sm_count);
    if (!plan.ok()) {
      out.error = cudaErrorInvalidValue;
      return out;
    }
    plans.push_back(*plan);
  }
  std::size_t ws_bytes = 0;
  std::size_t counter_bytes = 0;
  for (const auto& p : plans) {
    ws_bytes = std::max(ws_bytes, p.workspace_bytes());
    if (p.workspace_bytes() > 0) {
      counter_bytes = std::max(counter_bytes, p.counter_bytes());
    }
  }
  // The workspace and, in the same allocation, a guard past its end that no launch may touch.
  constexpr std::size_t guard_bytes = 256;
  std::byte* d_ws = nullptr;
  KVKIT_TRY(mem.alloc(d_ws, ws_bytes + guard_bytes));
  // Garbage, not zeros: the launcher owes the workspace no initialization.
  KVKIT_TRY(cudaMemset(d_ws, 0xA5, ws_bytes + guard_bytes));
  // The caller's counters (zeroed_counters), for the largest batch.
  const auto counter_count =
      static_cast<std::size_t>(shape.batch_size) * static_cast<std::size_t>(shape.num_kv_heads);
  std::uint32_t* d_counters = nullptr;
  if (mode.zeroed_counters) {
    KVKIT_TRY(mem.alloc(d_counters, counter_count));
    KVKIT_TRY(cudaMemset(d_counters, 0, counter_count * sizeof(std::uint32_t)));
  }

  kvkit::cuda::decode_args<Layout, T> a;
  a.layout = layout;
  a.cache = d_cache;
  a.capacity = capacity;
  a.table = kvkit::csr_page_table{d_indptr, d_indices, d_last,
                                  static_cast<std::int32_t>(steps.front().last_page_len.size()),
                                  layout.page_size()};
  a.q = d_q;
  a.out = d_out;
  a.lse = mode.lse ? d_lse : nullptr;
  a.static_scales = static_scales.empty() ? nullptr : d_scales;
  a.options = options;
  a.page_check = mode.check_pages ? d_check : nullptr;
  a.dependent_launch = mode.dependent_launch;
  a.zeroed_counters = d_counters;
  a.zeroed_counter_count = mode.zeroed_counters ? static_cast<std::int64_t>(counter_count) : 0;
  a.page_table_ready = mode.page_table_ready;
  a.cache_ready_but_last_page = mode.late_last_pages;
  const std::int64_t page_bytes = layout.bytes_per_page();

  stream_and_graph sg;
  KVKIT_TRY(cudaStreamCreate(&sg.stream));
  cudaStream_t stream = sg.stream;
  cudaGraphExec_t& exec = sg.exec;
  for (std::size_t i = 0; i < steps.size(); ++i) {
    const decode_step& s = steps[i];
    const std::size_t batch = s.last_page_len.size();
    KVKIT_TRY(cudaMemcpy(d_indptr, s.indptr.data(), s.indptr.size() * 4, cudaMemcpyHostToDevice));
    if (!s.indices.empty()) {
      KVKIT_TRY(
          cudaMemcpy(d_indices, s.indices.data(), s.indices.size() * 4, cudaMemcpyHostToDevice));
    }
    KVKIT_TRY(cudaMemcpy(d_last, s.last_page_len.data(), batch * 4, cudaMemcpyHostToDevice));
    KVKIT_TRY(cudaMemcpy(mode.late_queries ? static_cast<void*>(d_q_staged) : d_q, s.q.data(),
                         s.q.size() * 2, cudaMemcpyHostToDevice));
    a.table.batch_size = static_cast<std::int32_t>(batch);
    std::vector<std::int32_t> last_ids;
    if (mode.late_last_pages) {
      for (std::size_t b = 0; b < batch; ++b) {
        if (s.indptr[b + 1] > s.indptr[b]) {
          last_ids.push_back(s.indices[static_cast<std::size_t>(s.indptr[b + 1] - 1)]);
        }
      }
      if (!last_ids.empty()) {
        KVKIT_TRY(
            cudaMemcpy(d_last_ids, last_ids.data(), last_ids.size() * 4, cudaMemcpyHostToDevice));
      }
    }
    for (std::int32_t r = 0; r < std::max(mode.repeats, 1); ++r) {
      KVKIT_TRY(cudaMemsetAsync(d_out, 0xFF, elems * sizeof(T), stream)); // NaN in fp16 and bf16
      KVKIT_TRY(cudaMemsetAsync(d_lse, 0xFF, rows * sizeof(float), stream));
      if (mode.graph) {
        if (exec == nullptr) {
          cudaGraph_t graph = nullptr;
          KVKIT_TRY(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
          const cudaError_t launch =
              kd::decode_dim<HeadDim>(a, plans[i], d_ws, ws_bytes, stream, mode.smem_optin);
          KVKIT_TRY(cudaStreamEndCapture(stream, &graph));
          if (launch != cudaSuccess) {
            cudaGraphDestroy(graph);
            out.error = launch;
            return out;
          }
          const cudaError_t inst = cudaGraphInstantiate(&exec, graph, 0);
          cudaGraphDestroy(graph);
          KVKIT_TRY(inst);
        }
        KVKIT_TRY(cudaGraphLaunch(exec, stream));
      } else {
        if (mode.late_queries) {
          KVKIT_TRY(cudaMemsetAsync(d_q, 0xFF, s.q.size() * 2, stream)); // NaN until copied
          for (const std::int32_t page : last_ids) {
            KVKIT_TRY(cudaMemsetAsync(d_cache + page * page_bytes, 0xFF,
                                      static_cast<std::size_t>(page_bytes), stream));
          }
          copy_late<<<1, 256, 0, stream>>>(
              d_q_staged, reinterpret_cast<std::uint16_t*>(d_q), s.q.size(),
              reinterpret_cast<const uint4*>(d_cache_staged), reinterpret_cast<uint4*>(d_cache),
              d_last_ids, static_cast<std::int32_t>(last_ids.size()), page_bytes / 16);
          KVKIT_TRY(cudaGetLastError());
        }
        if (mode.pending_error_first && i == 0 && r == 0) {
          out.pending_error_left = leave_pending_error();
          out.pending_error_returned =
              kd::decode_dim<HeadDim>(a, plans[i], d_ws, ws_bytes, stream, mode.smem_optin);
          out.pending_error_taken = cudaPeekAtLastError() == cudaSuccess;
          (void)cudaGetLastError();
          KVKIT_TRY(cudaStreamSynchronize(stream));
          std::vector<std::uint16_t> o(elems);
          KVKIT_TRY(cudaMemcpy(o.data(), d_out, o.size() * 2, cudaMemcpyDeviceToHost));
          out.untouched_after_error =
              std::all_of(o.begin(), o.end(), [](std::uint16_t x) { return x == 0xFFFF; });
        }
        if (mode.own_error_on_repeat && i == 0 && r == 1) {
          cudaStream_t capturing = nullptr;
          KVKIT_TRY(cudaStreamCreate(&capturing));
          const cudaError_t begun = cudaStreamBeginCapture(capturing, cudaStreamCaptureModeRelaxed);
          if (begun == cudaSuccess) {
            out.own_error_returned = kd::decode_dim<HeadDim>(a, plans[i], d_ws, ws_bytes,
                                                             cudaStreamLegacy, mode.smem_optin);
            out.own_error_taken = cudaPeekAtLastError() == cudaSuccess;
            cudaGraph_t graph = nullptr;
            (void)cudaStreamEndCapture(capturing, &graph);
            if (graph != nullptr) {
              cudaGraphDestroy(graph);
            }
          }
          cudaStreamDestroy(capturing);
          (void)cudaGetLastError(); // the ended capture's error, if it was invalidated
          KVKIT_TRY(begun);
          KVKIT_TRY(cudaStreamSynchronize(stream));
          std::vector<std::uint16_t> o(elems);
          KVKIT_TRY(cudaMemcpy(o.data(), d_out, o.size() * 2, cudaMemcpyDeviceToHost));
          out.untouched_after_error =
              std::all_of(o.begin(), o.end(), [](std::uint16_t x) { return x == 0xFFFF; });
        }
        KVKIT_TRY(kd::decode_dim<HeadDim>(a, plans[i], d_ws, ws_bytes, stream, mode.smem_optin));
        if (mode.late_queries) {
          KVKIT_TRY(cudaMemcpyAsync(d_q_staged + elems, d_q, s.q.size() * 2,
                                    cudaMemcpyDeviceToDevice, stream));
        }
      }
    }
    if (mode.late_queries) {
      out.queries_after.resize(s.q.size());
      KVKIT_TRY(cudaMemcpy(out.queries_after.data(), d_q_staged + elems, s.q.size() * 2,
                           cudaMemcpyDeviceToHost));
    }
    KVKIT_TRY(cudaStreamSynchronize(stream));
    std::vector<std::uint16_t> o(batch * static_cast<std::size_t>(shape.num_q_heads) * HeadDim);
    std::vector<float> l(batch * static_cast<std::size_t>(shape.num_q_heads));
    KVKIT_TRY(cudaMemcpy(o.data(), d_out, o.size() * 2, cudaMemcpyDeviceToHost));
    KVKIT_TRY(cudaMemcpy(l.data(), d_lse, l.size() * 4, cudaMemcpyDeviceToHost));
    out.out.push_back(std::move(o));
    out.lse.push_back(std::move(l));
    out.max_splits = plans[i].max_splits;
  }
  KVKIT_TRY(cudaMemcpy(&out.page_check, d_check, sizeof(std::int32_t), cudaMemcpyDeviceToHost));
  std::vector<std::uint8_t> ws(ws_bytes + guard_bytes);
  KVKIT_TRY(cudaMemcpy(ws.data(), d_ws, ws.size(), cudaMemcpyDeviceToHost));
  const auto ws_end = ws.begin() + static_cast<std::ptrdiff_t>(ws_bytes);
  out.workspace_written = std::any_of(ws.begin() + static_cast<std::ptrdiff_t>(counter_bytes),
                                      ws_end, [](std::uint8_t x) { return x != 0xA5; });
  out.past_workspace_intact =
      std::all_of(ws_end, ws.end(), [](std::uint8_t x) { return x == 0xA5; });
  if (mode.zeroed_counters) {
    std::vector<std::uint32_t> counters(counter_count);
    KVKIT_TRY(cudaMemcpy(counters.data(), d_counters, counters.size() * sizeof(std::uint32_t),
                         cudaMemcpyDeviceToHost));
    out.counters_zero =
        std::all_of(counters.begin(), counters.end(), [](std::uint32_t x) { return x == 0; });
  } else {
    const std::size_t last_counters =
        plans.back().workspace_bytes() > 0 ? plans.back().counter_bytes() : 0;
    out.counters_zero =
        std::all_of(ws.begin(), ws.begin() + static_cast<std::ptrdiff_t>(last_counters),
                    [](std::uint8_t x) { return x == 0; });
  }
  int device = 0;
  int clusters = 0;
  KVKIT_TRY(cudaGetDevice(&device));
  KVKIT_TRY(cudaDeviceGetAttribute(&clusters, cudaDevAttrClusterLaunch, device));
  // As the launcher decides: a build for an older compute capability, even run here through its
  // PTX, merges through the workspace.
  cudaFuncAttributes built{};
  KVKIT_TRY(cudaFuncGetAttributes(
      &built, kd::paged_decode_kernel<Layout, T, HeadDim, 1, 1, kd::decode_warps, 0>));
  out.cluster_device = clusters != 0 && kd::decode_built_for_clusters(built);
  return out;
}

namespace {

// What the launcher chooses for `lens` over `layout` with `q_heads` query heads, planned for 132
// multiprocessors and run on `sms` that let a block opt in to `optin` bytes of shared memory (by
// default 227 KiB, the H100's and the H200's); an unset choice (no tiles) where the plan fails.
template <int D, class Layout>
kvkit::cuda::detail::decode_build_choice
chosen(const Layout& layout, std::int32_t q_heads, const std::vector<std::int32_t>& lens,
       std::int32_t sms = 132, std::int32_t optin = 227 * 1024) {
  const auto plan = kvkit::plan_decode(
      kvkit::decode_shape_for(layout, static_cast<std::int32_t>(lens.size()), q_heads), lens, 132);
  if (!plan.ok()) {
    return {0, 0, 0, {}, 0};
  }
  kvkit::cuda::decode_args<Layout, __nv_bfloat16> a;
  a.layout = layout;
  a.table.batch_size = static_cast<std::int32_t>(lens.size());
  a.table.page_size = layout.page_size();
  return kvkit::cuda::detail::decode_build_chosen<D>(a, *plan, sms, optin);
}

} // namespace

std::vector<std::string> decode_choice_failures() {
  using kvkit::kv_order;
  using kvkit::cuda::detail::decode_long_ring;
  using kvkit::cuda::detail::decode_warps;
  using kvkit::cuda::detail::decode_wide_warps;
  std::vector<std::string> failed;
  const auto expect = [&](bool ok, const std::string& what,
                          const kvkit::cuda::detail::decode_build_choice& c) {
    // Only the one-tile builds sized by the device's shared memory are given its opt-in.
    const bool sized = c.tiles == 1 && (c.warps == kvkit::cuda::detail::decode_narrow_warps ||
                                        c.ring == kvkit::cuda::detail::decode_short_ring);
    if (!ok || (c.smem_optin != -1) != sized) {
      failed.push_back(what + ": chose " + std::to_string(c.tiles) + " tiles, " +
                       std::to_string(c.warps) + " warps, ring " + std::to_string(c.ring) + ", " +
                       std::to_string(c.plan.max_splits) + " splits of " +
                       std::to_string(c.plan.chunk_tokens) + " keys, given an opt-in of " +
                       std::to_string(c.smem_optin));
    }
  };
  // "int4 on a grid of at most one block per SM runs blocks of eight warps".
  using int4_g128_hnd = kvkit::paged_layout<kvkit::int4_group_codec<128>,
                                            kvkit::int4_group_codec<128>, kv_order::hnd>;
  for (const std::int32_t len : {2048, 2047, 1700}) {
    for (const std::int32_t group : {4, 8, 16}) {
      // Group 16 runs the kernel of two query tiles, whose wide build exists where it fits.
      const bool wide =
          group <= 8 ||
          kvkit::cuda::detail::decode_wide_fit<kvkit::int4_group_codec<128>,
                                               kvkit::int4_group_codec<128>, 128, 2>();
      const auto c = chosen<128>(int4_g128_hnd(16, 8, 128), 8 * group, {len}, 132);
      expect(c.tiles == 1 && c.warps == (wide ? decode_wide_warps : decode_warps),
             "int4 g128 HND, one sequence of " + std::to_string(len) + ", group " +
                 std::to_string(group) + (wide ? ": eight warps" : ": four warps"),
             c);
    }
    const auto c =
        chosen<64>(kvkit::paged_layout<kvkit::int4_group_codec<32>>(16, 8, 64), 32, {len}, 132);
    expect(c.tiles == 1 && c.warps == decode_wide_warps,
           "int4 g32 head dim 64, one sequence of " + std::to_string(len) + ": eight warps", c);
  }
  // "fp8 whole sequences in one wave of two blocks per SM": the two-tile kernel on whole
  // sequences at 132 SMs, the one-tile kernel at 100 (256 blocks are no wave of two there).
  using fp8_nhd = kvkit::paged_layout<kvkit::fp8_e4m3_codec>;
  using fp8_hnd = kvkit::paged_layout<kvkit::fp8_e4m3_codec, kvkit::fp8_e4m3_codec, kv_order::hnd>;
  const std::vector<std::int32_t> whole_fp8 = fp8_whole_wave_lengths();
  for (const auto& c : {chosen<128>(fp8_nhd(16, 8, 128), 16, whole_fp8, 132),
                        chosen<128>(fp8_hnd(16, 8, 128), 16, whole_fp8, 132)}) {
    expect(c.tiles == 2 && c.warps == decode_warps && c.plan.max_splits == 1,
           "fp8 whole sequences at 132 SMs: two tiles", c);
  }
  {
    const auto c = chosen<128>(fp8_nhd(16, 8, 128), 16, whole_fp8, 66);
    expect(c.tiles == 1 && c.plan.max_splits == 1, "fp8 whole sequences on 66 SMs: one tile", c);
  }
  // "int4 blocks of 2048 keys on the two-tile kernel's shallow build": two tiles, four stages.
  using int4_g32_hnd =
      kvkit::paged_layout<kvkit::int4_group_codec<32>, kvkit::int4_group_codec<32>, kv_order::hnd>;
  for (const auto& c : {chosen<128>(int4_g32_hnd(16, 8, 128), 64, lengths_below(32, 2048, 37, 64)),
                        chosen<128>(kvkit::paged_layout<kvkit::int4_group_codec<32>>(16, 8, 128),
                                    32, lengths_below(7, 8192, 29, 97))}) {
    expect(c.tiles == 2 && c.ring == decode_long_ring && c.plan.chunk_tokens == 2048,
           "int4 blocks of 2048 keys: two tiles, four stages", c);
  }
  // "fp8 split plans paired on the two-tile kernel's shallow build": half the splits of twice
  // the keys on the four-stage two-tile build at 132 SMs; the plan's own splits on the one-tile
  // kernel on 66 (where its grid is no wave of four blocks an SM).
  struct paired_case {
    const char* name;
    kvkit::cuda::detail::decode_build_choice at_132;
    kvkit::cuda::detail::decode_build_choice at_66;
    std::int32_t splits; // the plan's
    std::int32_t chunk;
  };
  const auto eight = lengths_below(8, 32768, 37, 97);
  const auto many = lengths_below(24, 8192, 37, 97);
  const auto mid = lengths_below(8, 8192, 37, 300);
  const paired_case paired[] = {
      {"fp8 8 x 32768 NHD", chosen<128>(fp8_nhd(16, 8, 128), 16, eight),
       chosen<128>(fp8_nhd(16, 8, 128), 16, eight, 66), 8, 4096},
      {"fp8 24 x 8192 HND", chosen<128>(fp8_hnd(16, 8, 128), 16, many),
       chosen<128>(fp8_hnd(16, 8, 128), 16, many, 66), 2, 4096},
      {"fp8 8 x 8192 NHD", chosen<128>(fp8_nhd(16, 8, 128), 32, mid),
       chosen<128>(fp8_nhd(16, 8, 128), 32, mid, 66), 8, 1024},
  };
  for (const paired_case& p : paired) {
    const auto& c = p.at_132;
    expect(c.tiles == 2 && c.ring == decode_long_ring && c.plan.max_splits == (p.splits + 1) / 2 &&
               c.plan.chunk_tokens == 2 * p.chunk,
           std::string(p.name) + " at 132 SMs: paired, two tiles, four stages", c);
    const auto& d = p.at_66;
    expect(d.tiles == 1 && d.plan.max_splits == p.splits && d.plan.chunk_tokens == p.chunk,
           std::string(p.name) + " on 66 SMs: the plan's splits, one tile", d);
  }
  // "int4 in NHD pages on blocks of four KV heads": the head-split build for the plans that say
  // so, with a quarter of the grid's y; the same plan over HND pages (which the plan leaves to
  // blocks of one head) on the one-tile build of one head a block, four times the blocks.
  {
    using int4_nhd = kvkit::paged_layout<kvkit::int4_group_codec<32>>;
    using int4_hnd = kvkit::paged_layout<kvkit::int4_group_codec<32>, kvkit::int4_group_codec<32>,
                                         kv_order::hnd>;
    for (const auto& [name, lens] : {std::pair{"32 x 32768", lengths_below(32, 32768, 11, 97)},
                                     std::pair{"64 x 32768", lengths_below(64, 32768, 13, 301)}}) {
      const auto c = chosen<128>(int4_nhd(16, 8, 128), 64, lens);
      expect(c.tiles == 1 && c.warps == decode_warps && c.ring == 0 &&
                 c.heads == kvkit::decode_plan::head_split_heads &&
                 c.plan.heads_per_block == kvkit::decode_plan::head_split_heads &&
                 c.blocks == static_cast<std::int64_t>(c.plan.max_splits) * 2 *
                                 static_cast<std::int64_t>(lens.size()),
             std::string("int4 g32 NHD ") + name + ": four KV heads a block", c);
      kvkit::cuda::decode_args<int4_hnd, __nv_bfloat16> a;
      a.layout = int4_hnd(16, 8, 128);
      a.table.batch_size = static_cast<std::int32_t>(lens.size());
      a.table.page_size = 16;
      const auto h = kvkit::cuda::detail::decode_build_chosen<128>(a, c.plan, 132, 227 * 1024);
      expect(h.tiles == 1 && h.heads == 1 &&
                 h.blocks == static_cast<std::int64_t>(c.plan.max_splits) * 8 *
                                 static_cast<std::int64_t>(lens.size()),
             std::string("int4 g32 HND ") + name + " under that plan: one KV head a block", h);
    }
  }
  // bf16 at head dim 256, whose own ring takes more shared memory than an A100 lets a block
  // opt in to: its own ring at 227 KiB, the short ring at 163 KiB (an A100's), the narrow build
  // at 99 KiB (compute capability 8.6, 8.9 and 12.x), each sized build given the opt-in.
  {
    const kvkit::paged_layout<kvkit::bf16_codec> bf16_256(16, 8, 256);
    const auto lens = lengths_below(32, 2048, 37, 97);
    const auto own = chosen<256>(bf16_256, 32, lens);
    expect(own.tiles == 1 && own.warps == decode_warps && own.ring == 0,
           "bf16 head dim 256 at 227 KiB: its own ring", own);
    const auto a100 = chosen<256>(bf16_256, 32, lens, 132, 163 * 1024);
    expect(a100.tiles == 1 && a100.warps == decode_warps &&
               a100.ring == kvkit::cuda::detail::decode_short_ring && a100.smem_optin == 163 * 1024,
           "bf16 head dim 256 at 163 KiB: the short ring", a100);
    const auto least = chosen<256>(bf16_256, 32, lens, 132, 99 * 1024);
    expect(least.tiles == 1 && least.warps == kvkit::cuda::detail::decode_narrow_warps &&
               least.smem_optin == 99 * 1024,
           "bf16 head dim 256 at 99 KiB: the narrow build", least);
  }
  return failed;
}

std::vector<std::string> decode_validation_failures() {
  using layout_t = kvkit::paged_layout<kvkit::bf16_codec>;
  using args_t = kvkit::cuda::decode_args<layout_t, __nv_bfloat16>;
  std::vector<std::string> failed;
  std::byte* const fake = stand_in();
  auto* p = reinterpret_cast<std::int32_t*>(fake);
  auto* t = reinterpret_cast<__nv_bfloat16*>(fake);
  args_t good;
  good.layout = layout_t(16, 2, 128);
  good.cache = fake;
  good.capacity = 10;
  good.table = kvkit::csr_page_table{p, p, p, 3, 16};
  good.q = t;
  good.out = t;
  const std::vector<std::int32_t> lens{1, 5000, 20};
  const auto plan = *kvkit::plan_decode({3, 8, 2, 128, 0}, lens, 132);
  const std::size_t ws = plan.workspace_bytes();
  const auto check = [&](const char* name, const args_t& a, const kvkit::decode_plan& pl, void* w,
                         std::size_t bytes, bool expect_ok) {
    if (!launchers_agree(kvkit::cuda::validate(a, pl, w, bytes).ok(), expect_ok, true,
                         [&] { return kvkit::cuda::paged_decode(a, pl, w, bytes, nullptr); })) {
      failed.emplace_back(name);
    }
  };
  if (ws == 0) {
    failed.emplace_back("plan for a 5000-token sequence has no splits");
  }
  check("good", good, plan, fake, ws, true);
  check("workspace missing", good, plan, nullptr, ws, false);
  check("workspace too small", good, plan, fake, ws - 4, false);
  check("workspace misaligned", good, plan, fake + 4, ws, false);
  // One change each to the good arguments (`with`) or to the plan (`with_plan`), checked with the
  // other as it is.
  const auto with = [&](const char* name, bool expect_ok, auto change) {
    args_t a = good;
    change(a);
    check(name, a, plan, fake, ws, expect_ok);
  };
  const auto with_plan = [&](const char* name, bool expect_ok, auto change) {
    kvkit::decode_plan pl = plan;
    change(pl);
    check(name, good, pl, fake, ws, expect_ok);
  };
  with("null cache", false, [&](args_t& a) { a.cache = nullptr; });
  with("misaligned cache", false, [&](args_t& a) { a.cache = fake + 8; });
  with("null q", false, [](args_t& a) { a.q = nullptr; });
  with("misaligned q", false, [&](args_t& a) { a.q = t + 1; });
  with("null out", false, [](args_t& a) { a.out = nullptr; });
  with("misaligned out", false, [&](args_t& a) { a.out = t + 4; });
  with("null indices", false, [](args_t& a) { a.table.indices = nullptr; });
  with("null indptr", false, [](args_t& a) { a.table.indptr = nullptr; });
  with("null last_page_len", false, [](args_t& a) { a.table.last_page_len = nullptr; });
  // The page table, log-sum-exps, fp8 scales and debug flag are read or written an element at a
  // time: each needs its element's alignment, no more.
  auto* const odd = reinterpret_cast<std::int32_t*>(fake + 2);
  with("4-byte aligned table, log-sum-exps and debug flag", true, [&](args_t& a) {
    a.table.indptr = p + 1;
    a.table.indices = p + 3;
    a.table.last_page_len = p + 5;
    a.lse = reinterpret_cast<float*>(fake + 4);
    a.page_check = p + 7;
  });
  with("misaligned indptr", false, [&](args_t& a) { a.table.indptr = odd; });
  with("misaligned indices", false, [&](args_t& a) { a.table.indices = odd; });
  with("misaligned last_page_len", false, [&](args_t& a) { a.table.last_page_len = odd; });
  with("misaligned lse", false, [&](args_t& a) { a.lse = reinterpret_cast<float*>(fake + 2); });
  with("misaligned debug flag", false, [&](args_t& a) { a.page_check = odd; });
  with("page size differs from the layout", false, [](args_t& a) { a.table.page_size = 8; });
  with("batch differs from a non-graph plan", false, [](args_t& a) { a.table.batch_size = 2; });
  with("no capacity", false, [](args_t& a) { a.capacity = 0; });
  // A graph-safe plan serves any batch up to its own, none past it.
  const auto graph = *kvkit::plan_decode_graph_safe({3, 8, 2, 128, 0}, 5000, 132);
  args_t a;
  for (const std::int32_t batch : {-1, 0, 2, 3, 4}) {
    a = good;
    a.table.batch_size = batch;
    const std::string name = "graph-safe plan of 3, batch " + std::to_string(batch);
    check(name.c_str(), a, graph, fake, graph.workspace_bytes(), batch >= 0 && batch <= 3);
  }
  // An empty batch under a graph-safe plan: accepted, and the launcher returns success having
  // launched nothing (no CUDA call: this runs without a device too).
  a = good;
  a.table.batch_size = 0;
  if (!launchers_agree(
          kvkit::cuda::validate(a, graph, fake, graph.workspace_bytes()).ok(), true, false, [&] {
            return kvkit::cuda::paged_decode(a, graph, fake, graph.workspace_bytes(), nullptr);
          })) {
    failed.emplace_back("graph-safe plan of 3, batch 0, launched");
  }
  // The launcher of one head dim refuses a plan for another, before anything else.
  if (kvkit::cuda::paged_decode_dim<64>(good, plan, fake, ws, nullptr) != cudaErrorInvalidValue ||
      kvkit::cuda::paged_decode_dim<256>(good, plan, fake, ws, nullptr) != cudaErrorInvalidValue) {
    failed.emplace_back("paged_decode_dim of another head dim");
  }
  // At most 65535 sequences (the grid's z): the plans refuse more (decode_shape::validate), and
  // so does the launcher, given a plan made by hand for more.
  {
    const std::vector<std::int32_t> many(65536, 100);
    if (kvkit::plan_decode({65536, 8, 2, 128, 0}, many, 132).ok()) {
      failed.emplace_back("a plan for 65536 sequences");
    }
    const auto wide = kvkit::plan_decode({65535, 8, 2, 128, 0}, std::span(many).first(65535), 132);
    if (!wide.ok()) {
      failed.emplace_back("no plan for 65535 sequences");
    } else {
      a = good;
      a.table.batch_size = 65535;
      check("65535 sequences", a, *wide, fake, wide->workspace_bytes(), true);
      auto wider = *wide;
      wider.shape.batch_size = 65536;
      a.table.batch_size = 65536;
      check("65536 sequences, a plan made by hand", a, wider, fake,
            std::max(wide->workspace_bytes(), wider.workspace_bytes()), false);
    }
  }
  // The caller's zeroed counters: one per (sequence, KV head) of the plan, 4-byte aligned.
  auto* const counters = reinterpret_cast<std::uint32_t*>(fake);
  const auto needed = static_cast<std::int64_t>(plan.counter_count());
  const auto with_counters = [&](const char* name, bool expect_ok, std::uint32_t* at,
                                 std::int64_t count) {
    with(name, expect_ok, [&](args_t& c) {
      c.zeroed_counters = at;
      c.zeroed_counter_count = count;
    });
  };
  with_counters("zeroed counters", true, counters, needed);
  with_counters("more zeroed counters than needed", true, counters, needed + 100);
  with_counters("too few zeroed counters", false, counters, needed - 1);
  with_counters("negative zeroed counter count", false, counters, -1);
  with_counters("misaligned zeroed counters", false, reinterpret_cast<std::uint32_t*>(fake + 2),
                needed);
  with_counters("zeroed counter count without counters", false, nullptr, needed);
  with("kv heads differ from the plan", false, [](args_t& c) { c.layout = layout_t(16, 4, 128); });
  with("head dim differs from the plan", false, [](args_t& c) { c.layout = layout_t(16, 2, 64); });
  with("window differs from the plan", false, [](args_t& c) { c.options.window = 5; });
  const auto with_cap = [&](const char* name, bool expect_ok, float cap) {
    with(name, expect_ok, [&](args_t& c) { c.options.logits_soft_cap = cap; });
  };
  with_cap("negative soft cap", false, -1.0F);
  with_cap("subnormal soft cap", false, std::numeric_limits<float>::denorm_min()); // 1 / cap: inf
  with_cap("smallest normal soft cap", true, std::numeric_limits<float>::min());
  with_cap("NaN soft cap", false, std::numeric_limits<float>::quiet_NaN());
  const auto with_scale = [&](const char* name, float scale) {
    with(name, false, [&](args_t& c) { c.options.scale = scale; });
  };
  with_scale("infinite scale", std::numeric_limits<float>::infinity());
  with_scale("negative scale", -0.125F);
  with_scale("NaN scale", std::numeric_limits<float>::quiet_NaN());
  const auto with_chunk = [&](const char* name, bool expect_ok, std::int32_t chunk) {
    with_plan(name, expect_ok, [&](kvkit::decode_plan& pl) { pl.chunk_tokens = chunk; });
  };
  constexpr auto tile = static_cast<std::int32_t>(kvkit::decode_plan::tile_tokens);
  with_chunk("chunk not a multiple of the tile", false, 100);
  with_chunk("a chunk of no keys", false, 0);
  with_chunk("a negative chunk", false, -tile);
  // A chunk of at most 2^30 keys, as the plans make them (the kernel's split ends are 32-bit).
  with_chunk("a chunk of 2^30 keys", true, 1 << 30);
  with_chunk("a chunk over 2^30 keys", false, (1 << 30) + tile);
  with_plan("no splits", false, [](kvkit::decode_plan& pl) { pl.max_splits = 0; });
  auto plan96 = plan;
  plan96.shape.head_dim = 96;
  check("head dim 96", good, plan96, fake, ws, false);
  a = good;
  a.layout = layout_t(16, 2, 96); // the layout agrees: only the kernels' head dims refuse it
  check("head dim 96 in the plan and the layout", a, plan96, fake, ws, false);
  with_plan("kv_bits of another cache", false, [](kvkit::decode_plan& pl) {
    pl.shape.kv_bits = 8; // a plan for an 8-bit cache, the layout's is bf16
  });
  with_plan("kv_scaled_one_width of another cache", false, [](kvkit::decode_plan& pl) {
    pl.shape.kv_scaled_one_width = true; // a plan for a cache scaled per token
  });
  const auto with_page_size = [&](const char* name, bool expect_ok, std::int32_t page_size) {
    with_plan(name, expect_ok, [&](kvkit::decode_plan& pl) { pl.shape.page_size = page_size; });
  };
  with_page_size("page_size of another cache", false, 32); // the layout's pages hold 16
  // The layout's (the plan above was built without one: 0).
  with_page_size("page_size of this cache", true, 16);
  with_page_size("negative page_size", false, -1);
  with_plan("more splits than the merge holds", false, [](kvkit::decode_plan& pl) {
    pl.max_splits = kvkit::decode_plan::max_splits_limit + 1;
  });
  with_plan("group of 17", false, [](kvkit::decode_plan& pl) { pl.shape.num_q_heads = 2 * 17; });
  // KV heads a block: 1, or decode_plan::head_split_heads where the KV heads are a multiple of
  // it and the splits at most head_split_max_splits. A cache without the head-split build (bf16
  // here) runs such a plan on blocks of one head, so it is accepted.
  with_plan("two KV heads a block", false, [](kvkit::decode_plan& pl) { pl.heads_per_block = 2; });
  with_plan("blocks of four KV heads over two", false, [](kvkit::decode_plan& pl) {
    pl.heads_per_block = kvkit::decode_plan::head_split_heads;
  });
  {
    a = good;
    a.layout = layout_t(16, 4, 128);
    auto four = *kvkit::plan_decode({3, 16, 4, 128, 0}, lens, 132);
    four.heads_per_block = kvkit::decode_plan::head_split_heads;
    check("blocks of four KV heads over four", a, four, fake, four.workspace_bytes(), true);
    four.max_splits = kvkit::decode_plan::head_split_max_splits + 1;
    check("blocks of four KV heads, more splits than their merge holds", a, four, fake,
          four.workspace_bytes(), false);
  }
  // fp8 without its static scales (and with them, accepted), a per-channel codec and a codec of
  // the caller's own: the good case's arguments otherwise, each under a plan made for its layout,
  // so that only the check of the codec or of its scales can refuse it.
  const auto codec_case = [&](auto layout, const float* scales, bool expect_ok, const char* name) {
    const auto pl = kvkit::plan_decode(kvkit::decode_shape_for(layout, 3, 8), lens, 132);
    if (!pl.ok()) {
      failed.push_back(std::string(name) + ": no plan");
      return;
    }
    kvkit::cuda::decode_args<decltype(layout), __nv_bfloat16> o;
    o.layout = layout;
    o.cache = fake;
    o.capacity = good.capacity;
    o.table = good.table;
    o.q = t;
    o.out = t;
    o.static_scales = scales;
    if (kvkit::cuda::validate(o, *pl, fake, pl->workspace_bytes()).ok() != expect_ok) {
      failed.emplace_back(name);
    }
  };
  const auto* scales = reinterpret_cast<const float*>(fake);
  using fp8_layout = kvkit::paged_layout<kvkit::fp8_e4m3_codec>;
  codec_case(fp8_layout(16, 2, 128), nullptr, false, "fp8 without static scales");
  codec_case(fp8_layout(16, 2, 128), scales, true, "fp8 with static scales");
  codec_case(
      kvkit::paged_layout<kvkit::int4_channel_codec, kvkit::int4_group_codec<32>>(16, 2, 128),
      nullptr, false, "per-channel K codec");
  // bf16's twin, so that everything but the codec agrees: the kernels are written for the
  // library's codecs.
  struct own_bf16 : kvkit::bf16_codec {};
  static_assert(kvkit::kv_codec<own_bf16>);
  codec_case(kvkit::paged_layout<own_bf16>(16, 2, 128), nullptr, false,
             "a codec of the caller's own");
  // A page_layout of the caller's own, here with paged_layout's own geometry: the kernels are
  // written for paged_layout.
  struct own_layout : kvkit::paged_layout<kvkit::bf16_codec> {
    using paged_layout::paged_layout;
  };
  static_assert(kvkit::page_layout<own_layout>);
  codec_case(own_layout(16, 2, 128), nullptr, false, "a page layout of the caller's own");
  // Plans: bad shapes and lengths are errors.
  if (kvkit::plan_decode({3, 8, 2, 128, 0}, std::vector<std::int32_t>{1, 0, 2}, 132).ok() ||
      kvkit::plan_decode({3, 8, 2, 128, 0}, std::vector<std::int32_t>{1, 2}, 132).ok() ||
      kvkit::plan_decode({3, 8, 3, 128, 0}, lens, 132).ok() ||
      kvkit::plan_decode_graph_safe({3, 8, 2, 128, 0}, 0, 132).ok() ||
      kvkit::plan_decode({3, 8, 2, 128, 0}, lens, 0).ok()) {
    failed.emplace_back("a bad plan request was accepted");
  }
  return failed;
}

namespace {

// One kernel's resident blocks per multiprocessor with `need` bytes of shared memory of its own
// and with what the launcher asks for (decode_held_smem, for blocks of decode_warps warps): a line
// in `failed` where the first is below the blocks its grids are cut for (`planned`) or the second
// is not exactly that.
template <class Kernel>
void check_held(const std::string& name, Kernel kernel, int threads, bool held_kernel, int planned,
                std::int32_t need, int device, std::vector<std::string>& failed) {
  // The limit only goes up (a launcher that raised it for its cluster mailboxes counts on it).
  cudaFuncAttributes attributes{};
  int own = 0;
  int held = 0;
  std::int32_t smem = 0;
  bool ok = cudaFuncGetAttributes(&attributes, kernel) == cudaSuccess;
  const std::int32_t limit =
      attributes.maxDynamicSharedSizeBytes > need ? attributes.maxDynamicSharedSizeBytes : need;
  ok = ok && cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, limit) ==
                 cudaSuccess;
  ok = ok &&
       cudaOccupancyMaxActiveBlocksPerMultiprocessor(&own, kernel, threads, need) == cudaSuccess;
  if (held_kernel) {
    ok = ok &&
         kd::decode_held_smem(kernel, threads, planned, need, limit, device, smem) == cudaSuccess;
  } else {
    smem = need; // the wide and narrow kernels are not held (launch_decode)
  }
  ok = ok && cudaOccupancyMaxActiveBlocksPerMultiprocessor(
                 &held, kernel, threads, static_cast<std::size_t>(smem)) == cudaSuccess;
  if (!ok) {
    (void)cudaGetLastError();
    failed.push_back(name + ": a CUDA call failed");
  } else if (own < planned || (held_kernel && held != planned)) {
    failed.push_back(name + ": cut for " + std::to_string(planned) + " blocks an SM, " +
                     std::to_string(own) + " resident with " + std::to_string(need) +
                     " bytes of shared memory, " + std::to_string(held) + " with " +
                     std::to_string(smem));
  }
}

// check_held for one decode kernel. The head-split build (HB heads a block) is counted twice: with
// its cluster mailboxes, four times a one-head block's, which its launches take where its splits
// merge in clusters, and with the one-tile kernel's shared memory alone, which the others take.
template <class Layout, class T, int D, int NT, int KT, int W, int Ring, int HB = 1>
void check_residency(const std::string& what, int device, std::vector<std::string>& failed) {
  using K = typename Layout::k_codec;
  using V = typename Layout::v_codec;
  const auto kernel = kd::paged_decode_kernel<Layout, T, D, NT, KT, W, Ring, HB>;
  constexpr int planned = kd::decode_planned_blocks<K, V, D, NT, KT, W>;
  constexpr int plain = kd::decode_smem_bytes<K, V, D, NT, KT, W, Ring>();
  constexpr int need =
      HB > 1 ? kd::decode_cluster_smem_bytes<K, V, D, NT, KT, W, Ring, HB>() : plain;
  const std::string name = what + " D=" + std::to_string(D) + " NT=" + std::to_string(NT) +
                           " KT=" + std::to_string(KT) + " W=" + std::to_string(W) +
                           (Ring > 0 ? " ring " + std::to_string(Ring) : "") +
                           (HB > 1 ? " heads " + std::to_string(HB) : "");
  constexpr bool held_kernel = W == kd::decode_warps;
  check_held(name, kernel, W * 32, held_kernel, planned, need, device, failed);
  if constexpr (HB > 1) {
    check_held(name + " without clusters", kernel, W * 32, held_kernel, planned, plain, device,
               failed);
  }
}

// The kernels the launcher may run for a cache of `Layout` at head dim D with NT query tiles
// (launch_decode): the one-tile kernel's own build and, where they exist, its head-split build,
// the two-tile kernel and its long ring, the short ring, the narrow build and the wide kernel.
template <class Layout, class T, int D, int NT>
void check_residency_tiles(const std::string& what, int device, std::vector<std::string>& failed) {
  using K = typename Layout::k_codec;
  using V = typename Layout::v_codec;
  check_residency<Layout, T, D, NT, 1, kd::decode_warps, 0>(what, device, failed);
  if constexpr (kd::decode_head_split_fit<Layout, D, NT>()) {
    check_residency<Layout, T, D, NT, 1, kd::decode_warps, 0, kvkit::decode_plan::head_split_heads>(
        what, device, failed);
  }
  if constexpr (kd::decode_two_tiles_fit<K, V, D, NT>()) {
    check_residency<Layout, T, D, NT, 2, kd::decode_warps, 0>(what, device, failed);
    if constexpr (kd::decode_long_ring_fit<K, V, D, NT>()) {
      check_residency<Layout, T, D, NT, 2, kd::decode_warps, kd::decode_long_ring>(what, device,
                                                                                   failed);
    }
  }
  if constexpr (kd::decode_short_ring_fit<K, V, D, NT>()) {
    check_residency<Layout, T, D, NT, 1, kd::decode_warps, kd::decode_short_ring>(what, device,
                                                                                  failed);
  }
  if constexpr (kd::decode_narrow_fit<K, V, D, NT>()) {
    check_residency<Layout, T, D, NT, 1, kd::decode_narrow_warps, 0>(what, device, failed);
  }
  if constexpr (kd::decode_wide_fit<K, V, D, NT>()) {
    check_residency<Layout, T, D, NT, 1, kd::decode_wide_warps, 0>(what, device, failed);
  }
}

// Those of both query tiles.
template <class Layout, class T, int D>
void check_residency_all(const std::string& what, int device, std::vector<std::string>& failed) {
  check_residency_tiles<Layout, T, D, 1>(what, device, failed);
  check_residency_tiles<Layout, T, D, 2>(what, device, failed);
}

} // namespace

// The variants the tests run (each instantiation compiles the kernels of one head dim).
#define KVKIT_DECODE_CASE(D, L, T)                                                                 \
  template decode_outcome run_decode<D, L, T>(                                                     \
      const L&, const std::vector<std::byte>&, std::int32_t, const kvkit::decode_shape&,           \
      const std::vector<decode_step>&, const std::vector<float>&, const kvkit::attention_options&, \
      const decode_mode&);

using kvkit::kv_order;
using kvkit::paged_layout;
using bf16_nhd = paged_layout<kvkit::bf16_codec>;
using fp16_hnd = paged_layout<kvkit::fp16_codec, kvkit::fp16_codec, kv_order::hnd>;
using e4m3_nhd = paged_layout<kvkit::fp8_e4m3_codec>;
using e5m2_hnd = paged_layout<kvkit::fp8_e5m2_codec, kvkit::fp8_e5m2_codec, kv_order::hnd>;
using int8_nhd = paged_layout<kvkit::int8_codec>;
using int4_32 = paged_layout<kvkit::int4_group_codec<32>>;
using int4_128_hnd =
    paged_layout<kvkit::int4_group_codec<128>, kvkit::int4_group_codec<128>, kv_order::hnd>;
using e4m3_hnd = paged_layout<kvkit::fp8_e4m3_codec, kvkit::fp8_e4m3_codec, kv_order::hnd>;
using int4_32_hnd =
    paged_layout<kvkit::int4_group_codec<32>, kvkit::int4_group_codec<32>, kv_order::hnd>;
using int8_k_int4_v = paged_layout<kvkit::int8_codec, kvkit::int4_group_codec<64>>;

KVKIT_DECODE_CASE(64, bf16_nhd, __nv_bfloat16)
KVKIT_DECODE_CASE(128, bf16_nhd, __nv_bfloat16)
KVKIT_DECODE_CASE(256, bf16_nhd, __nv_bfloat16)
KVKIT_DECODE_CASE(128, fp16_hnd, __half)
KVKIT_DECODE_CASE(256, fp16_hnd, __half)
KVKIT_DECODE_CASE(128, e4m3_nhd, __nv_bfloat16)
KVKIT_DECODE_CASE(64, e5m2_hnd, __half)
KVKIT_DECODE_CASE(128, int8_nhd, __nv_bfloat16)
KVKIT_DECODE_CASE(256, int4_32, __half)
KVKIT_DECODE_CASE(128, int4_128_hnd, __nv_bfloat16)
KVKIT_DECODE_CASE(128, e4m3_hnd, __nv_bfloat16)
KVKIT_DECODE_CASE(128, int4_32_hnd, __nv_bfloat16)
KVKIT_DECODE_CASE(128, int8_k_int4_v, __half)
KVKIT_DECODE_CASE(64, int4_32, __nv_bfloat16)
KVKIT_DECODE_CASE(128, int4_32, __nv_bfloat16)
KVKIT_DECODE_CASE(128, bf16_nhd, __half)
KVKIT_DECODE_CASE(256, e4m3_nhd, __nv_bfloat16)
KVKIT_DECODE_CASE(256, int8_nhd, __nv_bfloat16)
KVKIT_DECODE_CASE(64, int8_nhd, __half)

std::vector<std::string> decode_residency_failures() {
  std::vector<std::string> failed;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    (void)cudaGetLastError();
    return {"no device"};
  }
  // The kernels of the variants above (no other kernel is compiled for this check).
  check_residency_all<bf16_nhd, __nv_bfloat16, 64>("bf16", device, failed);
  check_residency_all<bf16_nhd, __nv_bfloat16, 128>("bf16", device, failed);
  check_residency_all<bf16_nhd, __nv_bfloat16, 256>("bf16", device, failed);
  check_residency_all<fp16_hnd, __half, 128>("fp16 hnd", device, failed);
  check_residency_all<fp16_hnd, __half, 256>("fp16 hnd", device, failed);
  check_residency_all<e4m3_nhd, __nv_bfloat16, 128>("fp8 e4m3", device, failed);
  check_residency_all<e5m2_hnd, __half, 64>("fp8 e5m2 hnd", device, failed);
  check_residency_all<int8_nhd, __nv_bfloat16, 128>("int8", device, failed);
  check_residency_all<int4_32, __half, 256>("int4 g32", device, failed);
  check_residency_all<int4_128_hnd, __nv_bfloat16, 128>("int4 g128 hnd", device, failed);
  check_residency_all<e4m3_hnd, __nv_bfloat16, 128>("fp8 e4m3 hnd", device, failed);
  check_residency_all<int4_32_hnd, __nv_bfloat16, 128>("int4 g32 hnd", device, failed);
  check_residency_all<int8_k_int4_v, __half, 128>("int8 K, int4 V", device, failed);
  check_residency_all<int4_32, __nv_bfloat16, 64>("int4 g32", device, failed);
  check_residency_all<int4_32, __nv_bfloat16, 128>("int4 g32", device, failed);
  check_residency_all<bf16_nhd, __half, 128>("bf16, fp16 queries", device, failed);
  check_residency_all<e4m3_nhd, __nv_bfloat16, 256>("fp8 e4m3", device, failed);
  check_residency_all<int8_nhd, __nv_bfloat16, 256>("int8", device, failed);
  check_residency_all<int8_nhd, __half, 64>("int8, fp16 queries", device, failed);
  return failed;
}

} // namespace kvkit_test
