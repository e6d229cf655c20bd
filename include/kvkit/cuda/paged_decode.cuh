#pragma once
//! paged_decode: attention of one query token per sequence over its paged K/V cache, for every
//! per-token codec (fp16, bf16, fp8, int8, int4 groups) with dequantization fused into the loads,
//! GQA/MQA groups of 1 to 16 query heads per KV head, head dims 64/128/256, split-KV with an
//! in-launch log-sum-exp merge, optional LSE output, sliding window and logit soft cap.
//!
//! How it works (docs/kernels.md has the long form): a thread block takes one (sequence, KV
//! head, split) and its warps (four, in most builds) take 16-key tiles in turn. Each warp copies
//! its tiles' whole K and V rows into its own slice of shared memory (`cp.async`, several tiles
//! ahead, chunks swizzled per key), so no block barrier is needed in the loop. The group's query
//! heads are the N dimension of tensor-core MMAs (m16n8k16, fp32 accumulation): S^T = K Q^T with
//! keys as M, then O^T = V^T P^T with channels as M, P^T moved into place with `movmatrix`. Each
//! thread reads 16-byte runs of a key's channels and dequantizes them straight into MMA operands; K
//! and Q share a channel permutation, and V's channel permutation is undone when the output is
//! written.

#include <cooperative_groups.h>
#include <cuda/atomic>
#include <cuda/ptx>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <array>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "kvkit/attention/decode_plan.hpp"
#include "kvkit/attention/options.hpp"
#include "kvkit/block/page_table.hpp"
#include "kvkit/concepts/kv_codec.hpp"
#include "kvkit/concepts/page_layout.hpp"
#include "kvkit/cuda/detail/checks.cuh"
#include "kvkit/cuda/detail/elements.cuh"
#include "kvkit/cuda/detail/page_codecs.cuh"
#include "kvkit/error.hpp"
#include "kvkit/layout/page_layout.hpp"
#include "kvkit/quant/codecs.hpp"

namespace kvkit::cuda {

//! Query and output element types of paged_decode.
template <class T>
concept query_element = std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>;

//! One decode step of one layer. All pointers are device pointers.
template <page_layout Layout, query_element T>
struct decode_args {
  Layout layout;                    //!< page geometry and codecs
  const std::byte* cache = nullptr; //!< [capacity][layout.bytes_per_page()], 16-byte aligned
  std::int32_t capacity = 0;        //!< pages in `cache`
  csr_page_table table;             //!< the batch's pages (block_table::export_csr), on the device
  const T* q = nullptr;             //!< [batch][num_q_heads][head_dim], 16-byte aligned
  T* out = nullptr;                 //!< [batch][num_q_heads][head_dim], 16-byte aligned
  float* lse = nullptr;             //!< optional [batch][num_q_heads], natural log
  const float* static_scales = nullptr; //!< [2][kv_heads]: K's then V's (fp8 codecs)
  attention_options options;            //!< scale, sliding window, soft cap
  //! Debug mode when set: every page id is checked against [0, capacity); a bad one sets
  //! *page_check to 1 and its keys read as zeros instead of reading outside the cache. The
  //! table's extents (indptr, last_page_len in 1..page_size) are not checked: they must hold, as
  //! block_table's exports do (a check in the kernel's prologue cost the ordinary path up to 3.6%
  //! at B=1, L=8192 on an H100).
  std::int32_t* page_check = nullptr;
  //! Launch as a programmatic dependent of the kernel before it on the stream (compute
  //! capability 9 and up; ignored below): the decode grid is placed while that kernel's grid
  //! retires, instead of after, and its blocks wait for that kernel's writes before they touch
  //! memory, so the result is the same. A grid of at most one block per multiprocessor (a small
  //! batch) also lets the launch after it start once its blocks are past their keys (that
  //! launch, if it is a dependent launch, still waits for this one's results), and so does a
  //! grid whose blocks are all resident at once, with page_table_ready, of a 16-bit cache or of
  //! a quantized one split in chunks of 1024 keys or more. False: an ordinary launch in stream
  //! order.
  bool dependent_launch = true;
  //! Arrival counters that the caller keeps at zero (optional): a device buffer of
  //! zeroed_counter_count 32-bit counters, at least the plan's decode_plan::counter_count()
  //! (allocate them for the largest batch), zeroed once (cudaMemset) before their first launch
  //! and used for nothing but these launches. Every launch leaves them at zero again, whatever its
  //! plan, so the launcher skips the memset that zeroes the workspace's own counters before a
  //! launch that merges through the workspace: the kernel then follows the kernel before it
  //! directly, which is what lets a dependent launch overlap it. They live apart from the
  //! workspace because the workspace's counters move with the plan's batch: a workspace zeroed
  //! once holds the partial results of a plan for a small batch where a plan for a larger one
  //! keeps its counters. Launches that share the buffer must follow each other in stream order
  //! (one buffer per stream where decodes run on several at once), as launches that share a
  //! workspace must. A launch that fails part way can leave counters set: zero them again after
  //! an error. Null: the workspace's counters, zeroed by the launcher where they are used.
  std::uint32_t* zeroed_counters = nullptr;
  std::int64_t zeroed_counter_count = 0; //!< counters at zeroed_counters
  //! With dependent_launch: the page table (table.indptr, indices, last_page_len) is not written
  //! by the kernel the decode follows on the stream, nor by one still running before it (it was
  //! uploaded or built earlier, as an engine's page table is), so the decode reads it before it
  //! waits for that kernel, and its two dependent round trips (the sequence's extent, then its
  //! page ids) overlap that kernel's end. The queries, the cache and everything else are still
  //! read after the wait. Used by the grids that signal their own dependents early (at most one
  //! block per multiprocessor, or all resident at once: see dependent_launch), so that a decode
  //! after such a decode is placed early and has time to read; a larger grid reads the queries
  //! first and the table after the wait, which measured faster there. False: every read waits.
  bool page_table_ready = false;
  //! With page_table_ready: the kernel the decode follows on the stream, and any still running
  //! before it, writes no cache page of the batch's sequences but each sequence's last (as a
  //! kernel that appends each sequence's new token does), so the decode also issues the copies of
  //! its first tiles that lie before the sequence's last page ahead of its wait, and they overlap
  //! that kernel's end. The queries and the last pages are read after the wait. Ignored in debug
  //! mode (page_check). False: the cache too is read after the wait.
  bool cache_ready_but_last_page = false;
};

namespace detail {

// Whether the decode and prefill kernels read codec C's pages: no per-page-channel codec (that C
// is one of the library's, validate checks through device_layout).
template <class C>
inline constexpr bool decode_codec = C::scaling != kv_scaling::per_page_channel;

} // namespace detail

//! bad_argument unless the plan's shape is valid and matches the layout (kv heads, head dim,
//! kv_bits, kv_scaled_one_width, and page_size unless 0: decode_shape_for gives them), the layout
//! is a paged_layout whose codecs are the library's per-token ones (a per-page-channel codec, a
//! kv_codec of the caller's own, or a page_layout model of the caller's own is rejected), the
//! page table's page size is the layout's, the batch fits the plan (equals it
//! unless the plan is graph-safe; the plan's batch and KV heads are at most 65535 each, the grid's
//! z and y: decode_shape::validate), the pointers are set (the fp8 scales' pointer included: their
//! values, on the device, are not checked; the cache, queries and outputs 16-byte aligned, the
//! page table, log-sum-exps, fp8 scales and debug flag aligned to their elements), options
//! are in range, the plan's heads_per_block is 1, or decode_plan::head_split_heads with KV heads a
//! multiple of it and at most decode_plan::head_split_max_splits splits, the workspace holds
//! plan.workspace_bytes() 16-byte-aligned bytes, and zeroed
//! counters, where given, number at least plan.counter_count() (a count without counters:
//! bad_argument). The sequences' lengths are not checked on the host: each holds at most 2^30 keys
//! (the kernel locates keys in 32 bits; the plans refuse longer lengths and bounds, window or not).
//! Nor is the query head count (decode_args has none): q and out hold the plan's
//! shape.num_q_heads heads a sequence.
//! A sequence with no pages (or no tokens) is skipped and its outputs and log-sum-exps left as they
//! were, so a graph-safe batch can be padded with empty sequences; the CPU reference rejects empty
//! ones.
template <page_layout Layout, query_element T>
[[nodiscard]] status validate(const decode_args<Layout, T>& a, const decode_plan& plan,
                              const void* workspace, std::size_t workspace_bytes) {
  using K = typename Layout::k_codec;
  using V = typename Layout::v_codec;
  const decode_shape& s = plan.shape;
  if (!detail::device_layout<Layout> || !s.validate().ok() || !a.layout.validate().ok() ||
      a.layout.num_kv_heads() != s.num_kv_heads || a.layout.head_dim() != s.head_dim ||
      s.kv_bits != decode_kv_bits<Layout> ||
      s.kv_scaled_one_width != decode_kv_scaled_one_width<Layout> ||
      (s.page_size != 0 && s.page_size != a.layout.page_size()) || !detail::decode_codec<K> ||
      !detail::decode_codec<V> || a.table.page_size != a.layout.page_size() ||
      a.table.batch_size < 0 || a.table.batch_size > s.batch_size ||
      (!plan.graph_safe && a.table.batch_size != s.batch_size)) {
    return errc::bad_argument;
  }
  if (plan.chunk_tokens <= 0 || plan.chunk_tokens % decode_plan::tile_tokens != 0 ||
      plan.chunk_tokens > kvkit::detail::max_decode_keys || plan.max_splits <= 0 ||
      plan.max_splits > decode_plan::max_splits_limit ||
      (plan.heads_per_block != 1 && (plan.heads_per_block != decode_plan::head_split_heads ||
                                     s.num_kv_heads % decode_plan::head_split_heads != 0 ||
                                     plan.max_splits > decode_plan::head_split_max_splits))) {
    return errc::bad_argument;
  }
  if (!a.options.validate().ok() || a.options.window != s.window) {
    return errc::bad_argument;
  }
  if (a.cache == nullptr || !detail::aligned<16>(a.cache) || a.capacity <= 0 || a.q == nullptr ||
      a.out == nullptr || !detail::aligned<16>(a.q) || !detail::aligned<16>(a.out) ||
      a.table.indptr == nullptr || a.table.indices == nullptr || a.table.last_page_len == nullptr ||
      !detail::elements_aligned(a.table.indptr, a.table.indices, a.table.last_page_len, a.lse,
                                a.static_scales, a.page_check)) {
    return errc::bad_argument;
  }
  if (Layout::has_static_scales && a.static_scales == nullptr) {
    return errc::bad_argument;
  }
  if (plan.workspace_bytes() > 0 &&
      (workspace == nullptr || workspace_bytes < plan.workspace_bytes() ||
       !detail::aligned<16>(workspace))) {
    return errc::bad_argument;
  }
  if (a.zeroed_counters == nullptr
          ? a.zeroed_counter_count != 0
          : a.zeroed_counter_count < 0 ||
                static_cast<std::uint64_t>(a.zeroed_counter_count) < plan.counter_count() ||
                !detail::elements_aligned(a.zeroed_counters)) {
    return errc::bad_argument;
  }
  return {};
}

namespace detail {

// n / d and n % d for n < 2^31 with a multiply and a shift (division by an invariant integer).
struct fast_divmod {
  std::uint32_t divisor = 1;
  std::uint32_t multiplier = 1;
  std::uint32_t shift = 0;

  static fast_divmod make(std::uint32_t d) {
    fast_divmod f;
    f.divisor = d;
    while ((1ULL << f.shift) < d) {
      ++f.shift;
    }
    f.multiplier = static_cast<std::uint32_t>(((1ULL << 32) * ((1ULL << f.shift) - d)) / d + 1);
    return f;
  }
  __device__ void divmod(std::uint32_t n, std::uint32_t& q, std::uint32_t& r) const {
    q = (__umulhi(n, multiplier) + n) >> shift;
    r = n - q * divisor;
  }
};

template <class Layout, class T>
struct decode_params {
  Layout layout;
  const std::byte* cache;
  std::int64_t page_bytes;
  csr_page_table table;
  const T* q;
  T* out;
  float* lse;
  const float* static_scales;
  std::int32_t* page_check;
  std::int32_t capacity;
  std::int32_t group;
  std::int32_t num_q_heads;
  float scale;
  float soft_cap;
  std::int32_t window;
  std::int32_t chunk;
  fast_divmod page_div;
  std::uint32_t* counters;
  float* part_o;
  float* part_lse;
  std::int32_t max_splits;
  bool cluster;          // the splits of a (sequence, KV head) form one thread block cluster
  bool page_table_ready; // the page table is read before griddepcontrol.wait
  bool cache_early;      // and the first tiles before the sequence's last page are copied too
  bool signal_early;     // griddepcontrol.launch_dependents once a block is past its keys
};

// ---- device building blocks -------------------------------------------------------------------

template <class E>
__device__ inline void mma16816(float (&d)[4], std::uint32_t a0, std::uint32_t a1, std::uint32_t a2,
                                std::uint32_t a3, std::uint32_t b0, std::uint32_t b1) {
  if constexpr (std::is_same_v<E, __nv_bfloat16>) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, "
                 "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, "
                 "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
}

__device__ inline std::uint32_t transpose8x8(std::uint32_t x) {
  std::uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

__device__ inline float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// How far (in log2 units) a tile's logits may pass their row's running maximum before the maximum
// moves (paged_decode_kernel): probabilities stay below 2^8 = 256, within fp16's range even once
// multiplied by the 32 an int4 step's parameters may have been divided by.
inline constexpr float lazy_max_bound = 8.0F;

// The weight of a partial whose log2-sum-exp is `lse` in a merge whose largest one is `mx`; 0 when
// every partial is empty (mx is -inf), where exp2(-inf - -inf) would be NaN.
__device__ inline float merge_weight(float lse, float mx) {
  return mx == -INFINITY ? 0.0F : fast_exp2(lse - mx);
}

// log2 of the sum of exp2 terms whose largest exponent is `mx` and whose sum scaled by exp2(-mx)
// is `sum`; -inf for an empty sum.
__device__ inline float log2_sum_exp(float mx, float sum) {
  return sum > 0.0F ? mx + __log2f(sum) : -INFINITY;
}

// Four consecutive outputs, scaled, in the output type: one 8-byte store (`dst` 8-byte aligned).
template <class T>
__device__ inline void store_scaled(T* dst, const float4& v, float scale) {
  *reinterpret_cast<uint2*>(dst) = make_uint2(narrow_pair<T>(v.x * scale, v.y * scale),
                                              narrow_pair<T>(v.z * scale, v.w * scale));
}

__device__ inline float fast_tanh(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Copies `Bytes` to the shared-window address `s` (zeros where !valid); with `L2Wide` (16 bytes
// only), L2 fetches the 256 bytes around them from memory (the `.L2::256B` prefetch size).
template <int Bytes, bool L2Wide = false>
__device__ inline void cp_async_to(std::uint32_t s, const void* global, bool valid) {
  static_assert(!L2Wide || Bytes == 16, "the wide fetch is for 16-byte copies");
  const int n = valid ? Bytes : 0; // 0: the destination is zero-filled, nothing is read
  if constexpr (L2Wide) {
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n" ::"r"(s), "l"(global),
                 "r"(n)
                 : "memory");
  } else if constexpr (Bytes == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(global), "r"(n)
                 : "memory");
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(s), "l"(global),
                 "n"(Bytes), "r"(n)
                 : "memory");
  }
}
template <int Bytes>
__device__ inline void cp_async(void* smem, const void* global, bool valid) {
  cp_async_to<Bytes>(static_cast<std::uint32_t>(__cvta_generic_to_shared(smem)), global, valid);
}
__device__ inline void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int Pending>
__device__ inline void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(Pending) : "memory");
}

// Reads `Bytes` (4, 8 or 16) from shared memory into consecutive words.
template <int Bytes>
__device__ inline void lds(const void* smem, std::uint32_t* w) {
  if constexpr (Bytes == 16) {
    const uint4 v = *static_cast<const uint4*>(smem);
    w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
  } else if constexpr (Bytes == 8) {
    const uint2 v = *static_cast<const uint2*>(smem);
    w[0] = v.x, w[1] = v.y;
  } else {
    w[0] = *static_cast<const std::uint32_t*>(smem);
  }
}

// ldmatrix.x4.trans: four 8x8 blocks of 16-bit elements, each from eight 16-byte rows (lane l
// gives row l % 8 of block l / 8), transposed: word n of lane l holds elements (2 (l % 4), l / 4)
// and (2 (l % 4) + 1, l / 4) of block n, by (row, column).
__device__ inline void ldsm_x4_trans(const void* smem, std::uint32_t (&w)[4]) {
  const auto s = static_cast<std::uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3])
               : "r"(s)
               : "memory");
}

__device__ inline std::uint32_t prmt(std::uint32_t a, std::uint32_t b, std::uint32_t sel) {
  return __byte_perm(a, b, sel);
}

__device__ inline std::uint32_t hsub2(std::uint32_t a, std::uint32_t b) {
  __half2 r = __hsub2(*reinterpret_cast<const __half2*>(&a), *reinterpret_cast<const __half2*>(&b));
  return *reinterpret_cast<const std::uint32_t*>(&r);
}
__device__ inline std::uint32_t hfma2(std::uint32_t a, std::uint32_t b, std::uint32_t c) {
  __half2 r = __hfma2(*reinterpret_cast<const __half2*>(&a), *reinterpret_cast<const __half2*>(&b),
                      *reinterpret_cast<const __half2*>(&c));
  return *reinterpret_cast<const std::uint32_t*>(&r);
}

// Two fp8 codes (bytes 2*Hi, 2*Hi+1 of x) as an f16 pair, exactly.
template <fp8_format F, int Hi>
__device__ inline std::uint32_t fp8_pair_to_f16x2(std::uint32_t x) {
  if constexpr (F == fp8_format::e5m2) {
    return prmt(x, 0U, Hi == 0 ? 0x1404U : 0x3424U); // e5m2 is the top byte of an fp16
  } else {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    // The pair's 16 bits taken as a half of x, which the conversion instruction selects itself
    // (extracting them first costs a shift per pair).
    std::uint32_t r;
    if constexpr (Hi == 0) {
      asm("{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, %1;\ncvt.rn.f16x2.e4m3x2 %0, lo;\n}\n"
          : "=r"(r)
          : "r"(x));
    } else {
      asm("{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, %1;\ncvt.rn.f16x2.e4m3x2 %0, hi;\n}\n"
          : "=r"(r)
          : "r"(x));
    }
    return r;
#else
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(
        static_cast<__nv_fp8x2_storage_t>(Hi == 0 ? (x & 0xFFFFU) : (x >> 16)), __NV_E4M3);
    return static_cast<std::uint32_t>(h.x) | (static_cast<std::uint32_t>(h.y) << 16);
#endif
  }
}

// Signed bytes 2*Hi, 2*Hi+1 of x (each biased by 128 beforehand) as an exact f16 pair.
template <int Hi>
__device__ inline std::uint32_t int8_pair_to_f16x2(std::uint32_t biased) {
  constexpr std::uint32_t f16_1152 = 0x64806480U; // 1024 + 128 in both halves
  return hsub2(prmt(biased, 0x64646464U, Hi == 0 ? 0x4140U : 0x4342U), f16_1152);
}

