#pragma once
// What the GPU attention tests share: random paged caches filled through the reference quantizer,
// page tables over them, queries, and the error bounds the kernels are held to.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <random>
#include <type_traits>
#include <vector>

#include <catch2/catch.hpp>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "cuda/decode_device.hpp"
#include "kvkit/quant/codecs.hpp"
#include "kvkit/quant/float_conversions.hpp"
#include "kvkit/reference/quantize.hpp"

namespace kvkit_test {

template <class T>
std::uint16_t to_bits(float x) {
  return std::is_same_v<T, __half> ? kvkit::float_to_fp16_bits(x) : kvkit::float_to_bf16_bits(x);
}
template <class T>
float from_bits(std::uint16_t b) {
  return std::is_same_v<T, __half> ? kvkit::fp16_bits_to_float(b) : kvkit::bf16_bits_to_float(b);
}

// Near-normal values, cheaply: the sum of four uniform 16-bit parts of one splitmix64 draw
// (Irwin-Hall of four, scaled to unit variance; within 3.5 of zero). std::normal_distribution took
// most of the host time of the cases with caches of hundreds of MB.
class fast_normal {
public:
  explicit fast_normal(std::uint64_t seed) : state_(seed) {}
  float operator()() {
    std::uint64_t z = (state_ += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30U)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27U)) * 0x94D049BB133111EBULL;
    z ^= z >> 31U;
    const auto sum = static_cast<float>((z & 0xFFFFU) + ((z >> 16U) & 0xFFFFU) +
                                        ((z >> 32U) & 0xFFFFU) + (z >> 48U));
    // Mean 4 * 32767.5, variance 4 * (65536^2 - 1) / 12.
    return (sum - 131070.0F) * (1.7320508F / 65536.0F);
  }

private:
  std::uint64_t state_;
};

// A paged cache filled through the reference quantizer, and steps of page tables over it.
template <class Layout>
struct problem {
  Layout layout;
  std::int32_t capacity = 0;
  std::vector<std::byte> cache;
  std::vector<float> scales; // [2][kv_heads] for fp8, else empty
  std::mt19937_64 rng;
  std::vector<std::int32_t> free_pages;
  // Where positive, every 50th token of a sequence (from its fourth) takes K and V values of this
  // magnitude, without K's outliers (at most 3.5 times it).
  float big = 0.0F;
  // K's values times 1 + rise * token / 1024 (token: the position in its sequence), so that the
  // logits spread wider, and their running maximum climbs, along the sequence.
  float rise = 0.0F;

  problem(Layout l, std::int32_t cap, std::uint64_t seed, float big_values = 0.0F)
      : layout(l), capacity(cap), rng(seed), big(big_values) {
    cache.assign(static_cast<std::size_t>(cap * layout.bytes_per_page()), std::byte{0xEE});
    free_pages.resize(static_cast<std::size_t>(cap));
    std::iota(free_pages.begin(), free_pages.end(), 0);
    std::shuffle(free_pages.begin(), free_pages.end(), rng); // scattered pages
    using K = typename Layout::k_codec;
    if constexpr (K::scaling == kvkit::kv_scaling::static_per_head) {
      for (std::int32_t i = 0; i < 2 * layout.num_kv_heads(); ++i) {
        scales.push_back(0.01F + 0.002F * static_cast<float>(i)); // values up to ~4 fit in e4m3
      }
    }
  }

  // A sequence of `len` fresh random tokens (some channels with outliers in K); returns its
  // pages and the last page's fill.
  void add_sequence(std::int32_t len, decode_step& step) {
    const std::int32_t p = layout.page_size();
    const std::int32_t pages = (len + p - 1) / p;
    REQUIRE(static_cast<std::int32_t>(free_pages.size()) >= pages);
    fast_normal d(rng());
    const std::int32_t width = layout.num_kv_heads() * layout.head_dim();
    for (std::int32_t i = 0; i < pages; ++i) {
      const std::int32_t page = free_pages.back();
      free_pages.pop_back();
      step.indices.push_back(page);
      const std::int32_t count = std::min(p, len - i * p);
      std::vector<float> k(static_cast<std::size_t>(count * width));
      std::vector<float> v(k.size());
      for (std::size_t e = 0; e < k.size(); ++e) {
        const bool outlier = (e % static_cast<std::size_t>(layout.head_dim())) % 37 == 5;
        const std::int32_t token = i * p + static_cast<std::int32_t>(e) / width;
        const float magnitude = big > 0.0F && token % 50 == 3 ? big : 1.0F;
        const float climb = 1.0F + rise * static_cast<float>(token) / 1024.0F;
        k[e] = d() * (outlier && magnitude == 1.0F ? 3.0F : magnitude) * climb;
        v[e] = d() * magnitude;
      }
      REQUIRE(kvkit::reference::quantize_page(
                  layout, k.data(), v.data(), count,
                  cache.data() + static_cast<std::size_t>(page * layout.bytes_per_page()),
                  scales.empty() ? nullptr : scales.data())
                  .ok());
    }
    step.indptr.push_back(static_cast<std::int32_t>(step.indices.size()));
    step.last_page_len.push_back(len - (pages - 1) * p);
  }

