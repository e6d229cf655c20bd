#pragma once
//! paged_layout: where each K and V element, and each scale, lives inside one page of one layer.

#include <cstddef>
#include <cstdint>

#include "kvkit/concepts/kv_codec.hpp"
#include "kvkit/concepts/page_layout.hpp"
#include "kvkit/config.hpp"
#include "kvkit/error.hpp"
#include "kvkit/quant/codecs.hpp"

namespace kvkit {

//! Geometry of one page of one layer: K data, V data, then K and V parameters (scales, zero
//! points), each region starting on a 16-byte boundary so kernels can use 16-byte vector loads.
//!
//! ```
//! page: | K data | V data | K params | V params |
//! data:   nhd: element (t, h, c) at (t * heads + h) * head_dim + c
//!         hnd: element (t, h, c) at (h * page_size + t) * head_dim + c
//!         4-bit codes pack channel pairs into a byte, the even channel in the low nibble
//! params: per_token_head   [head][token]
//!         per_token_group  [head][token][channel / group_size]
//!         per_page_channel [head][channel]
//! ```
//!
//! Because the parameters live in the page, copy-on-write, swap, prefix sharing and transfer move
//! a page with its scales and need no side tables. Static fp8 scales (one per head or tensor) are
//! calibration results passed to kernels, not page contents. Offsets are in bytes from the page's
//! start unless named `index`.
template <kv_codec KCodec, kv_codec VCodec = KCodec, kv_order Order = kv_order::nhd>
class paged_layout {
public:
  using k_codec = KCodec;
  using v_codec = VCodec;
  static constexpr kv_order order = Order;
  //! True when K or V uses calibrated scales passed to kernels (fp8), not stored in pages.
  static constexpr bool has_static_scales = KCodec::scaling == kv_scaling::static_per_head ||
                                            VCodec::scaling == kv_scaling::static_per_head;

  constexpr paged_layout() = default;
  //! A layout for pages of `page_size` tokens, `num_kv_heads` heads of `head_dim` channels. Call
  //! `validate()` before use.
  KVKIT_HOST_DEVICE constexpr paged_layout(std::int32_t page_size, std::int32_t num_kv_heads,
                                           std::int32_t head_dim)
      : page_size_(page_size), num_kv_heads_(num_kv_heads), head_dim_(head_dim) {}

  //! bad_argument unless every dimension is positive, a page's K and V would take at most 1 GiB
  //! as 16-bit elements, the page with its codecs' parameters stays under 2 GiB (bytes_per_page()
  //! at most INT32_MAX: kernels locate a page's bytes in 32 bits), 4-bit codecs have an even
  //! head_dim, and grouped codecs' group size divides head_dim.
  [[nodiscard]] constexpr status validate() const noexcept {
    if (page_size_ <= 0 || num_kv_heads_ <= 0 || head_dim_ <= 0) {
      return errc::bad_argument;
    }
    // K and V of 2^28 elements each as 16-bit elements make 1 GiB; bounded a factor at a time so
    // that no product overflows 64 bits (2^30 * 2^31 at most).
    constexpr std::int64_t max_elements = std::int64_t{1} << 28;
    const std::int64_t tokens_heads = static_cast<std::int64_t>(page_size_) * num_kv_heads_;
    if (tokens_heads > max_elements || tokens_heads * head_dim_ > max_elements) {
      return errc::bad_argument;
    }
    if (!fits<KCodec>() || !fits<VCodec>() || bytes_per_page() > INT32_MAX) {
      return errc::bad_argument;
    }
    return {};
  }

  [[nodiscard]] KVKIT_HOST_DEVICE constexpr std::int32_t page_size() const { return page_size_; }
  [[nodiscard]] KVKIT_HOST_DEVICE constexpr std::int32_t num_kv_heads() const {
    return num_kv_heads_;
  }
  [[nodiscard]] KVKIT_HOST_DEVICE constexpr std::int32_t head_dim() const { return head_dim_; }
  [[nodiscard]] KVKIT_HOST_DEVICE constexpr std::int64_t elements() const {
    return static_cast<std::int64_t>(page_size_) * num_kv_heads_ * head_dim_;
  }