// int4 codes to values in three instructions a pair: a shift and a lop3 put nibble Shift/4 of each
// 16-bit half of x in the top mantissa bits of 1.0 (giving 1 + c/16), then one fma with
// (16 scale, zero - 16 scale) gives c * scale + zero. Offsetting by 16 scales (not 1024 as the
// usual 0x6400 trick) keeps the rounding of the adjusted zero point to 1/128 of a step.
template <int Shift>
__device__ inline std::uint32_t int4_pair_biased(std::uint32_t x) {
  constexpr int up = 6 - Shift; // nibble bits to bits 6..9 of each half
  const std::uint32_t y = up >= 0 ? (x << (up >= 0 ? up : 0)) : (x >> (up < 0 ? -up : 0));
  // (y & mask) | one as one instruction: with both constants as immediates the compiler splits
  // it in two (an instruction takes one immediate), so they are passed in registers.
  std::uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(r) : "r"(y), "r"(0x03C003C0U), "r"(0x3C003C00U));
  return r;
}
// (16 scale, zero - 16 scale) pairs from (scale, zero) pairs. Both stay inside fp16 while the
// scale is below 2048 and the zero point within ±16384 (int4_fits); the decode loop scales down
// the parameters of a step that holds a group beyond (int4_scaled).
__device__ inline void int4_params(std::uint32_t s2, std::uint32_t z2, std::uint32_t& s16,
                                   std::uint32_t& z16) {
  constexpr std::uint32_t f16_16 = 0x4C004C00U;    // 16.0 in both halves
  constexpr std::uint32_t f16_neg16 = 0xCC00CC00U; // -16.0
  const __half2 s = *reinterpret_cast<const __half2*>(&s2);
  const __half2 a = __hmul2(s, *reinterpret_cast<const __half2*>(&f16_16));
  s16 = *reinterpret_cast<const std::uint32_t*>(&a);
  z16 = hfma2(s2, f16_neg16, z2);
}

// The largest |scale| and |zero| of an int4 (scale, zero) word and `most` (fp16 halves; NaN
// ignored).
__device__ inline std::uint32_t int4_extent(std::uint32_t most, std::uint32_t w) {
  const __half2 r = __hmax2(*reinterpret_cast<const __half2*>(&most),
                            __habs2(*reinterpret_cast<const __half2*>(&w)));
  return *reinterpret_cast<const std::uint32_t*>(&r);
}
// Whether int4_params keeps every (scale, zero) word whose extents are `most` in fp16, and its
// values c * scale + zero too: a scale below 2048 and a zero point within ±16384 keep
// |zero - 16 scale| below 49152 and the values below 47104.
__device__ inline bool int4_fits(std::uint32_t most) {
  constexpr std::uint32_t limits = 0x74006800U; // (2048, 16384) as (scale, zero)
  return __hblt2(*reinterpret_cast<const __half2*>(&most),
                 *reinterpret_cast<const __half2*>(&limits));
}
// Whether the words whose extents are `most` fit int4_params once quartered: a scale below 8192
// (any zero point fp16 holds then leaves |zero - 16 scale| / 4 below 49144 and the values below
// 47096). Otherwise they fit once divided by 32: |zero - 16 scale| / 32 below 34800 and the values
// below 32752 for any pair fp16 holds (the codecs' largest scale is 65504, for a group beyond
// fp16's range; 8736 within it).
__device__ inline bool int4_quarter_fits(std::uint32_t most) {
  return (most & 0xFFFFU) < 0x7000U; // the scale's half, |scale| < 8192
}
// A (scale, zero) word times `by` (a power of two below 1 in both halves), exactly but where it
// falls below fp16's normal range.
__device__ inline std::uint32_t int4_scaled(std::uint32_t w, std::uint32_t by) {
  const __half2 r =
      __hmul2(*reinterpret_cast<const __half2*>(&w), *reinterpret_cast<const __half2*>(&by));
  return *reinterpret_cast<const std::uint32_t*>(&r);
}

// ---- how each codec's codes become MMA operands -----------------------------------------------
//
// K: a thread holds D/4 consecutive channels of a key; operand slot p (an element pair) covers
//    the relative channels k_channel(p, 0) and k_channel(p, 1); k-step s uses slots 2s and 2s+1.
//    "Relative" numbers the thread's channels in order; they are not contiguous in the key: the
//    thread's n-th 16-byte item is item 4n + i of the key (k_abs), so that the four threads of a
//    key read 64 consecutive bytes per copy instruction.
// V: a thread holds D/8 consecutive channels of four keys; m-tile j's rows g and g+8 are the
//    relative channels v_channel(j, 0) and v_channel(j, 1); the thread's n-th item is item
//    8n + g of the key (v_abs). Where K and V are both 16-bit, V is instead read with
//    `ldmatrix.trans` (stage_layout::ldsm_v), which transposes 8-key by 8-channel blocks into
//    operand layout: m-tile j's rows g and g+8 are channels 16j + g and 16j + 8 + g.
template <class C, int D>
struct frag {
  static constexpr int bits = C::bits;
  static constexpr bool per_token = C::scaling == kv_scaling::per_token_head;
  static constexpr bool grouped = C::scaling == kv_scaling::per_token_group;
  static constexpr bool static_scale = C::scaling == kv_scaling::static_per_head;
  using mma_t = std::conditional_t<std::is_same_v<C, bf16_codec>, __nv_bfloat16, __half>;

  static constexpr int k_bytes = D / 4 * bits / 8;
  static constexpr int k_words = k_bytes / 4;
  static constexpr int v_bytes = D / 8 * bits / 8;
  static constexpr int v_words = v_bytes / 4;
  // Bytes of one copy (an item) and the channels it holds.
  static constexpr int k_item = k_bytes < 16 ? k_bytes : 16;
  static constexpr int k_items = k_bytes / k_item;
  static constexpr int k_item_channels = k_item * 8 / bits;
  static constexpr int v_item = v_bytes < 16 ? v_bytes : 16;
  static constexpr int v_items = v_bytes / v_item;
  static constexpr int v_item_channels = v_item * 8 / bits;
  // Parameter words a thread reads per K key: int8 its scale; int4 one per item (an item never
  // spans two groups: it holds at most 32 channels).
  static constexpr int k_param_words = per_token ? 1 : (grouped ? k_items : 0);
  // Bytes of one key's parameters of one head, contiguous in the page: int8 one scale, int4 a
  // (scale, zero) pair per group.
  static constexpr int param_row = per_token ? 4 : (grouped ? D / C::group_size * 4 : 0);
  static_assert(!grouped || (k_item_channels <= C::group_size && v_items == 1 &&
                             v_item_channels <= C::group_size),
                "a thread's K item, and its V channels, lie in one parameter group");
  // Group of K item `w` of thread i, and of thread g's V channels.
  static constexpr int k_group(int w, int i) {
    return grouped ? (4 * w + i) * k_item_channels / C::group_size : 0;
  }
  static constexpr int v_group(int g) { return grouped ? g * v_item_channels / C::group_size : 0; }

  static constexpr int k_channel(int p, int half) {
    return bits == 4 ? 8 * (p / 4) + p % 4 + 4 * half : 2 * p + half;
  }
  static constexpr int v_channel(int j, int half) {
    if constexpr (bits == 16) {
      return 2 * j + half;
    } else if constexpr (bits == 8) {
      return 4 * (j / 2) + 2 * (j % 2) + half;
    } else {
      return 8 * (j / 4) + j % 4 + 4 * half;
    }
  }
  // Channel in the key of thread i's K relative channel `rel`, and of thread g's V one.
  static constexpr int k_abs(int i, int rel) {
    return (rel / k_item_channels * 4 + i) * k_item_channels + rel % k_item_channels;
  }
  static constexpr int v_abs(int g, int rel) {
    return (rel / v_item_channels * 8 + g) * v_item_channels + rel % v_item_channels;
  }

  // K operand words of k-step S (slots 2S, 2S+1) of one key.
  template <int S>
  __device__ static void k_operand(const std::uint32_t (&w)[k_words], const std::uint32_t* params,
                                   std::uint32_t& lo, std::uint32_t& hi) {
    if constexpr (bits == 16) {
      lo = w[2 * S];
      hi = w[2 * S + 1];
    } else if constexpr (bits == 8 && static_scale) {
      lo = fp8_pair_to_f16x2<C::format, 0>(w[S]);
      hi = fp8_pair_to_f16x2<C::format, 1>(w[S]);
    } else if constexpr (bits == 8) {
      const std::uint32_t biased = w[S] ^ 0x80808080U;
      lo = int8_pair_to_f16x2<0>(biased);
      hi = int8_pair_to_f16x2<1>(biased);
    } else {
      // Slots 2S and 2S+1 are nibble pairs q = 2(S%2) and q+1 of word S/2.
      constexpr int word = S / 2;
      constexpr int q = 2 * (S % 2);
      const std::uint32_t pw = params[(8 * word) / k_item_channels];
      std::uint32_t s16 = 0;
      std::uint32_t z16 = 0;
      int4_params(prmt(pw, pw, 0x1010U), prmt(pw, pw, 0x3232U), s16, z16);
      lo = hfma2(int4_pair_biased<4 * q>(w[word]), s16, z16);
      hi = hfma2(int4_pair_biased<4 * q + 4>(w[word]), s16, z16);
    }
  }

  // V operand words of m-tile J from keys t0, t1 (their words and parameter words): the pair
  // over the two keys of channel v_channel(J, 0) (`a`) and of v_channel(J, 1) (`b`).
  template <int J>
  __device__ static void v_operand(const std::uint32_t (&w0)[v_words],
                                   const std::uint32_t (&w1)[v_words], std::uint32_t p0,
                                   std::uint32_t p1, std::uint32_t& a, std::uint32_t& b) {
    if constexpr (bits == 16) {
      a = prmt(w0[J], w1[J], 0x5410U);
      b = prmt(w0[J], w1[J], 0x7632U);
    } else if constexpr (bits == 8) {
      const std::uint32_t x = prmt(w0[J / 2], w1[J / 2], J % 2 == 0 ? 0x5140U : 0x7362U);
      if constexpr (static_scale) {
        a = fp8_pair_to_f16x2<C::format, 0>(x);
        b = fp8_pair_to_f16x2<C::format, 1>(x);
      } else {
        const std::uint32_t biased = x ^ 0x80808080U;
        a = int8_pair_to_f16x2<0>(biased);
        b = int8_pair_to_f16x2<1>(biased);
      }
    } else {
      // Low 16 bits: key t0's nibbles 0-3 (or 4-7); high 16 bits: key t1's.
      const std::uint32_t x = prmt(w0[J / 4], w1[J / 4], 0x5410U); // bytes 0,1 of each
      const std::uint32_t y = prmt(w0[J / 4], w1[J / 4], 0x7632U); // bytes 2,3 of each
      std::uint32_t s16 = 0;
      std::uint32_t z16 = 0;
      int4_params(prmt(p0, p1, 0x5410U), prmt(p0, p1, 0x7632U), s16, z16);
      // Channel 8(J/4) + J%4 is nibble J%4 of bytes 0,1; channel +4 is nibble J%4 of bytes 2,3.
      a = hfma2(int4_pair_biased<4 * (J % 4)>(x), s16, z16);
      b = hfma2(int4_pair_biased<4 * (J % 4)>(y), s16, z16);
    }
  }
};

// Bytes per warp of one pipeline stage, and the layout of a stage: each section holds items of
// one size, lane-interleaved ([item][lane][bytes]) so that a warp's shared-memory reads are
// conflict-free.
template <class K, class V, int D, int NT, int KT = 1>
struct stage_layout {
  using kf = frag<K, D>;
  using vf = frag<V, D>;
  static constexpr int k_item = kf::k_item;
  static constexpr int k_items = kf::k_items; // per key
  static constexpr int v_item = vf::v_item;
  static constexpr int v_items = vf::v_items;

  // Data: the tile's 16 K rows, then its 16 V rows (one head's channels of a key, row_bytes
  // each), 16-byte chunks XOR-swizzled per key so that the fragment reads are conflict-free.
  static constexpr int k_row = D * kf::bits / 8;
  static constexpr int v_row = D * vf::bits / 8;
  static constexpr int k_chunks = k_row / 16;
  static constexpr int v_chunks = v_row / 16;
  static_assert(k_chunks >= 2 && v_chunks >= 2, "rows of at least 32 bytes");
  // 16-bit K and V: V operands come straight from `ldmatrix.trans` (eight keys of one chunk a
  // matrix), with no byte permutes to pair two keys' channels (H200 sm_90a, bf16 at head dim 128:
  // 32 PRMT and 8 LDS.128 a tile become 8 LDSM). Its eight rows of a matrix need eight different
  // 16-byte bank groups, so the eight keys of a group of eight get eight different swizzles; the
  // two keys a K read pairs still differ in the chunk's bit 2, as below.
  static constexpr bool ldsm_v = kf::bits == 16 && vf::bits == 16;
  // Otherwise the swizzle serves the fragment reads: a K read puts keys g (two of them) and
  // chunks 4n + i (four) in one phase of eight lanes, a V read keys 2i + x (four) and chunks
  // 8n + g (two).
  __host__ __device__ static constexpr int swizzle(int key) {
    if constexpr (ldsm_v) {
      return ((key & 1) << 2) | ((key >> 1) & 3);
    } else {
      return ((key & 1) << 2) ^ (((key >> 1) & 3) << 1);
    }
  }
  // Byte offset in a row region of byte `offset` of key `key`'s row. Rows shorter than the 128
  // bytes of the 32 banks (int4 at head dims 64 and 128, 8-bit at 64) are also permuted: a V read
  // takes keys 2i + x of the four i in one phase, and their rows (every 64 or 128 bytes) began on
  // the same banks, which no swizzle inside a row could part (Nsight Compute, int4 at head dim
  // 128: 8 of a tile's 51 shared wavefronts were these conflicts). Keys with bit 2 set trade rows
  // with their neighbour, so the four start on four (32-byte rows) or two (64-byte) bank groups;
  // the copies and the K reads still cover whole aligned 128 bytes a phase.
  template <int Chunks, int Row>
  __host__ __device__ static constexpr int at(int key, int offset) {
    const int slot = Row < 128 ? key ^ ((key >> 2) & 1) : key;
    return slot * Row + (((offset / 16) ^ (swizzle(key) & (Chunks - 1))) * 16) + offset % 16;
  }
  // The fragment reads of thread (g, i) = (lane / 4, lane % 4), as offsets in the K and V row
  // regions: K item `it` of key g + 8 tk, and V item `it` of key 2i + (tv & 1) + 8 (tv >> 1). The
  // kernel reads there, and reads_conflict_free checks these same offsets.
  __host__ __device__ static constexpr int k_read(int g, int i, int tk, int it) {
    return at<k_chunks, k_row>(g + 8 * tk, (4 * it + i) * k_item);
  }
  __host__ __device__ static constexpr int v_read(int g, int i, int tv, int it) {
    return at<v_chunks, v_row>(2 * i + (tv & 1) + 8 * (tv >> 1), (8 * it + g) * v_item);
  }
  // With ldsm_v, lane l's row address for m-tile j's `ldmatrix.x4.trans`: matrix l / 8 (keys 0-7
  // of chunk 2j, of chunk 2j + 1, then keys 8-15 of each), row l % 8 of it.
  __host__ __device__ static constexpr int v_ldsm_read(int lane, int j) {
    const int block = lane / 8;
    return at<v_chunks, v_row>(lane % 8 + 8 * (block >> 1), (2 * j + (block & 1)) * 16);
  }
  // Whether a warp's read of `Bytes` a lane (4, 8 or 16) at byte `addr(lane)` takes one shared
  // memory wavefront a phase: the lanes are served 128 / Bytes at a time, and a phase is
  // conflict-free when no bank holds two different words of it.
  template <int Bytes, class Addr>
  static constexpr bool conflict_free(Addr addr) {
    for (int first = 0; first < 32; first += 128 / Bytes) {
      int word_of_bank[32] = {};
      for (int& w : word_of_bank) {
        w = -1;
      }
      for (int lane = first; lane < first + 128 / Bytes; ++lane) {
        for (int k = 0; k < Bytes / 4; ++k) {
          const int word = addr(lane) / 4 + k;
          if (word_of_bank[word % 32] >= 0 && word_of_bank[word % 32] != word) {
            return false;
          }
          word_of_bank[word % 32] = word;
        }
      }
    }
    return true;
  }
  // The fragment reads of a step (the kernel's lds calls below), each conflict-free.
  static constexpr bool reads_conflict_free() {
    for (int tk = 0; tk < 2; ++tk) {
      for (int it = 0; it < k_items; ++it) {
        if (!conflict_free<k_item>([&](int lane) { return k_read(lane / 4, lane % 4, tk, it); })) {
          return false;
        }
      }
    }
    if constexpr (ldsm_v) {
      // An ldmatrix reads one matrix's eight 16-byte rows a phase (lanes 8m .. 8m + 7).
      for (int j = 0; j < D / 16; ++j) {
        if (!conflict_free<16>([&](int lane) { return v_ldsm_read(lane, j); })) {
          return false;
        }
      }
    } else {
      for (int tv = 0; tv < 4; ++tv) {
        for (int it = 0; it < v_items; ++it) {
          if (!conflict_free<v_item>(
                  [&](int lane) { return v_read(lane / 4, lane % 4, tv, it); })) {
            return false;
          }
        }
      }
    }
    return true;
  }
  static_assert(reads_conflict_free(), "K and V fragment reads without bank conflicts");
  // The kernel's V reads of short rows take keys 2i + x + 8 as eight rows past keys 2i + x (two
  // offsets worked out before the loop, in their own spelling, which keeps the code they were
  // measured in), which holds because `at` repeats every eight keys: the same offsets as v_read's.
  static constexpr bool short_v_rows_repeat() {
    for (int g = 0; g < 8; ++g) {
      for (int i = 0; i < 4; ++i) {
        for (int tv = 0; tv < 4; ++tv) {
          if (v_read(g, i, tv, 0) !=
              at<v_chunks, v_row>(2 * i + (tv & 1), g * v_item) + (tv >> 1) * 8 * v_row) {
            return false;
          }
        }
      }
    }
    return true;
  }
  // Where channel `ch` of output row `row` lies in a warp's [rows][D] block of the block merge:
  // 16-byte chunks XOR-swizzled by the row, so that a warp's stores of its rows spread over all
  // banks, while the merge still reads four consecutive channels as one 16-byte load. Row bits 1,
  // 2 and 3 flip chunk bits a, b and b + 1 (`red_swizzle` packs a and b), the first pair in the
  // order below that leaves every store of the kernel conflict-free. Most kernels store four
  // consecutive channels a lane, the lanes of a row 32 to 64 bytes apart, and the first pair
  // (chunk bits 0, 1, 2) serves the 8-bit and int4 kernels at head dim 128 (unswizzled, a
  // store's lanes fell on 2 of the 8 bank groups, and int4's, stored a float at a time, were
  // 16-way conflicted). The ldmatrix kernels store a float at a time (channels 8mm + g of rows
  // 2i + c); with that pair, rows 2i of i = 0, 1 (and 2, 3) fell on the same eight banks, two
  // wavefronts a store (Nsight Compute, bf16 B=1: 32 of a warp's stores).
  __host__ __device__ static constexpr int red_at_by(int swz, int row, int ch) {
    const int x = row >> 1;
    const int a = swz & 7;
    const int b = swz >> 3;
    const int flip = (((x & 1) << a) ^ (((x >> 1) & 1) << b) ^ (((x >> 2) & 1) << (b + 1))) * 4;
    return row * D + (ch ^ (flip & (D - 1)));
  }
  // The merge's stores of thread (g, i) = (lane / 4, lane % 4), in `red_at`'s coordinates: row
  // 2i + c of a query tile (the tile's first row added), and at store `n` channel 8n + g (the
  // ldmatrix kernels, a float a store) or the four channels from vf::v_abs(g, 4n) (a float4). The
  // kernel stores there, and stores_conflict_free checks these same places.
  __host__ __device__ static constexpr int red_store_row(int i, int c) { return 2 * i + c; }
  __host__ __device__ static constexpr int red_store_ch(int g, int n) {
    if constexpr (ldsm_v) {
      return 8 * n + g;
    } else {
      return vf::v_abs(g, 4 * n);
    }
  }
  // Whether the merge's stores of a warp's outputs (rows 2i + c of a query tile) are each
  // conflict-free with this swizzle.
  static constexpr bool stores_conflict_free(int swz) {
    for (int c = 0; c < 2; ++c) {
      if constexpr (ldsm_v) {
        for (int mm = 0; mm < D / 8; ++mm) {
          if (!conflict_free<4>([&](int lane) {
                return 4 * red_at_by(swz, red_store_row(lane % 4, c), red_store_ch(lane / 4, mm));
              })) {
            return false;
          }
        }
      } else {
        for (int q = 0; q < D / 32; ++q) {
          if (!conflict_free<16>([&](int lane) {
                return 4 * red_at_by(swz, red_store_row(lane % 4, c), red_store_ch(lane / 4, q));
              })) {
            return false;
          }
        }
      }
    }
    return true;
  }
  static constexpr int pick_red_swizzle() {
    for (int b = 1; b < 4; ++b) {
      for (int a = 0; a < 4; ++a) {
        if (a != b && stores_conflict_free(a | (b << 3))) {
          return a | (b << 3);
        }
      }
    }
    return -1;
  }
  // Whether some pair leaves the stores conflict-free: every kernel but those of an int4 V cache
  // at head dim 256, whose lanes g = 2p and 2p + 1 store channels 128 bytes apart in one row (a
  // 2-way conflict once a block, that no swizzle by the row parts; they keep the first pair).
  static constexpr int picked_red_swizzle = pick_red_swizzle();
  static constexpr bool red_stores_conflict_free = picked_red_swizzle >= 0;
  static constexpr int red_swizzle = red_stores_conflict_free ? picked_red_swizzle : 1 << 3;
  __host__ __device__ static constexpr int red_at(int row, int ch) {
    if constexpr (red_swizzle == 1 << 3) {
      // The first pair in the form its kernels were tuned with (the general one compiles to
      // other machine code).
      return row * D + (ch ^ (((row >> 1) & 7) << 2));
    } else {
      return red_at_by(red_swizzle, row, ch);
    }
  }
  // The stores were checked (stores_conflict_free) in red_at_by's form: the first pair's own
  // spelling above must be the same map.
  static constexpr bool red_at_is_checked_map() {
    for (int row = 0; row < 16; ++row) {
      for (int ch = 0; ch < D; ++ch) {
        if (red_at(row, ch) != red_at_by(red_swizzle, row, ch)) {
          return false;
        }
      }
    }
    return true;
  }
  static_assert(red_at_is_checked_map(), "the merge's map is the one its stores were checked in");

