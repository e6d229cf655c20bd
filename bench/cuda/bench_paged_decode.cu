// paged_decode throughput: Llama-3-8B attention shapes (8 KV heads, head dim 128 unless
// KVKIT_DECODE_HEAD_DIM says otherwise (below), groups 4 and 8 unless KVKIT_DECODE_GROUPS does)
// for B in {1, 8, 32, 64, 128} x L in {512, 2048, 8192, 32768}, every codec (bf16, fp8 e4m3 and
// int4 g32 at every shape and group; fp16, fp8 e5m2, int8, int4 g64 and g128 at group 8, and at
// group 4 at the sweep's shapes: B=1, L=2048; B=8, L=8192; B=32, L=2048; B=64, L=8192), page
// size 16, plus a page-size sweep (bf16: 1, 2, 4, 8, 16, 32 and 64; fp8 and int4: 1, 16 and 64),
// and bf16, fp8 e4m3 and int4 g32 in HND pages at the same shapes as fp16's. Pages are
// scattered at random over a cache of 4 M tokens, filled through quantize_pages from random values,
// and small shapes rotate over disjoint page sets, up to 256 of them, so that the keys of one loop
// (512 MB of them where the cache holds that many) are far more than the 50 MB L2 holds.
// Time per call comes from a back-to-back loop of launches between two events (median of 7 loops).
// The paged_decode_graph rows capture the same loop, planned with plan_decode_graph_safe, in a CUDA
// graph and time its replays, as an engine that runs its decode step from a graph would see the
// kernel. Launches use the defaults an engine would (each a programmatic dependent of the one
// before) and arrival counters zeroed once at allocation (decode_args::zeroed_counters, so split
// shapes need no memset before each); the page table is written before the loop
// (decode_args::page_table_ready) and no launch of the loop writes the cache
// (decode_args::cache_ready_but_last_page: an engine's decode step follows the kernel that appends
// each sequence's token to its last page, which that promise allows).
//
// A last row launches an empty kernel the same way (paged_decode_launch/empty_kernel): the host
// time of the launch alone, for the stream rows' host_us (the host's time to queue a call).
//
// The decode_beside_swap rows run bf16 B=32, L=8192 on one stream while another swaps pages in or
// out through the swap kernel (a block a page, or 64 to 4 blocks) or the copy engines, the two
// streams at the same priority or the decode's first (decode_first): what each costs the other.
//
// Each row prints: effective TB/s ((K+V bytes read, scales included) + q + out) / time), a device
// memcpy of 1 GB from the same run, PyTorch SDPA on contiguous bf16 KV of the same shape when
// KVKIT_SDPA_CSV names the file bench/cuda/sdpa_peer.py wrote in the same run, the target of the
// shape and the ratios; quantized rows also print their time over bf16's at the same shape and in
// the same order (NHD or HND).

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <benchmark/benchmark.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "cuda/bench_cuda_timing.cuh"
#include "kvkit/cuda/copy_blocks.cuh"
#include "kvkit/cuda/paged_decode.cuh"
#include "kvkit/cuda/quantize_pages.cuh"
#include "kvkit/layout/page_layout.hpp"
#include "kvkit/quant/codecs.hpp"

