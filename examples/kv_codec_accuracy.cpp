// How much each KV codec perturbs K, V and an attention output computed from them, on random data
// and on data whose K has channel outliers (as real models' K caches do). Prints a Markdown table.
//
// Per codec: quantize K and V page by page with the CPU reference (16-token pages, 8 KV heads,
// head_dim 128, 2048 tokens), dequantize, and report relative errors ||x' - x|| / ||x|| of K, of V,
// and of softmax(q·K / sqrt(d)) · V for 4 random queries per head, computed in float64.
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include <kvkit/layout/page_layout.hpp>
#include <kvkit/quant/codecs.hpp>
#include <kvkit/reference/quantize.hpp>

namespace {

constexpr std::int32_t page_size = 16;
constexpr std::int32_t heads = 8;
constexpr std::int32_t dim = 128;
constexpr std::int32_t tokens = 2048;
constexpr std::size_t per_token = static_cast<std::size_t>(heads * dim);

struct data {
  std::vector<float> k, v, q; // k, v: [tokens][heads][dim]; q: [4][heads][dim]
};

data make(bool outliers, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> n(0.0F, 1.0F);
  data d;
  d.k.resize(tokens * per_token);
  d.v.resize(tokens * per_token);
  d.q.resize(4 * per_token);
  for (std::size_t i = 0; i < d.k.size(); ++i) {
    const auto c = static_cast<std::int32_t>(i % dim);
    // Outliers: 4 fixed channels of every head 20x larger, the pattern KIVI reports for K.
    d.k[i] = n(rng) * (outliers && c % 32 == 7 ? 20.0F : 1.0F);
    d.v[i] = n(rng);
  }
  for (auto& x : d.q) {
    x = n(rng);
  }
  return d;
}

double rel(const std::vector<float>& a, const std::vector<float>& b) {
  double e = 0;
  double t = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    e += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    t += static_cast<double>(a[i]) * a[i];
  }
  return std::sqrt(e / t);
}

// softmax(q·K / sqrt(d)) · V per query and head, in float64.
std::vector<double> attention(const data& d, const std::vector<float>& k,
                              const std::vector<float>& v) {
  std::vector<double> out(4 * per_token, 0.0);
  std::vector<double> s(tokens);
  for (std::int32_t qi = 0; qi < 4; ++qi) {
    for (std::int32_t h = 0; h < heads; ++h) {
      const float* q =
          &d.q[static_cast<std::size_t>(qi) * per_token + static_cast<std::size_t>(h * dim)];
      double m = -1e300;
      for (std::int32_t t = 0; t < tokens; ++t) {
        const float* kt =
            &k[static_cast<std::size_t>(t) * per_token + static_cast<std::size_t>(h * dim)];
        double dot = 0;
        for (std::int32_t c = 0; c < dim; ++c) {
          dot += static_cast<double>(q[c]) * kt[c];
        }
        s[static_cast<std::size_t>(t)] = dot / std::sqrt(static_cast<double>(dim));
        m = std::max(m, s[static_cast<std::size_t>(t)]);
      }
      double z = 0;
      for (auto& x : s) {
        x = std::exp(x - m);
        z += x;
      }
      double* o =
          &out[static_cast<std::size_t>(qi) * per_token + static_cast<std::size_t>(h * dim)];
      for (std::int32_t t = 0; t < tokens; ++t) {
        const float* vt =
            &v[static_cast<std::size_t>(t) * per_token + static_cast<std::size_t>(h * dim)];
        for (std::int32_t c = 0; c < dim; ++c) {
          o[c] += s[static_cast<std::size_t>(t)] / z * vt[c];
        }
      }
    }
  }
  return out;
}

// The largest finite value of the layout's fp8 format (its K codec's; 448, e4m3's, for a layout
// without fp8, whose scales are unused).
template <class Layout>
float fp8_largest() {
  using K = typename Layout::k_codec;
  if constexpr (requires { K::format; }) {
    return kvkit::fp8_max(K::format);
  } else {
    return 448.0F;
  }
}