  // Then the tile's K parameter rows and its V parameter rows, [key][param_row] each, copied
  // whole per key.
  static constexpr int k_off = 0;
  static constexpr int v_off = k_off + 16 * k_row;
  static constexpr int kp_off = v_off + 16 * v_row;
  static constexpr int vp_off = kp_off + 16 * kf::param_row;
  static constexpr int bytes = (vp_off + 16 * vf::param_row + 15) / 16 * 16;
  // Resident blocks per SM (decode_blocks_per_sm, which the plan also uses) and pipeline bytes
  // per warp. Four blocks for a quantized cache (head dim up to 128, groups up to 8): 228 KB of
  // shared memory per SM, 1 KB of it reserved per block, leaves 14 KB a warp, three fp8 or int8
  // stages or five int4 ones (of which the kernel keeps three at head dim 128: decode_stages); the
  // kernel is then held to 128 registers. Otherwise two blocks with 24 KB a warp, or 16 KB when K
  // or V is int4: a third block fits where registers allow, and its warps gain more than deeper
  // stages would (H200: int4 B=128, L=32768 2.85 ms to 2.52, measured before the launcher held
  // every grid to its planned blocks, decode_held_smem; with the third block kept out, whether
  // 24 KB a warp would now serve int4 better is unmeasured). One block for a 16-bit cache at
  // head dim 256, whose 16 KB tiles would leave one stage in 24 KB: 48 KB a warp, three stages,
  // 192 KB a block (H200, bf16 at head dim 256 against two stages, 64 rows: 2.8% less time by
  // geometric mean, B=64 and 128 3-8% less, B=1, L=2048 and 8192 2-11% less; B=1, L=512 g8 5-6%
  // more, a row of 5.5 us, and B=1 and 8, L=512 g4 and B=8, L=8192 up to 1.4% more).
  // The two-tile kernel (KT = 2) runs two blocks per SM (one where the grid has at most one a
  // SM) with 24 KB a warp: at head dim 128, five or six stages of an 8-bit cache and eight of an
  // int4 one, so that two tiles or more stay in flight while a step computes two (H200, fp8 and
  // int8: 32 or 48 KB a warp 1-5% slower); int4 blocks of 2048 keys or more and fp8 blocks of
  // 8192 or more run a build that keeps four (decode_long_ring_fit). Two blocks of its 80-96 KB
  // fit, and its registers (fp8 198, int8 208, int4 184 at head dim 128) are under the cap of two.
  static constexpr int blocks_per_sm =
      KT == 2
          ? 2
          : decode_blocks_per_sm(kf::bits < vf::bits ? kf::bits : vf::bits, D, NT == 1 ? 8 : 16);
  static constexpr int warp_budget() {
    if (KT == 2) {
      return 24 * 1024;
    }
    if (blocks_per_sm == 1) {
      return 48 * 1024;
    }
    if (blocks_per_sm == 4) {
      return 14 * 1024;
    }
    return kf::bits == 4 || vf::bits == 4 ? 16 * 1024 : 24 * 1024;
  }
  static constexpr int budget = warp_budget();
  static constexpr int stages =
      (budget / bytes) < 2 ? 2 : ((budget / bytes) > 8 ? 8 : budget / bytes);
};

inline constexpr int decode_warps = 4;
// The stages of the kernel's second builds (decode_stages' `Ring`): at most four for long blocks
// (decode_long_ring_fit), two for devices that let a block opt in to less shared memory than the
// kernel's own ring takes (decode_short_ring_fit).
inline constexpr int decode_long_ring = 4;
inline constexpr int decode_short_ring = 2;

// Pipeline stages a warp keeps: stage_layout's, but at most three in the one-tile kernels of an
// int4 cache at head dim 128 with groups up to 8 (stage_layout gives five) and in every kernel of
// other than decode_warps warps: the wide kernel (int4, blocks of more warps on a grid of at most
// one block per SM) and the narrow build (decode_narrow_fit, which has three anyway). The
// prologue, which reads the page ids and sets up the copies of every stage, is then shorter (the
// wide kernel's by 421 sm_90a instructions at head dim 128), and 16 warps an SM of three stages
// (eight in the wide kernel) still keep 60-120 KB an SM in flight; two stages would leave too
// little shared memory for the split merge. H200, int4 g32 at head dim 128 against five stages,
// each in one call, best of each row:
// - the four-warp kernel (two rounds, 80 rows, geometric mean 0.986): 8-13% faster at B=64 and
//   128, L=512 (eight tiles a warp), 2-5.5% at L=2048, 0-2.9% at the large shapes in NHD pages
//   (B=128, L=32768 g8 1767 to 1727 us), from 0.3% slower to 1.8% faster in HND pages; four
//   stages about half of that;
// - the wide kernel (three rounds): B=1, L=2048 (two tiles a warp) 3.6-5.4% faster (HND g4 5.15
//   to 4.87 us, NHD g8 5.43 to 5.15); splits of 1024 keys at L=8192 (eight tiles a warp, through
//   the benchmark's overrides) 5.6-6.9%, of 4096 at L=32768 0.8-2.5%.
// The wide kernels at head dim 64 and at groups over 8 take the same rule, unmeasured.
//
// `Ring`, where it is not 0: a second build of the kernel that keeps at most that many stages,
// decode_long_ring for long blocks (decode_long_ring_fit) or decode_short_ring for devices with
// less shared memory a block (decode_short_ring_fit).
template <class K, class V, int D, int NT, int KT = 1, int W = decode_warps, int Ring = 0>
constexpr int decode_stages() {
  constexpr int ring = stage_layout<K, V, D, NT, KT>::stages;
  if constexpr (Ring > 0) {
    return ring > Ring ? Ring : ring;
  }
  constexpr bool int4_one_tile =
      KT == 1 && D == 128 && NT == 1 && frag<K, D>::bits == 4 && frag<V, D>::bits == 4;
  return (W != decode_warps || int4_one_tile) && ring > 3 ? 3 : ring;
}

template <class K, class V, int D, int NT, int KT = 1, int W = decode_warps, int Ring = 0>
constexpr int decode_smem_bytes() {
  using sl = stage_layout<K, V, D, NT, KT>;
  constexpr int pipeline = W * decode_stages<K, V, D, NT, KT, W, Ring>() * sl::bytes;
  // The warps' states for the block's merge.
  constexpr int merge = W * NT * 8 * (D + 2) * 4;
  return pipeline > merge ? pipeline : merge;
}

// A launch whose splits merge in a thread block cluster gives each block a mailbox after the
// rest of its shared memory: an mbarrier, then the partial outputs that the cluster's blocks push
// to it (float4 each: every output of the group goes to one block, its owner) and their
// log2-sum-exps. Sized for the largest group of the kernel, times the block's heads (HB), and the
// most splits a cluster holds: a block owns at most ceil(outputs / splits) of them from each
// split.
template <class K, class V, int D, int NT, int KT = 1, int W = decode_warps, int Ring = 0>
constexpr int decode_mailbox_offset() {
  return (decode_smem_bytes<K, V, D, NT, KT, W, Ring>() + 127) / 128 * 128;
}
// Bytes one split sends an owner per output: the float4 and its log2-sum-exp.
inline constexpr int decode_mailbox_entry_bytes = 4 * 4 + 4;
template <int D, int NT, int HB = 1>
constexpr int decode_mailbox_bytes() {
  constexpr int outputs = HB * NT * 8 * (D / 4);
  return 16 + ((outputs + decode_plan::max_cluster_splits - 1) * decode_mailbox_entry_bytes + 15) /
                  16 * 16;
}
template <class K, class V, int D, int NT, int KT = 1, int W = decode_warps, int Ring = 0,
          int HB = 1>
constexpr int decode_cluster_smem_bytes() {
  return decode_mailbox_offset<K, V, D, NT, KT, W, Ring>() + decode_mailbox_bytes<D, NT, HB>();
}

// Whether the head-split build exists for these codecs, order and shapes: the one-tile kernel of
// decode_warps warps, each taking one of decode_plan::head_split_heads KV heads, for int4 K and V
// in NHD pages at head dim 128 with groups up to 8 (the plans that choose it:
// kvkit::detail::head_split_cache).
template <class Layout, int D, int NT>
constexpr bool decode_head_split_fit() {
  return frag<typename Layout::k_codec, D>::bits == 4 &&
         frag<typename Layout::v_codec, D>::bits == 4 && D == 128 && NT == 1 &&
         Layout::order == kv_order::nhd && decode_warps == decode_plan::head_split_heads;
}

// Whether the two-tile kernel serves these codecs and shapes: fp8, int8 and int4 caches (K and V
// of one width; H200, B=1, L=2048: fp8 7-13% faster, int8 13-17%; int4 at one wave of two blocks
// per SM, 5-18%; bf16 was 2-10% slower with its 255 registers), at head dims up to 128 with groups
// up to 8 heads, where the registers hold both tiles' operands without spilling, and with a ring
// that holds two steps of two tiles (its 24 KB a warp keeps the block's shared memory under 100
// KB).
template <class K, class V, int D, int NT>
constexpr bool decode_two_tiles_fit() {
  return frag<K, D>::bits == frag<V, D>::bits && frag<K, D>::bits <= 8 && D <= 128 && NT == 1 &&
         stage_layout<K, V, D, NT, 2>::stages >= 4;
}

// Whether the launcher runs long blocks (decode_long_block_keys) on a second build of the two-tile
// kernel that keeps at most four stages (decode_stages' `Ring`, decode_long_ring): an int4 cache,
// or an 8-bit one without per-token scales (fp8), at head dim 128, where the kernel otherwise keeps
// eight stages (int4) or six (fp8). A warp of such a block takes 32 tiles or more, and with four
// stages each step waits for its own two tiles' copies with none of the next step's in flight; with
// eight, a short block's warps have all their tiles in flight from the prologue. H200, this build
// against the single one in one call, three rounds, best of each:
// - int4 g32, blocks of 2048 keys: 4.5-5.8% faster at B=32, L=2048 (whole sequences, NHD and HND
//   pages; NHD g4 31.44 to 29.65 us) and 1.3-4.1% at B=8, L=8192 (four splits, NHD pages),
//   9.3-9.6% at B=32, L=2048 with pages of one token. Four stages for every block were tried
//   before and lost at shorter blocks: 256 keys (B=1, L=8192) 3.7-4.8% slower, 1024 (B=1,
//   L=32768) from 3.2% faster to 1.6% slower.
// - fp8 e4m3, whole sequences at B=32 (two calls): L=8192 and 32768 1.6-2.5% faster in NHD pages,
//   0.6-1.1% in HND pages; at L=2048 within 0.5% either way, so fp8 takes it from 8192 keys.
//   int8 (scaled per token) was 0.4-2.1% slower with four stages at most of its shapes of 2048
//   keys or more and keeps its five.
template <class K, class V, int D, int NT>
constexpr bool decode_long_ring_fit() {
  return decode_two_tiles_fit<K, V, D, NT>() && D == 128 &&
         (frag<K, D>::bits == 4 || (!frag<K, D>::per_token && !frag<V, D>::per_token)) &&
         stage_layout<K, V, D, NT, 2>::stages > decode_long_ring;
}
// Keys a block takes from which decode_long_ring_fit's caches run the four-stage build.
template <class K>
inline constexpr std::int32_t decode_long_block_keys = frag<K, 128>::bits == 4 ? 2048 : 8192;
// Keys from which an fp8 plan's splits, launched two at a time as one block (the launcher's
// paired grid), run the four-stage build while the sequences stay split. Lower than
// decode_long_block_keys: whole sequences of 2048 keys gained nothing from four stages (within
// 0.5% either way), where splits of 1024 paired to 2048 gained 1-3% over the six-stage build.
inline constexpr std::int32_t decode_paired_block_keys = decode_plan::two_tiles_min_keys;

// The least shared memory any device of compute capability 8.0 or later lets a block opt in to:
// 99 KB (8.6, 8.9 and 12.x; 8.0 allows 163 KB, 9.0 and 10.0 227 KB).
inline constexpr std::int32_t decode_least_smem_optin = 99 * 1024;

// Shared memory of the one-tile kernel's build of decode_short_ring stages (blocks of
// decode_warps warps).
template <class K, class V, int D, int NT>
constexpr int decode_short_ring_bytes() {
  return decode_smem_bytes<K, V, D, NT, 1, decode_warps, decode_short_ring>();
}

// Whether the one-tile kernel of four-warp blocks has a second build of decode_short_ring stages
// for devices that let a block opt in to less shared memory than the kernel's own ring takes:
// where that ring takes more than decode_least_smem_optin and two stages take less. Those are the
// 16-bit caches at head dim 256: three stages, 192 KB a block, where an A100 allows 163 KB; two
// take 128 KB.
template <class K, class V, int D, int NT>
constexpr bool decode_short_ring_fit() {
  return decode_smem_bytes<K, V, D, NT>() > decode_least_smem_optin &&
         decode_short_ring_bytes<K, V, D, NT>() < decode_smem_bytes<K, V, D, NT>();
}

// Warps in a block of the narrow build of the one-tile kernel: two, each with the kernel's own
// stages (three at most: decode_stages), for the caches whose short ring still takes more shared
// memory than decode_least_smem_optin. Those are the 16-bit caches at head dim 256: two warps of
// three 16 KB stages take 96 KB a block, where devices of compute capability 8.6, 8.9 and 12.x
// allow 99 KB (L4, L40S, A10, RTX 3090 to 5090). Such a device holds one block an SM, as the plan
// cuts these grids for (decode_blocks_per_sm), and its bandwidth an SM is a third of the H200's or
// less, which two warps with two 16 KB tiles each in flight (64 KB an SM) are meant to keep busy
// (not measured: no such device has run it). With a cluster merge's mailboxes the build takes
// 106-116 KB, so there its splits merge through the workspace.
inline constexpr int decode_narrow_warps = 2;
template <class K, class V, int D, int NT>
constexpr bool decode_narrow_fit() {
  return decode_short_ring_fit<K, V, D, NT>() &&
         decode_least_smem_optin < decode_short_ring_bytes<K, V, D, NT>() &&
         decode_smem_bytes<K, V, D, NT, 1, decode_narrow_warps>() <= decode_least_smem_optin;
}

// The builds of the one-tile kernel that the launcher chooses between by the device's shared
// memory a block (decode_build_for).
enum class decode_build : std::uint8_t {
  own,        // four warps, the kernel's own ring
  short_ring, // four warps, decode_short_ring stages (decode_short_ring_fit)
  narrow,     // decode_narrow_warps warps (decode_narrow_fit)
};
// The build the launcher runs on a device that lets a block opt in to `smem_optin` bytes of shared
// memory (0 where the device's limit is unknown): the own ring where it fits (or no other build
// exists), else the short ring where that fits, else the narrow build (which fits every device of
// compute capability 8.0 or later).
template <class K, class V, int D, int NT>
constexpr decode_build decode_build_for(std::int32_t smem_optin) {
  if (decode_narrow_fit<K, V, D, NT>() && smem_optin < decode_short_ring_bytes<K, V, D, NT>()) {
    return decode_build::narrow;
  }
  if (decode_short_ring_fit<K, V, D, NT>() && decode_smem_bytes<K, V, D, NT>() > smem_optin) {
    return decode_build::short_ring;
  }
  return decode_build::own;
}

// Blocks per multiprocessor that a kernel's grids are cut for and its registers are held to:
// stage_layout's for blocks of decode_warps warps, one for the wide blocks (small grids) and the
// narrow ones (devices that hold one such block an SM).
template <class K, class V, int D, int NT, int KT, int W>
inline constexpr int decode_planned_blocks =
    W == decode_warps ? stage_layout<K, V, D, NT, KT>::blocks_per_sm : 1;