namespace {

// KV heads of every row: 8, or KVKIT_DECODE_KV_HEADS (1 to 64) to see what the distance between a
// page's K and V regions (page size x KV heads x head dim x element bytes) does with a page size.
std::int32_t kv_heads() {
  static const std::int32_t heads = [] {
    const char* v = std::getenv("KVKIT_DECODE_KV_HEADS");
    const int n = v == nullptr ? 0 : std::atoi(v);
    return n >= 1 && n <= 64 ? n : 8;
  }();
  return heads;
}
// Head dim of every row: 128, or KVKIT_DECODE_HEAD_DIM (64 or 256) to see the kernels of the other
// head dims. The SDPA peer (sdpa_peer.py) measures head dim 128, so no row compares with it then.
std::int32_t head_dim() {
  static const std::int32_t dim = [] {
    const char* v = std::getenv("KVKIT_DECODE_HEAD_DIM");
    const int n = v == nullptr ? 0 : std::atoi(v);
    return n == 64 || n == 256 ? n : 128;
  }();
  return dim;
}
// GQA groups of the rows: 4 and 8, or KVKIT_DECODE_GROUPS, a comma-separated list of groups from 1
// to 16 (over 8, the kernels of two query tiles run, with their own shared-memory budgets: an int4
// cache's four-warp kernel keeps 16 KB a warp there). An item that is not a number from 1 to 16
// (ASCII digits, spaces around them allowed) is left out, as sdpa_peer.py leaves it out. For the
// codecs that do not run the full grid, the largest group takes every shape and the others only
// the sweep's shapes (with the defaults: group 8 every shape, group 4 the sweep's). The graph rows
// keep groups 4 and 8.
const std::vector<int>& groups() {
  static const std::vector<int> list = [] {
    std::vector<int> out;
    if (const char* v = std::getenv("KVKIT_DECODE_GROUPS"); v != nullptr) {
      std::stringstream in(v);
      std::string item;
      while (std::getline(in, item, ',')) {
        const auto first = item.find_first_not_of(' ');
        const auto last = item.find_last_not_of(' ');
        const std::string digits =
            first == std::string::npos ? "" : item.substr(first, last - first + 1);
        if (digits.empty() || digits.size() > 2 ||
            !std::all_of(digits.begin(), digits.end(),
                         [](char c) { return c >= '0' && c <= '9'; })) {
          continue;
        }
        const int g = std::stoi(digits);
        if (g >= 1 && g <= 16 && std::find(out.begin(), out.end(), g) == out.end()) {
          out.push_back(g);
        }
      }
    }
    return out.empty() ? std::vector<int>{4, 8} : out;
  }();
  return list;
}
constexpr std::int64_t cache_tokens = 128LL * 32768; // the largest shape
constexpr double rotate_bytes = 512e6;               // keys in flight over all rotations

using shape_key = std::tuple<int, int, int, int>; // B, L, group, page size

// For trying plans (the rows then measure that plan, not the library's):
// KVKIT_DECODE_CHUNK=N (a multiple of 64) replaces every row's keys per split with N, on blocks of
// one KV head (decode_plan::heads_per_block 1), and KVKIT_DECODE_TWO_TILES=0 or 1 every plan's
// choice of the two-tile kernel (decode_plan::two_tiles, which the launcher takes where that
// kernel serves the codec). Unset or invalid: the library's.
int chunk_override() {
  static const int chunk = [] {
    const char* v = std::getenv("KVKIT_DECODE_CHUNK");
    const int n = v == nullptr ? 0 : std::atoi(v);
    return n > 0 && n % kvkit::decode_plan::tile_tokens == 0 ? n : 0;
  }();
  return chunk;
}
// KVKIT_DECODE_LAUNCH=late: no read of the page table or the cache before the wait for the launch
// before (page_table_ready and cache_ready_but_last_page off); =plain: that, and each launch a
// plain one, not a programmatic dependent. Unset or anything else: the defaults described above.
int launch_override() { // 0: the defaults, 1: late, 2: plain
  static const int mode = [] {
    const char* v = std::getenv("KVKIT_DECODE_LAUNCH");
    const std::string m = v == nullptr ? "" : v;
    return m == "late" ? 1 : (m == "plain" ? 2 : 0);
  }();
  return mode;
}
// KVKIT_DECODE_PAGE_ORDER=sequential: the pool's pages in order (a sequence's pages adjacent)
// instead of shuffled; =N (a positive integer): shuffled with seed N instead of the default
// stream. For telling what page placement costs from what the kernel does with a page size.
long page_order_override() { // 0: the default shuffle, -1: sequential, N > 0: that seed
  static const long mode = [] {
    const char* v = std::getenv("KVKIT_DECODE_PAGE_ORDER");
    const std::string m = v == nullptr ? "" : v;
    if (m == "sequential") {
      return -1L;
    }
    const long n = std::atol(m.c_str());
    return n > 0 ? n : 0L;
  }();
  return mode;
}
// KVKIT_DECODE_HEADS=1 or 4: every plan of the one-tile kernel whose KV heads that divides takes
// blocks of that many heads (decode_plan::heads_per_block; the launcher runs blocks of four on the
// head-split build where the cache has one), its keys per split scaled so that the grid keeps its
// blocks (blocks of four only where that makes at most head_split_max_splits splits): =1
// measures the head-split rows as the plan before that rule made them.
int heads_override() {
  static const int heads = [] {
    const char* v = std::getenv("KVKIT_DECODE_HEADS");
    return v != nullptr && (v[0] == '1' || v[0] == '4') && v[1] == '\0' ? v[0] - '0' : 0;
  }();
  return heads;
}
int two_tiles_override() { // -1: the plan's
  static const int two = [] {
    const char* v = std::getenv("KVKIT_DECODE_TWO_TILES");
    return v != nullptr && (v[0] == '0' || v[0] == '1') && v[1] == '\0' ? v[0] - '0' : -1;
  }();
  return two;
}
// The settings above that are in effect, as "NAME=value" items (the values the rows run with), or
// "none": the run's context carries it as kvkit_decode_overrides, so that a run with any of them,
// which measures something other than the library's defaults, is told from one without
// (scripts/decode_targets.py refuses it).
std::string overrides_in_effect() {
  std::string out;
  const auto add = [&out](const char* name, const std::string& value) {
    out += (out.empty() ? "" : " ") + std::string(name) + "=" + value;
  };
  if (kv_heads() != 8) {
    add("KVKIT_DECODE_KV_HEADS", std::to_string(kv_heads()));
  }
  if (head_dim() != 128) {
    add("KVKIT_DECODE_HEAD_DIM", std::to_string(head_dim()));
  }
  std::vector<int> sorted = groups();
  std::sort(sorted.begin(), sorted.end());
  if (sorted != std::vector<int>{4, 8}) { // the default rows, in whatever order they were named
    std::string list;
    for (const int g : groups()) {
      list += (list.empty() ? "" : ",") + std::to_string(g);
    }
    add("KVKIT_DECODE_GROUPS", list);
  }
  if (chunk_override() != 0) {
    add("KVKIT_DECODE_CHUNK", std::to_string(chunk_override()));
  }
  if (launch_override() != 0) {
    add("KVKIT_DECODE_LAUNCH", launch_override() == 1 ? "late" : "plain");
  }
  if (page_order_override() != 0) {
    add("KVKIT_DECODE_PAGE_ORDER",
        page_order_override() < 0 // else the seed as the shuffle takes it
            ? "sequential"
            : std::to_string(static_cast<std::uint32_t>(page_order_override())));
  }
  if (heads_override() != 0) {
    add("KVKIT_DECODE_HEADS", std::to_string(heads_override()));
  }
  if (two_tiles_override() >= 0) {
    add("KVKIT_DECODE_TWO_TILES", std::to_string(two_tiles_override()));
  }
  return out.empty() ? "none" : out;
}
// bf16's seconds per shape in each order (NHD, HND): a quantized row is compared with bf16 in its
// own order.
std::map<shape_key, double>& bf16_seconds(kvkit::kv_order order = kvkit::kv_order::nhd) {
  static std::map<shape_key, double> m[2];
  return m[order == kvkit::kv_order::hnd ? 1 : 0];
}

// PyTorch SDPA seconds per (B, L, group) from KVKIT_SDPA_CSV ("B,L,group,seconds,backend").
const std::map<std::tuple<int, int, int>, double>& sdpa_seconds() {
  static const std::map<std::tuple<int, int, int>, double> m = [] {
    std::map<std::tuple<int, int, int>, double> r;
    const char* path = std::getenv("KVKIT_SDPA_CSV");
    if (path == nullptr || head_dim() != 128) {
      return r;
    }
    std::ifstream in(path);
    std::string line;
    while (std::getline(in, line)) {
      std::replace(line.begin(), line.end(), ',', ' ');
      std::istringstream s(line);
      int b = 0, l = 0, g = 0;
      double sec = 0;
      if (s >> b >> l >> g >> sec) {
        r[{b, l, g}] = sec;
      }
    }
    return r;
  }();
  return m;
}

// A cache of one codec and page size, filled once, kept while consecutive benchmarks use it.
struct cache_context {
  std::string name;
  std::int32_t page_size = 0;
  std::int64_t bytes_per_page = 0;
  std::int32_t capacity = 0;
  std::byte* cache = nullptr;
  float* scales = nullptr;
  std::vector<std::int32_t> order; // pages in a random order
  double memcpy_rate = 0.0;        // bytes/s, read + write, of a 1 GB device copy
  ~cache_context() {
    cudaFree(cache);
    cudaFree(scales);
  }
};
std::unique_ptr<cache_context>& current() {
  static std::unique_ptr<cache_context> c;
  return c;
}

template <class Layout>
cache_context* context_for(const std::string& name, std::int32_t page_size) {
  auto& c = current();
  if (c && c->name == name && c->page_size == page_size) {
    return c.get();
  }
  c.reset();
  cudaDeviceSynchronize();
  auto ctx = std::make_unique<cache_context>();
  ctx->name = name;
  ctx->page_size = page_size;
  const Layout layout(page_size, kv_heads(), head_dim());
  ctx->bytes_per_page = layout.bytes_per_page();
  ctx->capacity = static_cast<std::int32_t>(cache_tokens / page_size);
  if (cudaMalloc(&ctx->cache, static_cast<std::size_t>(ctx->capacity) *
                                  static_cast<std::size_t>(ctx->bytes_per_page)) != cudaSuccess ||
      cudaMalloc(&ctx->scales, 2 * kv_heads() * sizeof(float)) != cudaSuccess) {
    return nullptr;
  }
  const std::vector<float> scales(2 * kv_heads(), 4.0F / 448.0F);
  cudaMemcpy(ctx->scales, scales.data(), scales.size() * sizeof(float), cudaMemcpyHostToDevice);
  // Random values (uniform in [-4, 4)) quantized into every page, a batch of pages at a time.
  const std::int32_t batch = std::max<std::int32_t>(1, 65536 / page_size);
  const auto elems = static_cast<std::size_t>(batch) * page_size * kv_heads() * head_dim();
  std::vector<__nv_bfloat16> host(elems);
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> d(-4.0F, 4.0F);
  for (auto& x : host) {
    x = __float2bfloat16(d(rng));
  }
  __nv_bfloat16* src = nullptr;
  std::int32_t* ids = nullptr;
  cudaMalloc(&src, elems * 2);
  cudaMalloc(&ids, static_cast<std::size_t>(batch) * 4);
  cudaMemcpy(src, host.data(), elems * 2, cudaMemcpyHostToDevice);
  std::vector<std::int32_t> page_ids(static_cast<std::size_t>(batch));
  for (std::int32_t first = 0; first < ctx->capacity; first += batch) {
    const std::int32_t n = std::min(batch, ctx->capacity - first);
    std::iota(page_ids.begin(), page_ids.begin() + n, first);
    cudaMemcpy(ids, page_ids.data(), static_cast<std::size_t>(n) * 4, cudaMemcpyHostToDevice);
    const kvkit::cuda::page_batch<Layout, __nv_bfloat16> pb{
        layout, ctx->cache, ctx->capacity, ids, n, src, src, ctx->scales};
    (void)kvkit::cuda::quantize_pages(pb, nullptr);
  }
  cudaDeviceSynchronize();
  cudaFree(src);
  cudaFree(ids);
  ctx->order.resize(static_cast<std::size_t>(ctx->capacity));
  std::iota(ctx->order.begin(), ctx->order.end(), 0);
  if (const long order = page_order_override(); order == 0) {
    std::shuffle(ctx->order.begin(), ctx->order.end(), rng);
  } else if (order > 0) {
    std::mt19937 seeded(static_cast<std::uint32_t>(order));
    std::shuffle(ctx->order.begin(), ctx->order.end(), seeded);
  }
  // The memcpy peer: 1 GB device to device, inside the cache.
  const std::size_t copy = std::min<std::size_t>(
      1ULL << 30, static_cast<std::size_t>(ctx->capacity) * ctx->bytes_per_page / 2);
  const double s = kvkit_bench::median_seconds(
      [&] { cudaMemcpyAsync(ctx->cache + copy, ctx->cache, copy, cudaMemcpyDeviceToDevice); });
  ctx->memcpy_rate = 2.0 * static_cast<double>(copy) / s;
  c = std::move(ctx);
  return c.get();
}

// The device arrays of a decode row: CSR page tables of `rotations` disjoint page sets, one after
// the other, each of `batch` sequences of `len` tokens in pages of `page_size` (the cache's pages
// in ctx.order), and each set's queries and outputs (bf16, `q_elems` a set; the caller fills the
// queries). Freed with the object.
struct decode_buffers {
  std::int32_t* indptr = nullptr;
  std::int32_t* indices = nullptr; // set r's pages from indices + r * batch * pages a sequence
  std::int32_t* last = nullptr;
  __nv_bfloat16* q = nullptr;
  __nv_bfloat16* out = nullptr;

