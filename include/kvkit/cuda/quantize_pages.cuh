#pragma once
//! Bulk page quantization on the GPU: K/V of whole pages (fp32, fp16 or bf16) into a paged cache in
//! any kvkit codec and layout, scales included, and back. Bit-exact with kvkit::reference.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "kvkit/concepts/kv_codec.hpp"
#include "kvkit/concepts/page_layout.hpp"
#include "kvkit/cuda/detail/checks.cuh"
#include "kvkit/cuda/detail/elements.cuh"
#include "kvkit/cuda/detail/page_codecs.cuh"
#include "kvkit/error.hpp"
#include "kvkit/layout/page_layout.hpp"
#include "kvkit/quant/codecs.hpp"

namespace kvkit::cuda {

//! Element types the page kernels read and write outside the cache.
template <class T>
concept page_element =
    std::is_same_v<T, float> || std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>;

//! Arguments shared by quantize_pages and dequantize_pages. All pointers are device pointers;
//! the cache, k and v 16-byte aligned.
template <page_layout Layout, page_element T>
struct page_batch {
  Layout layout;                          //!< page geometry and codecs
  std::byte* cache = nullptr;             //!< [capacity][layout.bytes_per_page()] one layer
  std::int32_t capacity = 0;              //!< pages in `cache`
  const std::int32_t* page_ids = nullptr; //!< [num_pages] pages to write (distinct) or read
  std::int32_t num_pages = 0;             //!< pages in this batch
  T* k = nullptr;                         //!< [num_pages][page_size][kv_heads][head_dim]
  T* v = nullptr;                         //!< same shape as k
  const float* static_scales = nullptr;   //!< [2][kv_heads]: K's then V's (fp8 codecs)
  //! Debug mode when set (a device int): every page id is checked against [0, capacity); a bad
  //! one sets *page_check to 1 and its page is left alone (quantize_pages does not write it,
  //! dequantize_pages does not read it and leaves its rows of k and v as they were).
  std::int32_t* page_check = nullptr;
};

namespace detail {

// Tokens one CTA of the rows, runs and dequantize kernels covers: their loads are issued
// together, so each thread keeps this many accesses in flight.
inline constexpr std::int32_t tokens_per_cta = 4;

// Registers of the per-channel quantizer, and so the most threads a CTA of it can have: each warp
// holds its registers in units of 256, and a CTA at most 65536 of them. A page's channels take
// CTAs of that many threads along the grid's y, so the kernel takes up to 65535 of them.
inline constexpr int columns_registers = 72;
inline constexpr unsigned columns_max_threads =
    65536 / ((columns_registers * 32 + 255) / 256 * 256) * 32;

// Registers of the row kernels (quantize_rows_kernel, dequantize_rows_kernel,
// dequantize_columns_kernel), whose CTAs cover a whole row of a page, up to 1024 threads (64 KV
// heads of 128 channels). A CTA of 1024 threads fits an SM's 65536 registers only at 64 or fewer
// a thread, so the cap holds the compiler to that on every architecture the PTX is compiled for.
// Without a cap these kernels took 32-47 (sm_90a); a cap of 64 let them take up to 64, and 48
// keeps them where they were: both measured the same as no cap (H100, 2026-12-05).
inline constexpr int row_kernel_registers = 48;

//! Whether the page kernels and write_kv take pages of layout `l`: a paged_layout of the
//! library's codecs (device_layout), a valid layout with head_dim a multiple of 8 (the kernels move
//! 8 channels at a time), 64, 128 or 256 for a codec with one scale per token and head (int8: its
//! quantizer reduces a head's row across 2, 4 or 8 lanes), and a page region of at most 2^31 bits
//! (the kernels locate codes in 32-bit arithmetic).
template <class Layout>
[[nodiscard]] bool page_kernels_fit(const Layout& l) {
  using K = typename Layout::k_codec;
  using V = typename Layout::v_codec;
  const auto head_dim_fits = [&](auto codec) {
    using C = typename decltype(codec)::type;
    if constexpr (C::scaling == kv_scaling::per_token_head) {
      return l.head_dim() == 64 || l.head_dim() == 128 || l.head_dim() == 256;
    }
    return true;
  };
  constexpr std::int64_t widest = K::bits > V::bits ? K::bits : V::bits;
  return device_layout<Layout> && l.validate().ok() && l.head_dim() % 8 == 0 &&
         head_dim_fits(std::type_identity<K>{}) && head_dim_fits(std::type_identity<V>{}) &&
         l.elements() * widest <= (std::int64_t{1} << 31);
}

} // namespace detail

//! bad_argument unless the layout fits the kernels (the library's codecs, head_dim a multiple of 8
//! and, for per-token-head codecs, 64, 128 or 256; a page's K or V region at most 2^31 bits; pages
//! of at most 262140 tokens; for a per-channel codec, at most 65535 * 896 four-channel quads a
//! token, over 234 million channels), the batch is non-negative, and when there is work the
//! pointers that the codecs need are set, the cache, k and v 16-byte aligned (the kernels move 16
//! bytes at a time; a misaligned access would fault on the device), the page ids, fp8 scales and
//! debug flag aligned to their elements, and capacity > 0.
template <page_layout Layout, page_element T>
[[nodiscard]] status validate(const page_batch<Layout, T>& b) {
  const auto& l = b.layout;
  // The kernels take a page's tokens in blocks along the grid's y (at most 65535).
  if (!detail::page_kernels_fit(l) ||
      l.page_size() > detail::tokens_per_cta * detail::max_grid_rows || b.num_pages < 0) {
    return errc::bad_argument;
  }
  constexpr bool per_channel = Layout::k_codec::scaling == kv_scaling::per_page_channel ||
                               Layout::v_codec::scaling == kv_scaling::per_page_channel;
  if (per_channel && static_cast<std::int64_t>(l.num_kv_heads()) * l.head_dim() / 4 >
                         detail::max_grid_rows * detail::columns_max_threads) {
    return errc::bad_argument;
  }
  if (b.num_pages > 0 &&
      (b.cache == nullptr || b.page_ids == nullptr || b.k == nullptr || b.v == nullptr ||
       b.capacity <= 0 || (Layout::has_static_scales && b.static_scales == nullptr) ||
       !detail::aligned<16>(b.cache) || !detail::aligned<16>(b.k) || !detail::aligned<16>(b.v) ||
       !detail::elements_aligned(b.page_ids, b.static_scales, b.page_check))) {
    return errc::bad_argument;
  }
  return {};
}

namespace detail {

// Eight codes of C, packed as they lie in the page: 16 bytes (16-bit), 8 (8-bit) or 4 (4-bit).
template <kv_codec C>
__device__ inline void store_codes(std::byte* dst, const std::uint32_t (&q)[8]) {
  if constexpr (C::bits == 16) {
    *reinterpret_cast<uint4*>(dst) = make_uint4(q[0] | (q[1] << 16), q[2] | (q[3] << 16),
                                                q[4] | (q[5] << 16), q[6] | (q[7] << 16));
  } else if constexpr (C::bits == 8) {
    *reinterpret_cast<uint2*>(dst) = make_uint2(q[0] | (q[1] << 8) | (q[2] << 16) | (q[3] << 24),
                                                q[4] | (q[5] << 8) | (q[6] << 16) | (q[7] << 24));
  } else {
    std::uint32_t w = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      w |= (q[i] & 0xFU) << (4 * i);
    }
    *reinterpret_cast<std::uint32_t*>(dst) = w;
  }
}

template <kv_codec C>
__device__ inline void load_codes(const std::byte* src, std::uint32_t (&q)[8]) {
  if constexpr (C::bits == 16) {
    const uint4 w = *reinterpret_cast<const uint4*>(src);
    const std::uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      q[2 * i] = words[i] & 0xFFFFU;
      q[2 * i + 1] = words[i] >> 16;
    }
  } else if constexpr (C::bits == 8) {
    const uint2 w = *reinterpret_cast<const uint2*>(src);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      q[i] = (w.x >> (8 * i)) & 0xFFU;
      q[4 + i] = (w.y >> (8 * i)) & 0xFFU;
    }
  } else {
    const std::uint32_t w = *reinterpret_cast<const std::uint32_t*>(src);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      q[i] = (w >> (4 * i)) & 0xFU;
    }
  }
}