// `HB`: KV heads a block takes, 1 or decode_plan::head_split_heads (a head a warp: the head-split
// build, decode_head_split_fit).
template <class Layout, class T, int D, int NT, int KT, int W, int Ring, int HB = 1>
__global__ void __launch_bounds__(
    W * 32, decode_planned_blocks<typename Layout::k_codec, typename Layout::v_codec, D, NT, KT, W>)
    paged_decode_kernel(const decode_params<Layout, T> p) {
  using K = typename Layout::k_codec;
  using V = typename Layout::v_codec;
  using kf = frag<K, D>;
  using vf = frag<V, D>;
  using sl = stage_layout<K, V, D, NT, KT>;
  using kmma = typename kf::mma_t;
  using vmma = typename vf::mma_t;
  constexpr int stages = decode_stages<K, V, D, NT, KT, W, Ring>();
  constexpr int ksteps = D / 16;
  constexpr float log2e = 1.4426950408889634F;
  // The stages start on a 128-byte boundary. A 16-byte static flag once sat before them, which
  // put every stage 16 bytes off that boundary, and the copies into them lost 12-15% of the
  // bandwidth (H200, bf16: B=64, L=8192 567 us, 485 us with the same flag and the stages aligned;
  // B=128, L=32768 4.38 ms against 3.76). So the kernel has no static shared memory, and the
  // alignment is stated as well.
  extern __shared__ __align__(128) uint4 smem_raw[];

  // The merges scale every output by the thread's own V scale, which blocks of several heads
  // would apply to the other heads' rows too: the head-split build is for caches without one.
  static_assert(HB == 1 || (HB == W && NT == 1 && !vf::static_scale),
                "a head a warp, of groups up to 8, without static V scales");
  const int split = static_cast<int>(blockIdx.x);
  const int b = static_cast<int>(blockIdx.z);
  const int warp = static_cast<int>(threadIdx.x) / 32;
  // The block's first KV head, and the warp's: in the head-split build each warp takes its own
  // head over all of the split's keys (HB > 1), otherwise the warps share one head's keys.
  const int h_block = static_cast<int>(blockIdx.y) * HB;
  const int h = HB > 1 ? h_block + warp : h_block;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int g = lane / 4;
  const int i = lane % 4;
  if (b >= p.table.batch_size) {
    return;
  }
  // A launch whose splits may merge in a cluster gives each block a mailbox
  // (decode_cluster_smem_bytes): its mbarrier is set up first thing, and the cluster barrier that
  // tells the other blocks so is arrived at (relaxed: the fence orders the setup before thread
  // 0's arrival, and nothing else needs ordering; a release arrival waited for the block's
  // earlier memory operations, on the chain to the first tiles). Blocks whose splits do merge in
  // the cluster wait on it once the prologue's copies are in flight; the others never read it.
  std::uint64_t* const mailbox = reinterpret_cast<std::uint64_t*>(
      reinterpret_cast<char*>(smem_raw) + decode_mailbox_offset<K, V, D, NT, KT, W, Ring>());
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (p.cluster) {
    if (threadIdx.x == 0) {
      ::cuda::ptx::mbarrier_init(mailbox, 1U);
      ::cuda::ptx::fence_mbarrier_init(::cuda::ptx::sem_release, ::cuda::ptx::scope_cluster);
    }
    ::cuda::ptx::barrier_cluster_arrive(::cuda::ptx::sem_relaxed);
  }
#endif
  // Launched as a programmatic dependent of the kernel before it on the stream
  // (decode_args::dependent_launch), this grid is placed while that kernel's grid retires: no
  // block reads memory that kernel may write before it has finished and its writes are visible
  // (griddepcontrol.wait; a no-op in an ordinary launch). That is every read, or with
  // decode_args::page_table_ready every read but the page table's, which then overlap the wait.
  const auto wait_for_dependency = [] {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
  };
  // This thread's relative K channels of head tile nt, row g, two to a word: each of its K items
  // is a run of whole 16-byte pieces of the query row (kf::k_abs), read 16 bytes at a time
  // (validate requires 16-byte aligned queries; a row is D elements).
  constexpr int item_words = kf::k_item_channels * static_cast<int>(sizeof(T)) / 4;
  std::uint32_t qw[NT][kf::k_items * item_words];
  const auto load_queries = [&] {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int head = nt * 8 + g;
      const T* qrow = p.q + (static_cast<std::int64_t>(b) * p.num_q_heads + h * p.group + head) * D;
#pragma unroll
      for (int n = 0; n < kf::k_items; ++n) {
#pragma unroll
        for (int v = 0; v < item_words / 4; ++v) {
          const uint4 x = head < p.group ? *reinterpret_cast<const uint4*>(
                                               qrow + (4 * n + i) * kf::k_item_channels + 8 * v)
                                         : make_uint4(0U, 0U, 0U, 0U);
          std::uint32_t* const w = &qw[nt][n * item_words + 4 * v];
          w[0] = x.x;
          w[1] = x.y;
          w[2] = x.z;
          w[3] = x.w;
        }
      }
    }
  };
  if (!p.page_table_ready) {
    wait_for_dependency();
  }
  // The sequence's extent, then the group's queries: their address needs no page table, so their
  // round trip to memory overlaps the page table's instead of following the first copies (H200,
  // bf16 B=1, L=2048: the queries arrived 1.3 us after the prologue's copies were issued). The
  // extent's loads go out first: they start the chain of round trips to the first tiles (H200:
  // the queries' four loads issued ahead of them made bf16 B=8, L=512 2.5% slower). Unless the
  // page table is read before the wait: then the queries follow it and the wait.
  const Layout& layout = p.layout;
  const std::int32_t first_page = p.table.indptr[b];
  const std::int32_t last_page = p.table.indptr[b + 1];
  const std::int32_t last_len = p.table.last_page_len[b];
  if (!p.page_table_ready) {
    load_queries();
  }
  const std::int32_t npages = last_page - first_page;
  const std::int32_t len = npages <= 0 ? 0 : (npages - 1) * layout.page_size() + last_len;
  if (len <= 0) {
    // Nothing to attend to (a graph-safe batch's padding). A block that read the page table
    // before its wait still waits, so that a batch of empty sequences alone, whose blocks all
    // end here, ends after the kernel before it as any other decode does.
    if (p.page_table_ready) {
      wait_for_dependency();
    }
    return;
  }
  const std::int32_t lo = p.window > 0 && len > p.window ? len - p.window : 0;
  const std::int32_t n = len - lo;
  std::int32_t chunk = p.chunk;
  {
    const std::int32_t grid_splits = static_cast<std::int32_t>(gridDim.x);
    const std::int32_t need = (n + grid_splits - 1) / grid_splits;
    const std::int32_t need_tiles =
        (need + decode_plan::tile_tokens - 1) / decode_plan::tile_tokens * decode_plan::tile_tokens;
    chunk = need_tiles > chunk ? need_tiles : chunk;
  }
  const std::int32_t nsplit = (n + chunk - 1) / chunk;
  // Whether the splits merge in the cluster (every block of it arrived at its barrier above).
  const bool cluster_merge = p.cluster && nsplit > 1;
  // A block past the sequence's splits has nothing to do (in a cluster merge, it owns no outputs
  // and only waits out the barrier it arrived at).
  if (split >= nsplit) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (cluster_merge) {
      ::cuda::ptx::barrier_cluster_wait();
    }
#endif
    return;
  }
  const std::int32_t c0 = lo + split * chunk;
  const std::int32_t c1 = c0 + chunk < len ? c0 + chunk : len;
  const std::int32_t ntiles = (c1 - c0 + 15) / 16;
  // The warp's tiles: every W-th of the split's from its own, or all of them in the head-split
  // build. (Spelled apart: the other kernels' code is the one measured with this spelling.)
  std::int32_t my_tiles = 0;
  if constexpr (HB > 1) {
    my_tiles = ntiles;
  } else {
    my_tiles = ntiles > warp ? (ntiles - warp + W - 1) / W : 0;
  }
  // The first key of the warp's tile t.
  const auto tile_start = [&](std::int32_t t) {
    if constexpr (HB > 1) {
      return c0 + t * 16;
    } else {
      return c0 + (warp + W * t) * 16;
    }
  };

  char* const warp_smem =
      reinterpret_cast<char*>(smem_raw) + static_cast<std::size_t>(warp) * stages * sl::bytes;
  // How a tile is located and its copies issued. The lean form: the copies' shared addresses
  // from one conversion here (converted at each copy, a kernel that may run in a cluster read its
  // block's rank, SR_CgaCtaId, every tile), the debug page check without a branch, and (but in
  // the one-tile 8-bit kernels, held to 128 registers, where it spilled: sm_90a, fp8 and int8 at
  // head dim 128) the rows located without a branch. H200, against the earlier form in one call,
  // 301 rows: geometric mean 0.987; int4 in HND pages 2.7-3.8% faster at the large shapes, bf16 at
  // B=1 2.2% by geometric mean (graph rows at L=2048 5.83 to 5.58 us, g4, and 6.20 to 5.93, g8).
  // The 8-bit two-tile kernels keep the earlier form: with the lean one, fp8 at B=32 from L=8192
  // ran 1-2% slower (docs/paged_decode_log.md). The lean kernels' sm_90a code is the measured one;
  // the 8-bit two-tile loops are within 7 instructions of their earlier code.
  constexpr bool lean_issue = !(kf::bits == 8 && vf::bits == 8 && KT == 2);
  [[maybe_unused]] const auto warp_smem_s =
      static_cast<std::uint32_t>(__cvta_generic_to_shared(warp_smem));

  // Page and slot of this lane's key (lane % 16) of the warp's tile t; page -1 when outside.
  struct key_loc {
    std::int32_t page = -1; // -1: outside the range (or a bad page in debug mode)
    std::int32_t slot = 0;
    const std::byte* k_row = nullptr; // the key's K and V rows of head h; null when outside
    const std::byte* v_row = nullptr; // (set only when K and V codes differ in width)
  };
  // The page id and slot of this lane's key of tile t (slot -1 and page -1 outside the range): a
  // read without a branch around it, so that the reads of several tiles can be in flight together.
  const auto page_of = [&](std::int32_t t, std::int32_t& slot) -> std::int32_t {
    const std::int32_t tok = tile_start(t) + (lane & 15);
    const bool inside = t < my_tiles && tok < c1;
    std::uint32_t pi = 0;
    std::uint32_t off = 0;
    p.page_div.divmod(static_cast<std::uint32_t>(tok), pi, off);
    slot = inside ? static_cast<std::int32_t>(off) : -1;
    return inside ? __ldg(p.table.indices + first_page + static_cast<std::int32_t>(pi)) : -1;
  };
  // The key's rows from its page id and slot as page_of gives them (and, in debug mode, the
  // check of an id inside the range). In the lean form an id the check rejects, or any negative
  // one, becomes -1 (rows null), and a rejected one sets the flag by a predicated store, not in a
  // branch around an atomic.
  constexpr bool rows_without_branch = !(kf::bits == 8 && vf::bits == 8);
  // In the one-tile kernels but int8's, a key's rows and parameter rows are located in 32-bit
  // offsets from its page's start (a page is at most 1 GiB: paged_layout::validate), each linear in
  // the key's slot with a start and a step fixed for the warp's head, and the page's start comes
  // from one 32 by 32-bit product. In 64 bits (the earlier form), sm_90a at head dim 128: 13-19
  // instructions more a tile (int4's loop 526 for 507 in NHD pages, 504 for 486 in HND; fp8's 417
  // for 399, and it spilled 8 bytes; bf16's 395 for 376). H200, against the 64-bit form in one
  // call, two rounds of all 301 rows and two more of int4's, by geometric mean: int4's one-tile
  // kernel in HND pages 2.6% faster (up to 4%), its eight-warp kernel (B=1, L <= 2048) 2.6-3.3% in
  // NHD pages, fp8 in NHD pages 0.6-1.2%; int4's one-tile kernel in NHD pages and bf16 unchanged.
  // The two-tile int4 kernel ran 1.1% slower in NHD pages (up to 4.5%) with them, and int8's
  // one-tile kernel, held to 128 registers, spilled in its loop, so those two (and the 8-bit
  // two-tile kernels) keep 64-bit offsets.
  constexpr bool narrow_offsets =
      KT == 1 && !(kf::bits == 8 && vf::bits == 8 && (kf::per_token || vf::per_token));
  [[maybe_unused]] const auto page_base = [&](std::int32_t pg) {
    return p.cache + static_cast<std::uint64_t>(static_cast<std::uint32_t>(pg)) *
                         static_cast<std::uint32_t>(p.page_bytes);
  };
  // The warp's head's rows in a page: token t's at first + t * step (paged_layout::k_rows and the
  // like), in 32 bits.
  [[maybe_unused]] const auto narrow = [](std::int64_t n) {
    return static_cast<std::uint32_t>(n);
  };
  [[maybe_unused]] const std::uint32_t k_row_at = narrow(layout.k_rows(h).first);
  [[maybe_unused]] const std::uint32_t k_row_step = narrow(layout.k_rows(h).step);
  [[maybe_unused]] const std::uint32_t v_row_at = narrow(layout.v_rows(h).first);
  [[maybe_unused]] const std::uint32_t v_row_step = narrow(layout.v_rows(h).step);
  // The parameter rows likewise (a lane < 16 reads K's, a lane >= 16 V's: `issue`).
  [[maybe_unused]] const std::uint32_t k_param_at = narrow(layout.k_param_rows(h).first);
  [[maybe_unused]] const std::uint32_t k_param_step = narrow(layout.k_param_rows(h).step);
  [[maybe_unused]] const std::uint32_t v_param_at = narrow(layout.v_param_rows(h).first);
  [[maybe_unused]] const std::uint32_t v_param_step = narrow(layout.v_param_rows(h).step);
  const auto place = [&](std::int32_t page, std::int32_t slot, key_loc& loc) {
    const bool inside = slot >= 0;
    if constexpr (lean_issue) {
      const std::uint32_t limit =
          p.page_check != nullptr ? static_cast<std::uint32_t>(p.capacity) : 0x7FFFFFFFU;
      const bool bad = inside && static_cast<std::uint32_t>(page) >= limit;
      if (bad && p.page_check != nullptr) {
        // A plain store of the same value from every thread that finds one, read by the host
        // after the launch. (As a relaxed atomic store, sm_90a: the int8 kernel spilled 20 bytes.)
        *p.page_check = 1;
      }
      page = bad ? -1 : page;
    } else if (inside && p.page_check != nullptr && (page < 0 || page >= p.capacity)) {
      atomicExch(p.page_check, 1);
      page = -1;
    }
    loc.page = page;
    loc.slot = inside ? slot : 0;
    const auto rows_of = [&](std::int32_t pg, std::int32_t in_page) {
      if constexpr (narrow_offsets) {
        const std::byte* const pb = page_base(pg);
        loc.k_row = pb + (k_row_at + static_cast<std::uint32_t>(in_page) * k_row_step);
        if constexpr (kf::bits != vf::bits) {
          loc.v_row = pb + (v_row_at + static_cast<std::uint32_t>(in_page) * v_row_step);
        }
      } else {
        const std::byte* const pb = p.cache + static_cast<std::int64_t>(pg) * p.page_bytes;
        loc.k_row =
            pb + layout.k_data_offset() + layout.element_index(in_page, h, 0) * kf::bits / 8;
        if constexpr (kf::bits != vf::bits) {
          loc.v_row =
              pb + layout.v_data_offset() + layout.element_index(in_page, h, 0) * vf::bits / 8;
        }
      }
    };
    loc.k_row = nullptr;
    loc.v_row = nullptr;
    if constexpr (rows_without_branch) {
      rows_of(page >= 0 ? page : 0, loc.slot);
      loc.k_row = page >= 0 ? loc.k_row : nullptr;
      loc.v_row = page >= 0 ? loc.v_row : nullptr;
    } else if (page >= 0) {
      rows_of(page, slot);
    }
  };

  const std::int64_t kv_gap = layout.v_data_offset() - layout.k_data_offset();
  // A parameter row's offset in its page, in 32 bits (a page is under 2 GiB: paged_layout's
  // validate). With 64-bit offsets the loop carried 64-bit sums: sm_90a code at head dim 128,
  // int4's one-tile loop 544 instructions a tile (537 in 32 bits), its two-tile loop 1006 (995).
  // H200: int4 0.5-1.1% faster at the large shapes, int8 B=64 and B=128, L=512 2% faster.
  const auto param_offset = [](std::int64_t region, std::int64_t in_region) {
    return static_cast<std::int32_t>(region) + static_cast<std::int32_t>(in_region);
  };
  // A key's K (`k_side`) or V parameter row's offset in its page: from the head's first row and
  // step where rows are located in 32 bits, else in the earlier form. Both selects are spelled
  // whole: with one codec, whose steps are one value, they fold to the select of the first rows
  // that the kernels were measured with (a step chosen outside the select changed ptxas's code for
  // every int4 kernel).
  const auto param_row_of = [&](bool k_side, std::int32_t slot) {
    if constexpr (narrow_offsets) {
      return static_cast<std::int32_t>((k_side ? k_param_at : v_param_at) +
                                       static_cast<std::uint32_t>(slot) *
                                           (k_side ? k_param_step : v_param_step));
    } else {
      return param_offset(k_side ? layout.k_param_offset() : layout.v_param_offset(),
                          k_side ? layout.template param_index<K>(slot, h, 0) * K::param_bytes
                                 : layout.template param_index<V>(slot, h, 0) * V::param_bytes);
    }
  };
  // Copies of the warp's tile (located by `page`/`slot` of lanes 0..15) into stage `st`.
  const auto issue = [&](int st, const key_loc& loc) {
    const std::int32_t page = loc.page;
    const std::int32_t slot = loc.slot;
    [[maybe_unused]] const std::uint32_t base_s =
        warp_smem_s + static_cast<std::uint32_t>(st * sl::bytes);
    // Rows: lane l copies chunks l, l + 32, ... of the tile's rows (whole rows per instruction).
    // With `both`, K and V rows have the same size and lie kv_gap bytes apart, so one shuffle of
    // a key's row serves both copies. A key outside the range reads nothing (from the cache's
    // start).
    const auto rows = [&](auto chunks_c, auto row_c, auto both_c, const std::byte* my_row,
                          int off) {
      constexpr int chunks = decltype(chunks_c)::value;
      constexpr int row = decltype(row_c)::value;
      const int first_key = lane / chunks; // chunks divides 32: rows are at most 512 bytes
      const int chunk = lane % chunks;
#pragma unroll
      for (int n = 0; n < chunks / 2; ++n) {
        const int key = first_key + n * (32 / chunks);
        const auto r = reinterpret_cast<const std::byte*>(
            __shfl_sync(0xFFFFFFFFU, reinterpret_cast<unsigned long long>(my_row), key));
        const bool valid = r != nullptr;
        const std::byte* const src = (valid ? r : p.cache) + chunk * 16;
        if constexpr (lean_issue) {
          // int4 rows of NHD pages lie between the neighbouring heads' rows of the same key, which
          // other blocks of the grid read at about the same time, so they are fetched into L2 256
          // bytes at a time: at head dim 128 (64-byte rows) in every kernel, at 64 (32-byte rows)
          // in the four-warp kernels. Against plain copies (H100 unless named; each run is in
          // docs/paged_decode_log.md):
          // - head dim 128: the two-tile and eight-warp kernels, int4 g32 B=8, L=8192 8.7-10.4%
          //   faster; the one-tile kernel on plain copies 5.6-27% slower from B=8, L=32768 and
          //   B=32, L=8192, and with these fetches 3.3-13.4% faster from B=64 (H200) than with the
          //   L2 prefetch a step early (`prefetch.global.L2`) that it had before;
          // - head dim 64: the one-tile kernel 30-38% faster than that prefetch from B=64, the
          //   two-tile kernel 0.65% faster by geometric mean (B=1, L=8192 2% slower), the
          //   eight-warp kernel (B=1, L=2048) no clear gain, so it keeps plain copies;
          // - head dim 256 (128-byte rows): plain copies; the fetches ran up to 4% slower than the
          //   prefetch in the one-tile kernel and 0.7-3.5% slower than plain copies in the
          //   eight-warp kernel.
          // Tried wider and lost: fp8 and int8 (128-byte rows) up to 9.5% slower from L=8192 at
          // B=8 and 128, and the one-tile kernel with both the prefetch and these fetches, 3-17.5%.
          constexpr bool l2_wide = kf::bits == 4 && vf::bits == 4 &&
                                   (D == 128 || (D == 64 && W == decode_warps)) &&
                                   Layout::order == kv_order::nhd;
          const int at = sl::template at<chunks, row>(key, chunk * 16);
          cp_async_to<16, l2_wide>(base_s + static_cast<std::uint32_t>(off + at), src, valid);
          if constexpr (decltype(both_c)::value) {
            cp_async_to<16, l2_wide>(base_s + static_cast<std::uint32_t>(sl::v_off + at),
                                     src + kv_gap, valid);
          }
        } else {
          // The earlier form, spelled as it was (other spellings, even an unused variable, change
          // ptxas's code for the lean kernels or these).
          char* const base = warp_smem + st * sl::bytes;
          cp_async<16>(base + off + sl::template at<chunks, row>(key, chunk * 16), src, valid);
          if constexpr (decltype(both_c)::value) {
            cp_async<16>(base + sl::v_off + sl::template at<chunks, row>(key, chunk * 16),
                         src + kv_gap, valid);
          }
        }
      }
    };
    if constexpr (kf::bits == vf::bits) {
      rows(std::integral_constant<int, sl::k_chunks>{}, std::integral_constant<int, sl::k_row>{},
           std::true_type{}, loc.k_row, sl::k_off);
    } else {
      rows(std::integral_constant<int, sl::k_chunks>{}, std::integral_constant<int, sl::k_row>{},
           std::false_type{}, loc.k_row, sl::k_off);
      rows(std::integral_constant<int, sl::v_chunks>{}, std::integral_constant<int, sl::v_row>{},
           std::false_type{}, loc.v_row, sl::v_off);
    }
    // Scales and zero points: lane l < 16 copies the K parameter row of key l, lane 16 + l the V
    // row, in copies of up to 16 bytes (a row is 4 to 32 bytes and aligned to its size up to 16).
    // Each lane's own key, so no shuffle; a key outside the range gets zeros (and reads nothing,
    // from the cache's start).
    const auto params = [&](auto row_c, int dst, std::int32_t src_off) {
      constexpr int row = decltype(row_c)::value;
      constexpr int piece = row < 16 ? row : 16;
      const bool valid = page >= 0;
      const std::byte* src = nullptr;
      if constexpr (narrow_offsets) {
        src = valid ? page_base(page) + static_cast<std::uint32_t>(src_off) : p.cache;
      } else {
        src = valid ? p.cache + static_cast<std::int64_t>(page) * p.page_bytes + src_off : p.cache;
      }
#pragma unroll
      for (int n = 0; n < row / piece; ++n) {
        if constexpr (lean_issue) {
          cp_async_to<piece>(base_s + static_cast<std::uint32_t>(dst + n * piece), src + n * piece,
                             valid);
        } else {
          char* const base = warp_smem + st * sl::bytes;
          cp_async<piece>(base + dst + n * piece, src + n * piece, valid);
        }
      }
    };
    if constexpr (std::is_same_v<K, V> && kf::param_row > 0) {
      // One codec: the V rows follow the K rows in the stage, and one copy serves both halves of
      // the warp.
      params(std::integral_constant<int, kf::param_row>{}, sl::kp_off + lane * kf::param_row,
             param_row_of(lane < 16, slot));
    } else {
      if constexpr (kf::param_row > 0) {
        if (lane < 16) {
          params(std::integral_constant<int, kf::param_row>{}, sl::kp_off + lane * kf::param_row,
                 param_row_of(true, slot));
        }
      }
      if constexpr (vf::param_row > 0) {
        if (lane >= 16) {
          params(std::integral_constant<int, vf::param_row>{},
                 sl::vp_off + (lane - 16) * vf::param_row, param_row_of(false, slot));
        }
      }
    }
  };

  // Prologue: the page ids of the first `stages` tiles read together (one round trip to memory,
  // not one per tile: the copies' asm orders every later read after them), then the first
  // stages-KT tiles in flight, and the next KT tiles' pages located. The loop takes KT tiles a
  // step; where the warp's tiles are not a multiple of KT, the last step's extra tile is copied as
  // zeros (its page is -1) and its keys are masked like any key past the range.
  const std::int32_t my_steps = (my_tiles + KT - 1) / KT;
  const std::int32_t loop_tiles = my_steps * KT;
  // How the loop locates its next tiles (`next`, `next_id` below): their rows are placed (and, in
  // debug mode, the ids checked) only when their copies are issued, a step after the ids are read:
  // placed at once, each step waited there for its id's round trip to memory (H200, bf16 B=1: the
  // loop's most sampled stall).
  std::int32_t first_ids[stages];
  std::int32_t first_slots[stages];
