#pragma once
//! paged_prefill: attention of several query tokens per sequence over its paged K/V cache (chunked
//! prefill, extend, speculative verification), causal, for every per-token codec (fp16, bf16, fp8,
//! int8, int4 groups) dequantized as the tiles are loaded, any GQA/MQA group, head dims 64/128/256,
//! optional LSE output, sliding window and logit soft cap. What it computes is
//! kvkit::reference::paged_attention: sequence b's queries are its last tokens.
//!
//! How it works (docs/kernels.md has the long form): a thread block of four warps takes 64 rows of
//! one (sequence, KV head), a row being one (query token, query head of the group), so every query
//! head that reads a KV head shares one pass over its keys. The block walks the keys its rows can
//! see (up to its last query's position, from its first query's window) in tiles of 64 keys (32 at
//! head dim 256): the block's threads decode each tile's K and V into shared memory as 16-bit
//! values (bf16 for a bf16 cache, fp16 otherwise), then each warp computes its 16 rows' logits
//! with tensor-core MMAs (m16n8k16, fp32 accumulation), masks them, updates its running softmax
//! and accumulates P V with MMAs. A first version: one tile in flight at a time, no split over
//! long contexts.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "kvkit/attention/options.hpp"
#include "kvkit/block/page_table.hpp"
#include "kvkit/concepts/kv_codec.hpp"
#include "kvkit/concepts/page_layout.hpp"
#include "kvkit/cuda/detail/checks.cuh"
#include "kvkit/cuda/detail/page_codecs.cuh"
#include "kvkit/cuda/paged_decode.cuh"
#include "kvkit/cuda/quantize_pages.cuh"
#include "kvkit/error.hpp"
#include "kvkit/layout/page_layout.hpp"