// Eight values of codec C decoded as C::decode gives them: `c` and `p` are the codes and
// parameters as loaded (from `codes_at` and `params_at`; for fp8, `scales[head]`). True where
// decode8's straight-line path took them (no NaN code, finite parameters); false where the codec's
// scalar code did, from the page again (it canonicalizes NaN).
template <kv_codec C>
__device__ inline bool decode8_exact(const code_chunk<C>& c, const chunk_params& p,
                                     const std::byte* codes_at, const std::byte* params_at,
                                     const float* scales, std::int32_t head, float (&x)[8]) {
  if (decode8<C>(c, p, x)) {
    return true;
  }
  std::uint32_t q[8];
  load_codes<C>(codes_at, q);
  typename C::params cp{};
  if constexpr (C::scaling == kv_scaling::static_per_head) {
    cp = C::with_scale(scales[head]);
  } else if constexpr (C::param_bytes > 0) {
    cp = C::load(params_at);
  }
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    x[i] = C::decode(q[i], cp);
  }
  return false;
}

// Where a token row comes from and goes: its input (nullptr when there is no such token), its
// page and its token index in the page.
template <class T>
struct row_ref {
  const T* src;
  std::byte* page;
  std::int32_t token;
};

// Eight input values as loaded: one 16-byte vector (16-bit types) or two (float).
template <class T>
struct raw8 {
  uint4 v[sizeof(T) == 4 ? 2 : 1];
};

template <class T>
__device__ inline raw8<T> load_raw8(const T* src) {
  raw8<T> r;
#pragma unroll
  for (int j = 0; j < static_cast<int>(sizeof(T)) / 2; ++j) {
    r.v[j] = reinterpret_cast<const uint4*>(src)[j];
  }
  return r;
}

template <class T>
__device__ inline void widen8(const raw8<T>& r, float (&x)[8]) {
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const uint4& q = r.v[sizeof(T) == 4 ? i / 4 : 0];
    const int k = sizeof(T) == 4 ? i % 4 : i / 2;
    const std::uint32_t w = k == 0 ? q.x : k == 1 ? q.y : k == 2 ? q.z : q.w;
    if constexpr (std::is_same_v<T, float>) {
      x[i] = __uint_as_float(w);
    } else {
      x[i] = widen_half<T>(w, i % 2);
    }
  }
}

// Quantizes up to tokens_per_cta token rows of one region (K or V) in a codec without per-token
// parameters (fp16, bf16, fp8): row u is rows.row(u); thread i takes the i-th chunk of eight
// channels of every row, so consecutive lanes read consecutive 16 bytes. Inputs stay packed until
// they are coded. Shared by whole-page quantization and write_kv.
template <kv_codec C, class Layout, class Rows>
__device__ void quantize_token_rows(const Layout& l, const Rows& rows, std::int64_t data_offset,
                                    const float* scales) {
  static_assert(C::scaling == kv_scaling::none || C::scaling == kv_scaling::static_per_head);
  using T = std::remove_cv_t<std::remove_pointer_t<decltype(rows.row(0).src)>>;
  const auto cpr = static_cast<std::uint32_t>(l.head_dim() / 8); // chunks per head
  const auto chunks = static_cast<std::uint32_t>(l.num_kv_heads()) * cpr;
  const std::int32_t code_step = static_cast<std::int32_t>(l.token_stride());
  for (std::uint32_t chunk = threadIdx.x; chunk < chunks; chunk += blockDim.x) {
    const auto head = static_cast<std::int32_t>(chunk / cpr);
    const auto channel = static_cast<std::int32_t>(chunk % cpr) * 8;
    // Offset of token 0's chunk (elements); each token adds its step.
    const auto codes_at = static_cast<std::int32_t>(l.element_index(0, head, channel));
    bool valid[tokens_per_cta];
    raw8<T> raw[tokens_per_cta];
#pragma unroll
    for (int u = 0; u < tokens_per_cta; ++u) {
      const auto* src = rows.row(u).src;
      valid[u] = src != nullptr;
      if (valid[u]) {
        raw[u] = load_raw8(src + static_cast<std::int64_t>(chunk) * 8);
      }
    }
    float inv = 1.0F;
    if constexpr (C::scaling == kv_scaling::static_per_head) {
      inv = C::with_scale(scales[head]).inv;
    }
#pragma unroll
    for (int u = 0; u < tokens_per_cta; ++u) {
      if (valid[u]) {
        const auto r = rows.row(u); // again, rather than holding four rows' places in registers
        float x[8];
        widen8(raw[u], x);
        *reinterpret_cast<code_chunk<C>*>(r.page + data_offset +
                                          (codes_at + r.token * code_step) * C::bits / 8) =
            encode8<C>(x, inv);
      }
    }
  }
}