#pragma unroll
  for (int t = 0; t < stages; ++t) {
    first_ids[t] = page_of(t, first_slots[t]);
  }
  // The prologue's copies of the warp's tile t (nothing past the warp's steps), one group a tile.
  const auto start_tile = [&](int t) {
    key_loc loc;
    place(first_ids[t], first_slots[t], loc);
    if (t < loop_tiles) {
      issue(t, loc);
    }
    cp_async_commit();
  };
  // With cache_early, the first tiles whose keys all lie before the sequence's last page are
  // copied before the wait, in order, up to the first that does not.
  int early = 0;
  if (p.cache_early) {
    const std::int32_t last_page_start = (npages - 1) * layout.page_size();
#pragma unroll
    for (int t = 0; t < stages - KT; ++t) {
      // Spelled out rather than tile_start(t) + 16: written that way, ptxas scheduled this
      // prologue differently (its sm_90a code was compared, not its speed).
      const std::int32_t tile_end = HB > 1 ? c0 + t * 16 + 16 : c0 + (warp + W * t) * 16 + 16;
      if (early == t && t < loop_tiles && tile_end <= last_page_start) {
        start_tile(t);
        early = t + 1;
      }
    }
  }
  if (p.page_table_ready) {
    wait_for_dependency();
    load_queries();
  }
  float k_static = 1.0F;
  float v_static = 1.0F;
  if constexpr (kf::static_scale) {
    k_static = p.static_scales[h];
  }
  if constexpr (vf::static_scale) {
    v_static = p.static_scales[layout.num_kv_heads() + h];
  }
  const float logit_scale = p.scale * k_static;
  const bool capped = p.soft_cap > 0.0F;
  const float inv_cap = capped ? 1.0F / p.soft_cap : 0.0F;
#pragma unroll
  for (int t = 0; t < stages - KT; ++t) {
    if (t >= early) {
      start_tile(t);
    }
  }
  key_loc next[KT];
  std::int32_t next_id[KT];
  std::int32_t next_slot[KT];
#pragma unroll
  for (int k = 0; k < KT; ++k) {
    next_id[k] = first_ids[stages - KT + k];
    next_slot[k] = first_slots[stages - KT + k];
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // In a cluster merge, every block's mailbox is set up (each block arrived as it started):
  // waited for here, while the first tiles are in flight, and not after the loop, where the wait
  // cost its latency again.
  if (cluster_merge) {
    ::cuda::ptx::barrier_cluster_wait();
  }
#endif

  // The queries as K-side operands: head tile nt, row g, slots of this thread's channels (the
  // words as read where they pair the slots' channels in the MMA's type already).
  std::uint32_t qf[NT][D / 8];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
    for (int s = 0; s < D / 8; ++s) {
      const int r0 = kf::k_channel(s, 0);
      const int r1 = kf::k_channel(s, 1);
      if (std::is_same_v<T, kmma> && r0 % 2 == 0 && r1 == r0 + 1) {
        qf[nt][s] = qw[nt][r0 / 2];
      } else {
        qf[nt][s] = narrow_pair<kmma>(widen_half<T>(qw[nt][r0 / 2], r0 % 2),
                                      widen_half<T>(qw[nt][r1 / 2], r1 % 2));
      }
    }
  }

  float o[NT][ksteps][4];
  float m[NT][2];
  float l[NT][2];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
    for (int j = 0; j < ksteps; ++j) {
      o[nt][j][0] = o[nt][j][1] = o[nt][j][2] = o[nt][j][3] = 0.0F;
    }
    m[nt][0] = m[nt][1] = -INFINITY;
    l[nt][0] = l[nt][1] = 0.0F;
  }

  // Where a stage holds this thread's V items of keys 2i and 2i + 1 (those of keys 2i + 8 and
  // 2i + 9 lie eight rows further), for rows that `at` permutes: worked out once, so that the loop
  // adds only the stage's base.
  [[maybe_unused]] const int v_read0 =
      sl::v_off + sl::template at<sl::v_chunks, sl::v_row>(2 * i, g * sl::v_item);
  [[maybe_unused]] const int v_read1 =
      sl::v_off + sl::template at<sl::v_chunks, sl::v_row>(2 * i + 1, g * sl::v_item);
  int read_stage = 0;
  int write_stage = stages - KT;
  // Stage `stage + kt` of the ring (stage < stages, kt < KT). The forms for kt = 0 here and for
  // KT = 1 below are those of the one-tile kernel before KT existed, whose machine code they keep
  // (the general forms compile to more instructions there).
  const auto ring = [](int stage, int kt) {
    return kt == 0 ? stage : (stage + kt >= stages ? stage + kt - stages : stage + kt);
  };
  for (std::int32_t u = 0; u < my_steps; ++u) {
    const std::int32_t t = u * KT; // the step's first tile
    cp_async_wait<stages - 2 * KT>();
    __syncwarp(); // the step's rows were copied by every lane of the warp
    std::uint32_t kw[KT][2][kf::k_words];
    std::uint32_t vw[KT][4][vf::v_words];
    std::uint32_t va[KT][sl::ldsm_v ? ksteps : 1][4]; // ldsm_v: m-tile j's A operand
    std::uint32_t kp[KT][2][kf::k_param_words > 0 ? kf::k_param_words : 1];
    std::uint32_t vp[KT][4];
#pragma unroll
    for (int kt = 0; kt < KT; ++kt) {
      const char* const st = warp_smem + ring(read_stage, kt) * sl::bytes;
#pragma unroll
      for (int tk = 0; tk < 2; ++tk) {
#pragma unroll
        for (int it = 0; it < sl::k_items; ++it) {
          lds<sl::k_item>(st + sl::k_off + sl::k_read(g, i, tk, it),
                          &kw[kt][tk][it * sl::k_item / 4]);
        }
#pragma unroll
        for (int w = 0; w < kf::k_param_words; ++w) {
          lds<4>(st + sl::kp_off + (g + 8 * tk) * kf::param_row + kf::k_group(w, i) * 4,
                 &kp[kt][tk][w]);
        }
      }
#pragma unroll
      for (int tv = 0; tv < 4; ++tv) {
        vp[kt][tv] = 0;
      }
      if constexpr (sl::ldsm_v) {
        // Blocks of m-tile j: keys 0-7 of chunk 2j, keys 0-7 of chunk 2j + 1, then keys 8-15 of
        // each (the A operand's a0..a3: rows g and g + 8, keys 2i and 2i + 8).
#pragma unroll
        for (int j = 0; j < ksteps; ++j) {
          ldsm_x4_trans(st + sl::v_off + sl::v_ldsm_read(lane, j), va[kt][j]);
        }
      } else if constexpr (sl::v_row < 128) {
        static_assert(sl::v_items == 1, "a short row's V item is the thread's whole V share");
        static_assert(sl::short_v_rows_repeat(), "keys 2i + x + 8 lie eight rows past 2i + x");
#pragma unroll
        for (int tv = 0; tv < 4; ++tv) {
          lds<sl::v_item>(st + ((tv & 1) != 0 ? v_read1 : v_read0) + (tv >> 1) * 8 * sl::v_row,
                          &vw[kt][tv][0]);
        }
      } else {
#pragma unroll
        for (int tv = 0; tv < 4; ++tv) {
#pragma unroll
          for (int it = 0; it < sl::v_items; ++it) {
            lds<sl::v_item>(st + sl::v_off + sl::v_read(g, i, tv, it),
                            &vw[kt][tv][it * sl::v_item / 4]);
          }
        }
      }
      // int8: the scales of keys g and g+8 (the P rows); int4: the groups of this thread's
      // channels in the four keys of its V operands.
#pragma unroll
      for (int w = 0; w < (vf::per_token ? 2 : (vf::grouped ? 4 : 0)); ++w) {
        const int key = vf::per_token ? g + 8 * w : 2 * i + (w & 1) + 8 * (w >> 1);
        lds<4>(st + sl::vp_off + key * vf::param_row + vf::v_group(g) * 4, &vp[kt][w]);
      }
    }

    // The tiles after the ones in flight go out before this step's arithmetic, into the stages
    // the previous step read.
#pragma unroll
    for (int kt = 0; kt < KT; ++kt) {
      if (t + stages - KT + kt < loop_tiles) {
        place(next_id[kt], next_slot[kt], next[kt]);
        issue(ring(write_stage, kt), next[kt]);
      }
      cp_async_commit();
    }
#pragma unroll
    for (int kt = 0; kt < KT; ++kt) {
      next_id[kt] = page_of(t + stages + kt, next_slot[kt]);
    }
    if constexpr (KT == 1) {
      read_stage = read_stage + 1 == stages ? 0 : read_stage + 1;
      write_stage = write_stage + 1 == stages ? 0 : write_stage + 1;
    } else {
      read_stage = read_stage + KT >= stages ? read_stage + KT - stages : read_stage + KT;
      write_stage = write_stage + KT >= stages ? write_stage + KT - stages : write_stage + KT;
    }

    // An int4 group of the step beyond int4_fits (a range of about 30700 or more, or a zero point
    // beyond ±16384) would overflow int4_params: then the step's int4 parameters are divided by 4
    // (by 32 where a scale reaches 8192) and its logits (K) or probabilities (V) multiplied by the
    // same in float, which gives the same attention. One max a parameter word, and a vote, a step.
    bool scaled = false;
    float undo = 1.0F; // what the step's int4 parameters were divided by
    if constexpr (kf::grouped || vf::grouped) {
      // Calls f on each int4 (scale, zero) word the step's operands read.
      const auto each_int4_word = [&](auto&& f) {
#pragma unroll
        for (int kt = 0; kt < KT; ++kt) {
          if constexpr (kf::grouped) {
#pragma unroll
            for (int tk = 0; tk < 2; ++tk) {
#pragma unroll
              for (int w = 0; w < kf::k_param_words; ++w) {
                f(kp[kt][tk][w]);
              }
            }
          }
          if constexpr (vf::grouped) {
#pragma unroll
            for (int tv = 0; tv < 4; ++tv) {
              f(vp[kt][tv]);
            }
          }
        }
      };
      std::uint32_t most = 0;
      each_int4_word([&](std::uint32_t w) { most = int4_extent(most, w); });
      scaled = __any_sync(0xFFFFFFFFU, !int4_fits(most));
      if (scaled) {
        const bool quarter = __all_sync(0xFFFFFFFFU, int4_quarter_fits(most));
        undo = quarter ? 4.0F : 32.0F;
        const std::uint32_t by = quarter ? 0x34003400U : 0x28002800U; // 1/4 or 1/32, both halves
        each_int4_word([&](std::uint32_t& w) { w = int4_scaled(w, by); });
      }
    }

    // S^T = K Q^T: rows are keys g and g+8, columns the heads 2i, 2i+1 of each head tile. The
    // even and odd k-steps accumulate apart, so the MMAs form two chains of ksteps/2 that
    // overlap instead of one of ksteps (a B=1 warp has no other warp to hide the wait behind;
    // H200: bf16 B=1, L=2048 2.5% faster). Not for int4 K, whose kernel is held to 128 registers
    // and issue-bound: 0.5-0.8% slower at the largest shapes.
    constexpr bool two_chains = kf::bits != 4;
    float s[KT][NT][4];
    float s_odd[KT][NT][4];
#pragma unroll
    for (int kt = 0; kt < KT; ++kt) {
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          s[kt][nt][e] = 0.0F;
          s_odd[kt][nt][e] = 0.0F;
        }
      }
    }
    [&]<int... S>(std::integer_sequence<int, S...>) {
      (
          [&] {
#pragma unroll
            for (int kt = 0; kt < KT; ++kt) {
              std::uint32_t a0, a1, a2, a3;
              kf::template k_operand<S>(kw[kt][0], kp[kt][0], a0, a2);
              kf::template k_operand<S>(kw[kt][1], kp[kt][1], a1, a3);
#pragma unroll
              for (int nt = 0; nt < NT; ++nt) {
                mma16816<kmma>(two_chains && S % 2 == 1 ? s_odd[kt][nt] : s[kt][nt], a0, a1, a2, a3,
                               qf[nt][2 * S], qf[nt][2 * S + 1]);
              }
            }
          }(),
          ...);
    }
    (std::make_integer_sequence<int, ksteps>{});
    if constexpr (two_chains) {
#pragma unroll
      for (int kt = 0; kt < KT; ++kt) {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            s[kt][nt][e] += s_odd[kt][nt][e];
          }
        }
      }
    }

    float key_scale[KT][2];
#pragma unroll
    for (int kt = 0; kt < KT; ++kt) {
      const std::int32_t first_key = tile_start(t + kt);
#pragma unroll
      for (int tk = 0; tk < 2; ++tk) {
        key_scale[kt][tk] = kf::grouped && scaled ? undo * logit_scale : logit_scale;
        if constexpr (kf::per_token) {
          key_scale[kt][tk] *= __uint_as_float(kp[kt][tk][0]);
        }
        if (first_key + g + 8 * tk >= c1) {
          key_scale[kt][tk] = NAN; // marks a key past the range
        }
      }
    }
    std::uint32_t pb[KT][NT][2];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      // The logits, soft-capped where the launch asks. For an int4 K cache the cap is one branch
      // around all of them (13 instructions skipped a tile when not capped: H200, int4 0.1-1.7%
      // faster at B=8 to 128); elsewhere ptxas predicates it per logit, the form kept there (the
      // branch measured fp8 at two blocks an SM 1-2% slower, bf16 within 0.2%).
      float x[KT][4];
      if constexpr (kf::bits == 4) {
#pragma unroll
        for (int kt = 0; kt < KT; ++kt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            x[kt][e] = s[kt][nt][e] * key_scale[kt][e / 2];
          }
        }
        if (capped) {
#pragma unroll
          for (int kt = 0; kt < KT; ++kt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              x[kt][e] = p.soft_cap * fast_tanh(x[kt][e] * inv_cap);
            }
          }
        }
