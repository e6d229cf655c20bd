#pragma once
//! The `page_layout` concept: where K and V codes and their codecs' parameters lie in a page.

#include <concepts>
#include <cstdint>
#include <type_traits>

#include "kvkit/concepts/kv_codec.hpp"
#include "kvkit/error.hpp"

namespace kvkit {

//! Element order inside a page's K (and V) region.
enum class kv_order : std::uint8_t {
  nhd, //!< [token][kv head][channel] (FlashInfer's NHD, vLLM's flash layout)
  hnd, //!< [kv head][token][channel] (FlashInfer's HND): a head's tokens are contiguous
};

//! The geometry of one page of one layer of a paged KV cache: what the host reference, the plans
//! and the CUDA launchers take as their `Layout`.
//!
//! Required, for `const L& l`, `std::int32_t t, h, c` (a token of the page, a KV head, a
//! channel) and `C` either of `L::k_codec` and `L::v_codec`:
//!  - `L` is semiregular and trivially copyable: kernels take it by value in their arguments,
//!    which are default-constructed before it is set (a default layout need not validate).
//!  - `L::k_codec`, `L::v_codec`: the `kv_codec`s of K and of V; `L::order` (`kv_order`): the
//!    order of the data regions' elements; `L::has_static_scales` (`bool`): true exactly where K's
//!    or V's codec has `kv_scaling::static_per_head` (calibrated scales passed to kernels rather
//!    than stored in pages).
//!  - `l.validate()` -> `status`: `bad_argument` for a geometry the other expressions do not
//!    describe (non-positive dimensions, sizes past the model's limits).
//!  - `l.page_size()`, `l.num_kv_heads()`, `l.head_dim()` -> `std::int32_t`; `l.elements()` ->
//!    `std::int64_t`: the product of the three, the elements of each of K and V in a page.
//!  - `l.element_index(t, h, c)` -> `std::int64_t`: the element's index in a data region (codes
//!    of `C::bits` bits; 4-bit codes two a byte, the even index in the low nibble), and
//!    `l.token_stride()` -> `std::int64_t`: its step from token t to t + 1 (every index is
//!    linear in the token).
//!  - `l.template param_index<C>(t, h, c)` -> `std::int64_t`: the index of the parameter set
//!    that covers the element, each set `C::param_bytes` bytes, and
//!    `l.template param_token_stride<C>()` -> `std::int64_t`: its step from token to token (0
//!    where one set covers every token of the page).
//!  - `l.k_data_offset()`, `l.v_data_offset()`, `l.k_param_offset()`, `l.v_param_offset()`,
//!    `l.bytes_per_page()` -> `std::int64_t`: the regions' byte offsets in the page and the page's
//!    size.
//!  - `l.k_rows(h)`, `l.v_rows(h)`, `l.k_param_rows(h)`, `l.v_param_rows(h)` ->
//!    `typename L::head_rows`, whose `first` and `step` (`std::int64_t`) place head h's row of
//!    token t, in bytes from the page's start, at `first + t * step`.
//!
//! Semantics the compiler cannot check, for a layout that validates: every region starts on a
//! 16-byte boundary and `bytes_per_page()` is a multiple of 16 (kernels move 16 bytes at a time);
//! the four regions do not overlap and lie inside the page; `element_index` is distinct over the
//! page's (t, h, c) and its codes lie inside each data region, and each parameter set inside its
//! region; the rows agree with the indices: `k_rows(h)` is `{k_data_offset() + element_index(0,
//! h, 0) * bits / 8, token_stride() * bits / 8}` with K's codec's bits (V's likewise), and
//! `k_param_rows(h)` is `{k_param_offset() + param_index<K>(0, h, 0) * param_bytes,
//! param_token_stride<K>() * param_bytes}` (V's likewise). Everything is a pure function of the
//! geometry; all but `validate()` callable on host and device (KVKIT_HOST_DEVICE, as
//! `paged_layout`'s are). kvkit's model is `paged_layout`. The host reference and the decode
//! plans take any model; the CUDA launchers, whose device paths are written for `paged_layout`'s
//! geometry, do not compile for another (and their `validate` refuses it).
template <class L>
concept page_layout = std::semiregular<L> && std::is_trivially_copyable_v<L> &&
    kv_codec<typename L::k_codec> && kv_codec<typename L::v_codec> &&
    requires(const L& l, std::int32_t t, std::int32_t h, std::int32_t c) {
  { L::order } -> std::convertible_to<kv_order>;
  { L::has_static_scales } -> std::convertible_to<bool>;
  requires L::has_static_scales == (L::k_codec::scaling == kv_scaling::static_per_head ||
                                    L::v_codec::scaling == kv_scaling::static_per_head);
  { l.validate() } -> std::same_as<status>;
  { l.page_size() } -> std::same_as<std::int32_t>;
  { l.num_kv_heads() } -> std::same_as<std::int32_t>;
  { l.head_dim() } -> std::same_as<std::int32_t>;
  { l.elements() } -> std::same_as<std::int64_t>;
  { l.element_index(t, h, c) } -> std::same_as<std::int64_t>;
  { l.token_stride() } -> std::same_as<std::int64_t>;
  { l.template param_index<typename L::k_codec>(t, h, c) } -> std::same_as<std::int64_t>;
  { l.template param_index<typename L::v_codec>(t, h, c) } -> std::same_as<std::int64_t>;
  { l.template param_token_stride<typename L::k_codec>() } -> std::same_as<std::int64_t>;
  { l.template param_token_stride<typename L::v_codec>() } -> std::same_as<std::int64_t>;
  { l.k_data_offset() } -> std::same_as<std::int64_t>;
  { l.v_data_offset() } -> std::same_as<std::int64_t>;
  { l.k_param_offset() } -> std::same_as<std::int64_t>;
  { l.v_param_offset() } -> std::same_as<std::int64_t>;
  { l.bytes_per_page() } -> std::same_as<std::int64_t>;
  { l.k_rows(h) } -> std::same_as<typename L::head_rows>;
  { l.v_rows(h) } -> std::same_as<typename L::head_rows>;
  { l.k_param_rows(h) } -> std::same_as<typename L::head_rows>;
  { l.v_param_rows(h) } -> std::same_as<typename L::head_rows>;
  { l.k_rows(h).first } -> std::convertible_to<std::int64_t>;
  { l.k_rows(h).step } -> std::convertible_to<std::int64_t>;
};

} // namespace kvkit