// Rows of whole pages: tokens token0 .. token0 + 3 of one page, read from contiguous input.
template <class T>
struct page_rows {
  const T* first;
  std::int64_t row_elems;
  std::int32_t token0;
  std::int32_t tokens;
  std::byte* dest;
  __device__ row_ref<T> row(int u) const {
    return {u < tokens ? first + u * row_elems : nullptr, dest, token0 + u};
  }
  // The rows of this CTA: page blockIdx.x of the batch (cache page `page_id`), tokens from
  // blockIdx.y * tokens_per_cta.
  template <class Layout>
  __device__ static page_rows of_block(const Layout& l, const T* src, std::byte* cache,
                                       std::int32_t page_id) {
    const auto page_index = static_cast<std::int32_t>(blockIdx.x);
    const auto token0 = static_cast<std::int32_t>(blockIdx.y) * tokens_per_cta;
    const std::int64_t row_elems = static_cast<std::int64_t>(l.num_kv_heads()) * l.head_dim();
    return {src + (static_cast<std::int64_t>(page_index) * l.page_size() + token0) * row_elems,
            row_elems, token0,
            l.page_size() - token0 < tokens_per_cta ? l.page_size() - token0 : tokens_per_cta,
            cache + static_cast<std::int64_t>(page_id) * l.bytes_per_page()};
  }
};

template <kv_codec C, bool Checked, class Layout, class T>
__global__ void __maxnreg__(row_kernel_registers)
    quantize_rows_kernel(Layout l, const T* src, std::byte* cache, const std::int32_t* page_ids,
                         std::int64_t data_offset, const float* scales, page_guard guard) {
  const std::int32_t page_id = page_ids[static_cast<std::int32_t>(blockIdx.x)];
  if (guard.rejects<Checked>(page_id)) {
    return;
  }
  const auto rows = page_rows<T>::of_block(l, src, cache, page_id);
  quantize_token_rows<C>(l, rows, data_offset, scales);
}

// Rows of new tokens, each to its own slot (`block * page_size + offset`; negative: skip).
// `Checked`: in the debug mode, slots at or past slot_limit (page_guard::slot_limit) are skipped
// too; the unchecked rows are the kernels' own, unchanged by the mode.
template <class T, bool Checked>
struct slot_rows {
  const T* first;
  std::int64_t row_elems;
  const std::int64_t* slots;
  std::int32_t first_token;
  std::int32_t num_tokens;
  std::byte* cache;
  std::int64_t bytes_per_page;
  std::int32_t page_size;
  std::int64_t slot_limit;
  __device__ row_ref<T> row(int u) const {
    const std::int64_t slot = first_token + u < num_tokens ? slots[first_token + u] : -1;
    // Negative slots (padding) and, checked, slots past the cache (negative ones as unsigned are
    // past it too).
    if (Checked ? static_cast<std::uint64_t>(slot) >= static_cast<std::uint64_t>(slot_limit)
                : slot < 0) {
      return {nullptr, nullptr, 0};
    }
    // The slot's page and offset without a 64-bit division where a shift or a 32-bit one will do.
    std::int64_t block;
    std::int32_t offset;
    if ((page_size & (page_size - 1)) == 0) {
      block = slot >> (__ffs(page_size) - 1);
      offset = static_cast<std::int32_t>(slot & (page_size - 1));
    } else if (slot <= 0xFFFFFFFFLL) {
      const auto b32 = static_cast<std::uint32_t>(slot) / static_cast<std::uint32_t>(page_size);
      block = b32;
      offset = static_cast<std::int32_t>(static_cast<std::uint32_t>(slot) -
                                         b32 * static_cast<std::uint32_t>(page_size));
    } else {
      block = slot / page_size;
      offset = static_cast<std::int32_t>(slot - block * page_size);
    }
    return {first + u * row_elems, cache + block * bytes_per_page, offset};
  }
};

