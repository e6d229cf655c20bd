#pragma once
//! The `kv_codec` concept: how K or V elements are stored in a page, with their scales.

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace kvkit {

//! What one set of a codec's parameters (scale, zero point) covers.
enum class kv_scaling : std::uint8_t {
  none,             //!< no parameters (fp16/bf16 passthrough)
  static_per_head,  //!< a calibrated scale per KV head (or one per tensor), passed to kernels
  per_token_head,   //!< one set per token and KV head, stored in the page
  per_token_group,  //!< one set per token, KV head and group of `group_size` channels, in the page
  per_page_channel, //!< one set per page, KV head and channel (over the page's tokens), in the page
};

//! A K/V element codec, usable on host and device (its functions are KVKIT_HOST_DEVICE).
//!
//! Required, for codec `C`, `float x`, `const float* xs`, `std::int32_t n`, `C::params p`,
//! `std::uint32_t code`, `std::byte* out`, `const std::byte* in`:
//!  - `C::bits` (4, 8 or 16): stored bits per element; 4-bit codes pack two per byte, the element
//!    with the even channel index in the low nibble.
//!  - `C::scaling` (`kv_scaling`) and `C::group_size` (channels per parameter set for
//!    per_token_group, else 0).
//!  - `C::param_bytes`: bytes one parameter set takes in the page (0 when none are stored).
//!  - `typename C::params`: trivially copyable scale (and zero point).
//!  - `C::fit(xs, n)` -> `params`: parameters for a group of `n` values (non-finite values are
//!    ignored; an all-zero group gets parameters that encode it exactly).
//!  - `C::encode(x, p)` -> `std::uint32_t`: the code of `x` in the low `bits` bits.
//!  - `C::decode(code, p)` -> `float`.
//!  - `C::store(p, out)`, `C::load(in)` -> `params`: a parameter set's bytes in the page.
//!
//! Semantics: `decode(encode(x, p), p)` is the codec's rounding of `x`; the same inputs give the
//! same bits on host and device.
template <class C>
concept kv_codec = std::is_trivially_copyable_v<typename C::params> &&
    requires(float x, const float* xs, std::int32_t n, const typename C::params& p,
             std::uint32_t code, std::byte* out, const std::byte* in) {
  requires C::bits == 4 || C::bits == 8 || C::bits == 16;
  { C::scaling } -> std::convertible_to<kv_scaling>;
  { C::group_size } -> std::convertible_to<std::int32_t>;
  { C::param_bytes } -> std::convertible_to<std::int32_t>;
  { C::fit(xs, n) } -> std::same_as<typename C::params>;
  { C::encode(x, p) } -> std::same_as<std::uint32_t>;
  { C::decode(code, p) } -> std::same_as<float>;
  C::store(p, out);
  { C::load(in) } -> std::same_as<typename C::params>;
};

} // namespace kvkit