template <class Layout>
void row(const char* name, const data& d, const std::vector<double>& exact) {
  const Layout layout(page_size, heads, dim);
  // fp8 static scales: calibrated per head from the data (max |x| / the format's largest finite
  // value: 448 for e4m3, 57344 for e5m2), as engines do; other codecs take none.
  std::vector<float> scales(2 * heads, 1.0F);
  for (std::int32_t which = 0; which < 2; ++which) {
    const auto& x = which == 0 ? d.k : d.v;
    for (std::int32_t h = 0; h < heads; ++h) {
      float amax = 0;
      for (std::int32_t t = 0; t < tokens; ++t) {
        for (std::int32_t c = 0; c < dim; ++c) {
          amax = std::max(amax, std::fabs(x[static_cast<std::size_t>(t) * per_token +
                                            static_cast<std::size_t>(h * dim + c)]));
        }
      }
      scales[static_cast<std::size_t>(which * heads + h)] = amax / fp8_largest<Layout>();
    }
  }
  std::vector<std::byte> page(static_cast<std::size_t>(layout.bytes_per_page()));
  std::vector<float> k(d.k.size()), v(d.v.size());
  const std::size_t chunk = page_size * per_token;
  for (std::int32_t p = 0; p < tokens / page_size; ++p) {
    const std::size_t off = static_cast<std::size_t>(p) * chunk;
    if (!kvkit::reference::quantize_page(layout, d.k.data() + off, d.v.data() + off, page_size,
                                         page.data(), scales.data()) ||
        !kvkit::reference::dequantize_page(layout, page.data(), page_size, k.data() + off,
                                           v.data() + off, scales.data())) {
      std::printf("| %s | error |\n", name);
      return;
    }
  }
  const auto approx = attention(d, k, v);
  double e = 0;
  double t = 0;
  for (std::size_t i = 0; i < exact.size(); ++i) {
    e += (approx[i] - exact[i]) * (approx[i] - exact[i]);
    t += exact[i] * exact[i];
  }
  const double bits = 8.0 * static_cast<double>(layout.bytes_per_page()) /
                      static_cast<double>(2 * page_size * per_token);
  std::printf("| %-34s | %5.2f | %9.2e | %9.2e | %9.2e |\n", name, bits, rel(d.k, k), rel(d.v, v),
              std::sqrt(e / t));
}

template <class K, class V = K>
using nhd = kvkit::paged_layout<K, V>;

void table(bool outliers) {
  const data d = make(outliers, outliers ? 2 : 1);
  std::vector<float> k = d.k;
  const auto exact = attention(d, d.k, d.v);
  std::printf("\n%s (2048 tokens, 8 KV heads, head_dim 128, pages of 16)\n\n",
              outliers ? "K with channel outliers (4 channels per head x20)" : "Gaussian K and V");
  std::printf("| codec (K / V) | bits/elem | K error | V error | attention output error |\n");
  std::printf("|---|---|---|---|---|\n");
  row<nhd<kvkit::fp16_codec>>("fp16", d, exact);
  row<nhd<kvkit::bf16_codec>>("bf16", d, exact);
  row<nhd<kvkit::fp8_e4m3_codec>>("fp8 e4m3 (per-head scale)", d, exact);
  row<nhd<kvkit::fp8_e5m2_codec>>("fp8 e5m2 (per-head scale)", d, exact);
  row<nhd<kvkit::int8_codec>>("int8 (per token and head)", d, exact);
  row<nhd<kvkit::int4_group_codec<32>>>("int4 g32", d, exact);
  row<nhd<kvkit::int4_group_codec<64>>>("int4 g64", d, exact);
  row<nhd<kvkit::int4_group_codec<128>>>("int4 g128", d, exact);
  row<nhd<kvkit::int4_channel_codec, kvkit::int4_group_codec<32>>>(
      "int4 per-channel K / int4 g32 V", d, exact);
  row<nhd<kvkit::int4_channel_codec, kvkit::int4_group_codec<128>>>(
      "int4 per-channel K / int4 g128 V", d, exact);
}

} // namespace

int main() {
  table(false);
  table(true);
  return 0;
}