template <kv_codec C, bool Checked, class Layout, class T>
__global__ void __maxnreg__(row_kernel_registers)
    dequantize_rows_kernel(Layout l, const std::byte* cache, const std::int32_t* page_ids,
                           std::int64_t data_offset, std::int64_t param_offset, T* dst,
                           const float* scales, page_guard guard) {
  const auto page_index = static_cast<std::int32_t>(blockIdx.x);
  const std::int32_t page_id = page_ids[page_index];
  if (guard.rejects<Checked>(page_id)) {
    return;
  }
  const auto token0 = static_cast<std::int32_t>(blockIdx.y) * tokens_per_cta;
  const std::int32_t tokens = min(tokens_per_cta, l.page_size() - token0);
  const std::byte* page = cache + static_cast<std::int64_t>(page_id) * l.bytes_per_page();
  const auto cpr = static_cast<std::uint32_t>(l.head_dim() / 8);
  const auto chunks = static_cast<std::uint32_t>(l.num_kv_heads()) * cpr;
  const std::int32_t row_elems = l.num_kv_heads() * l.head_dim();
  // Bytes from one token's codes to the next; the product in 64 bits (at page size 1 a token's
  // stride is the whole region, whose 2^31 bits fit no int32).
  const auto code_step = static_cast<std::int32_t>(l.token_stride() * C::bits / 8);
  const std::int32_t param_step =
      static_cast<std::int32_t>(l.template param_token_stride<C>()) * C::param_bytes;
  T* rows = dst + (static_cast<std::int64_t>(page_index) * l.page_size() + token0) * row_elems;
  for (std::uint32_t chunk = threadIdx.x; chunk < chunks; chunk += blockDim.x) {
    const auto head = static_cast<std::int32_t>(chunk / cpr);
    const auto channel = static_cast<std::int32_t>(chunk % cpr) * 8;
    const std::byte* codes_at =
        page + data_offset +
        static_cast<std::int32_t>(l.element_index(token0, head, channel)) * C::bits / 8;
    const std::byte* params_at =
        page + param_offset +
        static_cast<std::int32_t>(l.template param_index<C>(token0, head, channel)) *
            C::param_bytes;
    T* out = rows + chunk * 8;
    // Codes and parameters of every token first, so their loads are in flight together.
    code_chunk<C> codes[tokens_per_cta];
    chunk_params p[tokens_per_cta];
#pragma unroll
    for (int u = 0; u < tokens_per_cta; ++u) {
      if (u < tokens) {
        codes[u] = load_chunk<C>(codes_at + u * code_step);
        if constexpr (C::scaling == kv_scaling::static_per_head) {
          p[u] = {scales[head], 0.0F};
        } else if constexpr (C::param_bytes > 0) {
          p[u] = load_chunk_params<C>(params_at + u * param_step);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < tokens_per_cta; ++u) {
      if (u < tokens) {
        T* o = out + u * row_elems;
        float x[8];
        if (decode8_exact<C>(codes[u], p[u], codes_at + u * code_step, params_at + u * param_step,
                             scales, head, x)) {
          if constexpr (std::is_same_v<passthrough_element<C>, T>) {
            *reinterpret_cast<uint4*>(o) = codes[u]; // decode then encode: the same bits
          } else {
            store8_non_nan(o, x);
          }
        } else { // NaN codes or parameters: the codec's scalar code canonicalized NaN
          store8(o, x);
        }
      }
    }
  }
}

// Registers a thread of the runs kernels may use: with 16-bit inputs (a run in 16 registers) 40
// lets 12 CTAs of 128 threads share an SM, so enough warps hide the latency of each run's chain
// (loads, reduction, division, codes); float inputs take twice the registers.
template <class T>
inline constexpr int run_kernel_registers = sizeof(T) == 4 ? 64 : 40;

// Channels one lane of quantize_runs_kernel handles.
inline constexpr std::int32_t lane_channels = 32;

// Lanes of quantize_runs_kernel that share one parameter set.
template <kv_codec C>
__device__ inline int run_group_lanes(std::int32_t head_dim) {
  if constexpr (C::scaling == kv_scaling::per_token_group) {
    return C::group_size / lane_channels;
  } else {
    return head_dim / lane_channels;
  }
}

// The parameters the codec's scalar code derives for a lane's run and the lanes sharing its group
// (non-finite values left out), reduced across those lanes. Every lane of the warp must call it.
template <kv_codec C, class V>
__device__ inline typename C::params exact_run_params(const V& x, int lanes) {
  if constexpr (C::scaling == kv_scaling::per_token_head) {
    float amax = 0.0F;
#pragma unroll
    for (int i = 0; i < lane_channels; ++i) {
      const float a = fabsf(x.fresh(i));
      amax = kvkit::detail::finite(a) && a > amax ? a : amax;
    }
    for (int off = lanes / 2; off > 0; off /= 2) {
      amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFU, amax, off));
    }
    return C::from_amax(amax);
  } else {
    const float inf = __int_as_float(0x7F800000);
    float lo = inf;
    float hi = -inf;
    int any = 0;
#pragma unroll
    for (int i = 0; i < lane_channels; ++i) {
      const float v = x.fresh(i);
      if (kvkit::detail::finite(v)) {
        lo = fminf(lo, v);
        hi = fmaxf(hi, v);
        any = 1;
      }
    }
    for (int off = lanes / 2; off > 0; off /= 2) {
      lo = fminf(lo, __shfl_xor_sync(0xFFFFFFFFU, lo, off));
      hi = fmaxf(hi, __shfl_xor_sync(0xFFFFFFFFU, hi, off));
      any |= __shfl_xor_sync(0xFFFFFFFFU, any, off);
    }
    return C::from_range({lo, hi, any != 0});
  }
}