  decode_buffers(const cache_context& ctx, int batch, int len, int page_size, std::size_t q_elems,
                 std::int32_t rotations) {
    const std::int32_t pages_per_seq = (len + page_size - 1) / page_size;
    const auto pages = static_cast<std::size_t>(batch) * pages_per_seq * rotations;
    std::vector<std::int32_t> host_indptr(static_cast<std::size_t>(batch) + 1);
    const std::vector<std::int32_t> host_last(static_cast<std::size_t>(batch),
                                              len - (pages_per_seq - 1) * page_size);
    for (int b = 0; b <= batch; ++b) {
      host_indptr[static_cast<std::size_t>(b)] = b * pages_per_seq;
    }
    cudaMalloc(&indptr, host_indptr.size() * 4);
    cudaMalloc(&last, host_last.size() * 4);
    cudaMalloc(&indices, pages * 4);
    cudaMalloc(&q, q_elems * 2 * static_cast<std::size_t>(rotations));
    cudaMalloc(&out, q_elems * 2 * static_cast<std::size_t>(rotations));
    cudaMemcpy(indptr, host_indptr.data(), host_indptr.size() * 4, cudaMemcpyHostToDevice);
    cudaMemcpy(last, host_last.data(), host_last.size() * 4, cudaMemcpyHostToDevice);
    cudaMemcpy(indices, ctx.order.data(), pages * 4, cudaMemcpyHostToDevice);
  }
  decode_buffers(const decode_buffers&) = delete;
  decode_buffers& operator=(const decode_buffers&) = delete;
  ~decode_buffers() {
    cudaFree(indptr);
    cudaFree(indices);
    cudaFree(last);
    cudaFree(q);
    cudaFree(out);
  }
};

template <class Layout>
void BM_decode(benchmark::State& state, std::string codec, int batch, int len, int group,
               int page_size, bool graph = false) {
  if (!kvkit_bench::gpu_available()) {
    state.SkipWithError("no CUDA device");
    return;
  }
  cache_context* ctx = context_for<Layout>(codec, page_size);
  if (ctx == nullptr) {
    state.SkipWithError("cache allocation failed");
    return;
  }
  const Layout layout(page_size, kv_heads(), head_dim());
  const std::int32_t q_heads = group * kv_heads();
  const std::int32_t pages_per_seq = (len + page_size - 1) / page_size;
  const std::int64_t pages = static_cast<std::int64_t>(batch) * pages_per_seq;
  // The useful bytes: whole pages' K/V and scales, plus q and out in bf16.
  const double kv_bytes = static_cast<double>(pages) * static_cast<double>(ctx->bytes_per_page);
  const double bytes = kv_bytes + 2.0 * batch * q_heads * head_dim() * 2;
  const auto rotations = static_cast<std::int32_t>(std::clamp<std::int64_t>(
      std::min<std::int64_t>(static_cast<std::int64_t>(rotate_bytes / kv_bytes) + 1,
                             ctx->capacity / pages),
      1, 256));

  // Page tables of `rotations` disjoint page sets, one device array each after the other.
  const auto q_elems = static_cast<std::size_t>(batch) * q_heads * head_dim();
  const decode_buffers bufs(*ctx, batch, len, page_size, q_elems, rotations);
  {
    std::vector<__nv_bfloat16> q(q_elems * static_cast<std::size_t>(rotations));
    std::mt19937 rng(11);
    std::normal_distribution<float> d(0.0F, 1.0F);
    for (auto& x : q) {
      x = __float2bfloat16(d(rng));
    }
    cudaMemcpy(bufs.q, q.data(), q.size() * 2, cudaMemcpyHostToDevice);
  }
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  const std::vector<std::int32_t> lens(static_cast<std::size_t>(batch), len);
  const kvkit::decode_shape shape = kvkit::decode_shape_for(layout, batch, q_heads);
  kvkit::decode_plan plan = graph ? *kvkit::plan_decode_graph_safe(shape, len, sms)
                                  : *kvkit::plan_decode(shape, lens, sms);
  if (const int chunk = chunk_override(); chunk > 0) {
    plan.chunk_tokens = chunk;
    plan.max_splits = (len + chunk - 1) / chunk;
    plan.heads_per_block = 1;
  }
  if (two_tiles_override() >= 0) {
    plan.two_tiles = two_tiles_override() == 1;
  }
  if (const int heads = heads_override();
      heads > 0 && !plan.two_tiles && plan.shape.num_kv_heads % heads == 0) {
    // The plan's keys a split of one head, cut into `heads` the way choose_splits cuts them.
    const std::int64_t keys = std::int64_t{plan.chunk_tokens} * plan.heads_per_block;
    const std::int64_t chunk = kvkit::detail::whole_tiles((keys + heads - 1) / heads);
    const std::int64_t splits = (len + chunk - 1) / chunk;
    if (heads == 1 || splits <= kvkit::decode_plan::head_split_max_splits) {
      plan.chunk_tokens = static_cast<std::int32_t>(chunk);
      plan.max_splits = static_cast<std::int32_t>(splits);
      plan.heads_per_block = heads;
    }
  }
  cudaStream_t stream = nullptr;
  if (graph) {
    cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  }
  // The workspace, and arrival counters zeroed once, as an engine that sets
  // decode_args::zeroed_counters would.
  std::byte* ws = nullptr;
  cudaMalloc(&ws, std::max<std::size_t>(plan.workspace_bytes(), 16));
  cudaMemset(ws, 0, std::max<std::size_t>(plan.workspace_bytes(), 16));
  std::uint32_t* counters = nullptr;
  cudaMalloc(&counters, plan.counter_count() * sizeof(std::uint32_t));
  cudaMemset(counters, 0, plan.counter_count() * sizeof(std::uint32_t));

  std::vector<kvkit::cuda::decode_args<Layout, __nv_bfloat16>> args(
      static_cast<std::size_t>(rotations));
  for (std::int32_t r = 0; r < rotations; ++r) {
    auto& a = args[static_cast<std::size_t>(r)];
    a.layout = layout;
    a.cache = ctx->cache;
    a.capacity = ctx->capacity;
    a.table =
        kvkit::csr_page_table{bufs.indptr, bufs.indices + r * pages, bufs.last, batch, page_size};
    a.q = bufs.q + q_elems * static_cast<std::size_t>(r);
    a.out = bufs.out + q_elems * static_cast<std::size_t>(r);
    a.static_scales = ctx->scales;
    a.zeroed_counters = counters;
    a.zeroed_counter_count = static_cast<std::int64_t>(plan.counter_count());
    // The page table is written once, before the loop, and the cache too: no launch of the loop
    // writes either.
    a.page_table_ready = launch_override() == 0;
    a.cache_ready_but_last_page = launch_override() == 0;
    a.dependent_launch = launch_override() != 2;
  }
  int next = 0;
  const auto launch = [&] {
    const auto& a = args[static_cast<std::size_t>(next)];
    next = next + 1 == rotations ? 0 : next + 1;
    return kvkit::cuda::paged_decode(a, plan, ws, plan.workspace_bytes(), stream);
  };
  // Calls per timed loop: about 2 ms of work, at least the rotation count.
  if (const cudaError_t e = launch(); e != cudaSuccess) {
    state.SkipWithError(cudaGetErrorString(e));
    if (stream != nullptr) {
      cudaStreamDestroy(stream);
    }
    return;
  }
  const double once = kvkit_bench::median_seconds([&] { (void)launch(); }, 5, stream);
  const int calls = std::max(rotations, static_cast<int>(std::clamp(2e-3 / once, 4.0, 400.0)));
  std::vector<double> per_call;
  std::vector<double> host_per_call; // stream rows: the host's time to queue a call
  if (graph) {
    // The same `calls` launches, captured once; each replay is timed and divided by `calls`.
    cudaGraph_t g = nullptr;
    cudaGraphExec_t exec = nullptr;
    cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal);
    cudaError_t err = cudaSuccess;
    for (int c = 0; c < calls && err == cudaSuccess; ++c) {
      err = launch();
    }
    const cudaError_t ended = cudaStreamEndCapture(stream, &g);
    if (err == cudaSuccess) {
      err = ended != cudaSuccess ? ended : cudaGraphInstantiate(&exec, g, 0);
    }
    if (err == cudaSuccess) {
      cudaGraphLaunch(exec, stream); // warm-up replay
      per_call = kvkit_bench::time_launches(
          state, [&] { return cudaGraphLaunch(exec, stream); }, 1, stream, nullptr, calls);
    } else {
      state.SkipWithError(cudaGetErrorString(err));
    }
    if (exec != nullptr) {
      cudaGraphExecDestroy(exec);
    }
    if (g != nullptr) {
      cudaGraphDestroy(g);
    }
    cudaStreamDestroy(stream);
  } else {
    per_call = kvkit_bench::time_launches(state, launch, calls, nullptr, &host_per_call);
  }
  if (!per_call.empty()) {
    const double t = kvkit_bench::median(per_call);
    const double rate = bytes / t;
    state.counters["us"] = t * 1e6;
    if (!host_per_call.empty()) {
      // Near "us", the loop is bound by the host's launch rate, not by the kernel.
      state.counters["host_us"] = kvkit_bench::median(host_per_call) * 1e6;
    }
    state.counters["TB/s"] = rate / 1e12;
    state.counters["memcpy_TB/s"] = ctx->memcpy_rate / 1e12;
    state.counters["x_memcpy"] = rate / ctx->memcpy_rate;
    state.counters["splits"] = plan.max_splits;
    state.counters["two_tiles"] = plan.two_tiles ? 1.0 : 0.0; // the plan chose the two-tile kernel
    state.counters["heads"] = plan.heads_per_block; // KV heads a block (4: the head-split build)
    // The targets and the SDPA peer are for the default rows' 8 KV heads.
    const bool peer_heads = kv_heads() == 8;
    const std::int64_t tokens = static_cast<std::int64_t>(batch) * len;
    if (peer_heads && batch == 1 && len == 2048) {
      state.counters["x_target"] = 6e-6 / t; // target: <= 6 us per call
    } else if (peer_heads && tokens >= 256 * 1024) {
      state.counters["x_target"] = rate / 4.5e12;
    } else if (peer_heads && ((batch == 8 && len == 8192) || (batch == 32 && len == 2048))) {
      state.counters["x_target"] = rate / 4.0e12;
    }
    const auto sdpa = sdpa_seconds().find({batch, len, group});
    if (peer_heads && sdpa != sdpa_seconds().end()) {
      // SDPA reads bf16 K/V of the same shape, contiguous, whatever this row's codec: its rate
      // from its own bytes, and the ratio of the two times.
      const double sdpa_bytes =
          2.0 * batch * len * kv_heads() * head_dim() * 2 + 2.0 * batch * q_heads * head_dim() * 2;
      state.counters["sdpa_TB/s"] = sdpa_bytes / sdpa->second / 1e12;
      state.counters["x_sdpa"] = sdpa->second / t; // > 1: faster than SDPA on contiguous KV
    }
    const shape_key key{batch, len, group, page_size};
    if (graph) {
      // Graph rows are bf16, so the stream loop's time of the same shape is bf16's.
      if (const auto loop = bf16_seconds().find(key); loop != bf16_seconds().end()) {
        state.counters["x_stream"] = loop->second / t; // > 1: faster than the stream loop
      }
    } else if (std::is_same_v<typename Layout::k_codec, kvkit::bf16_codec>) {
      bf16_seconds(Layout::order)[key] = t;
    } else if (const auto base = bf16_seconds(Layout::order).find(key);
               base != bf16_seconds(Layout::order).end()) {
      state.counters["time_vs_bf16"] = t / base->second; // bf16 of the same order
    }
  }
  cudaFree(ws);
  cudaFree(counters);
}