  template <class T>
  decode_step make_step(const std::vector<std::int32_t>& lens, std::int32_t q_heads) {
    decode_step s;
    s.indptr.push_back(0);
    for (const std::int32_t len : lens) {
      add_sequence(len, s);
    }
    std::normal_distribution<float> d(0.0F, 1.0F);
    s.q.resize(lens.size() * static_cast<std::size_t>(q_heads * layout.head_dim()));
    for (auto& x : s.q) {
      x = to_bits<T>(d(rng));
    }
    return s;
  }

  // Frees the pages of a step (so a later step can reuse them with new contents).
  void release(const decode_step& s) {
    free_pages.insert(free_pages.end(), s.indices.begin(), s.indices.end());
    std::shuffle(free_pages.begin(), free_pages.end(), rng);
  }
};

// fp16 operands: keys/values exact or rounded once to fp16, P and the output rounded to the
// output type. bf16 anywhere (cache, queries, outputs) allows bf16 rounding.
template <class Layout, class T>
double bound() {
  const bool bf16 = std::is_same_v<T, __nv_bfloat16> ||
                    std::is_same_v<typename Layout::k_codec, kvkit::bf16_codec>;
  return bf16 ? 1e-2 : 3e-3;
}

// Pages that sequences of `lens` tokens fill.
template <class Layout>
std::int32_t pages_for(const Layout& layout, const std::vector<std::int32_t>& lens) {
  std::int32_t pages = 0;
  for (const std::int32_t len : lens) {
    pages += (len + layout.page_size() - 1) / layout.page_size();
  }
  return pages;
}

// How far a kernel's outputs are from the reference's.
struct errors {
  double out_rel = 0.0;     // relative L2 error of all outputs together
  double row_rel_max = 0.0; // the largest relative L2 error of one (sequence, query head) row
  std::size_t worst_row = 0;
  double lse_abs = 0.0;
  bool all_finite = true;
};

// Outputs (raw T bits) and log-sum-exps against the reference's, row by row (`dim` outputs a
// row): every output's and LSE's finiteness, the relative L2 error of all and of the worst row,
// and the largest LSE difference.
template <class T>
errors compare_rows(const std::vector<float>& ref, const std::vector<float>& ref_lse,
                    const std::vector<std::uint16_t>& out, const std::vector<float>& lse,
                    std::size_t dim) {
  errors e;
  double num = 0.0;
  double den = 0.0;
  for (std::size_t row = 0; row < ref.size() / dim; ++row) {
    double row_num = 0.0;
    double row_den = 0.0;
    for (std::size_t i = row * dim; i < (row + 1) * dim; ++i) {
      const double got = from_bits<T>(out[i]);
      e.all_finite = e.all_finite && std::isfinite(got);
      row_num += (got - ref[i]) * (got - ref[i]);
      row_den += static_cast<double>(ref[i]) * ref[i];
    }
    num += row_num;
    den += row_den;
    const double rel = std::sqrt(row_num / row_den);
    if (!(rel <= e.row_rel_max)) { // NaN too
      e.row_rel_max = rel;
      e.worst_row = row;
    }
  }
  e.out_rel = std::sqrt(num / den);
  for (std::size_t i = 0; i < ref_lse.size(); ++i) {
    e.all_finite = e.all_finite && std::isfinite(lse[i]);
    e.lse_abs = std::max(e.lse_abs, std::abs(static_cast<double>(lse[i]) - ref_lse[i]));
  }
  return e;
}

} // namespace kvkit_test