// Codecs with per-token parameters (int8, int4 groups), quantizing: each lane takes a run of 32
// adjacent channels of one token, so a group's parameters (a range reduction, two fp16
// conversions, a division and a reciprocal) are derived once per 32 values instead of once per 8.
// Work item i of the CTA's `tokens_per_cta` rows is row i / cpt's run i % cpt (cpt = runs per
// token). Loops are warp-uniform, so every lane takes part in the shuffles; a group's lanes are
// adjacent and never mix valid and idle lanes, because a token holds whole groups and a group's
// lane count is a power of two. Runs whose group is finite take the straight-line encoders of
// page_codecs.cuh (the same codes); a warp with a NaN or Inf in any group takes the scalar codec.
template <kv_codec C, class Layout, class Rows>
__device__ void quantize_token_runs(const Layout& l, const Rows& rows, std::int64_t data_offset,
                                    std::int64_t param_offset) {
  const auto rph = static_cast<std::uint32_t>(l.head_dim() / lane_channels); // runs per head
  const auto cpt = static_cast<std::uint32_t>(l.num_kv_heads()) * rph;       // runs per token
  const auto items = static_cast<std::uint32_t>(tokens_per_cta) * cpt;
  const int lanes = run_group_lanes<C>(l.head_dim());
  const std::int32_t group =
      C::scaling == kv_scaling::per_token_group ? C::group_size : l.head_dim();
  for (std::uint32_t base = threadIdx.x & ~31U; base < items; base += blockDim.x) {
    const std::uint32_t item = base + (threadIdx.x & 31U);
    const auto t = static_cast<int>(item / cpt);
    const std::uint32_t run = item % cpt;
    const auto r = item < items ? rows.row(t) : decltype(rows.row(0)){nullptr, nullptr, 0};
    const auto* src = r.src;
    const bool valid = src != nullptr;
    const auto head = static_cast<std::int32_t>(run / rph);
    const auto channel = static_cast<std::int32_t>(run % rph) * lane_channels;
    run_values<std::remove_cv_t<std::remove_pointer_t<decltype(src)>>> x;
    if (valid) {
      x.load(src + static_cast<std::int64_t>(run) * lane_channels);
    } else {
      x.clear();
    }
    // The straight-line path: the group's range (or largest magnitude), NaN-propagating.
    typename C::params p;
    bool finite_group;
    const float inf = __int_as_float(0x7F800000);
    if constexpr (C::scaling == kv_scaling::per_token_head) {
      float amax = run_amax(x);
      for (int off = lanes / 2; off > 0; off /= 2) {
        amax = max_nan(amax, __shfl_xor_sync(0xFFFFFFFFU, amax, off));
      }
      p = C::from_amax(amax);
      finite_group = amax < inf && p.inv < inf; // false for NaN too
    } else {
      float lo;
      float hi;
      run_range(x, lo, hi);
      for (int off = lanes / 2; off > 0; off /= 2) {
        lo = min_nan(lo, __shfl_xor_sync(0xFFFFFFFFU, lo, off));
        hi = max_nan(hi, __shfl_xor_sync(0xFFFFFFFFU, hi, off));
      }
      p = lo >= -65504.0F && hi <= 65504.0F ? int4_params_in_range(lo, hi)
                                            : C::from_range({lo, hi, true});
      // Saturated parameters (a range beyond fp16's) need the scalar encoder's clamps.
      finite_group = lo >= -65504.0F && hi < inf && p.scale < 65504.0F;
    }
    const bool fast = __all_sync(0xFFFFFFFFU, finite_group);
    if (!fast) {
      p = exact_run_params<C>(x, lanes); // every lane: the shuffles use the full mask
    }
    if (valid) {
      const std::int32_t token = r.token;
      std::byte* page = r.page;
      std::byte* out = page + data_offset + l.element_index(token, head, channel) * C::bits / 8;
      if (fast) {
        if constexpr (C::scaling == kv_scaling::per_token_head) {
          const auto codes = encode_run_int8(x, p.inv);
          reinterpret_cast<uint4*>(out)[0] = codes.word[0];
          reinterpret_cast<uint4*>(out)[1] = codes.word[1];
        } else {
          *reinterpret_cast<uint4*>(out) = encode_run_int4(x, p.zero, p.inv).word[0];
        }
      } else {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          std::uint32_t q[8];
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            q[i] = C::encode(x.fresh(8 * j + i), p);
          }
          store_codes<C>(out + 8 * j * C::bits / 8, q);
        }
      }
      if (channel % group == 0) {
        C::store(p, page + param_offset +
                        l.template param_index<C>(token, head, channel) * C::param_bytes);
      }
    }
  }
}

template <kv_codec C, bool Checked, class Layout, class T>
__global__ void __maxnreg__(run_kernel_registers<T>)
    quantize_runs_kernel(Layout l, const T* src, std::byte* cache, const std::int32_t* page_ids,
                         std::int64_t data_offset, std::int64_t param_offset, page_guard guard) {
  const std::int32_t page_id = page_ids[static_cast<std::int32_t>(blockIdx.x)];
  if (guard.rejects<Checked>(page_id)) {
    return;
  }
  const auto rows = page_rows<T>::of_block(l, src, cache, page_id);
  quantize_token_runs<C>(l, rows, data_offset, param_offset);
}

// Whether codec C is quantized by the runs kernels (per-token parameters).
template <kv_codec C>
inline constexpr bool quantized_by_runs =
    C::scaling == kv_scaling::per_token_head || C::scaling == kv_scaling::per_token_group;

// write_kv, one region (K or V): the CTA's tokens_per_cta new tokens, each to its own slot;
// `Checked`: in the debug mode (`guard`).
template <kv_codec C, bool Checked, class Layout, class T>
__device__ void write_region(const Layout& l, const T* src, const std::int64_t* slots,
                             std::int32_t num_tokens, std::byte* cache, std::int64_t data_offset,
                             std::int64_t param_offset, const float* scales, page_guard guard) {
  const auto first = static_cast<std::int32_t>(blockIdx.x) * tokens_per_cta;
  const std::int64_t row_elems = static_cast<std::int64_t>(l.num_kv_heads()) * l.head_dim();
  const std::int64_t slot_limit = guard.slot_limit<Checked>(l.page_size());
  // The debug mode's flag, a thread per token (the rows skip such slots on their own).
  if (Checked && threadIdx.x < tokens_per_cta &&
      first + static_cast<std::int32_t>(threadIdx.x) < num_tokens &&
      slots[first + static_cast<std::int32_t>(threadIdx.x)] >= slot_limit) {
    atomicExch(guard.flag, 1);
  }
  const slot_rows<T, Checked> rows{
      src + first * row_elems, row_elems,     slots,     first, num_tokens, cache,
      l.bytes_per_page(),      l.page_size(), slot_limit};
  if constexpr (quantized_by_runs<C>) {
    quantize_token_runs<C>(l, rows, data_offset, param_offset);
  } else if constexpr (C::scaling != kv_scaling::per_page_channel) {
    quantize_token_rows<C>(l, rows, data_offset, scales);
  } // per-channel codecs need whole pages: validate() rejects them before launch
}

// Registers of the write_kv kernel: the runs quantizer's cap when both regions use it, else 48
// (the rows quantizer's need; 10 CTAs of 128 threads per SM).
template <kv_codec KC, kv_codec VC, class T>
inline constexpr int write_kv_registers =
    quantized_by_runs<KC>&& quantized_by_runs<VC> ? run_kernel_registers<T> : 48;