// One row of the table: Google Benchmark times it by hand, seven iterations, in microseconds.
template <class F>
void register_row(const std::string& name, F&& run) {
  benchmark::RegisterBenchmark(name.c_str(), std::forward<F>(run))
      ->UseManualTime()
      ->Iterations(7)
      ->Unit(benchmark::kMicrosecond);
}

template <class Layout>
void register_codec(const std::string& codec, const std::vector<int>& page_sizes, bool full_grid) {
  const int largest_group = *std::max_element(groups().begin(), groups().end());
  for (const int page : page_sizes) {
    for (const int group : groups()) {
      for (const int b : {1, 8, 32, 64, 128}) {
        for (const int l : {512, 2048, 8192, 32768}) {
          const bool sweep_shape = (b == 8 && l == 8192) || (b == 32 && l == 2048) ||
                                   (b == 64 && l == 8192) || (b == 1 && l == 2048);
          if (page != 16 && !sweep_shape) {
            continue; // other page sizes: the mid, small and one large shape
          }
          if (!full_grid && page == 16 && group != largest_group && !sweep_shape) {
            continue;
          }
          const std::string name = "paged_decode/" + codec + "/B" + std::to_string(b) + "/L" +
                                   std::to_string(l) + "/g" + std::to_string(group) + "/p" +
                                   std::to_string(page);
          register_row(
              name, [=](benchmark::State& s) { BM_decode<Layout>(s, codec, b, l, group, page); });
        }
      }
    }
  }
}