namespace kvkit::cuda {

//! One prefill/extend step of one layer. All pointers are device pointers.
template <page_layout Layout, query_element T>
struct prefill_args {
  Layout layout;                    //!< page geometry and codecs
  const std::byte* cache = nullptr; //!< [capacity][layout.bytes_per_page()], 16-byte aligned
  std::int32_t capacity = 0;        //!< pages in `cache`
  //! The batch's pages (block_table::export_csr), on the device, the new tokens' K and V already
  //! written (write_kv): sequence b has table.num_tokens(b) tokens, its queries the last of them.
  csr_page_table table;
  //! [batch + 1]: sequence b's queries are rows qo_indptr[b] .. qo_indptr[b + 1] - 1 of q and out
  //! (0 first, non-decreasing; a sequence may have none).
  const std::int32_t* qo_indptr = nullptr;
  //! At least the most queries any sequence of the batch has (the host knows it from its
  //! schedule); it sizes the grid. 0: nothing to do.
  std::int32_t max_queries = 0;
  std::int32_t num_q_heads = 0;         //!< a multiple of the layout's KV heads
  const T* q = nullptr;                 //!< [total queries][num_q_heads][head_dim], 16-byte aligned
  T* out = nullptr;                     //!< [total queries][num_q_heads][head_dim], 16-byte aligned
  float* lse = nullptr;                 //!< optional [total queries][num_q_heads], natural log
  const float* static_scales = nullptr; //!< [2][kv_heads]: K's then V's (fp8 codecs)
  attention_options options;            //!< scale, sliding window, soft cap
  //! Debug mode when set (a device int): a page id outside [0, capacity) sets *page_check to 1
  //! and its keys read as zeros instead of reading outside the cache; so does a sequence with more
  //! queries than tokens or than max_queries, which is then skipped. Outside the debug mode such a
  //! sequence is skipped too (its outputs left as they were) and nothing is flagged.
  std::int32_t* page_check = nullptr;
};

namespace detail {

// Rows (query token, query head) a block of the prefill kernel takes, and its threads: four warps
// of 16 rows, each the M of its MMAs.
inline constexpr std::int32_t prefill_rows = 64;
inline constexpr int prefill_threads = 128;

// Keys of one tile: 64, or 32 at head dim 256 (the shared memory and the accumulators).
template <int D>
inline constexpr int prefill_keys = D > 128 ? 32 : 64;

// 16-bit elements from one row to the next in shared memory: 8 more than a row, so that the
// fragment loads of a warp (eight rows, four words each) fall on 32 different banks.
template <int D>
inline constexpr int prefill_stride = D + 8;

// The 16-bit type a codec's values are decoded to for the MMAs: bf16 for a bf16 cache, fp16 for
// the others (whose decoded values, like the decode kernel's, must fit fp16's range).
template <class C>
using prefill_mma_t = std::conditional_t<std::is_same_v<C, bf16_codec>, __nv_bfloat16, __half>;

// Shared memory of one block: the queries' tile, then K's and V's.
template <int D>
inline constexpr std::size_t prefill_smem_bytes =
    static_cast<std::size_t>(prefill_rows + 2 * prefill_keys<D>) * prefill_stride<D> * 2;

// Eight 16-bit values of type From as eight of type To (through float; the same bits when the
// types agree).
template <class From, class To>
__device__ inline uint4 convert8(uint4 w) {
  if constexpr (std::is_same_v<From, To>) {
    return w;
  } else {
    const std::uint32_t in[4] = {w.x, w.y, w.z, w.w};
    std::uint32_t o[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      o[i] = narrow_pair<To>(widen_half<From>(in[i], 0), widen_half<From>(in[i], 1));
    }
    return make_uint4(o[0], o[1], o[2], o[3]);
  }
}

// Eight channels of one token and head of codec C, as eight values of the 16-bit type E.
template <kv_codec C, class E>
__device__ inline uint4 decode_for_mma(const std::byte* codes_at, const std::byte* params_at,
                                       const float* scales, std::int32_t head) {
  if constexpr (std::is_same_v<passthrough_element<C>, E>) {
    return *reinterpret_cast<const uint4*>(codes_at);
  } else {
    chunk_params p{};
    if constexpr (C::scaling == kv_scaling::static_per_head) {
      p = {scales[head], 0.0F};
    } else if constexpr (C::param_bytes > 0) {
      p = load_chunk_params<C>(params_at);
    }
    float x[8];
    (void)decode8_exact<C>(load_chunk<C>(codes_at), p, codes_at, params_at, scales, head, x);
    return make_uint4(narrow_pair<E>(x[0], x[1]), narrow_pair<E>(x[2], x[3]),
                      narrow_pair<E>(x[4], x[5]), narrow_pair<E>(x[6], x[7]));
  }
}

__device__ inline std::uint32_t lds32(const std::uint16_t* p) {
  return *reinterpret_cast<const std::uint32_t*>(p);
}

// Logit scale folded with log2(e): the kernel's exponentials are exp2.
inline constexpr float prefill_log2e = 1.4426950408889634F;

template <class K, class V, int D, bool Checked, class Layout, class T>
__global__ void __launch_bounds__(prefill_threads)
    paged_prefill_kernel(const prefill_args<Layout, T> a, float scale) {
  using KE = prefill_mma_t<K>;
  using VE = prefill_mma_t<V>;
  constexpr int BM = prefill_rows;
  constexpr int BN = prefill_keys<D>;
  constexpr int LD = prefill_stride<D>;
  constexpr int CH = D / 8; // 16-byte chunks of a row
  extern __shared__ uint4 prefill_smem[];
  std::uint16_t* qs = reinterpret_cast<std::uint16_t*>(prefill_smem);
  std::uint16_t* ks = qs + BM * LD;
  std::uint16_t* vs = ks + BN * LD;

  const auto b = static_cast<std::int32_t>(blockIdx.z);
  const auto kvh = static_cast<std::int32_t>(blockIdx.y);
  const Layout& l = a.layout;
  const std::int32_t group = a.num_q_heads / l.num_kv_heads();
  const std::int32_t q0 = a.qo_indptr[b];
  const std::int32_t nq = a.qo_indptr[b + 1] - q0;
  if (nq <= 0) {
    return;
  }
  const std::int32_t first_page = a.table.indptr[b];
  const std::int32_t pages = a.table.indptr[b + 1] - first_page;
  const std::int32_t ps = l.page_size();
  const std::int32_t len = pages <= 0 ? 0 : (pages - 1) * ps + a.table.last_page_len[b];
  if (nq > len || nq > a.max_queries) { // the grid covers max_queries * group rows
    if constexpr (Checked) {
      if (threadIdx.x == 0 && blockIdx.y == 0) {
        atomicExch(a.page_check, 1);
      }
    }
    return;
  }
  const std::int32_t rows = nq * group; // validate bounds max_queries * group
  // The last tiles of a sequence see the most keys: they go first.
  const auto r0 = static_cast<std::int32_t>(gridDim.x - 1 - blockIdx.x) * BM;
  if (r0 >= rows) {
    return;
  }
  const std::int32_t row_end = min(rows, r0 + BM);
  const std::int32_t base = len - nq; // query 0's position
  const std::int32_t window = a.options.window;
  const std::int32_t key_end = base + (row_end - 1) / group + 1;
  const std::int32_t key_begin = window > 0 ? max(0, base + r0 / group - window + 1) : 0;

  // The queries' tile, in K's MMA type; rows past the sequence's are zeros.
  for (int c = static_cast<int>(threadIdx.x); c < BM * CH; c += prefill_threads) {
    const int row = c / CH;
    const int ch = (c % CH) * 8;
    const std::int32_t r = r0 + row;
    uint4 w = make_uint4(0, 0, 0, 0);
    if (r < row_end) {
      const std::int32_t i = r / group;
      const std::int32_t g = r - i * group;
      const T* src = a.q +
                     (static_cast<std::int64_t>(q0 + i) * a.num_q_heads +
                      static_cast<std::int64_t>(kvh) * group + g) *
                         D +
                     ch;
      w = convert8<T, KE>(*reinterpret_cast<const uint4*>(src));
    }
    *reinterpret_cast<uint4*>(qs + row * LD + ch) = w;
  }

  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int gq = lane / 4; // the fragment's row (and row + 8)
  const int t4 = lane % 4; // its column pair
  // Positions of this thread's two rows (-1: no row, every key masked).
  std::int32_t pos[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const std::int32_t r = r0 + warp * 16 + gq + 8 * h;
    pos[h] = r < row_end ? base + r / group : -1;
  }

  const float* k_scales = a.static_scales;
  const float* v_scales = a.static_scales == nullptr ? nullptr : a.static_scales + l.num_kv_heads();
  const std::int64_t page_bytes = l.bytes_per_page();
  const float cap = a.options.logits_soft_cap;
  const float inv_cap = cap > 0.0F ? 1.0F / cap : 0.0F;

  float o[D / 8][4] = {};
  float m[2] = {-INFINITY, -INFINITY}; // running maxima, log2 units
  float sum[2] = {0.0F, 0.0F};         // this thread's part of the denominators

  for (std::int32_t kt = key_begin; kt < key_end; kt += BN) {
    __syncthreads(); // the tile before is read (and, first, the queries are stored)
    for (int c = static_cast<int>(threadIdx.x); c < BN * CH; c += prefill_threads) {
      const int j = c / CH;
      const int ch = (c % CH) * 8;
      const std::int32_t t = kt + j;
      uint4 kw = make_uint4(0, 0, 0, 0);
      uint4 vw = kw;
      if (t < key_end) {
        const std::int32_t page = a.table.indices[first_page + t / ps];
        bool skip = false;
        if constexpr (Checked) {
          if (page < 0 || page >= a.capacity) {
            atomicExch(a.page_check, 1);
            skip = true;
          }
        }
        if (!skip) {
          const std::byte* pg = a.cache + static_cast<std::int64_t>(page) * page_bytes;
          const std::int32_t slot = t % ps;
          const std::int64_t e = l.element_index(slot, kvh, ch);
          kw = decode_for_mma<K, KE>(pg + l.k_data_offset() + e * K::bits / 8,
                                     pg + l.k_param_offset() +
                                         l.template param_index<K>(slot, kvh, ch) * K::param_bytes,
                                     k_scales, kvh);
          vw = decode_for_mma<V, VE>(pg + l.v_data_offset() + e * V::bits / 8,
                                     pg + l.v_param_offset() +
                                         l.template param_index<V>(slot, kvh, ch) * V::param_bytes,
                                     v_scales, kvh);
        }
      }
      *reinterpret_cast<uint4*>(ks + j * LD + ch) = kw;
      *reinterpret_cast<uint4*>(vs + j * LD + ch) = vw;
    }
    __syncthreads();

    // S = Q K^T for the warp's 16 rows and the tile's keys.
    float s[BN / 8][4] = {};
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const std::uint16_t* qa = qs + (warp * 16 + gq) * LD + kk * 16 + 2 * t4;
      const std::uint32_t a0 = lds32(qa);
      const std::uint32_t a1 = lds32(qa + 8 * LD);
      const std::uint32_t a2 = lds32(qa + 8);
      const std::uint32_t a3 = lds32(qa + 8 * LD + 8);
#pragma unroll
      for (int n = 0; n < BN / 8; ++n) {
        const std::uint16_t* kb = ks + (n * 8 + gq) * LD + kk * 16 + 2 * t4;
        mma16816<KE>(s[n], a0, a1, a2, a3, lds32(kb), lds32(kb + 8));
      }
    }

    // Scale, soft cap and mask (causal, window); the running maxima.
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int n = 0; n < BN / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const std::int32_t key = kt + n * 8 + 2 * t4 + (e & 1);
        const std::int32_t p = pos[e / 2];
        float x = s[n][e] * scale;
        if (cap > 0.0F) {
          x = cap * tanhf(x * inv_cap);
        }
        const bool seen = key <= p && (window == 0 || key > p - window);
        s[n][e] = seen ? x * prefill_log2e : -INFINITY;
        mx[e / 2] = fmaxf(mx[e / 2], s[n][e]);
      }
    }
    float base_of[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xFFFFFFFFU, mx[h], 1));
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xFFFFFFFFU, mx[h], 2));
      const float next = fmaxf(m[h], mx[h]);
      base_of[h] = next == -INFINITY ? 0.0F : next; // a row that has seen no key yet
      const float rescale = exp2f(m[h] - base_of[h]);
      m[h] = next;
      sum[h] *= rescale;