// write_kv in one launch: blockIdx.y 0 writes K, 1 writes V. Both regions' CTAs need the same
// threads (tokens_per_cta runs of 32 channels = one chunk of 8 per thread per token). `Checked`:
// the debug mode's build (`guard` has a flag), a kernel of its own so that the checks of every
// row cost the ordinary one nothing.
template <kv_codec KC, kv_codec VC, bool Checked, class Layout, class T>
__global__ void __maxnreg__((write_kv_registers<KC, VC, T>))
    write_kv_kernel(Layout l, const T* k, const T* v, const std::int64_t* slots,
                    std::int32_t num_tokens, std::byte* cache, const float* static_scales,
                    page_guard guard) {
  if (blockIdx.y == 0) {
    write_region<KC, Checked>(l, k, slots, num_tokens, cache, l.k_data_offset(), l.k_param_offset(),
                              static_scales, guard);
  } else {
    write_region<VC, Checked>(l, v, slots, num_tokens, cache, l.v_data_offset(), l.v_param_offset(),
                              static_scales == nullptr ? nullptr : static_scales + l.num_kv_heads(),
                              guard);
  }
}

// Four adjacent input values (channels c..c+3 of one token) as loaded, and widened.
template <class T>
using quad_raw = std::conditional_t<std::is_same_v<T, float>, float4, uint2>;

template <class T>
__device__ inline void widen_quad(const quad_raw<T>& r, float (&x)[4]) {
  if constexpr (std::is_same_v<T, float>) {
    x[0] = r.x;
    x[1] = r.y;
    x[2] = r.z;
    x[3] = r.w;
  } else {
    x[0] = widen_half<T>(r.x, 0);
    x[1] = widen_half<T>(r.x, 1);
    x[2] = widen_half<T>(r.y, 0);
    x[3] = widen_half<T>(r.y, 1);
  }
}

// Per-channel codecs: one CTA per page, a thread per four adjacent channels (one 2-byte code word
// per token), so a warp reads 128 adjacent channels of a token at once and writes their 64 code
// bytes, and a thread ranges, parameterizes and codes its channels alone: no shuffles, no shared
// parameter math. Pages of up to `held` tokens are loaded once and kept in registers; longer
// ones are read twice (range, then codes). Ranges are NaN-propagating; when every value is
// finite and within ±65504, the zero point (rounded down) and the scale put every
// (x - zero) * inv in [0, 15.5), so codes need no clamp. Otherwise the thread ranges its channels
// again as the scalar code does and codes with it.
template <kv_codec C, bool Checked, class Layout, class T>
__global__ void __maxnreg__(columns_registers)
    quantize_columns_kernel(Layout l, const T* src, std::byte* cache, const std::int32_t* page_ids,
                            std::int64_t data_offset, std::int64_t param_offset, page_guard guard) {
  static_assert(C::bits == 4 && C::param_bytes == 4);
  constexpr int held = sizeof(T) == 4 ? 8 : 16; // tokens kept in 32 registers
  constexpr int batch = 8; // tokens whose loads are in flight together, longer pages
  const auto page_index = static_cast<std::int32_t>(blockIdx.x);
  const std::int32_t page_id = page_ids[page_index];
  if (guard.rejects<Checked>(page_id)) {
    return;
  }
  std::byte* page = cache + static_cast<std::int64_t>(page_id) * l.bytes_per_page();
  const T* base = src + static_cast<std::int64_t>(page_index) * l.elements();
  const std::int32_t dim = l.head_dim();
  const std::int32_t tokens = l.page_size();
  const std::int32_t row = l.num_kv_heads() * dim; // input elements per token
  const std::int32_t word_step =
      static_cast<std::int32_t>(l.token_stride()) / 4; // code words (4 channels) per token
  const float inf = __int_as_float(0x7F800000);
  const auto quad = static_cast<std::int32_t>(blockIdx.y * blockDim.x + threadIdx.x);
  if (quad < row / 4) {
    const std::int32_t h = 4 * quad / dim;
    const std::int32_t c = 4 * quad % dim;
    const T* in = base + 4 * quad;
    // Byte pointers to token 0's values and code word; token t adds t times a uniform step.
    const auto* in_bytes = opaque(reinterpret_cast<const char*>(in));
    auto* out_bytes =
        opaque(reinterpret_cast<char*>(reinterpret_cast<std::uint16_t*>(page + data_offset) +
                                       static_cast<std::int32_t>(l.element_index(0, h, c)) / 4));
    const auto row_bytes = static_cast<std::int64_t>(row) * static_cast<std::int64_t>(sizeof(T));
    const auto word_bytes = static_cast<std::int64_t>(word_step) * 2;
    // Token t's values, or the last token's past the page (they leave a range unchanged):
    // loads without branches.
    const auto load = [&](std::int32_t t) {
      return __ldg(reinterpret_cast<const quad_raw<T>*>(in_bytes + min(t, tokens - 1) * row_bytes));
    };
    // fn(t, values) for every token, `batch` tokens' loads in flight.
    const auto each_token = [&](auto&& fn) {
      for (std::int32_t t0 = 0; t0 < tokens; t0 += batch) {
        quad_raw<T> w[batch];
#pragma unroll
        for (int u = 0; u < batch; ++u) {
          w[u] = load(t0 + u);
        }
#pragma unroll
        for (int u = 0; u < batch; ++u) {
          fn(t0 + u, w[u]);
        }
      }
    };
    // Ranges: 16-bit inputs stay packed (one min or max per two values), floats per value.
    float lo[4] = {inf, inf, inf, inf};
    float hi[4] = {-inf, -inf, -inf, -inf};
    constexpr std::uint32_t inf2 = std::is_same_v<T, __half> ? 0x7C007C00U : 0x7F807F80U;
    std::uint32_t lo2[2] = {inf2, inf2};
    std::uint32_t hi2[2] = {inf2 | 0x80008000U, inf2 | 0x80008000U};
    const auto extend = [&](std::int32_t /*t*/, const quad_raw<T>& r) {
      if constexpr (std::is_same_v<T, float>) {
        float x[4];
        widen_quad<T>(r, x);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          lo[j] = min_nan(lo[j], x[j]);
          hi[j] = max_nan(hi[j], x[j]);
        }
      } else {
        extend2_nan<T>(lo2[0], hi2[0], r.x);
        extend2_nan<T>(lo2[1], hi2[1], r.y);
      }
    };
    quad_raw<T> v[held];
    const bool hold = tokens <= held;
    if (hold) {
#pragma unroll
      for (int u = 0; u < held; ++u) {
        v[u] = load(u);
      }
#pragma unroll
      for (int u = 0; u < held; ++u) {
        extend(u, v[u]);
      }
    } else {
      each_token(extend);
    }
    if constexpr (!std::is_same_v<T, float>) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        lo[j] = widen_half<T>(lo2[j / 2], j % 2);
        hi[j] = widen_half<T>(hi2[j / 2], j % 2);
      }
    }
    bool fast = true;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      fast = fast && lo[j] >= -65504.0F && hi[j] <= 65504.0F; // false for NaN too
    }
    typename C::params p[4];
    if (fast) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        p[j] = int4_params_in_range(lo[j], hi[j]);
      }
    } else {
      kvkit::detail::finite_range f[4];
      for (std::int32_t t = 0; t < tokens; ++t) {
        float x[4];
        widen_quad<T>(load(t), x);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          f[j].add(x[j]);
        }
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        p[j] = C::from_range(f[j]);
      }
    }
    // The four channels' parameters are adjacent: one 16-byte store. Both are fp16 values
    // (never NaN), so one paired conversion gives their bits exactly.
    std::uint32_t packed[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      packed[j] = narrow_pair<__half>(p[j].scale, p[j].zero);
    }
    *reinterpret_cast<uint4*>(page + param_offset +
                              l.template param_index<C>(0, h, c) * C::param_bytes) =
        make_uint4(packed[0], packed[1], packed[2], packed[3]);
    // Codes every token with word(values): from registers when the page is held.
    const auto code = [&](auto&& word) {
      const auto store = [&](std::int32_t t, const quad_raw<T>& r) {
        float x[4];
        widen_quad<T>(r, x);
        const std::uint32_t w = word(x);
        if (t < tokens) {
          asm volatile("st.global.b16 [%0], %1;" ::"l"(out_bytes + t * word_bytes),
                       "h"(static_cast<std::uint16_t>(w)));
        }
      };
      if (hold) {
#pragma unroll
        for (int u = 0; u < held; ++u) {
          store(u, v[u]);
        }
      } else {
        each_token(store);
      }
    };
    if (fast) {
      code([&](const float(&x)[4]) {
        std::uint32_t b[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          b[j] = round_bits(__fmul_rn(__fsub_rn(x[j], p[j].zero), p[j].inv)); // low byte: code
        }
        // Bits 8-15 of each b are zero, so b0 + 16 * b1 has codes 0 and 1 in its low byte.
        return __byte_perm(b[0] + 16U * b[1], b[2] + 16U * b[3], 0x0040U);
      });
    } else {
      code([&](const float(&x)[4]) {
        std::uint32_t w = 0;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          w |= (C::encode(x[j], p[j]) & 0xFU) << (4 * j);
        }
        return w;
      });
    }
  }
}

