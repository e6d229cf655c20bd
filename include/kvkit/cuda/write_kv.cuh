#pragma once
//! write_kv: the K and V of new tokens (any number per sequence) into their slots of a paged cache,
//! quantized on the fly with the layout's codecs.

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kvkit/cuda/quantize_pages.cuh"
#include "kvkit/error.hpp"

namespace kvkit::cuda {

//! New tokens' K and V to write into a paged cache (one layer). All pointers are device pointers.
template <class Layout, page_element T>
struct kv_write {
  Layout layout;                       //!< page geometry and codecs (per-token codecs only)
  std::byte* cache = nullptr;          //!< [capacity][layout.bytes_per_page()]
  std::int32_t capacity = 0;           //!< pages in `cache`
  const std::int64_t* slots = nullptr; //!< [num_tokens] block * page_size + offset; < 0: skip
  std::int32_t num_tokens = 0;
  const T* k = nullptr;                 //!< [num_tokens][kv_heads][head_dim]
  const T* v = nullptr;                 //!< same shape as k
  const float* static_scales = nullptr; //!< [2][kv_heads]: K's then V's (fp8 codecs)
};

//! bad_argument unless the layout is valid, head_dim is a multiple of 8, neither codec keeps
//! per-page parameters (a per-channel codec needs whole pages: use quantize_pages), the count is
//! non-negative and the pointers the codecs need are set. Slots are not bounds-checked on the
//! device: they must lie inside the cache (block_table's slot mappings do).
template <class Layout, page_element T>
[[nodiscard]] status validate(const kv_write<Layout, T>& w) {
  using K = typename Layout::k_codec;
  using V = typename Layout::v_codec;
  if (!w.layout.validate().ok() || w.layout.head_dim() % 8 != 0 || w.num_tokens < 0 ||
      K::scaling == kv_scaling::per_page_channel || V::scaling == kv_scaling::per_page_channel) {
    return errc::bad_argument;
  }
  if (w.num_tokens > 0 &&
      (w.cache == nullptr || w.slots == nullptr || w.k == nullptr || w.v == nullptr ||
       w.capacity <= 0 || (Layout::has_static_scales && w.static_scales == nullptr))) {
    return errc::bad_argument;
  }
  return {};
}

namespace detail {

// One region (K or V): per-token-parameter codecs through the runs quantizer, the others through
// the 8-channel rows quantizer.
template <kv_codec C, class Layout, page_element T>
cudaError_t launch_write(const kv_write<Layout, T>& w, const T* src, std::int64_t data_offset,
                         std::int64_t param_offset, const float* scales, unsigned blocks,
                         cudaStream_t stream) {
  const Layout& l = w.layout;
  if constexpr (quantized_by_runs<C>) {
    write_kv_runs_kernel<C><<<blocks, run_threads(l), 0, stream>>>(
        l, src, w.slots, w.num_tokens, w.cache, data_offset, param_offset);
  } else {
    const unsigned threads =
        threads_for(static_cast<std::int64_t>(l.num_kv_heads()) * l.head_dim() / 8);
    write_kv_kernel<C><<<blocks, threads, 0, stream>>>(l, src, w.slots, w.num_tokens, w.cache,
                                                       data_offset, param_offset, scales);
  }
  return cudaGetLastError();
}

} // namespace detail

//! Writes each new token's K and V into its slot, quantizing on the fly with the layout's codecs
//! (bit-exact with kvkit::reference::quantize_page of the same tokens), in two launches (K, V).
//! Asynchronous on `stream`; cudaErrorInvalidValue when `validate` fails.
template <class Layout, page_element T>
[[nodiscard]] cudaError_t write_kv(const kv_write<Layout, T>& w, cudaStream_t stream) {
  if (!validate(w).ok()) {
    return cudaErrorInvalidValue;
  }
  if (w.num_tokens == 0) {
    return cudaSuccess;
  }
  const Layout& l = w.layout;
  const auto blocks =
      static_cast<unsigned>((w.num_tokens + detail::tokens_per_cta - 1) / detail::tokens_per_cta);
  const float* v_scales = w.static_scales == nullptr ? nullptr : w.static_scales + l.num_kv_heads();
  if (const cudaError_t e = detail::launch_write<typename Layout::k_codec>(
          w, w.k, l.k_data_offset(), l.k_param_offset(), w.static_scales, blocks, stream);
      e != cudaSuccess) {
    return e;
  }
  return detail::launch_write<typename Layout::v_codec>(
      w, w.v, l.v_data_offset(), l.v_param_offset(), v_scales, blocks, stream);
}

} // namespace kvkit::cuda