#pragma unroll
      for (int d = 0; d < D / 8; ++d) {
        o[d][2 * h] *= rescale;
        o[d][2 * h + 1] *= rescale;
      }
    }
#pragma unroll
    for (int n = 0; n < BN / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[n][e] = exp2f(s[n][e] - base_of[e / 2]);
        sum[e / 2] += s[n][e];
      }
    }

    // O += P V: P's accumulators are the A fragments of the next MMA, 16 keys at a time.
#pragma unroll
    for (int kb = 0; kb < BN / 16; ++kb) {
      const std::uint32_t a0 = narrow_pair<VE>(s[2 * kb][0], s[2 * kb][1]);
      const std::uint32_t a1 = narrow_pair<VE>(s[2 * kb][2], s[2 * kb][3]);
      const std::uint32_t a2 = narrow_pair<VE>(s[2 * kb + 1][0], s[2 * kb + 1][1]);
      const std::uint32_t a3 = narrow_pair<VE>(s[2 * kb + 1][2], s[2 * kb + 1][3]);
      const std::uint16_t* vb = vs + (kb * 16 + 2 * t4) * LD + gq;
#pragma unroll
      for (int d = 0; d < D / 8; ++d) {
        const std::uint16_t* v = vb + d * 8;
        const std::uint32_t b0 = v[0] | (static_cast<std::uint32_t>(v[LD]) << 16);
        const std::uint32_t b1 = v[8 * LD] | (static_cast<std::uint32_t>(v[9 * LD]) << 16);
        mma16816<VE>(o[d], a0, a1, a2, a3, b0, b1);
      }
    }
  }