// Per-channel codecs, decoding: a thread reads its eight channels' parameters once, then decodes
// a 4-byte word per token, four tokens' loads at a time.
template <kv_codec C, bool Checked, class Layout, class T>
__global__ void __maxnreg__(row_kernel_registers)
    dequantize_columns_kernel(Layout l, const std::byte* cache, const std::int32_t* page_ids,
                              std::int64_t data_offset, std::int64_t param_offset, T* dst,
                              page_guard guard) {
  const auto page_index = static_cast<std::int32_t>(blockIdx.x);
  const std::int32_t page_id = page_ids[page_index];
  if (guard.rejects<Checked>(page_id)) {
    return;
  }
  const std::byte* page = cache + static_cast<std::int64_t>(page_id) * l.bytes_per_page();
  T* base = dst + static_cast<std::int64_t>(page_index) * l.elements();
  const std::int32_t heads = l.num_kv_heads();
  const std::int32_t dim = l.head_dim();
  const std::int32_t tokens = l.page_size();
  const std::int32_t row = heads * dim;
  const std::int32_t code_step = static_cast<std::int32_t>(l.token_stride());
  constexpr int batch = 4;
  for (std::int32_t col = static_cast<std::int32_t>(threadIdx.x); col < heads * dim / 8;
       col += static_cast<std::int32_t>(blockDim.x)) {
    const std::int32_t h = col / (dim / 8);
    const std::int32_t c = (col % (dim / 8)) * 8;
    T* out = base + h * dim + c;
    const auto codes_at = static_cast<std::int32_t>(l.element_index(0, h, c));
    const std::byte* params = page + param_offset + l.template param_index<C>(0, h, c) * 4;
    chunk_params p[8];
    bool fast = true;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      p[j] = load_chunk_params<C>(params + 4 * j);
      fast = fast && finite_float(p[j].scale) && finite_float(p[j].zero);
    }
    for (std::int32_t t0 = 0; t0 < tokens; t0 += batch) {
      std::uint32_t w[batch];
#pragma unroll
      for (int u = 0; u < batch; ++u) {
        if (t0 + u < tokens) {
          w[u] = *reinterpret_cast<const std::uint32_t*>(page + data_offset +
                                                         (codes_at + (t0 + u) * code_step) / 2);
        }
      }
#pragma unroll
      for (int u = 0; u < batch; ++u) {
        if (t0 + u < tokens) {
          float x[8];
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            const float code = __uint_as_float(((w[u] >> (4 * j)) & 0xFU) | 0x4B000000U);
            x[j] = __fmaf_rn(__fsub_rn(code, 8388608.0F), p[j].scale, p[j].zero);
          }
          T* o = out + (t0 + u) * row;
          if (fast) {
            store8_non_nan(o, x);
          } else { // NaN parameters: the scalar store canonicalizes NaN
            store8(o, x);
          }
        }
      }
    }
  }
}

