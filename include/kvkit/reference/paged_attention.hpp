#pragma once
//! CPU reference of paged attention in float64: decode (one query per sequence) and
//! prefill/extend (several queries per sequence over its paged cache), for any codec and layout.
//! What the GPU attention kernels are tested against.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

#include "kvkit/attention/options.hpp"
#include "kvkit/block/page_table.hpp"
#include "kvkit/concepts/kv_codec.hpp"
#include "kvkit/concepts/page_layout.hpp"
#include "kvkit/error.hpp"
#include "kvkit/layout/page_layout.hpp"
#include "kvkit/reference/quantize.hpp"

namespace kvkit::reference {

using kvkit::attention_options;

namespace detail {

// One element of a page region, decoded.
template <kv_codec C, class Layout>
double read(const Layout& l, const std::byte* data, const std::byte* params, const float* scales,
            std::int32_t t, std::int32_t h, std::int32_t c) {
  typename C::params p{};
  if constexpr (C::scaling == kv_scaling::static_per_head) {
    p = C::with_scale(scales[h]);
  } else if constexpr (C::param_bytes > 0) {
    p = C::load(params + l.template param_index<C>(t, h, c) * C::param_bytes);
  }
  return C::decode(get_code<C::bits>(data, l.element_index(t, h, c)), p);
}

// A batch size of at least 0 and, for a batch, the table's three arrays.
inline bool table_arrays_ok(const csr_page_table& t) noexcept {
  return t.batch_size == 0 || (t.batch_size > 0 && t.indptr != nullptr && t.indices != nullptr &&
                               t.last_page_len != nullptr);
}

} // namespace detail

//! Attention of `qo_indptr`-grouped queries over a paged cache. Sequence b of `table` has
//! `num_tokens(b)` cached tokens; its queries `q[qo_indptr[b] .. qo_indptr[b+1])` are its last
//! tokens (positions num_tokens(b) - n .. num_tokens(b) - 1), each attending causally to the keys
//! at or before its own position (within `window` when set). Shapes: q and out
//! [total queries][num_q_heads][head_dim]; lse (optional) [total queries][num_q_heads], natural log
//! of the softmax denominator, scaled logits included. Query head h reads KV head
//! h / (num_q_heads / num_kv_heads) (GQA; MQA when there is one KV head). `cache` holds
//! `num_cache_pages` pages of `layout.bytes_per_page()` bytes for one layer; `static_scales`
//! [2][num_kv_heads] for fp8 codecs. Errors: bad_argument (shapes, null pointers, a negative batch,
//! `qo_indptr` not starting at 0 or decreasing, a table whose `indptr` starts below 0 or decreases
//! or whose `last_page_len` is outside 1..page_size for a sequence with pages, more than INT32_MAX
//! tokens in a sequence, a sequence with more queries than tokens, missing fp8 scales or ones that
//! are not positive normal floats, options the GPU kernels refuse: a negative or non-finite scale,
//! a negative window, a soft cap that is not 0 or a positive normal float), invalid_block (a page
//! id outside the cache).
template <page_layout Layout>
[[nodiscard]] status
paged_attention(const Layout& layout, const std::byte* cache, std::int32_t num_cache_pages,
                const csr_page_table& table, std::span<const std::int32_t> qo_indptr,
                const float* q, std::int32_t num_q_heads, float* out, float* lse = nullptr,
                const float* static_scales = nullptr, const attention_options& options = {}) {
  using K = typename Layout::k_codec;
  using V = typename Layout::v_codec;
  const std::int32_t kv_heads = layout.num_kv_heads();
  const std::int32_t dim = layout.head_dim();
  if (!detail::table_arrays_ok(table) || !layout.validate().ok() || cache == nullptr ||
      q == nullptr || out == nullptr || num_q_heads <= 0 || num_q_heads % kv_heads != 0 ||
      table.page_size != layout.page_size() ||
      qo_indptr.size() != static_cast<std::size_t>(table.batch_size) + 1 || qo_indptr[0] != 0 ||
      (table.batch_size > 0 && table.indptr[0] < 0) || !options.validate().ok() ||
      !detail::scales_ok<K>(static_scales, kv_heads) ||
      !detail::scales_ok<V>(static_scales == nullptr ? nullptr : static_scales + kv_heads,
                            kv_heads)) {
    return errc::bad_argument;
  }
  for (std::int32_t b = 0; b < table.batch_size; ++b) {
    const std::int64_t n = static_cast<std::int64_t>(qo_indptr[static_cast<std::size_t>(b) + 1]) -
                           qo_indptr[static_cast<std::size_t>(b)];
    const std::int64_t pages = static_cast<std::int64_t>(table.indptr[b + 1]) - table.indptr[b];
    if (pages < 0 ||
        (pages > 0 && (table.last_page_len[b] < 1 || table.last_page_len[b] > table.page_size))) {
      return errc::bad_argument;
    }
    const std::int64_t tokens =
        pages == 0 ? 0 : (pages - 1) * table.page_size + table.last_page_len[b];
    if (tokens > std::numeric_limits<std::int32_t>::max() || n < 0 || n > tokens) {
      return errc::bad_argument;
    }
    for (std::int32_t i = 0; i < table.num_pages(b); ++i) {
      if (table.page(b, i) < 0 || table.page(b, i) >= num_cache_pages) {
        return errc::invalid_block;
      }
    }
  }
  const double scale =
      options.scale > 0.0F ? options.scale : 1.0 / std::sqrt(static_cast<double>(dim));
  const std::int32_t group = num_q_heads / kv_heads;
  const float* v_scales = static_scales == nullptr ? nullptr : static_scales + kv_heads;
  // Each key and value row is decoded once for the whole group of query heads that reads it; each
  // head's sums run in the same order as one head alone would.
  const auto dim_z = static_cast<std::size_t>(dim);
  std::vector<double> logits; // [group][keys]
  std::vector<double> acc(static_cast<std::size_t>(group) * dim_z);
  std::vector<double> row(dim_z);
  std::vector<double> m(static_cast<std::size_t>(group));
  std::vector<double> z(static_cast<std::size_t>(group));
  const auto page_of = [&](std::int32_t b, std::int32_t t) {
    return cache + static_cast<std::int64_t>(table.page(b, t / layout.page_size())) *
                       layout.bytes_per_page();
  };
  for (std::int32_t b = 0; b < table.batch_size; ++b) {
    const std::int32_t len = table.num_tokens(b);
    const std::int32_t first_q = qo_indptr[static_cast<std::size_t>(b)];
    const std::int32_t nq = qo_indptr[static_cast<std::size_t>(b) + 1] - first_q;
    for (std::int32_t i = 0; i < nq; ++i) {
      const std::int32_t pos = len - nq + i; // the query's own position
      const std::int32_t lo = options.window > 0 ? std::max(0, pos - options.window + 1) : 0;
      const auto keys = static_cast<std::size_t>(pos + 1 - lo);
      for (std::int32_t kvh = 0; kvh < kv_heads; ++kvh) {
        const float* qv =
            q + (static_cast<std::int64_t>(first_q + i) * num_q_heads + kvh * group) * dim;
        logits.assign(static_cast<std::size_t>(group) * keys, 0.0);
        std::fill(m.begin(), m.end(), -std::numeric_limits<double>::infinity());
        for (std::int32_t t = lo; t <= pos; ++t) {
          const std::byte* page = page_of(b, t);
          const std::int32_t slot = t % layout.page_size();
          for (std::int32_t c = 0; c < dim; ++c) {
            row[static_cast<std::size_t>(c)] =
                detail::read<K>(layout, page + layout.k_data_offset(),
                                page + layout.k_param_offset(), static_scales, slot, kvh, c);
          }
          for (std::int32_t g = 0; g < group; ++g) {
            const float* qh = qv + static_cast<std::int64_t>(g) * dim;
            double dot = 0.0;
            for (std::int32_t c = 0; c < dim; ++c) {
              dot += static_cast<double>(qh[c]) * row[static_cast<std::size_t>(c)];
            }
            double logit = dot * scale;
            if (options.logits_soft_cap > 0.0F) {
              logit = options.logits_soft_cap * std::tanh(logit / options.logits_soft_cap);
            }
            logits[static_cast<std::size_t>(g) * keys + static_cast<std::size_t>(t - lo)] = logit;
            m[static_cast<std::size_t>(g)] = std::max(m[static_cast<std::size_t>(g)], logit);
          }
        }
        for (std::int32_t g = 0; g < group; ++g) {
          double sum = 0.0;
          for (std::size_t t = 0; t < keys; ++t) {
            double& x = logits[static_cast<std::size_t>(g) * keys + t];
            x = std::exp(x - m[static_cast<std::size_t>(g)]);
            sum += x;
          }
          z[static_cast<std::size_t>(g)] = sum;
        }
        std::fill(acc.begin(), acc.end(), 0.0);
        for (std::int32_t t = lo; t <= pos; ++t) {
          const std::byte* page = page_of(b, t);
          const std::int32_t slot = t % layout.page_size();
          for (std::int32_t c = 0; c < dim; ++c) {
            row[static_cast<std::size_t>(c)] =
                detail::read<V>(layout, page + layout.v_data_offset(),
                                page + layout.v_param_offset(), v_scales, slot, kvh, c);
          }
          for (std::int32_t g = 0; g < group; ++g) {
            const double p =
                logits[static_cast<std::size_t>(g) * keys + static_cast<std::size_t>(t - lo)] /
                z[static_cast<std::size_t>(g)];
            double* a = acc.data() + static_cast<std::size_t>(g) * dim_z;
            for (std::size_t c = 0; c < dim_z; ++c) {
              a[c] += p * row[c];
            }
          }
        }
        for (std::int32_t g = 0; g < group; ++g) {
          const std::int64_t h = static_cast<std::int64_t>(first_q + i) * num_q_heads +
                                 static_cast<std::int64_t>(kvh) * group + g;
          float* o = out + h * dim;
          for (std::size_t c = 0; c < dim_z; ++c) {
            o[c] = static_cast<float>(acc[static_cast<std::size_t>(g) * dim_z + c]);
          }
          if (lse != nullptr) {
            lse[h] = static_cast<float>(m[static_cast<std::size_t>(g)] +
                                        std::log(z[static_cast<std::size_t>(g)]));
          }
        }
      }
    }
  }
  return {};
}

//! Decode attention: one query per sequence (its newest token), q and out
//! [batch][num_q_heads][head_dim]. A sequence with no tokens is an error (bad_argument).
template <page_layout Layout>
[[nodiscard]] status paged_decode(const Layout& layout, const std::byte* cache,
                                  std::int32_t num_cache_pages, const csr_page_table& table,
                                  const float* q, std::int32_t num_q_heads, float* out,
                                  float* lse = nullptr, const float* static_scales = nullptr,
                                  const attention_options& options = {}) {
  if (!detail::table_arrays_ok(table)) {
    return errc::bad_argument;
  }
  std::vector<std::int32_t> qo(static_cast<std::size_t>(table.batch_size) + 1);
  for (std::int32_t b = 0; b <= table.batch_size; ++b) {
    qo[static_cast<std::size_t>(b)] = b;
  }
  for (std::int32_t b = 0; b < table.batch_size; ++b) {
    // A sequence with no pages has no tokens; the rest of the table paged_attention checks.
    if (static_cast<std::int64_t>(table.indptr[b + 1]) - table.indptr[b] <= 0) {
      return errc::bad_argument;
    }
  }
  return paged_attention(layout, cache, num_cache_pages, table, qo, q, num_q_heads, out, lse,
                         static_scales, options);
}

} // namespace kvkit::reference