#pragma unroll
        for (int kt = 0; kt < KT; ++kt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float ks = key_scale[kt][e / 2];
            x[kt][e] = ks == ks ? x[kt][e] * log2e : -INFINITY;
          }
        }
      } else {
#pragma unroll
        for (int kt = 0; kt < KT; ++kt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float ks = key_scale[kt][e / 2];
            float y = s[kt][nt][e] * ks;
            if (capped) {
              y = p.soft_cap * fast_tanh(y * inv_cap);
            }
            x[kt][e] = ks == ks ? y * log2e : -INFINITY;
          }
        }
      }
      float pr[KT][4];
      float tmax[2];
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        tmax[c] = fmaxf(x[0][c], x[0][c + 2]);
#pragma unroll
        for (int kt = 1; kt < KT; ++kt) {
          tmax[c] = fmaxf(tmax[c], fmaxf(x[kt][c], x[kt][c + 2]));
        }
      }
      // Where no logit of the tile passes its row's running maximum by more than lazy_max_bound,
      // the maxima stay as they are and the tile skips their shuffles and the rescale: its
      // probabilities then reach 2^lazy_max_bound, which the MMA's type holds (a row's first tile,
      // whose maximum is -inf, gives +inf or NaN here and takes the other path). Not for a V cache
      // with a scale a key, which multiplies the probabilities. The shuffles sit on the chain a
      // B=1 warp waits on: H100, bf16 B=1, L=2048 2.1-2.8% faster (g4 6.37 to 6.19 us), the 30
      // other rows of bf16, fp8 and int4 measured within 1.2% either way (paged_decode_log.md, "A
      // running maximum kept without its shuffles").
      if (!vf::per_token && __all_sync(0xFFFFFFFFU, tmax[0] - m[nt][0] <= lazy_max_bound &&
                                                        tmax[1] - m[nt][1] <= lazy_max_bound)) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          float row_sum = l[nt][c];
#pragma unroll
          for (int kt = 0; kt < KT; ++kt) {
            pr[kt][c] = fast_exp2(x[kt][c] - m[nt][c]);
            pr[kt][c + 2] = fast_exp2(x[kt][c + 2] - m[nt][c]);
            row_sum = row_sum + pr[kt][c];
            row_sum = row_sum + pr[kt][c + 2];
          }
          l[nt][c] = row_sum;
        }
      } else {
        float corr[2];
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          float t = tmax[c];
          t = fmaxf(t, __shfl_xor_sync(0xFFFFFFFFU, t, 4));
          t = fmaxf(t, __shfl_xor_sync(0xFFFFFFFFU, t, 8));
          t = fmaxf(t, __shfl_xor_sync(0xFFFFFFFFU, t, 16));
          const float m_new = fmaxf(m[nt][c], t);
          const float m_use = m_new == -INFINITY ? 0.0F : m_new;
          corr[c] = fast_exp2(m[nt][c] - m_use);
          m[nt][c] = m_new;
          float row_sum = l[nt][c] * corr[c];
#pragma unroll
          for (int kt = 0; kt < KT; ++kt) {
            pr[kt][c] = fast_exp2(x[kt][c] - m_use);
            pr[kt][c + 2] = fast_exp2(x[kt][c + 2] - m_use);
            row_sum = row_sum + pr[kt][c];
            row_sum = row_sum + pr[kt][c + 2];
          }
          l[nt][c] = row_sum;
        }
        // Once the running maxima settle, most tiles change none of them: skip the rescale.
        if (__any_sync(0xFFFFFFFFU, corr[0] != 1.0F || corr[1] != 1.0F)) {
#pragma unroll
          for (int j = 0; j < ksteps; ++j) {
            o[nt][j][0] *= corr[0];
            o[nt][j][2] *= corr[0];
            o[nt][j][1] *= corr[1];
            o[nt][j][3] *= corr[1];
          }
        }
      }
#pragma unroll
      for (int kt = 0; kt < KT; ++kt) {
        if constexpr (vf::per_token) {
          const float sv0 = __uint_as_float(vp[kt][0]);
          const float sv1 = __uint_as_float(vp[kt][1]);
          pr[kt][0] *= sv0, pr[kt][1] *= sv0, pr[kt][2] *= sv1, pr[kt][3] *= sv1;
        }
        if constexpr (vf::grouped) {
          if (scaled) {
            pr[kt][0] *= undo, pr[kt][1] *= undo, pr[kt][2] *= undo, pr[kt][3] *= undo;
          }
        }
        pb[kt][nt][0] = transpose8x8(narrow_pair<vmma>(pr[kt][0], pr[kt][1]));
        pb[kt][nt][1] = transpose8x8(narrow_pair<vmma>(pr[kt][2], pr[kt][3]));
      }
    }

    // O^T += V^T P^T: rows are this thread's channels, columns the heads.
    [&]<int... J>(std::integer_sequence<int, J...>) {
      (
          [&] {
#pragma unroll
            for (int kt = 0; kt < KT; ++kt) {
              std::uint32_t a0, a1, a2, a3;
              if constexpr (sl::ldsm_v) {
                a0 = va[kt][J][0];
                a1 = va[kt][J][1];
                a2 = va[kt][J][2];
                a3 = va[kt][J][3];
              } else {
                vf::template v_operand<J>(vw[kt][0], vw[kt][1], vp[kt][0], vp[kt][1], a0, a1);
                vf::template v_operand<J>(vw[kt][2], vw[kt][3], vp[kt][2], vp[kt][3], a2, a3);
              }
#pragma unroll
              for (int nt = 0; nt < NT; ++nt) {
                mma16816<vmma>(o[nt][J], a0, a1, a2, a3, pb[kt][nt][0], pb[kt][nt][1]);
              }
            }
          }(),
          ...);
    }
    (std::make_integer_sequence<int, ksteps>{});
  }
  cp_async_wait<0>();
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // A small grid lets the launch after it start while it merges (the launcher's signal_early).
  if (p.signal_early) {
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
  }
#endif

  // Row sums over the keys of the warp, then the block's warps merged through shared memory.
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      l[nt][c] += __shfl_xor_sync(0xFFFFFFFFU, l[nt][c], 4);
      l[nt][c] += __shfl_xor_sync(0xFFFFFFFFU, l[nt][c], 8);
      l[nt][c] += __shfl_xor_sync(0xFFFFFFFFU, l[nt][c], 16);
    }
  }
  __syncthreads(); // every warp is done with its pipeline buffers
  constexpr int rows = NT * 8;
  float* const red = reinterpret_cast<float*>(smem_raw);
  float* const red_m = red;              // [warp][rows]
  float* const red_l = red_m + W * rows; // [warp][rows]
  float* const red_o = red_l + W * rows; // [warp][rows][D], swizzled (red_at)
  static_assert(D % 32 == 0 && vf::v_item_channels % 4 == 0,
                "the swizzle stays in a row, and a thread's V channels come in fours");
  // v_slot[rel]: 2 * j + half of the m-tile j and half whose V channel is relative channel rel.
  constexpr auto v_slot = [] {
    std::array<int, 2 * ksteps> at{};
    for (int j = 0; j < ksteps; ++j) {
      for (int half = 0; half < 2; ++half) {
        at[vf::v_channel(j, half)] = 2 * j + half;
      }
    }
    return at;
  }();
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int row = nt * 8 + sl::red_store_row(i, c);
      if (g == 0) {
        red_m[warp * rows + row] = m[nt][c];
        red_l[warp * rows + row] = l[nt][c];
      }
      if constexpr (sl::ldsm_v) {
        // Channel 8 (2j + half) + g of m-tile j's row half, one at a time.
#pragma unroll
        for (int mm = 0; mm < 2 * ksteps; ++mm) {
          red_o[warp * rows * D + sl::red_at(row, sl::red_store_ch(g, mm))] =
              o[nt][mm / 2][c + 2 * (mm % 2)];
        }
      } else {
        // The thread's relative V channels four at a time (vf::v_abs keeps each four together).
#pragma unroll
        for (int q = 0; q < ksteps / 2; ++q) {
          float v[4];
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int at = v_slot[4 * q + e];
            v[e] = o[nt][at / 2][c + 2 * (at % 2)];
          }
          *reinterpret_cast<float4*>(red_o + warp * rows * D +
                                     sl::red_at(row, sl::red_store_ch(g, q))) =
              make_float4(v[0], v[1], v[2], v[3]);
        }
      }
    }
  }
  __syncthreads();
  // The block's query heads are consecutive, HB groups of them (its KV heads'): row r of the
  // block is query head q_head0 + r.
  const std::int32_t q_head0 = h_block * p.group;
  const std::int64_t row0 = static_cast<std::int64_t>(b) * p.num_q_heads + q_head0;
  constexpr float ln2 = 0.6931471805599453F;
  // Each thread merges four consecutive channels of a head at a time, with that head's weights
  // of the warps' states exp2(m - max) / sum computed by the thread itself: no pass that computes
  // them first and no barrier after it. In a cluster merge, each output then goes straight to
  // the mailbox of the block that owns it (st.async, completing on that block's mbarrier): no
  // block waits for another except an owner for what it is sent, and none stays to be read.
  constexpr int quads = D / 4;
  const int outputs = HB * p.group * quads;
  const int per_owner = (outputs + nsplit - 1) / nsplit; // outputs a block owns (the last fewer)
  float* const box_o = reinterpret_cast<float*>(mailbox + 2); // [split][per_owner] float4
  [[maybe_unused]] float* const box_lse = box_o + 4 * nsplit * per_owner; // [split][per_owner]
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  const cg::cluster_group cluster = cg::this_cluster();
#endif
  for (int e = static_cast<int>(threadIdx.x); e < outputs; e += W * 32) {
    const int row = e / quads;
    const int quad = e - row * quads;
    float mx = -INFINITY;
    float sum = 0.0F;
    float4 val = make_float4(0.0F, 0.0F, 0.0F, 0.0F);
    if constexpr (HB > 1) {
      // A head a warp: the warp's own state is the head's (no merge across warps).
      const int w = row / p.group;
      const int r = row - w * p.group;
      mx = red_m[w * rows + r];
      sum = mx == -INFINITY ? 0.0F : red_l[w * rows + r];
      const float inv = sum > 0.0F ? 1.0F / sum : 0.0F;
      const float4 x =
          *reinterpret_cast<const float4*>(red_o + w * rows * D + sl::red_at(r, quad * 4));
      val = make_float4(x.x * inv, x.y * inv, x.z * inv, x.w * inv);
    } else {
#pragma unroll
      for (int w = 0; w < W; ++w) {
        mx = fmaxf(mx, red_m[w * rows + row]);
      }
      float wt[W];
#pragma unroll
      for (int w = 0; w < W; ++w) {
        wt[w] = merge_weight(red_m[w * rows + row], mx);
        sum += wt[w] * red_l[w * rows + row];
      }
      const float inv = sum > 0.0F ? 1.0F / sum : 0.0F;
#pragma unroll
      for (int w = 0; w < W; ++w) {
        const float4 x =
            *reinterpret_cast<const float4*>(red_o + w * rows * D + sl::red_at(row, quad * 4));
        const float f = wt[w] * inv;
        val.x += f * x.x;
        val.y += f * x.y;
        val.z += f * x.z;
        val.w += f * x.w;
      }
    }
    const float lse2 = log2_sum_exp(mx, sum);
    if (nsplit == 1) {
      store_scaled(p.out + (row0 + row) * D + quad * 4, val, v_static);
      if (quad == 0 && p.lse != nullptr) {
        p.lse[row0 + row] = lse2 * ln2;
      }
    } else if (cluster_merge) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
      const int owner = e / per_owner;
      const int at = split * per_owner + (e - owner * per_owner);
      const auto rank = static_cast<unsigned>(owner);
      std::uint64_t* const bar = cluster.map_shared_rank(mailbox, rank);
      const float v4[4] = {val.x, val.y, val.z, val.w};
      ::cuda::ptx::st_async(cluster.map_shared_rank(box_o + 4 * at, rank), v4, bar);
      ::cuda::ptx::st_async(cluster.map_shared_rank(box_lse + at, rank), lse2, bar);
#endif
    } else {
      const std::int64_t prow = (row0 + row) * p.max_splits + split;
      *reinterpret_cast<float4*>(p.part_o + prow * D + quad * 4) = val;
      if (quad == 0) {
        p.part_lse[prow] = lse2;
      }
    }
  }
  if (nsplit == 1) {
    return;
  }
  if (cluster_merge) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    // Split path in a cluster: this block merges the outputs it owns once every split's share
    // has arrived in its mailbox (the mbarrier counts the bytes), reading only its own shared
    // memory; no workspace, no arrival counter, no second pass.
    const int first = split * per_owner;
    const int mine = max(0, min(per_owner, outputs - first)); // the last owners own fewer or none
    if (threadIdx.x == 0) {
      (void)::cuda::ptx::mbarrier_arrive_expect_tx(
          ::cuda::ptx::sem_release, ::cuda::ptx::scope_cta, ::cuda::ptx::space_shared, mailbox,
          static_cast<std::uint32_t>(nsplit * mine * decode_mailbox_entry_bytes));
    }
    while (!::cuda::ptx::mbarrier_try_wait_parity(::cuda::ptx::sem_acquire,
                                                  ::cuda::ptx::scope_cluster, mailbox, 0U)) {
    }
    for (int k = static_cast<int>(threadIdx.x); k < mine; k += W * 32) {
      const int e = first + k;
      const int row = e / quads;
      const int quad = e - row * quads;
      float ls[decode_plan::max_cluster_splits];
      float4 v[decode_plan::max_cluster_splits];
#pragma unroll
      for (int sp = 0; sp < decode_plan::max_cluster_splits; ++sp) {
        ls[sp] = -INFINITY;
        v[sp] = make_float4(0.0F, 0.0F, 0.0F, 0.0F);
        if (sp < nsplit) {
          ls[sp] = box_lse[sp * per_owner + k];
          v[sp] = *reinterpret_cast<const float4*>(box_o + 4 * (sp * per_owner + k));
        }
      }
      float mx = -INFINITY;
#pragma unroll
      for (int sp = 0; sp < decode_plan::max_cluster_splits; ++sp) {
        mx = fmaxf(mx, ls[sp]);
      }
      float sum = 0.0F;
      float4 acc = make_float4(0.0F, 0.0F, 0.0F, 0.0F);
#pragma unroll
      for (int sp = 0; sp < decode_plan::max_cluster_splits; ++sp) {
        if (sp < nsplit && mx != -INFINITY) {
          const float w = fast_exp2(ls[sp] - mx);
          sum += w;
          acc.x += w * v[sp].x;
          acc.y += w * v[sp].y;
          acc.z += w * v[sp].z;
          acc.w += w * v[sp].w;
        }
      }
      store_scaled(p.out + (row0 + row) * D + quad * 4, acc, sum > 0.0F ? v_static / sum : 0.0F);
      if (quad == 0 && p.lse != nullptr) {
        p.lse[row0 + row] = log2_sum_exp(mx, sum) * ln2;
      }
    }
#endif
    return;
  }

  // Split path: the last block of this (sequence, KV head) to finish merges every split. One
  // thread counts the block's arrival with an acquire-release atomic at device scope, after a
  // barrier that orders every thread's partials before it: it releases them to the block that
  // merges, and in that block acquires the other splits' partials for every thread after the
  // barrier that follows (the pattern of a grid-wide barrier).
  __syncthreads();
  // The arrival flag reuses the first word of the merge area, whose last read came before the
  // barrier above.
  int& last_block = *reinterpret_cast<int*>(smem_raw);
  if (threadIdx.x == 0) {
    ::cuda::atomic_ref<std::uint32_t, ::cuda::thread_scope_device> counter(
        p.counters[static_cast<std::int64_t>(b) * layout.num_kv_heads() + h_block]);
    const std::uint32_t before = counter.fetch_add(1U, ::cuda::memory_order_acq_rel);
    last_block = before == static_cast<std::uint32_t>(nsplit - 1) ? 1 : 0;
    if (last_block != 0) {
      // Every split has counted: the word is left as a zeroed workspace had it.
      counter.store(0U, ::cuda::memory_order_relaxed);
    }
  }
  __syncthreads();
  if (last_block == 0) {
    return;
  }
  // Every output of the group is a log-sum-exp merge of the splits' partials (each normalized:
  // its state is (lse, 1, output)). Each thread copies the partials of its own outputs into its
  // own slots of shared memory, as many splits at a time as the shared memory holds, every copy
  // of a batch in flight at once, so the merge waits for one round trip to L2 a batch however many
  // splits there are. Meanwhile one warp per head turns the splits' log-sum-exps into weights
  // exp2(lse - max) there; then each thread sums the weighted partials of its outputs. The first
  // 128 bytes hold the arrival flag, which other threads may still be reading.
  constexpr int smem_bytes = decode_smem_bytes<K, V, D, NT, KT, W, Ring>();
  constexpr int threads = W * 32;
  // The most query rows a block merges (a group of at most 16; in the head-split build HB groups
  // of at most 8), and the most splits it merges.
  constexpr int merge_rows = HB > 1 ? HB * 8 : 16;
  constexpr int merge_splits =
      HB > 1 ? decode_plan::head_split_max_splits : decode_plan::max_splits_limit;
  constexpr int max_outputs = (merge_rows * quads + threads - 1) / threads;
  static_assert(128 + (merge_rows * merge_splits + merge_rows) * 4 + merge_rows * D * 4 <=
                    smem_bytes,
                "the split merge needs room for every weight and one split's partials");
  const int rows_q = HB * p.group * quads; // float4 outputs of the block's rows
  float* const weights = reinterpret_cast<float*>(reinterpret_cast<char*>(smem_raw) + 128);
  float* const row_scale = weights + HB * p.group * nsplit; // [row]: v_static / sum of weights
  const int weight_bytes = ((HB * p.group * nsplit + HB * p.group) * 4 + 15) / 16 * 16;
  float4* const staged = reinterpret_cast<float4*>(reinterpret_cast<char*>(weights) + weight_bytes);
  const int batch_splits = (smem_bytes - 128 - weight_bytes) / (HB * p.group * D * 4);
  // Copies of this thread's partials of splits [s0, s0 + count) to staged[split - s0][output].
  const auto stage_splits = [&](int s0, int count) {
#pragma unroll
    for (int k = 0; k < max_outputs; ++k) {
      const int e = static_cast<int>(threadIdx.x) + k * threads;
      if (e < rows_q) {
        const int row = e / quads;
        const float4* src = reinterpret_cast<const float4*>(p.part_o) +
                            ((row0 + row) * p.max_splits + s0) * quads + (e - row * quads);
        for (int sp = 0; sp < count; ++sp) {
          cp_async<16>(staged + sp * rows_q + e, src + sp * quads, true);
        }
      }
    }
    cp_async_commit();
  };
  stage_splits(0, nsplit < batch_splits ? nsplit : batch_splits);
  // The log-sum-exps of the warp's heads (head warp + r * W): the first 32 splits' of
  // every head loaded at once (a warp that loaded each head's after the previous head's weights
  // waited for a round trip to L2 per head), the rest, where there are more splits, a head at a
  // time.
  constexpr int warp_rows = (merge_rows + W - 1) / W;
  float lse_first[warp_rows];