// Threads for a CTA that covers `chunks` chunks: whole warps, at most 1024.
inline unsigned threads_for(std::int64_t chunks) {
  const std::int64_t warps = (chunks + 31) / 32;
  return static_cast<unsigned>(std::min<std::int64_t>(warps, 32) * 32);
}

// Threads of a runs-kernel CTA: a lane per run of 32 channels of tokens_per_cta tokens.
template <class Layout>
unsigned run_threads(const Layout& l) {
  return threads_for(static_cast<std::int64_t>(tokens_per_cta) * l.num_kv_heads() * l.head_dim() /
                     lane_channels);
}

// Launches the kernel of one region (K or V) of codec C; `Checked`: the debug mode's kernel.
template <kv_codec C, bool Quantize, bool Checked, class Layout, class T>
cudaError_t launch_region(const page_batch<Layout, T>& b, T* elements, std::int64_t data_offset,
                          std::int64_t param_offset, const float* scales, cudaStream_t stream) {
  const Layout& l = b.layout;
  const auto pages = static_cast<unsigned>(b.num_pages);
  const page_guard guard{b.capacity, b.page_check};
  if constexpr (C::scaling == kv_scaling::per_page_channel) {
    const unsigned threads =
        threads_for(static_cast<std::int64_t>(l.num_kv_heads()) * l.head_dim() / 8);
    if constexpr (Quantize) {
      // A thread per four channels.
      const auto quads = static_cast<std::int64_t>(l.num_kv_heads()) * l.head_dim() / 4;
      const unsigned quad_threads = std::min(threads_for(quads), columns_max_threads);
      const dim3 grid(pages, static_cast<unsigned>((quads + quad_threads - 1) / quad_threads));
      quantize_columns_kernel<C, Checked><<<grid, quad_threads, 0, stream>>>(
          l, elements, b.cache, b.page_ids, data_offset, param_offset, guard);
    } else {
      dequantize_columns_kernel<C, Checked><<<pages, threads, 0, stream>>>(
          l, b.cache, b.page_ids, data_offset, param_offset, elements, guard);
    }
  } else {
    const unsigned threads =
        threads_for(static_cast<std::int64_t>(l.num_kv_heads()) * l.head_dim() / 8);
    const dim3 grid(pages,
                    static_cast<unsigned>((l.page_size() + tokens_per_cta - 1) / tokens_per_cta));
    if constexpr (Quantize && quantized_by_runs<C>) {
      quantize_runs_kernel<C, Checked><<<grid, run_threads(l), 0, stream>>>(
          l, elements, b.cache, b.page_ids, data_offset, param_offset, guard);
    } else if constexpr (Quantize) {
      quantize_rows_kernel<C, Checked><<<grid, threads, 0, stream>>>(
          l, elements, b.cache, b.page_ids, data_offset, scales, guard);
    } else {
      dequantize_rows_kernel<C, Checked><<<grid, threads, 0, stream>>>(
          l, b.cache, b.page_ids, data_offset, param_offset, elements, scales, guard);
    }
  }
  return cudaGetLastError();
}

template <bool Quantize, bool Checked, class Layout, class T>
cudaError_t launch_regions(const page_batch<Layout, T>& b, cudaStream_t stream) {
  const Layout& l = b.layout;
  const float* v_scales = b.static_scales == nullptr ? nullptr : b.static_scales + l.num_kv_heads();
  const cudaError_t k = launch_region<typename Layout::k_codec, Quantize, Checked>(
      b, b.k, l.k_data_offset(), l.k_param_offset(), b.static_scales, stream);
  if (k != cudaSuccess) {
    return k;
  }
  return launch_region<typename Layout::v_codec, Quantize, Checked>(
      b, b.v, l.v_data_offset(), l.v_param_offset(), v_scales, stream);
}

// Both directions' launcher: the arguments checked, then K's launch and V's. The debug mode (a flag
// to set) runs kernels of their own, so the ordinary ones test nothing.
template <bool Quantize, class Layout, class T>
cudaError_t launch(const page_batch<Layout, T>& b, cudaStream_t stream) {
  static_assert(device_layout<Layout>,
                "the page kernels take paged_layout of the library's codecs only");
  if (const auto done = before_launch(validate(b).ok(), b.num_pages > 0)) {
    return *done;
  }
  return with_page_check(b.page_check, [&](auto checked) {
    return launch_regions<Quantize, decltype(checked)::value>(b, stream);
  });
}

} // namespace detail

//! Quantizes whole pages: `b.k` and `b.v` hold `b.num_pages` pages of K and V, written into
//! cache pages `b.page_ids`, scales included. Asynchronous on `stream`; returns the validation
//! error, an error an earlier call left pending (taken before anything launches:
//! detail::take_pending_error) or the launch's error. K's pages and V's are two launches, K's
//! first: were V's launch to fail after K's was queued (a failure that validation cannot foresee,
//! such as a device out of resources), its error comes back and K's pages are written. Page ids
//! must be in 0 .. capacity-1 (a block_table's pages are); they are checked on the device only in
//! the debug mode (page_batch::page_check).
template <page_layout Layout, page_element T>
[[nodiscard]] cudaError_t quantize_pages(const page_batch<Layout, T>& b, cudaStream_t stream) {
  return detail::launch<true>(b, stream);
}

//! Decodes cache pages `b.page_ids` into `b.k` and `b.v` (the inverse of quantize_pages; K's and
//! V's in two launches, as there).
template <page_layout Layout, page_element T>
[[nodiscard]] cudaError_t dequantize_pages(const page_batch<Layout, T>& b, cudaStream_t stream) {
  return detail::launch<false>(b, stream);
}

} // namespace kvkit::cuda