// Graph replay of the small and mid shapes, after the stream rows of the same shapes.
void register_graph_rows() {
  using layout = kvkit::paged_layout<kvkit::bf16_codec>;
  for (const auto& [b, l, g] : {std::tuple{1, 2048, 4}, std::tuple{1, 2048, 8},
                                std::tuple{8, 8192, 4}, std::tuple{32, 2048, 4}}) {
    const std::string name = "paged_decode_graph/bf16/B" + std::to_string(b) + "/L" +
                             std::to_string(l) + "/g" + std::to_string(g) + "/p16";
    register_row(name,
                 [=](benchmark::State& s) { BM_decode<layout>(s, "bf16", b, l, g, 16, true); });
  }
}

__global__ void empty_kernel() {}

// The launch peer: an empty kernel launched the way the decode of B=1, L=2048 is (8 x 8 blocks of
// 128 threads in clusters of 8, a programmatic dependent of the launch before it), in the same
// stream loop. Its host_us is what a bare launch costs the host a call; a decode row's host_us
// above it is the launcher's own work and what the driver does for the decode kernel alone (its
// parameters, shared memory), which this row does not separate.
void BM_launch_peer(benchmark::State& state) {
  if (!kvkit_bench::gpu_available()) {
    state.SkipWithError("no CUDA device");
    return;
  }
  cudaLaunchAttribute attrs[2];
  attrs[0].id = cudaLaunchAttributeClusterDimension;
  attrs[0].val.clusterDim.x = 8;
  attrs[0].val.clusterDim.y = 1;
  attrs[0].val.clusterDim.z = 1;
  attrs[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attrs[1].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(8, 8, 1);
  config.blockDim = dim3(128);
  config.attrs = attrs;
  config.numAttrs = 2;
  const auto launch = [&] {
    return cudaLaunchKernelEx(&config, empty_kernel);
  };
  if (const cudaError_t e = launch(); e != cudaSuccess) {
    state.SkipWithError(cudaGetErrorString(e));
    return;
  }
  std::vector<double> host;
  const std::vector<double> per_call =
      kvkit_bench::time_launches(state, launch, 400, nullptr, &host);
  if (per_call.empty() || host.empty()) {
    return;
  }
  state.counters["us"] = kvkit_bench::median(per_call) * 1e6;
  state.counters["host_us"] = kvkit_bench::median(host) * 1e6;
}

// Holds its stream until the host sets `*open` (pinned host memory, mapped), or for `cycles` clock
// cycles at most: the gate that the decode_beside_swap rows queue their work behind, so that what
// they time starts on the device only once the host has queued all of it (the copy-engine swap's
// host work, its lists and the batch call, is then not in the time, however long it takes).
__global__ void gate_kernel(const volatile int* open, long long cycles) {
  const long long start = clock64();
  while (*open == 0 && clock64() - start < cycles) {
  }
}

// A decode beside a swap: bf16 decode of B=32, L=8192, group 4 (pages of 16 tokens) in a loop on
// one stream while another swaps 64 scattered 64 KiB pages of each of 32 layers (128 MiB) between
// device caches and pinned host memory, through the swap kernel (`blocks` 0: a block a page;
// else at most that many blocks, page_copies::max_blocks) or, with `blocks` -1, the copy engines
// (swap_blocks_copy_engines). With `priority`, the decode's stream has the device's highest
// priority and the swap's its lowest. The decode loop is as long as the swap alone (whole calls).
// Prints the decode loop's time beside its time alone (decode_x: > 1, the swap slowed it) and the
// swap's rate beside its rate alone (swap_x: > 1, the decode slowed it), and the host's time to
// queue the swap (swap_host_us: the copy engines' lists and batch call; a launch for the kernel);
// the row's time is the longer of the two streams. Both streams start behind a gate that the host
// opens once it has queued everything, so no host work is in the times. `out`: device to host;
// else host to device.
void BM_decode_beside_swap(benchmark::State& state, bool out, int blocks, bool priority) {
  const bool engines = blocks < 0;
  if (!kvkit_bench::gpu_available()) {
    state.SkipWithError("no CUDA device");
    return;
  }
  using layout_t = kvkit::paged_layout<kvkit::bf16_codec>;
  constexpr int batch = 32, len = 8192, group = 4, page_size = 16;
  cache_context* ctx = context_for<layout_t>("bf16", page_size);
  if (ctx == nullptr) {
    state.SkipWithError("cache allocation failed");
    return;
  }
  // The gate's flag, opened by the host once it has queued the timed work; the gate gives up after
  // about a second if the flag never reaches the device (the row's times then hold the host's
  // queueing, as `swap_host_us`, the host's time to queue the swap, says how much).
  int* open = nullptr;
  int* d_open = nullptr;
  if (cudaHostAlloc(&open, sizeof(int), cudaHostAllocMapped) != cudaSuccess) {
    state.SkipWithError("mapped host flag allocation failed");
    return;
  }
  if (cudaHostGetDevicePointer(&d_open, open, 0) != cudaSuccess) {
    cudaFreeHost(open);
    state.SkipWithError("mapped host flag has no device address");
    return;
  }
  const layout_t layout(page_size, kv_heads(), head_dim());
  const std::int32_t q_heads = group * kv_heads();
  const auto q_elems = static_cast<std::size_t>(batch) * q_heads * head_dim();
  const decode_buffers bufs(*ctx, batch, len, page_size, q_elems, 1);
  cudaMemset(bufs.q, 0x3C, q_elems * 2); // bf16 0x3C3C, about 0.0115
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  const std::vector<std::int32_t> lens(batch, len);
  const kvkit::decode_plan plan =
      *kvkit::plan_decode(kvkit::decode_shape_for(layout, batch, q_heads), lens, sms);
  std::byte* ws = nullptr;
  cudaMalloc(&ws, std::max<std::size_t>(plan.workspace_bytes(), 16));
  kvkit::cuda::decode_args<layout_t, __nv_bfloat16> a;
  a.layout = layout;
  a.cache = ctx->cache;
  a.capacity = ctx->capacity;
  a.table = kvkit::csr_page_table{bufs.indptr, bufs.indices, bufs.last, batch, page_size};
  a.q = bufs.q;
  a.out = bufs.out;

  // The swap: 32 layers of 128 pages on each side, pairs scattered over disjoint halves.
  constexpr std::int32_t layers = 32, pairs = 64, pages = 2 * pairs;
  const auto page_bytes = layout.bytes_per_page();
  const std::size_t layer_bytes = static_cast<std::size_t>(pages) * page_bytes;
  std::vector<std::byte*> dev(layers), host(layers);
  for (std::int32_t l = 0; l < layers; ++l) {
    cudaMalloc(&dev[static_cast<std::size_t>(l)], layer_bytes);
    cudaHostAlloc(&host[static_cast<std::size_t>(l)], layer_bytes, cudaHostAllocDefault);
  }
  std::vector<kvkit::block_copy> list;
  for (std::int32_t i = 0; i < pairs; ++i) {
    list.push_back({(i * 7) % pairs, pairs + (i * 13) % pairs});
  }
  std::byte** d_from = nullptr;
  std::byte** d_to = nullptr;
  kvkit::block_copy* d_pairs = nullptr;
  cudaMalloc(&d_from, layers * sizeof(std::byte*));
  cudaMalloc(&d_to, layers * sizeof(std::byte*));
  cudaMalloc(&d_pairs, list.size() * sizeof(kvkit::block_copy));
  const std::vector<std::byte*>& from = out ? dev : host;
  const std::vector<std::byte*>& to = out ? host : dev;
  cudaMemcpy(d_from, from.data(), layers * sizeof(std::byte*), cudaMemcpyHostToDevice);
  cudaMemcpy(d_to, to.data(), layers * sizeof(std::byte*), cudaMemcpyHostToDevice);
  cudaMemcpy(d_pairs, list.data(), list.size() * sizeof(kvkit::block_copy), cudaMemcpyHostToDevice);
  kvkit::cuda::page_copies kernel_swap{d_from, d_to, layers, page_bytes, d_pairs, pairs};
  kernel_swap.max_blocks = std::max(blocks, 0);
  const kvkit::cuda::host_page_copies engine_swap{from.data(), to.data(), layers, page_bytes,
                                                  list.data(), pairs,     pages,  pages};
  kvkit::cuda::copy_batch scratch;

  cudaStream_t ds = nullptr, ss = nullptr;
  int least = 0, greatest = 0;
  cudaDeviceGetStreamPriorityRange(&least, &greatest);
  cudaStreamCreateWithPriority(&ds, cudaStreamNonBlocking, priority ? greatest : 0);
  cudaStreamCreateWithPriority(&ss, cudaStreamNonBlocking, priority ? least : 0);
  cudaError_t err = cudaSuccess;
  const auto decode = [&] {
    const cudaError_t e = kvkit::cuda::paged_decode(a, plan, ws, plan.workspace_bytes(), ds);
    err = err == cudaSuccess ? e : err;
  };
  const auto swap = [&] {
    const cudaError_t e = engines ? kvkit::cuda::swap_blocks_copy_engines(engine_swap, scratch, ss)
                                  : kvkit::cuda::swap_blocks(kernel_swap, ss);
    err = err == cudaSuccess ? e : err;
  };
  int clock_khz = 0;
  cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0);
  const long long hold = 1000LL * std::max(clock_khz, 1000);
  const auto close_gate = [&](cudaStream_t s) {
    *static_cast<volatile int*>(open) = 0;
    gate_kernel<<<1, 1, 0, s>>>(d_open, hold);
  };
  const auto open_gate = [&] {
    *static_cast<volatile int*>(open) = 1;
  };
  cudaEvent_t start, decode_end, swap_end;
  cudaEventCreate(&start);
  cudaEventCreate(&decode_end);
  cudaEventCreate(&swap_end);
  // One decode and one swap before any gate: a kernel's first launch may load its module, which
  // can wait for the device, and so for a closed gate.
  decode();
  swap();
  cudaDeviceSynchronize();
  // Median seconds of `fn`'s work on stream `s`, timed from behind the gate.
  const auto alone = [&](auto&& fn, cudaStream_t s) {
    std::vector<double> t;
    for (int r = 0; r < 7; ++r) {
      close_gate(s);
      cudaEventRecord(start, s);
      fn();
      cudaEventRecord(swap_end, s);
      open_gate();
      float ms = 0.0F;
      if (cudaEventSynchronize(swap_end) != cudaSuccess ||
          cudaEventElapsedTime(&ms, start, swap_end) != cudaSuccess) {
        return std::numeric_limits<double>::quiet_NaN();
      }
      t.push_back(ms * 1e-3);
    }
    return kvkit_bench::median(t);
  };
  const double decode_once = alone(decode, ds);
  const double swap_alone = alone(swap, ss);
  const int calls = std::max(1, static_cast<int>(std::lround(swap_alone / decode_once)));
  const double decode_alone = alone(
      [&] {
        for (int c = 0; c < calls; ++c) {
          decode();
        }
      },
      ds);
  cudaStream_t gate = nullptr;
  cudaStreamCreateWithFlags(&gate, cudaStreamNonBlocking);
  std::vector<double> decode_with, swap_with, swap_host;
  for (auto _ : state) {
    close_gate(gate);
    cudaEventRecord(start, gate);
    cudaStreamWaitEvent(ds, start);
    cudaStreamWaitEvent(ss, start);
    const auto queued_from = std::chrono::steady_clock::now();
    swap();
    swap_host.push_back(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - queued_from).count());
    for (int c = 0; c < calls; ++c) {
      decode();
    }
    cudaEventRecord(decode_end, ds);
    cudaEventRecord(swap_end, ss);
    open_gate();
    float d_ms = 0.0F, s_ms = 0.0F;
    if (err == cudaSuccess) {
      err = cudaEventSynchronize(decode_end);
    }
    if (err == cudaSuccess) {
      err = cudaEventSynchronize(swap_end);
    }
    if (err == cudaSuccess) {
      err = cudaEventElapsedTime(&d_ms, start, decode_end);
    }
    if (err == cudaSuccess) {
      err = cudaEventElapsedTime(&s_ms, start, swap_end);
    }
    if (err != cudaSuccess || !std::isfinite(decode_alone) || !std::isfinite(swap_alone)) {
      state.SkipWithError(err != cudaSuccess ? cudaGetErrorString(err) : "a run alone failed");
      decode_with.clear();
      break;
    }
    decode_with.push_back(d_ms * 1e-3);
    swap_with.push_back(s_ms * 1e-3);
    state.SetIterationTime(std::max(d_ms, s_ms) * 1e-3);
  }
  if (!decode_with.empty()) {
    const double swap_bytes = static_cast<double>(pairs) * layers * static_cast<double>(page_bytes);
    const double d = kvkit_bench::median(decode_with);
    const double sw = kvkit_bench::median(swap_with);
    state.counters["decode_calls"] = calls;
    state.counters["decode_us_alone"] = decode_alone * 1e6;
    state.counters["decode_us"] = d * 1e6;
    state.counters["decode_x"] = d / decode_alone;
    state.counters["swap_GB/s_alone"] = swap_bytes / swap_alone / 1e9;
    state.counters["swap_GB/s"] = swap_bytes / sw / 1e9;
    state.counters["swap_x"] = sw / swap_alone;
    state.counters["swap_host_us"] = kvkit_bench::median(swap_host) * 1e6;
  }
  cudaDeviceSynchronize(); // a failed iteration may have left work queued
  cudaEventDestroy(start);
  cudaEventDestroy(decode_end);
  cudaEventDestroy(swap_end);
  cudaStreamDestroy(ds);
  cudaStreamDestroy(ss);
  cudaStreamDestroy(gate);
  cudaFreeHost(open);
  for (std::int32_t l = 0; l < layers; ++l) {
    cudaFree(dev[static_cast<std::size_t>(l)]);
    cudaFreeHost(host[static_cast<std::size_t>(l)]);
  }
  cudaFree(d_from);
  cudaFree(d_to);
  cudaFree(d_pairs);
  cudaFree(ws);
}