  //! Index of element (token, head, channel) in a data region.
  [[nodiscard]] KVKIT_HOST_DEVICE constexpr std::int64_t
  element_index(std::int32_t token, std::int32_t head, std::int32_t channel) const {
    if constexpr (Order == kv_order::nhd) {
      return (static_cast<std::int64_t>(token) * num_kv_heads_ + head) * head_dim_ + channel;
    } else {
      return (static_cast<std::int64_t>(head) * page_size_ + token) * head_dim_ + channel;
    }
  }

  //! Index of the parameter set that covers element (token, head, channel), for codec `C`.
  template <kv_codec C>
  [[nodiscard]] KVKIT_HOST_DEVICE constexpr std::int64_t
  param_index(std::int32_t token, std::int32_t head, std::int32_t channel) const {
    if constexpr (C::scaling == kv_scaling::per_token_head) {
      return static_cast<std::int64_t>(head) * page_size_ + token;
    } else if constexpr (C::scaling == kv_scaling::per_token_group) {
      return (static_cast<std::int64_t>(head) * page_size_ + token) * (head_dim_ / C::group_size) +
             channel / C::group_size;
    } else if constexpr (C::scaling == kv_scaling::per_page_channel) {
      return static_cast<std::int64_t>(head) * head_dim_ + channel;
    } else {
      return 0;
    }
  }

  //! Elements from (token, head, channel) to (token + 1, head, channel) in a data region: every
  //! element_index is linear in the token with this step.
  [[nodiscard]] KVKIT_HOST_DEVICE constexpr std::int64_t token_stride() const {
    if constexpr (Order == kv_order::nhd) {
      return static_cast<std::int64_t>(num_kv_heads_) * head_dim_;
    } else {
      return head_dim_;
    }
  }

  //! Parameter sets from token to token + 1 for codec `C` (0 where one set covers every token of
  //! the page): every param_index is linear in the token with this step.
  template <kv_codec C>
  [[nodiscard]] KVKIT_HOST_DEVICE constexpr std::int64_t param_token_stride() const {
    if constexpr (C::scaling == kv_scaling::per_token_head) {
      return 1;
    } else if constexpr (C::scaling == kv_scaling::per_token_group) {
      return head_dim_ / C::group_size;
    } else {
      return 0;
    }
  }

  //! Where one head's rows lie in one region, in bytes from the page's start: token t's row starts
  //! at `first + t * step`.
  struct head_rows {
    std::int64_t first = 0;
    std::int64_t step = 0;
  };
  //! `head`'s rows of K codes (channel 0 first; 4-bit codes two channels a byte).
  [[nodiscard]] KVKIT_HOST_DEVICE constexpr head_rows k_rows(std::int32_t head) const {
    return data_rows<KCodec>(k_data_offset(), head);
  }
  //! `head`'s rows of V codes.
  [[nodiscard]] KVKIT_HOST_DEVICE constexpr head_rows v_rows(std::int32_t head) const {
    return data_rows<VCodec>(v_data_offset(), head);
  }
  //! `head`'s rows of K parameter sets (a row: the sets of one token, or the page's sets of the
  //! head for per_page_channel, then with step 0).
  [[nodiscard]] KVKIT_HOST_DEVICE constexpr head_rows k_param_rows(std::int32_t head) const {
    return param_rows<KCodec>(k_param_offset(), head);
  }
  //! `head`'s rows of V parameter sets.
  [[nodiscard]] KVKIT_HOST_DEVICE constexpr head_rows v_param_rows(std::int32_t head) const {
    return param_rows<VCodec>(v_param_offset(), head);
  }

