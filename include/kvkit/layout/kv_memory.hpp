#pragma once
//! KV-cache memory: the size formula, its paged form with scale overhead, its inverse, and the
//! shapes of well-known models.

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <string_view>

#include "kvkit/error.hpp"
#include "kvkit/layout/page_layout.hpp"
#include "kvkit/quant/kv_format.hpp"

namespace kvkit {

//! The attention shape of a decoder model, which is all its KV cache depends on.
struct model_config {
  std::string_view name;
  std::int32_t num_layers = 0;
  std::int32_t num_query_heads = 0;
  std::int32_t num_kv_heads = 0;
  std::int32_t head_dim = 0;
};

//! Public shapes of well-known models (from their published configurations).
namespace models {
inline constexpr model_config llama3_8b{"Llama-3-8B", 32, 32, 8, 128};
inline constexpr model_config llama3_70b{"Llama-3-70B", 80, 64, 8, 128};
inline constexpr model_config mistral_7b{"Mistral-7B", 32, 32, 8, 128};
inline constexpr model_config qwen2_5_7b{"Qwen2.5-7B", 28, 28, 4, 128};
//! Multi-head attention (one KV head per query head): what grouped-query attention saves.
inline constexpr model_config llama2_7b{"Llama-2-7B (MHA)", 32, 32, 32, 128};
inline constexpr std::array<model_config, 5> all{llama3_8b, llama3_70b, mistral_7b, qwen2_5_7b,
                                                 llama2_7b};
} // namespace models

//! `2 × layers × tokens × kv_heads × head_dim × bytes_per_element × batch`: K and V of `tokens`
//! tokens for each of `batch` sequences, no paging, no scales.
[[nodiscard]] constexpr double kv_bytes(const model_config& m, std::int64_t tokens,
                                        std::int64_t batch, double bytes_per_element) noexcept {
  return 2.0 * m.num_layers * static_cast<double>(tokens) * m.num_kv_heads * m.head_dim *
         bytes_per_element * static_cast<double>(batch);
}

//! Bytes of one page of one layer for a model and K/V formats (scales and alignment included).
//! bad_argument for a shape or page size the layout refuses, no layers, or a format value that is
//! none of the enumerators (one cast from a configuration's integer).
[[nodiscard]] constexpr result<std::int64_t>
page_bytes(const model_config& m, kv_format k, kv_format v, std::int32_t page_size) noexcept {
  if (static_cast<std::size_t>(k) >= all_kv_formats.size() ||
      static_cast<std::size_t>(v) >= all_kv_formats.size()) {
    return errc::bad_argument;
  }
  return visit_codec(k, [&](auto kc) -> result<std::int64_t> {
    return visit_codec(v, [&](auto vc) -> result<std::int64_t> {
      const paged_layout<decltype(kc), decltype(vc)> layout(page_size, m.num_kv_heads, m.head_dim);
      if (!layout.validate().ok() || m.num_layers <= 0) {
        return errc::bad_argument;
      }
      return layout.bytes_per_page();
    });
  });
}

//! Paged KV bytes of `batch` sequences of `tokens` tokens each: every sequence rounds up to whole
//! pages, and every page carries its scales. bad_argument for negative counts or a layout
//! page_bytes refuses, out_of_range where the bytes pass int64.
[[nodiscard]] constexpr result<std::int64_t> kv_bytes_paged(const model_config& m, kv_format k,
                                                            kv_format v, std::int64_t tokens,
                                                            std::int64_t batch,
                                                            std::int32_t page_size) noexcept {
  if (tokens < 0 || batch < 0) {
    return errc::bad_argument;
  }
  const auto page = page_bytes(m, k, v, page_size);
  if (!page) {
    return page.error();
  }
  // Every factor is at least zero; each product is checked before it is taken.
  const std::int64_t pages = tokens / page_size + (tokens % page_size != 0 ? 1 : 0);
  std::int64_t total = 1;
  for (const std::int64_t factor : {pages, batch, std::int64_t{m.num_layers}, *page}) {
    if (factor != 0 && total > std::numeric_limits<std::int64_t>::max() / factor) {
      return errc::out_of_range;
    }
    total *= factor;
  }
  return total;
}

//! How many tokens fit in `bytes` of KV memory (whole pages of `page_size` tokens, all layers).
[[nodiscard]] constexpr result<std::int64_t> tokens_that_fit(const model_config& m, kv_format k,
                                                             kv_format v, std::int64_t bytes,
                                                             std::int32_t page_size) noexcept {
  if (bytes < 0) {
    return errc::bad_argument;
  }
  const auto page = page_bytes(m, k, v, page_size);
  if (!page) {
    return page.error();
  }
  return bytes / (*page * m.num_layers) * page_size;
}

} // namespace kvkit