#pragma unroll
  for (int h = 0; h < 2; ++h) {
    sum[h] += __shfl_xor_sync(0xFFFFFFFFU, sum[h], 1);
    sum[h] += __shfl_xor_sync(0xFFFFFFFFU, sum[h], 2);
    const std::int32_t r = r0 + warp * 16 + gq + 8 * h;
    if (r >= row_end) {
      continue;
    }
    const std::int32_t i = r / group;
    const std::int64_t head_row = static_cast<std::int64_t>(q0 + i) * a.num_q_heads +
                                  static_cast<std::int64_t>(kvh) * group + (r - i * group);
    T* dst = a.out + head_row * D + 2 * t4;
    const float inv = 1.0F / sum[h];
#pragma unroll
    for (int d = 0; d < D / 8; ++d) {
      *reinterpret_cast<std::uint32_t*>(dst + d * 8) =
          narrow_pair<T>(o[d][2 * h] * inv, o[d][2 * h + 1] * inv);
    }
    if (a.lse != nullptr && t4 == 0) {
      a.lse[head_row] = m[h] * (1.0F / prefill_log2e) + logf(sum[h]);
    }
  }
}

} // namespace detail

//! bad_argument unless the layout is a paged_layout of the library's per-token codecs (a
//! per-page-channel codec, a kv_codec of the caller's own, or a page_layout model of the caller's
//! own is rejected) with head dim 64, 128 or 256, the page table's page size is the layout's, the
//! batch is 0 to 65535 and the KV heads at most 65535 (the grid's z and y), num_q_heads is a
//! positive multiple of the KV heads, max_queries is at least 0 with max_queries * (num_q_heads /
//! KV heads) below 2^31 - 64, the options are in range, and, when there is work (a batch and
//! max_queries > 0), the pointers are set (the fp8 scales' too: their values are not checked), the
//! cache, queries and outputs 16-byte aligned, the page table, qo_indptr, log-sum-exps, fp8
//! scales and debug flag aligned to their elements, and capacity > 0. What lies in device memory
//! (qo_indptr, the table, the page ids) is not checked on the host: see prefill_args::page_check.
template <page_layout Layout, query_element T>
[[nodiscard]] status validate(const prefill_args<Layout, T>& a) {
  using K = typename Layout::k_codec;
  using V = typename Layout::v_codec;
  const Layout& l = a.layout;
  if (!detail::device_layout<Layout> || !l.validate().ok() || !detail::decode_codec<K> ||
      !detail::decode_codec<V> ||
      (l.head_dim() != 64 && l.head_dim() != 128 && l.head_dim() != 256) ||
      a.table.page_size != l.page_size() || a.table.batch_size < 0 ||
      a.table.batch_size > detail::max_grid_rows || l.num_kv_heads() > detail::max_grid_rows ||
      a.num_q_heads <= 0 || a.num_q_heads % l.num_kv_heads() != 0 || a.max_queries < 0 ||
      static_cast<std::int64_t>(a.max_queries) * (a.num_q_heads / l.num_kv_heads()) >
          INT32_MAX - detail::prefill_rows ||
      !a.options.validate().ok()) {
    return errc::bad_argument;
  }
  if (a.table.batch_size > 0 && a.max_queries > 0 &&
      (a.cache == nullptr || a.capacity <= 0 || a.q == nullptr || a.out == nullptr ||
       a.qo_indptr == nullptr || a.table.indptr == nullptr || a.table.indices == nullptr ||
       a.table.last_page_len == nullptr || !detail::aligned<16>(a.cache) ||
       !detail::aligned<16>(a.q) || !detail::aligned<16>(a.out) ||
       (Layout::has_static_scales && a.static_scales == nullptr) ||
       !detail::elements_aligned(a.table.indptr, a.table.indices, a.table.last_page_len,
                                 a.qo_indptr, a.lse, a.static_scales, a.page_check))) {
    return errc::bad_argument;
  }
  return {};
}