#pragma unroll
  for (int r = 0; r < warp_rows; ++r) {
    const int row = warp + r * W;
    lse_first[r] = row < HB * p.group && lane < nsplit
                       ? __ldcg(p.part_lse + (row0 + row) * p.max_splits + lane)
                       : -INFINITY;
  }
#pragma unroll
  for (int r = 0; r < warp_rows; ++r) {
    const int row = warp + r * W;
    if (row >= HB * p.group) {
      break;
    }
    const float* const lse_row = p.part_lse + (row0 + row) * p.max_splits;
    float* const w_row = weights + row * nsplit;
    float mx = lse_first[r];
    for (int sp = lane + 32; sp < nsplit; sp += 32) {
      const float v = __ldcg(lse_row + sp);
      w_row[sp] = v;
      mx = fmaxf(mx, v);
    }
#pragma unroll
    for (int d = 16; d >= 1; d /= 2) {
      mx = fmaxf(mx, __shfl_xor_sync(0xFFFFFFFFU, mx, d));
    }
    float sum = 0.0F;
    if (lane < nsplit) {
      const float w = merge_weight(lse_first[r], mx);
      w_row[lane] = w;
      sum = w;
    }
    for (int sp = lane + 32; sp < nsplit; sp += 32) {
      const float w = merge_weight(w_row[sp], mx);
      w_row[sp] = w;
      sum += w;
    }
#pragma unroll
    for (int d = 16; d >= 1; d /= 2) {
      sum += __shfl_xor_sync(0xFFFFFFFFU, sum, d);
    }
    if (lane == 0) {
      row_scale[row] = sum > 0.0F ? v_static / sum : 0.0F;
      if (p.lse != nullptr) {
        p.lse[row0 + row] = log2_sum_exp(mx, sum) * ln2;
      }
    }
  }
  __syncthreads(); // the weights are in place
  float4 acc[max_outputs];
#pragma unroll
  for (int k = 0; k < max_outputs; ++k) {
    acc[k] = make_float4(0.0F, 0.0F, 0.0F, 0.0F);
  }
  for (int s0 = 0; s0 < nsplit; s0 += batch_splits) {
    const int count = nsplit - s0 < batch_splits ? nsplit - s0 : batch_splits;
    cp_async_wait<0>(); // this thread's copies (no other thread reads its slots)
#pragma unroll
    for (int k = 0; k < max_outputs; ++k) {
      const int e = static_cast<int>(threadIdx.x) + k * threads;
      if (e < rows_q) {
        const float* const w_row = weights + (e / quads) * nsplit + s0;
#pragma unroll 4
        for (int sp = 0; sp < count; ++sp) {
          const float w = w_row[sp];
          const float4 v = staged[sp * rows_q + e];
          acc[k].x += w * v.x;
          acc[k].y += w * v.y;
          acc[k].z += w * v.z;
          acc[k].w += w * v.w;
        }
      }
    }
    if (s0 + count < nsplit) {
      const int next = nsplit - s0 - count;
      stage_splits(s0 + count, next < batch_splits ? next : batch_splits);
    }
  }
#pragma unroll
  for (int k = 0; k < max_outputs; ++k) {
    const int e = static_cast<int>(threadIdx.x) + k * threads;
    if (e < rows_q) {
      const int row = e / quads;
      store_scaled(p.out + (row0 + row) * D + (e - row * quads) * 4, acc[k], row_scale[row]);
    }
  }
}

// While it lives, the calling thread's stream capture mode is relaxed (the mode it replaced comes
// back at its end). The launcher's once-per-device set-up (attributes, occupancy, the shared-memory
// limit) runs under it: an engine that captures its CUDA graphs before any eager step makes its
// first launch of a kernel inside a capture, in the global or thread-local mode, where the CUDA
// runtime may refuse calls it deems unsafe; a refused query would leave that kernel on its slower
// paths (no cluster merge) for the process.
class relaxed_capture_mode {
public:
  relaxed_capture_mode() { (void)cudaThreadExchangeStreamCaptureMode(&mode_); }
  ~relaxed_capture_mode() { (void)cudaThreadExchangeStreamCaptureMode(&mode_); }
  relaxed_capture_mode(const relaxed_capture_mode&) = delete;
  relaxed_capture_mode& operator=(const relaxed_capture_mode&) = delete;

private:
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
};

// What `query(device, value)` gives for `device`, asked once per device and query type (a host
// call per launch would cost more than a small decode takes on the GPU; each lambda is a type of
// its own), in relaxed capture mode; 0 for a device past the first 64. A failed query, or a result
// of 0, is asked again.
template <class Query>
cudaError_t decode_per_device(int device, std::int32_t& value, Query query) {
  static std::atomic<std::int32_t> known[64] = {};
  value = 0;
  if (device < 0 || device >= 64) {
    return cudaSuccess;
  }
  value = known[device].load(std::memory_order_acquire);
  if (value == 0) {
    const relaxed_capture_mode relaxed;
    if (const cudaError_t e = query(device, value); e != cudaSuccess) {
      value = 0;
      return e;
    }
    known[device].store(value, std::memory_order_release);
  }
  return cudaSuccess;
}

// Attribute A of `device`, asked once per device.
template <cudaDeviceAttr A>
cudaError_t decode_device_attribute(int device, std::int32_t& value) {
  return decode_per_device(device, value,
                           [](int d, std::int32_t& v) { return cudaDeviceGetAttribute(&v, A, d); });
}

// The current device and its multiprocessors (0 for a device past the first 64, which then
// counts as having no room for a small grid).
inline cudaError_t decode_device(int& device, std::int32_t& sms) {
  if (const cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) {
    return e;
  }
  return decode_device_attribute<cudaDevAttrMultiProcessorCount>(device, sms);
}

// The shared memory a block of `device` may opt in to (0 past the first 64 devices or where the
// query fails, which rules out the wide blocks and takes the narrow build where one exists).
inline std::int32_t decode_smem_optin(int device) {
  std::int32_t bytes = 0;
  if (decode_device_attribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>(device, bytes) !=
      cudaSuccess) {
    (void)cudaGetLastError(); // not an error of this launch: no wide blocks
  }
  return bytes;
}

// Dynamic shared memory for launches of `kernel` (blocks of `threads`, `need` bytes of their own)
// on `device` that leaves at most `planned` blocks of it resident per multiprocessor: `need` where
// no more fit anyway, otherwise enough that one block more would overflow the multiprocessor, the
// kernel's limit (`limit` bytes until now) raised to it. `need` as well where that limit cannot be
// raised (more blocks then fit than planned, which is not an error of the launch).
template <class Kernel>
cudaError_t decode_held_smem(Kernel kernel, int threads, int planned, std::int32_t need,
                             std::int32_t limit, int device, std::int32_t& smem) {
  smem = need;
  int resident = 0;
  if (const cudaError_t e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(
          &resident, kernel, threads, static_cast<std::size_t>(need));
      e != cudaSuccess || resident <= planned) {
    return e;
  }
  std::int32_t per_sm = 0;
  std::int32_t reserved = 0;
  if (const cudaError_t e =
          decode_device_attribute<cudaDevAttrMaxSharedMemoryPerMultiprocessor>(device, per_sm);
      e != cudaSuccess) {
    return e;
  }
  if (const cudaError_t e =
          decode_device_attribute<cudaDevAttrReservedSharedMemoryPerBlock>(device, reserved);
      e != cudaSuccess) {
    return e;
  }
  // planned + 1 blocks of keep_out bytes and their reserved shared memory overflow the SM.
  const std::int32_t keep_out = (per_sm / (planned + 1) - reserved + 1 + 127) / 128 * 128;
  if (keep_out > limit && cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               keep_out) != cudaSuccess) {
    (void)cudaGetLastError(); // not an error of this launch: more blocks resident than planned
    return cudaSuccess;
  }
  smem = keep_out > need ? keep_out : need;
  return cudaSuccess;
}

// Warps in a block of the wide kernel. An int4 cache on a grid of at most one block per
// multiprocessor, whose splits give each of these warps two tiles or more, runs blocks of this
// many warps: each scheduler has two warps to switch between and each warp half the tiles (int4's
// loop is bound by its instructions, and a B=1 warp waits on its own chain of dependent ones).
// H200, B=1, L=2048: int4 g32 12-14% faster; bf16 6-11% slower, fp8 and int8 (two tiles a step
// there) unchanged; L=512 (one tile a warp) int4 7-10% slower.
inline constexpr int decode_wide_warps = 8;

// Whether the wide kernel is built for these codecs and shapes: int4 K and V, where its shared
// memory (with a cluster merge's mailboxes) is at most 227 KB, the most any device of compute
// capability 9 lets a block opt in to (the launcher also checks the device's own limit).
template <class K, class V, int D, int NT>
constexpr bool decode_wide_fit() {
  return frag<K, D>::bits == 4 && frag<V, D>::bits == 4 &&
         decode_cluster_smem_bytes<K, V, D, NT, 1, decode_wide_warps>() <= 227 * 1024;
}

// Whether a kernel with these attributes was built for compute capability 9 or later, which its
// cluster merge and dependent launches need: code built for an older one, even run on a newer
// device through its PTX, has neither.
inline bool decode_built_for_clusters(const cudaFuncAttributes& attributes) {
  return attributes.ptxVersion >= 90 && attributes.binaryVersion >= 90;
}

// Thread blocks of a launch's grid: (split, KV heads, sequence), `heads` KV heads a block.
template <class Layout, class T>
std::int64_t decode_grid_blocks(const decode_args<Layout, T>& a, const decode_plan& plan,
                                std::int32_t heads = 1) {
  return static_cast<std::int64_t>(plan.max_splits) * (plan.shape.num_kv_heads / heads) *
         a.table.batch_size;
}

// One launch of the kernel taking KT tiles a step with blocks of W warps on `device`, which has
// `sms` multiprocessors, for a grid of `blocks` (decode_grid_blocks) over a batch of at least one
// sequence (decode_dim returns before an empty one); `smem_optin` as the dispatcher's below.
template <class Layout, class T, int D, int NT, int KT, int W = decode_warps, int Ring = 0,
          int HB = 1>
cudaError_t launch_decode(const decode_args<Layout, T>& a, const decode_plan& plan, void* workspace,
                          cudaStream_t stream, int device, std::int32_t sms, std::int64_t blocks,
                          std::int32_t smem_optin = -1) {
  using K = typename Layout::k_codec;
  using V = typename Layout::v_codec;
  const bool small_grid = blocks <= sms;
  decode_params<Layout, T> p{};
  p.layout = a.layout;
  p.cache = a.cache;
  p.page_bytes = a.layout.bytes_per_page();
  p.table = a.table;
  p.q = a.q;
  p.out = a.out;
  p.lse = a.lse;
  p.static_scales = a.static_scales;
  p.page_check = a.page_check;
  p.capacity = a.capacity;
  p.group = plan.shape.group_size();
  p.num_q_heads = plan.shape.num_q_heads;
  p.scale = a.options.scale > 0.0F ? a.options.scale
                                   : 1.0F / std::sqrt(static_cast<float>(plan.shape.head_dim));
  p.soft_cap = a.options.logits_soft_cap;
  p.window = a.options.window;
  p.chunk = plan.chunk_tokens;
  p.page_div = fast_divmod::make(static_cast<std::uint32_t>(a.layout.page_size()));
  p.max_splits = plan.max_splits;
  p.cluster = false;
  p.page_table_ready = false;
  p.cache_early = false;
  p.signal_early = false;
  if (plan.workspace_bytes() > 0) {
    auto* const ws = static_cast<std::byte*>(workspace);
    p.counters =
        a.zeroed_counters != nullptr ? a.zeroed_counters : reinterpret_cast<std::uint32_t*>(ws);
    p.part_lse = reinterpret_cast<float*>(ws + plan.counter_bytes());
    p.part_o = reinterpret_cast<float*>(ws + plan.partial_outputs_offset());
  }
  constexpr int smem_need = decode_smem_bytes<K, V, D, NT, KT, W, Ring>();
  constexpr int cluster_need = decode_cluster_smem_bytes<K, V, D, NT, KT, W, Ring, HB>();
  const auto kernel = paged_decode_kernel<Layout, T, D, NT, KT, W, Ring, HB>;
  // The shared-memory limit is raised once per device (a host call per launch would cost more
  // than a small decode takes on the GPU).
  static std::atomic<std::uint64_t> raised{0};
  const std::uint64_t bit = device < 64 ? (1ULL << device) : 0;
  // Devices where this kernel merges splits in thread block clusters, noted with the same
  // once-per-device query.
  static std::atomic<std::uint64_t> clusters{0};
  // Devices where the limit covers the mailboxes of a cluster merge as well (on one with less
  // shared memory a block, the splits merge through the workspace).
  static std::atomic<std::uint64_t> mailboxes{0};
  if (bit == 0 || (raised.load(std::memory_order_acquire) & bit) == 0) {
    const relaxed_capture_mode relaxed;
    // Where the caller gives the shared memory a block may opt in to (`smem_optin`, not negative:
    // the tests' stand-in for a smaller device, taken at the kernel's first launch on a device),
    // the mailboxes are tried only where they fit it, as such a device would decide. The
    // dispatcher passes it to the builds that it chooses by that limit (the short ring and the
    // narrow build), which on a larger device only a stand-in reaches; every other build is
    // launched with -1 (the device decides), so a stand-in never changes what they cache.
    const bool room = smem_optin < 0 || cluster_need <= smem_optin;
    if (room && cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     cluster_need) == cudaSuccess) {
      mailboxes.fetch_or(bit, std::memory_order_acq_rel);
    } else {
      if (room) {
        (void)cudaGetLastError(); // not an error of this launch: no cluster merge
      }
      if (const cudaError_t e =
              cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_need);
          e != cudaSuccess) {
        return e;
      }
    }
    // The cluster merge needs a device that launches clusters and a kernel built for
    // compute capability 9 or later (decode_built_for_clusters).
    int cluster_launch = 0;
    if (const cudaError_t e =
            cudaDeviceGetAttribute(&cluster_launch, cudaDevAttrClusterLaunch, device);
        e != cudaSuccess) {
      return e;
    }
    cudaFuncAttributes attributes{};
    if (const cudaError_t e = cudaFuncGetAttributes(&attributes, kernel); e != cudaSuccess) {
      return e;
    }
    if (cluster_launch != 0 && decode_built_for_clusters(attributes)) {
      clusters.fetch_or(bit, std::memory_order_acq_rel);
    }
    raised.fetch_or(bit, std::memory_order_acq_rel);
  }
  // A kernel of decode_warps warps has its grids cut for decode_planned_blocks blocks per
  // multiprocessor. Where its registers and shared memory would let one block more in, the launch
  // asks for enough shared memory to keep it out (decode_held_smem, once per device): on the H200,
  // the two-tile kernel of int4 g128 at head dim 128 (168 registers and 75 KB: a third block), and
  // at head dim 64 the two-tile kernels and those of groups over 8 (a third). There, int4 g128 in
  // the benchmark's loop of dependent launches: B=1, L=32768 g8 25.3 to 21.2 us, B=8, L=2048 g8
  // 15.6 to 13.7 (12-16% faster; g32 took 22.2 and 14.1), every other int4, fp8 and bf16 row
  // within 2% (the host-bound B=1, L=512 aside). One launch alone under Nsight Compute was not
  // slower with three blocks an SM (16.5 us against g32's 20.4 at B=8, L=2048): the loss is in the
  // loop, where a launch's blocks are placed while the one before it still runs. Grids of several
  // waves are held too: the plan cuts them for the planned count, and a third block breaks their
  // waves (int8 at head dim 64, B=64, L=8192, 512 blocks of the two-tile kernel: 248 us with the
  // third block, 177 held; B=128, L=2048 7% more time). At head dim 64, fp8, int8 and int4 g32
  // at B=1 to 32 measured within 1.8% either way. The wide kernel is not held: it runs on grids of
  // at most one block an SM, where a second one (the next launch's) takes no SM from this one
  // (int4 at head dim 64, B=1, L=2048 3.5% slower held). Nor is the narrow build: the devices it
  // is for hold one of its blocks an SM, as planned (a larger device runs it only where its limit
  // is unknown, and may then hold two).
  std::int32_t smem = smem_need;
  std::int32_t cluster_smem = cluster_need;
  if constexpr (W == decode_warps) {
    constexpr int planned = decode_planned_blocks<K, V, D, NT, KT, W>;
    std::int32_t padded = 0;
    if (decode_per_device(device, padded, [&](int d, std::int32_t& v) {
          const std::int32_t limit =
              (mailboxes.load(std::memory_order_acquire) & bit) != 0 ? cluster_need : smem_need;
          return decode_held_smem(kernel, W * 32, planned, smem_need, limit, d, v);
        }) != cudaSuccess) {
      (void)cudaGetLastError(); // not an error of this launch: the kernel's own shared memory
      padded = 0;
    }
    if (padded > smem) {
      smem = padded;
      cluster_smem = padded > cluster_need ? padded : cluster_need;
    }
  }
  const std::int32_t head_blocks = plan.shape.num_kv_heads / HB; // the grid's y
  const dim3 grid(static_cast<unsigned>(plan.max_splits), static_cast<unsigned>(head_blocks),
                  static_cast<unsigned>(a.table.batch_size));
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = dim3(W * 32);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  // The cluster shape (used where the splits merge in clusters), then the dependent launch.
  cudaLaunchAttribute attrs[2];
  attrs[0].id = cudaLaunchAttributeClusterDimension;
  attrs[0].val.clusterDim.x = static_cast<unsigned>(plan.max_splits);
  attrs[0].val.clusterDim.y = 1;
  attrs[0].val.clusterDim.z = 1;
  // A dependent launch needs compute capability 9 and a kernel built for it: the same condition
  // as the cluster merge, noted per device above.
  attrs[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  const bool dependent =
      a.dependent_launch && (clusters.load(std::memory_order_acquire) & bit) != 0;
  attrs[1].val.programmaticStreamSerializationAllowed = dependent ? 1 : 0;
  // A grid of at most one block per multiprocessor (a small batch) lets the launch after it
  // start once each of its blocks is past its keys, so that launch is placed, and reads its page
  // table where the caller allows it, while this one merges. Measured on the H200 in a loop of
  // decodes from a CUDA graph: bf16 B=1, L=2048 7.65 to 7.04 us (group 4), 8.30 to 7.39 (group
  // 8). A larger grid does the same where the caller allows the early reads (page_table_ready),
  // its K and V are 16-bit, and all its blocks are resident at once (one wave: no later block of
  // it needs the places the next launch's waiting blocks take). H200, bf16 in a stream loop:
  // B=8, L=512 17-20% faster, B=1, L=8192 (256 blocks) 12-13%, B=8, L=2048 9-11%, B=32, L=512
  // 4-5%, B=8, L=8192 1-4%, the other one-wave rows within 0.6% either way. A quantized cache
  // does so only where its sequences are split, in chunks of at least early_read_min_chunk keys
  // (H200, fp8, int8 and int4 in both orders: B=8, L=8192 2.5-5.3% faster, L=32768 from 0.4%
  // slower to 1.4% faster; int4 at B=32 in 2 splits: L=8192 0.7-1.2% faster, L=32768 from 1.2%
  // slower to 0.8% faster). Shorter splits were mixed (B=8, L=2048 in splits of 512 from 15%
  // faster to 3.7% slower) or lost (B=8 and B=32, L=512: 2.6-15% slower), and whole sequences
  // gained nothing (B=32, L=2048 to 32768: within 1.8% either way). Not without the early reads:
  // the early signal alone made every grid it applied to 0.2-12% slower. Grids larger than a
  // wave keep the ordinary order (int4 B=32, L=512 10% slower with an early signal), and reading
  // the table before the wait, with the queries after it, was 2-7% slower there (the wait ends
  // at once).
  bool early = small_grid;
  const bool sixteen_bit = frag<K, D>::bits == 16 && frag<V, D>::bits == 16;
  if (sixteen_bit ||
      (plan.max_splits > 1 && plan.chunk_tokens >= decode_plan::early_read_min_chunk)) {
    if (dependent && !small_grid && a.page_table_ready) {
      // Blocks of this kernel resident per multiprocessor.
      std::int32_t resident = 0;
      if (decode_per_device(device, resident, [&](int, std::int32_t& v) {
            return cudaOccupancyMaxActiveBlocksPerMultiprocessor(&v, kernel, W * 32, smem);
          }) != cudaSuccess) {
        (void)cudaGetLastError(); // not an error of this launch: no early signal
        resident = 0;
      }
      early = blocks <= static_cast<std::int64_t>(sms) * resident;
    }
  }
  p.signal_early = dependent && early;
  p.page_table_ready = dependent && early && a.page_table_ready;
  p.cache_early = p.page_table_ready && a.cache_ready_but_last_page && a.page_check == nullptr;
  // Up to max_cluster_splits splits merge inside a cluster of their blocks, where every cluster
  // of the grid can be resident at once; otherwise (a grid of clusters takes longer to place
  // than one of blocks: H200, bf16 B=8, L=8192 in clusters of 4: 96 us against 70) the splits go
  // through the workspace, where the last block to arrive merges them. How many clusters of each
  // size fit is asked once per device.
  if (plan.max_splits > 1 && plan.max_splits <= decode_plan::max_cluster_splits &&
      (clusters.load(std::memory_order_acquire) & mailboxes.load(std::memory_order_acquire) &
       bit) != 0) {
    static std::atomic<std::int32_t> fit[64][decode_plan::max_cluster_splits + 1] = {};
    std::atomic<std::int32_t>& known = fit[device][plan.max_splits];
    std::int32_t max_clusters = known.load(std::memory_order_acquire) - 1;
    if (max_clusters < 0) {
      const relaxed_capture_mode relaxed;
      config.attrs = attrs;
      config.numAttrs = 1;
      config.dynamicSmemBytes = cluster_smem;
      int n = 0;
      if (const cudaError_t e = cudaOccupancyMaxActiveClusters(&n, kernel, &config);
          e != cudaSuccess) {
        (void)cudaGetLastError(); // not an error of this launch: no cluster merge
        n = 0;
      }
      max_clusters = n;
      // A failure is kept as well (no cluster merges of this size on this device): asked again at
      // every launch, a query that keeps failing would cost each one a host round of its own.
      known.store(n + 1, std::memory_order_release);
    }
    p.cluster = static_cast<std::int64_t>(a.table.batch_size) * head_blocks <= max_clusters;
  }
  config.attrs = p.cluster ? attrs : attrs + 1;
  config.numAttrs = p.cluster ? 2 : 1;
  config.dynamicSmemBytes = p.cluster ? cluster_smem : smem;
  if (plan.max_splits > 1 && !p.cluster && a.zeroed_counters == nullptr) {
    // The arrival counters start at zero: where they lie depends on the plan, so a workspace
    // that served another plan holds anything there (unless the caller's counters are used).
    if (const cudaError_t e = cudaMemsetAsync(p.counters, 0, plan.counter_bytes(), stream);
        e != cudaSuccess) {
      return e;
    }
  }
  if (const cudaError_t e = cudaLaunchKernelEx(&config, kernel, p); e != cudaSuccess) {
    return e;
  }
  return cudaGetLastError();
}

