#pragma once
//! write_kv: the K and V of new tokens (any number per sequence) into their slots of a paged cache,
//! quantized on the fly with the layout's codecs.

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kvkit/concepts/page_layout.hpp"
#include "kvkit/cuda/detail/checks.cuh"
#include "kvkit/cuda/quantize_pages.cuh"
#include "kvkit/error.hpp"

namespace kvkit::cuda {

//! New tokens' K and V to write into a paged cache (one layer). All pointers are device pointers;
//! the cache, k and v 16-byte aligned.
template <page_layout Layout, page_element T>
struct kv_write {
  Layout layout;              //!< page geometry and codecs (per-token codecs only)
  std::byte* cache = nullptr; //!< [capacity][layout.bytes_per_page()]
  std::int32_t capacity = 0;  //!< pages in `cache`
  //! [num_tokens] block * page_size + offset, distinct (one slot written twice in a launch may
  //! mix the two tokens' codes and scales); < 0: skip.
  const std::int64_t* slots = nullptr;
  std::int32_t num_tokens = 0;
  const T* k = nullptr;                 //!< [num_tokens][kv_heads][head_dim]
  const T* v = nullptr;                 //!< same shape as k
  const float* static_scales = nullptr; //!< [2][kv_heads]: K's then V's (fp8 codecs)
  //! Debug mode when set (a device int): every slot's page is checked against [0, capacity); a
  //! token whose slot lies past the cache sets *page_check to 1 and is not written. Negative
  //! slots are padding, skipped in either mode and never flagged.
  std::int32_t* page_check = nullptr;
};

//! bad_argument unless the layout fits the kernels as quantize_pages' validate says (head_dim a
//! multiple of 8 and, for per-token-head codecs such as int8, 64, 128 or 256; a page's K or V
//! region at most 2^31 bits), neither codec keeps per-page parameters (a per-channel codec needs
//! whole pages: use quantize_pages), the count is from 0 to INT32_MAX - 3, and when there are
//! tokens the pointers the codecs need are set, capacity > 0, the cache, k and v 16-byte aligned
//! (the kernel moves 16 bytes at a time; a misaligned access would fault on the device), and the
//! slots, fp8 scales and debug flag aligned to their elements.
//! Slots must lie inside the cache (block_table's slot mappings do); they are checked on the
//! device only in the debug mode (kv_write::page_check).
template <page_layout Layout, page_element T>
[[nodiscard]] status validate(const kv_write<Layout, T>& w) {
  using K = typename Layout::k_codec;
  using V = typename Layout::v_codec;
  if (!detail::page_kernels_fit(w.layout) || w.num_tokens < 0 ||
      w.num_tokens > INT32_MAX - (detail::tokens_per_cta - 1) ||
      K::scaling == kv_scaling::per_page_channel || V::scaling == kv_scaling::per_page_channel) {
    return errc::bad_argument;
  }
  if (w.num_tokens > 0 &&
      (w.cache == nullptr || w.slots == nullptr || w.k == nullptr || w.v == nullptr ||
       w.capacity <= 0 || (Layout::has_static_scales && w.static_scales == nullptr) ||
       !detail::aligned<16>(w.cache) || !detail::aligned<16>(w.k) || !detail::aligned<16>(w.v) ||
       !detail::elements_aligned(w.slots, w.static_scales, w.page_check))) {
    return errc::bad_argument;
  }
  return {};
}

//! Writes each new token's K and V into its slot, quantizing on the fly with the layout's codecs
//! (bit-exact with kvkit::reference::quantize_page of the same tokens), in one launch.
//! Asynchronous on `stream`; cudaErrorInvalidValue when `validate` fails, and an error an earlier
//! call left pending is returned (taken) before anything launches (detail::take_pending_error).
template <page_layout Layout, page_element T>
[[nodiscard]] cudaError_t write_kv(const kv_write<Layout, T>& w, cudaStream_t stream) {
  static_assert(detail::device_layout<Layout>,
                "write_kv takes paged_layout of the library's codecs only");
  if (const auto done = detail::before_launch(validate(w).ok(), w.num_tokens > 0)) {
    return *done;
  }
  const Layout& l = w.layout;
  const dim3 grid(
      static_cast<unsigned>((w.num_tokens + detail::tokens_per_cta - 1) / detail::tokens_per_cta),
      2);
  const unsigned threads =
      detail::threads_for(static_cast<std::int64_t>(l.num_kv_heads()) * l.head_dim() / 8);
  using K = typename Layout::k_codec;
  using V = typename Layout::v_codec;
  const detail::page_guard guard{w.capacity, w.page_check};
  detail::with_page_check(w.page_check, [&](auto checked) {
    detail::write_kv_kernel<K, V, decltype(checked)::value><<<grid, threads, 0, stream>>>(
        l, w.k, w.v, w.slots, w.num_tokens, w.cache, w.static_scales, guard);
  });
  return cudaGetLastError();
}

} // namespace kvkit::cuda
