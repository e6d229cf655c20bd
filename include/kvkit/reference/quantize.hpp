#pragma once
//! CPU reference of page quantization: what the GPU page kernels are tested against.

#include <cfloat>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kvkit/concepts/kv_codec.hpp"
#include "kvkit/concepts/page_layout.hpp"
#include "kvkit/error.hpp"
#include "kvkit/layout/page_layout.hpp"
#include "kvkit/quant/codecs.hpp"

namespace kvkit::reference {

namespace detail {

// Element codes inside a data region: 16-bit little-endian, bytes, or nibble pairs.
template <std::int32_t Bits>
void put_code(std::byte* data, std::int64_t index, std::uint32_t code) {
  if constexpr (Bits == 16) {
    const auto v = static_cast<std::uint16_t>(code);
    std::memcpy(data + index * 2, &v, 2);
  } else if constexpr (Bits == 8) {
    data[index] = static_cast<std::byte>(code);
  } else {
    auto& b = data[index / 2];
    const auto shift = static_cast<unsigned>((index & 1) * 4);
    b = static_cast<std::byte>((static_cast<unsigned>(b) & ~(0xFU << shift)) |
                               ((code & 0xFU) << shift));
  }
}

template <std::int32_t Bits>
std::uint32_t get_code(const std::byte* data, std::int64_t index) {
  if constexpr (Bits == 16) {
    std::uint16_t v;
    std::memcpy(&v, data + index * 2, 2);
    return v;
  } else if constexpr (Bits == 8) {
    return static_cast<std::uint32_t>(data[index]);
  } else {
    return (static_cast<std::uint32_t>(data[index / 2]) >> ((index & 1) * 4)) & 0xFU;
  }
}

template <kv_codec C>
typename C::params static_params(const float* scales, std::int32_t head) {
  if constexpr (C::scaling == kv_scaling::static_per_head) {
    return C::with_scale(scales[head]);
  } else {
    return typename C::params{};
  }
}

template <kv_codec C>
bool scales_ok(const float* scales, std::int32_t heads) {
  if constexpr (C::scaling == kv_scaling::static_per_head) {
    if (scales == nullptr) {
      return false;
    }
    for (std::int32_t h = 0; h < heads; ++h) {
      // Positive and normal: 1 / scale is then finite (the codec multiplies by it).
      if (!(scales[h] >= FLT_MIN) || !kvkit::detail::finite(scales[h])) {
        return false;
      }
    }
  }
  return true;
}

// Quantizes one region (K or V): src is [num_tokens][heads][head_dim].
template <kv_codec C, page_layout Layout>
void quantize_region(const Layout& l, const float* src, std::int32_t num_tokens, std::byte* data,
                     std::byte* params, const float* scales) {
  const std::int32_t heads = l.num_kv_heads();
  const std::int32_t dim = l.head_dim();
  const auto at = [&](std::int32_t t, std::int32_t h, std::int32_t c) {
    return src[(static_cast<std::int64_t>(t) * heads + h) * dim + c];
  };
  const auto encode_span = [&](std::int32_t t, std::int32_t h, std::int32_t c0, std::int32_t n,
                               const typename C::params& p) {
    for (std::int32_t c = c0; c < c0 + n; ++c) {
      put_code<C::bits>(data, l.element_index(t, h, c), C::encode(at(t, h, c), p));
    }
  };
  if constexpr (C::scaling == kv_scaling::per_page_channel) {
    std::vector<float> column(static_cast<std::size_t>(num_tokens));
    for (std::int32_t h = 0; h < heads; ++h) {
      for (std::int32_t c = 0; c < dim; ++c) {
        for (std::int32_t t = 0; t < num_tokens; ++t) {
          column[static_cast<std::size_t>(t)] = at(t, h, c);
        }
        const auto p = C::fit(column.data(), num_tokens);
        C::store(p, params + l.template param_index<C>(0, h, c) * C::param_bytes);
        for (std::int32_t t = 0; t < num_tokens; ++t) {
          put_code<C::bits>(data, l.element_index(t, h, c), C::encode(at(t, h, c), p));
        }
      }
    }
    return;
  }
  const std::int32_t group = C::scaling == kv_scaling::per_token_group ? C::group_size : dim;
  for (std::int32_t t = 0; t < num_tokens; ++t) {
    for (std::int32_t h = 0; h < heads; ++h) {
      const float* row = &src[(static_cast<std::int64_t>(t) * heads + h) * dim];
      for (std::int32_t c0 = 0; c0 < dim; c0 += group) {
        typename C::params p = static_params<C>(scales, h);
        if constexpr (C::scaling == kv_scaling::per_token_head ||
                      C::scaling == kv_scaling::per_token_group) {
          p = C::fit(row + c0, group);
          C::store(p, params + l.template param_index<C>(t, h, c0) * C::param_bytes);
        }
        encode_span(t, h, c0, group, p);
      }
    }
  }
}

template <kv_codec C, page_layout Layout>
void dequantize_region(const Layout& l, const std::byte* data, const std::byte* params,
                       std::int32_t num_tokens, float* dst, const float* scales) {
  for (std::int32_t t = 0; t < num_tokens; ++t) {
    for (std::int32_t h = 0; h < l.num_kv_heads(); ++h) {
      for (std::int32_t c = 0; c < l.head_dim(); ++c) {
        typename C::params p = static_params<C>(scales, h);
        if constexpr (C::param_bytes > 0) {
          p = C::load(params + l.template param_index<C>(t, h, c) * C::param_bytes);
        }
        dst[(static_cast<std::int64_t>(t) * l.num_kv_heads() + h) * l.head_dim() + c] =
            C::decode(get_code<C::bits>(data, l.element_index(t, h, c)), p);
      }
    }
  }
}

template <page_layout Layout>
bool page_args_ok(const Layout& layout, std::int32_t num_tokens, const void* k, const void* v,
                  const void* page, const float* scales) {
  const std::int32_t heads = layout.num_kv_heads();
  return layout.validate().ok() && num_tokens >= 0 && num_tokens <= layout.page_size() &&
         k != nullptr && v != nullptr && page != nullptr &&
         scales_ok<typename Layout::k_codec>(scales, heads) &&
         scales_ok<typename Layout::v_codec>(scales == nullptr ? nullptr : scales + heads, heads);
}

} // namespace detail

//! Quantizes `num_tokens` tokens of K and V (`k`, `v`: [num_tokens][num_kv_heads][head_dim]
//! floats) into `page` (layout.bytes_per_page() bytes), parameters included. `static_scales`
//! ([2][num_kv_heads]: K's then V's) is required by static-scale codecs (fp8) and ignored
//! otherwise. Per-channel codecs fit their parameters over the `num_tokens` tokens given.
//! Errors: bad_argument (invalid layout, num_tokens outside 0..page_size, null pointers, missing
//! static scales or ones that are not positive normal floats).
template <page_layout Layout>
[[nodiscard]] status quantize_page(const Layout& layout, const float* k, const float* v,
                                   std::int32_t num_tokens, std::byte* page,
                                   const float* static_scales = nullptr) {
  using K = typename Layout::k_codec;
  using V = typename Layout::v_codec;
  if (!detail::page_args_ok(layout, num_tokens, k, v, page, static_scales)) {
    return errc::bad_argument;
  }
  detail::quantize_region<K>(layout, k, num_tokens, page + layout.k_data_offset(),
                             page + layout.k_param_offset(), static_scales);
  detail::quantize_region<V>(
      layout, v, num_tokens, page + layout.v_data_offset(), page + layout.v_param_offset(),
      static_scales == nullptr ? nullptr : static_scales + layout.num_kv_heads());
  return {};
}

//! Decodes `num_tokens` tokens of a page back to floats, [num_tokens][num_kv_heads][head_dim] each
//! for K and V. Errors as for `quantize_page`.
template <page_layout Layout>
[[nodiscard]] status dequantize_page(const Layout& layout, const std::byte* page,
                                     std::int32_t num_tokens, float* k, float* v,
                                     const float* static_scales = nullptr) {
  using K = typename Layout::k_codec;
  using V = typename Layout::v_codec;
  if (!detail::page_args_ok(layout, num_tokens, k, v, page, static_scales)) {
    return errc::bad_argument;
  }
  detail::dequantize_region<K>(layout, page + layout.k_data_offset(),
                               page + layout.k_param_offset(), num_tokens, k, static_scales);
  detail::dequantize_region<V>(
      layout, page + layout.v_data_offset(), page + layout.v_param_offset(), num_tokens, v,
      static_scales == nullptr ? nullptr : static_scales + layout.num_kv_heads());
  return {};
}

} // namespace kvkit::reference