// A plan of blocks of several KV heads (decode_plan::heads_per_block) runs the head-split build of
// the one-tile kernel where one exists (decode_head_split_fit), whatever else holds; where none
// does, it runs as a plan of one head a block, by the rules below.
//
// A launch runs the kernel that takes two tiles a step, where one exists (decode_two_tiles_fit)
// and the warps have two tiles or more each, on any grid the plan made for it
// (decode_plan::two_tiles: int8 from 2048 keys, whose one-tile kernel spills; int8 and int4 at
// one wave of two blocks per SM) and, for an 8-bit cache, on a grid of at most one block per
// multiprocessor (a small batch: a B=1 warp waits on its own chain of dependent instructions,
// and two tiles a step overlap two chains and share one softmax round; int4 gains nothing
// there) and on a grid of whole sequences of two_tiles_min_keys keys or more that makes one wave
// of two blocks per multiprocessor (for fp8, whose plan does not choose the two-tile kernel: it
// cannot tell fp8 K and V from fp8 K with bf16 V, which has no two-tile form; H200, fp8 at B=32
// with 8 KV heads: 0.1-0.9% faster at L=2048, 0.7-2.6% from L=8192, in NHD and HND pages, where
// grids of more blocks or of split sequences were 2-11% slower with it), and an fp8 plan's one
// wave of four blocks per SM of split sequences whose splits taken two at a time make long blocks
// in one wave of two (below). Every other launch runs the one-tile kernel, on its
// decode_short_ring build where that exists and the device lets a block opt in to less shared
// memory than the kernel's own ring takes, or on its narrow build (decode_narrow_fit) where the
// device allows less than the short ring takes. `smem_optin`: the shared memory a block may opt in
// to, the device's where it is negative (the tests pass an A100's and others' to run what those
// would).
//
// The choice, for a device of `sms` multiprocessors whose opt-in shared memory `optin()` gives
// (asked only on the paths that depend on it): calls `run.template operator()<KT, W, Ring>(p, n,
// o)` for the build chosen, with the plan `p` it runs (the caller's or, paired, half its splits of
// twice the keys), its grid of `n` blocks and `o`, the opt-in the build's launch is given
// (`smem_optin` for the builds sized by it, else -1), and returns what that returns. The
// launcher runs the build; decode_build_chosen reports it.
template <class Layout, class T, int D, int NT, class Optin, class Run>
auto dispatch_decode(const decode_args<Layout, T>& a, const decode_plan& plan, std::int32_t sms,
                     [[maybe_unused]] const Optin& optin, [[maybe_unused]] std::int32_t smem_optin,
                     Run&& run) {
  if constexpr (decode_head_split_fit<Layout, D, NT>()) {
    if (plan.heads_per_block == decode_plan::head_split_heads) {
      return run.template operator()<1, decode_warps, 0, decode_plan::head_split_heads>(
          plan, decode_grid_blocks(a, plan, decode_plan::head_split_heads), -1);
    }
  }
  const std::int64_t blocks = decode_grid_blocks(a, plan);
  const bool small_grid = blocks <= sms;
  using K = typename Layout::k_codec;
  using V = typename Layout::v_codec;
  if constexpr (decode_two_tiles_fit<K, V, D, NT>()) {
    constexpr bool eight_bit = frag<K, D>::bits == 8;
    constexpr bool long_ring = decode_long_ring_fit<K, V, D, NT>();
    // The two-tile kernel on `p`'s grid of `n` blocks: its four-stage build where the blocks take
    // `long_keys` keys or more (decode_long_ring_fit), its own ring otherwise.
    const auto two_tiles = [&](const decode_plan& p, std::int64_t n,
                               std::int32_t long_keys = decode_long_block_keys<K>) {
      if constexpr (long_ring) {
        if (p.chunk_tokens >= long_keys) {
          return run.template operator()<2, decode_warps, decode_long_ring>(p, n, -1);
        }
      }
      return run.template operator()<2, decode_warps, 0>(p, n, -1);
    };
    const bool whole_wave = plan.max_splits == 1 &&
                            plan.chunk_tokens >= decode_plan::two_tiles_min_keys &&
                            kvkit::detail::one_wave_of_two(blocks, sms);
    if ((((small_grid || whole_wave) && eight_bit) || plan.two_tiles) &&
        plan.chunk_tokens >= 2 * decode_plan::tile_tokens) {
      return two_tiles(plan, blocks);
    }
    if constexpr (eight_bit && long_ring) {
      // fp8's plan for four blocks per SM, in one wave of split sequences, run as half as many
      // splits of twice the keys on the four-stage build, where those make one wave of two blocks
      // per SM with blocks of decode_paired_block_keys or more, or whole sequences of
      // decode_long_block_keys or more (the plan cannot choose this for fp8, as above). Fewer
      // splits fit the plan's workspace. H200, against the plan, best of two or three rounds:
      // - 8 KV heads, B=8, L=32768 (8 splits of 4096 keys against 4 of 8192): 4.4-4.5% faster in
      //   NHD pages, 2.3% in HND pages; on the six-stage build from 0.3% faster to 0.6% slower.
      // - 8 KV heads, B=8, L=8192 (8 splits of 1024 against 4 of 2048): 3.5-4.2% faster with
      //   pages of 16 tokens (NHD and HND), 2.8-3.5% with 64, 1.3% with one; on the six-stage
      //   build 0.2-2.8% (pages of 16). With 16 KV heads (B=8, L=8192: 4 splits of 2048 against
      //   2 of 4096; B=1, L=32768: 32 of 1024 against 16 of 2048), 2 and 4 (B=8, L=32768 and
      //   B=32 and 64, L=8192): 3.4-8.0% faster at every such row of the benchmark.
      // - Whole sequences of 2048 keys (8 KV heads, B=32, L=2048 with pages of one token, planned
      //   as 2 splits of 1024): 1.2-1.3% slower, so whole sequences take the rule of whole
      //   sequences above.
      // The paired chunk stays within max_decode_keys, as the plans' chunks do, so that a
      // sequence's length plus a chunk, the furthest a split ends, stays in 32 bits.
      if (!plan.two_tiles && plan.max_splits > 1 && blocks > 2 * static_cast<std::int64_t>(sms) &&
          blocks <= 4 * static_cast<std::int64_t>(sms) &&
          plan.chunk_tokens <= kvkit::detail::max_decode_keys / 2) {
        decode_plan paired = plan;
        paired.max_splits = (plan.max_splits + 1) / 2;
        paired.chunk_tokens = 2 * plan.chunk_tokens;
        const std::int64_t paired_blocks = decode_grid_blocks(a, paired);
        const std::int32_t long_keys =
            paired.max_splits > 1 ? decode_paired_block_keys : decode_long_block_keys<K>;
        if (paired.chunk_tokens >= long_keys &&
            kvkit::detail::one_wave_of_two(paired_blocks, sms)) {
          return two_tiles(paired, paired_blocks, long_keys);
        }
      }
    }
  }
  if constexpr (decode_wide_fit<K, V, D, NT>()) {
    if (small_grid && plan.chunk_tokens >= 2 * decode_wide_warps * 16 &&
        decode_cluster_smem_bytes<K, V, D, NT, 1, decode_wide_warps>() <= optin()) {
      return run.template operator()<1, decode_wide_warps, 0>(plan, blocks, -1);
    }
  }
  if constexpr (decode_short_ring_fit<K, V, D, NT>()) {
    const decode_build build = decode_build_for<K, V, D, NT>(optin());
    if constexpr (decode_narrow_fit<K, V, D, NT>()) {
      if (build == decode_build::narrow) {
        return run.template operator()<1, decode_narrow_warps, 0>(plan, blocks, smem_optin);
      }
    }
    if (build == decode_build::short_ring) {
      return run.template operator()<1, decode_warps, decode_short_ring>(plan, blocks, smem_optin);
    }
  }
  return run.template operator()<1, decode_warps, 0>(plan, blocks, -1);
}

// Calls `f` with the build's query-row tiles for the plan's group (NT, as
// std::integral_constant<int, NT>): two for groups over 8, else one. The launcher and
// decode_build_chosen take NT from here alone, so that the choice reported is the one launched.
template <class F>
auto with_group_tiles(const decode_plan& plan, F&& f) {
  if (plan.shape.group_size() > 8) {
    return f(std::integral_constant<int, 2>{});
  }
  return f(std::integral_constant<int, 1>{});
}

template <class Layout, class T, int D, int NT>
cudaError_t launch_decode(const decode_args<Layout, T>& a, const decode_plan& plan, void* workspace,
                          cudaStream_t stream, std::int32_t smem_optin) {
  int device = 0;
  std::int32_t sms = 0;
  if (const cudaError_t e = decode_device(device, sms); e != cudaSuccess) {
    return e;
  }
  const auto optin = [&] {
    return smem_optin < 0 ? decode_smem_optin(device) : smem_optin;
  };
  return dispatch_decode<Layout, T, D, NT>(
      a, plan, sms, optin, smem_optin,
      [&]<int KT, int W, int Ring, int HB = 1>(const decode_plan& p, std::int64_t n,
                                               std::int32_t o) {
        return launch_decode<Layout, T, D, NT, KT, W, Ring, HB>(a, p, workspace, stream, device,
                                                                sms, n, o);
      });
}

//! The build of the decode kernel a launch of `a` with `plan` runs on a device of `sms`
//! multiprocessors whose blocks may opt in to `smem_optin` bytes of shared memory (a device's
//! figure, not negative), as the launcher chooses it (host only; for tests): the tiles a step, the
//! warps a block and the ring (0: the kernel's own, else decode_long_ring or decode_short_ring
//! stages), with the plan and grid it runs (a paired fp8 plan runs half the splits of twice the
//! keys) and the opt-in its launch is given (-1 for the builds not sized by it).
struct decode_build_choice {
  int tiles = 1;
  int warps = decode_warps;
  int ring = 0;
  decode_plan plan;
  std::int64_t blocks = 0;
  std::int32_t smem_optin = -1;
  int heads = 1; //!< KV heads a block: decode_plan::head_split_heads on the head-split build
};
template <int HeadDim, class Layout, class T>
decode_build_choice decode_build_chosen(const decode_args<Layout, T>& a, const decode_plan& plan,
                                        std::int32_t sms, std::int32_t smem_optin) {
  const auto optin = [&] {
    return smem_optin;
  };
  const auto chosen = [&]<int KT, int W, int Ring, int HB = 1>(const decode_plan& p, std::int64_t n,
                                                               std::int32_t o) {
    return decode_build_choice{KT, W, Ring, p, n, o, HB};
  };
  return with_group_tiles(plan, [&](auto nt) {
    return dispatch_decode<Layout, T, HeadDim, decltype(nt)::value>(a, plan, sms, optin, smem_optin,
                                                                    chosen);
  });
}

// paged_decode_dim, with the shared memory a block may opt in to as the launcher sees it
// (`smem_optin`, negative: the device's).
template <int HeadDim, class Layout, class T>
cudaError_t decode_dim(const decode_args<Layout, T>& a, const decode_plan& plan, void* workspace,
                       std::size_t workspace_bytes, cudaStream_t stream, std::int32_t smem_optin) {
  // The pending error is taken before the launcher's own queries, whose expected failures it
  // clears.
  const bool valid =
      validate(a, plan, workspace, workspace_bytes).ok() && plan.shape.head_dim == HeadDim;
  if (const auto done = before_launch(valid, a.table.batch_size > 0)) {
    return *done;
  }
  const cudaError_t e = with_group_tiles(plan, [&](auto nt) {
    return launch_decode<Layout, T, HeadDim, decltype(nt)::value>(a, plan, workspace, stream,
                                                                  smem_optin);
  });
  if (e != cudaSuccess) {
    // A failed runtime call (a launch, a memset, an attribute) leaves its error as the thread's
    // last error too; returned here, it is taken, so that the next launcher does not return it
    // again as pending and launch nothing.
    (void)cudaGetLastError();
  }
  return e;
}

} // namespace detail

//! Decode attention for a layout whose head dim is `HeadDim` (64, 128 or 256): instantiates only
//! that head dim's kernels. Same contract as paged_decode.
template <int HeadDim, page_layout Layout, query_element T>
requires(HeadDim == 64 || HeadDim == 128 || HeadDim == 256) [[nodiscard]] cudaError_t
    paged_decode_dim(const decode_args<Layout, T>& a, const decode_plan& plan, void* workspace,
                     std::size_t workspace_bytes, cudaStream_t stream) {
  static_assert(detail::device_layout<Layout>,
                "paged_decode_dim takes paged_layout of the library's codecs only");
  return detail::decode_dim<HeadDim>(a, plan, workspace, workspace_bytes, stream, -1);
}

//! Decode attention: for each sequence b of `a.table`, its query q[b] (all query heads) attends
//! to every cached key of the sequence (the newest included), within the sliding window when one
//! is set, and the result goes to out[b] (and the log-sum-exp of the scaled, capped logits to
//! lse[b]). Matches kvkit::reference::paged_decode to fp16/bf16 rounding of the operands (keys and
//! values are dequantized to fp16, or kept in bf16 for a bf16 cache; accumulation is fp32).
//! `plan` comes from plan_decode or plan_decode_graph_safe for the same shape; `workspace` holds
//! plan.workspace_bytes() bytes and needs no initialization. A split launch merges its splits in
//! thread block clusters where it can (compute capability 9 and up, at most
//! decode_plan::max_cluster_splits splits, and every cluster of the grid resident at once), and
//! otherwise through the workspace, after zeroing its arrival counters with a memset on `stream`
//! (skipped when the caller keeps counters of its own at zero: decode_args::zeroed_counters).
//! One kernel launch, asynchronous on `stream` (by default a programmatic dependent launch:
//! decode_args::dependent_launch); no allocation, no host synchronization, so a launch with a
//! graph-safe plan can be captured in a CUDA graph. cudaErrorInvalidValue when
//! `validate` fails; an error an earlier call left pending is returned (taken) before anything
//! launches (detail::take_pending_error); an error of the launcher's own calls is returned and
//! taken too.
template <page_layout Layout, query_element T>
[[nodiscard]] cudaError_t paged_decode(const decode_args<Layout, T>& a, const decode_plan& plan,
                                       void* workspace, std::size_t workspace_bytes,
                                       cudaStream_t stream) {
  static_assert(detail::device_layout<Layout>,
                "paged_decode takes paged_layout of the library's codecs only");
  switch (plan.shape.head_dim) {
  case 64:
    return paged_decode_dim<64>(a, plan, workspace, workspace_bytes, stream);
  case 128:
    return paged_decode_dim<128>(a, plan, workspace, workspace_bytes, stream);
  case 256:
    return paged_decode_dim<256>(a, plan, workspace, workspace_bytes, stream);
  default:
    return cudaErrorInvalidValue;
  }
}

} // namespace kvkit::cuda
