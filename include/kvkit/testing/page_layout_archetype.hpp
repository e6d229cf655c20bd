#pragma once
//! The smallest type that models `page_layout`.

#include <cstdint>

#include "kvkit/concepts/page_layout.hpp"
#include "kvkit/config.hpp"
#include "kvkit/error.hpp"
#include "kvkit/testing/kv_codec_archetype.hpp"

namespace kvkit::testing {

//! Models `page_layout` and nothing more: K and V in `kv_codec_archetype` (a byte an element,
//! one parameter byte per token and head), elements in NHD order, parameters [head][token]; each
//! region 16-byte aligned, in the order K data, V data, K parameters, V parameters. Fit for
//! compile-time checks of code generic over layouts, and for tests of the host reference with a
//! layout that is not kvkit's.
class page_layout_archetype {
public:
  using k_codec = kv_codec_archetype;
  using v_codec = kv_codec_archetype;
  static constexpr kv_order order = kv_order::nhd;
  static constexpr bool has_static_scales = false;
  struct head_rows {
    std::int64_t first = 0;
    std::int64_t step = 0;
  };

  constexpr page_layout_archetype() = default;
  constexpr page_layout_archetype(std::int32_t page_size, std::int32_t num_kv_heads,
                                  std::int32_t head_dim)
      : page_size_(page_size), num_kv_heads_(num_kv_heads), head_dim_(head_dim) {}

  //! bad_argument unless every dimension is positive and a page's K and V with their
  //! parameters take at most about 1 MiB (bounded a factor at a time: no product overflows).
  [[nodiscard]] constexpr status validate() const {
    constexpr std::int64_t most = std::int64_t{1} << 19; // (head_dim + 1) bytes a token and head
    const std::int64_t tokens_heads = static_cast<std::int64_t>(page_size_) * num_kv_heads_;
    if (page_size_ <= 0 || num_kv_heads_ <= 0 || head_dim_ <= 0 || tokens_heads > most ||
        tokens_heads * (static_cast<std::int64_t>(head_dim_) + 1) > most) {
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
  [[nodiscard]] KVKIT_HOST_DEVICE constexpr std::int64_t
  element_index(std::int32_t t, std::int32_t h, std::int32_t c) const {
    return t * token_stride() + static_cast<std::int64_t>(h) * head_dim_ + c;
  }
  [[nodiscard]] KVKIT_HOST_DEVICE constexpr std::int64_t token_stride() const {
    return static_cast<std::int64_t>(num_kv_heads_) * head_dim_;
  }
  template <class C>
  [[nodiscard]] KVKIT_HOST_DEVICE constexpr std::int64_t param_index(std::int32_t t, std::int32_t h,
                                                                     std::int32_t /*c*/) const {
    return static_cast<std::int64_t>(h) * page_size_ + t;
  }
  template <class C>
  [[nodiscard]] KVKIT_HOST_DEVICE constexpr std::int64_t param_token_stride() const {
    return 1;
  }
  [[nodiscard]] KVKIT_HOST_DEVICE constexpr std::int64_t k_data_offset() const { return 0; }
  [[nodiscard]] KVKIT_HOST_DEVICE constexpr std::int64_t v_data_offset() const {
    return align16(elements());
  }
  [[nodiscard]] KVKIT_HOST_DEVICE constexpr std::int64_t k_param_offset() const {
    return 2 * align16(elements());
  }
  [[nodiscard]] KVKIT_HOST_DEVICE constexpr std::int64_t v_param_offset() const {
    return k_param_offset() + align16(static_cast<std::int64_t>(num_kv_heads_) * page_size_);
  }
  [[nodiscard]] KVKIT_HOST_DEVICE constexpr std::int64_t bytes_per_page() const {
    return v_param_offset() + align16(static_cast<std::int64_t>(num_kv_heads_) * page_size_);
  }
  [[nodiscard]] KVKIT_HOST_DEVICE constexpr head_rows k_rows(std::int32_t h) const {
    return {k_data_offset() + element_index(0, h, 0), token_stride()};
  }
  [[nodiscard]] KVKIT_HOST_DEVICE constexpr head_rows v_rows(std::int32_t h) const {
    return {v_data_offset() + element_index(0, h, 0), token_stride()};
  }
  [[nodiscard]] KVKIT_HOST_DEVICE constexpr head_rows k_param_rows(std::int32_t h) const {
    return {k_param_offset() + param_index<k_codec>(0, h, 0), 1};
  }
  [[nodiscard]] KVKIT_HOST_DEVICE constexpr head_rows v_param_rows(std::int32_t h) const {
    return {v_param_offset() + param_index<v_codec>(0, h, 0), 1};
  }

private:
  [[nodiscard]] KVKIT_HOST_DEVICE static constexpr std::int64_t align16(std::int64_t n) {
    return (n + 15) / 16 * 16;
  }

  std::int32_t page_size_ = 0;
  std::int32_t num_kv_heads_ = 0;
  std::int32_t head_dim_ = 0;
};

static_assert(page_layout<page_layout_archetype>);

} // namespace kvkit::testing