const bool registered = [] {
  using kvkit::paged_layout;
  register_codec<paged_layout<kvkit::bf16_codec>>("bf16", {16, 1, 2, 4, 8, 32, 64}, true);
  register_codec<paged_layout<kvkit::bf16_codec, kvkit::bf16_codec, kvkit::kv_order::hnd>>(
      "bf16_hnd", {16}, false);
  register_codec<paged_layout<kvkit::fp8_e4m3_codec>>("fp8_e4m3", {16, 1, 64}, true);
  register_codec<paged_layout<kvkit::int8_codec>>("int8", {16}, false);
  // Quantized caches in the HND order, each compared with bf16_hnd: a head's rows of a page are
  // contiguous there (a 16-token page of one head: 2 KB of fp8 K), where in NHD each 128-byte
  // (fp8) or 64-byte (int4) row sits between the other heads' rows of its token
  // (docs/paged_decode_log.md).
  register_codec<paged_layout<kvkit::fp8_e4m3_codec, kvkit::fp8_e4m3_codec, kvkit::kv_order::hnd>>(
      "fp8_e4m3_hnd", {16}, false);
  register_codec<
      paged_layout<kvkit::int4_group_codec<32>, kvkit::int4_group_codec<32>, kvkit::kv_order::hnd>>(
      "int4_g32_hnd", {16}, false);
  register_codec<paged_layout<kvkit::int4_group_codec<32>>>("int4_g32", {16, 1, 64}, true);
  // The other codecs, in NHD pages of 16 tokens at the shapes of the HND rows: fp16 (bf16's
  // kernel with fp16 operands), fp8 e5m2 (a byte move where e4m3 converts) and int4 with groups
  // of 64 and 128 channels (fewer scale and zero rows than 32).
  register_codec<paged_layout<kvkit::fp16_codec>>("fp16", {16}, false);
  register_codec<paged_layout<kvkit::fp8_e5m2_codec>>("fp8_e5m2", {16}, false);
  register_codec<paged_layout<kvkit::int4_group_codec<64>>>("int4_g64", {16}, false);
  register_codec<paged_layout<kvkit::int4_group_codec<128>>>("int4_g128", {16}, false);
  register_graph_rows();
  register_row("paged_decode_launch/empty_kernel", BM_launch_peer);
  for (const bool priority : {false, true}) {
    for (const bool out : {true, false}) {
      for (const int blocks : {0, 64, 32, 16, 8, 4, -1}) {
        const std::string how = blocks < 0    ? "copy_engines"
                                : blocks == 0 ? "kernel"
                                              : "kernel_" + std::to_string(blocks) + "_blocks";
        register_row(std::string("decode_beside_swap/") + (out ? "out" : "in") + "/" + how +
                         (priority ? "/decode_first" : ""),
                     [=](benchmark::State& s) { BM_decode_beside_swap(s, out, blocks, priority); });
      }
    }
  }
  benchmark::AddCustomContext("kvkit_decode_overrides", overrides_in_effect());
  return true;
}();

} // namespace