  //! Parameter sets a region holds for codec `C`.
  template <kv_codec C>
  [[nodiscard]] KVKIT_HOST_DEVICE constexpr std::int64_t param_count() const {
    if constexpr (C::scaling == kv_scaling::per_token_head) {
      return static_cast<std::int64_t>(num_kv_heads_) * page_size_;
    } else if constexpr (C::scaling == kv_scaling::per_token_group) {
      return static_cast<std::int64_t>(num_kv_heads_) * page_size_ * (head_dim_ / C::group_size);
    } else if constexpr (C::scaling == kv_scaling::per_page_channel) {
      return static_cast<std::int64_t>(num_kv_heads_) * head_dim_;
    } else {
      return 0;
    }
  }

  [[nodiscard]] KVKIT_HOST_DEVICE constexpr std::int64_t k_data_offset() const { return 0; }
  [[nodiscard]] KVKIT_HOST_DEVICE constexpr std::int64_t v_data_offset() const {
    return align16(data_bytes<KCodec>());
  }
  [[nodiscard]] KVKIT_HOST_DEVICE constexpr std::int64_t k_param_offset() const {
    return v_data_offset() + align16(data_bytes<VCodec>());
  }
  [[nodiscard]] KVKIT_HOST_DEVICE constexpr std::int64_t v_param_offset() const {
    return k_param_offset() + align16(param_count<KCodec>() * KCodec::param_bytes);
  }
  //! Bytes of one page of one layer, scales included; a multiple of 16.
  [[nodiscard]] KVKIT_HOST_DEVICE constexpr std::int64_t bytes_per_page() const {
    return v_param_offset() + align16(param_count<VCodec>() * VCodec::param_bytes);
  }

  //! Bytes of K (or V) element data in a page for codec `C`.
  template <kv_codec C>
  [[nodiscard]] KVKIT_HOST_DEVICE constexpr std::int64_t data_bytes() const {
    return elements() * C::bits / 8;
  }

private:
  [[nodiscard]] KVKIT_HOST_DEVICE static constexpr std::int64_t align16(std::int64_t n) {
    return (n + 15) / 16 * 16;
  }

  template <kv_codec C>
  [[nodiscard]] KVKIT_HOST_DEVICE constexpr head_rows data_rows(std::int64_t region,
                                                                std::int32_t head) const {
    // The step is token_stride() in bytes, spelled as the distance from token 0's row to token 1's:
    // paged_decode's int4 kernels over HND pages were measured in the code this spelling gives (as
    // token_stride() * bits / 8, ptxas scheduled their loop otherwise, 0.1-1.0% slower on an H200).
    return {region + element_index(0, head, 0) * C::bits / 8,
            (element_index(1, head, 0) - element_index(0, head, 0)) * C::bits / 8};
  }
  template <kv_codec C>
  [[nodiscard]] KVKIT_HOST_DEVICE constexpr head_rows param_rows(std::int64_t region,
                                                                 std::int32_t head) const {
    return {region + param_index<C>(0, head, 0) * C::param_bytes,
            param_token_stride<C>() * C::param_bytes};
  }

  template <kv_codec C>
  [[nodiscard]] constexpr bool fits() const noexcept {
    if (C::bits == 4 && head_dim_ % 2 != 0) {
      return false;
    }
    if constexpr (C::scaling == kv_scaling::per_token_group) {
      if (head_dim_ % C::group_size != 0) {
        return false;
      }
    }
    return true;
  }

  std::int32_t page_size_ = 0;
  std::int32_t num_kv_heads_ = 0;
  std::int32_t head_dim_ = 0;
};

static_assert(page_layout<paged_layout<bf16_codec>>);
static_assert(page_layout<paged_layout<fp8_e4m3_codec, fp8_e4m3_codec, kv_order::hnd>>);
static_assert(page_layout<paged_layout<int4_channel_codec, int4_group_codec<32>>>);

} // namespace kvkit