namespace detail {

template <int D, page_layout Layout, query_element T>
cudaError_t launch_prefill(const prefill_args<Layout, T>& a, cudaStream_t stream) {
  using K = typename Layout::k_codec;
  using V = typename Layout::v_codec;
  const std::int64_t rows =
      static_cast<std::int64_t>(a.max_queries) * (a.num_q_heads / a.layout.num_kv_heads());
  const dim3 grid(static_cast<unsigned>((rows + prefill_rows - 1) / prefill_rows),
                  static_cast<unsigned>(a.layout.num_kv_heads()),
                  static_cast<unsigned>(a.table.batch_size));
  const float scale =
      a.options.scale > 0.0F ? a.options.scale : 1.0F / std::sqrt(static_cast<float>(D));
  constexpr std::size_t smem = prefill_smem_bytes<D>;
  return with_page_check(a.page_check, [&](auto checked) {
    const auto kernel = paged_prefill_kernel<K, V, D, decltype(checked)::value, Layout, T>;
    if constexpr (smem > 48 * 1024) {
      if (const cudaError_t e = cudaFuncSetAttribute(
              kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
          e != cudaSuccess) {
        (void)cudaGetLastError(); // the error is returned, not left pending
        return e;
      }
    }
    kernel<<<grid, prefill_threads, smem, stream>>>(a, scale);
    return cudaGetLastError();
  });
}

} // namespace detail

//! Attention of each sequence's queries over its paged cache, causal (query i of a sequence of n
//! queries and L tokens sits at position L - n + i and sees the keys at or before it, within
//! options.window when set), as kvkit::reference::paged_attention computes it in float64; outputs
//! in T, log-sum-exps (natural log, scaled logits) where `lse` is set. Asynchronous on `stream`;
//! cudaErrorInvalidValue when `validate` fails, and an error an earlier call left pending is
//! returned (taken) before anything launches (detail::take_pending_error). A sequence with no
//! queries is skipped. Safe to capture in a CUDA graph (one kernel, no host-side state).
template <page_layout Layout, query_element T>
[[nodiscard]] cudaError_t paged_prefill(const prefill_args<Layout, T>& a, cudaStream_t stream) {
  static_assert(detail::device_layout<Layout>,
                "paged_prefill takes paged_layout of the library's codecs only");
  if (const auto done =
          detail::before_launch(validate(a).ok(), a.table.batch_size > 0 && a.max_queries > 0)) {
    return *done;
  }
  switch (a.layout.head_dim()) {
  case 64:
    return detail::launch_prefill<64>(a, stream);
  case 128:
    return detail::launch_prefill<128>(a, stream);
  default:
    return detail::launch_prefill<256>(a, stream);
  }
}

} // namespace kvkit::cuda
