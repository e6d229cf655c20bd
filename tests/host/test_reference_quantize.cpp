#include <algorithm>
#include <cmath>
#include <cstddef>
#include <random>
#include <vector>

#include <catch2/catch.hpp>

#include "host/test_seed.hpp"
#include "kvkit/reference/quantize.hpp"

using kvkit::kv_order;

namespace {

struct sample {
  std::vector<float> k, v;
};

sample make(std::int32_t tokens, std::int32_t heads, std::int32_t dim, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> n(0.0F, 1.0F);
  sample s;
  s.k.resize(static_cast<std::size_t>(tokens * heads * dim));
  s.v.resize(s.k.size());
  for (std::size_t i = 0; i < s.k.size(); ++i) {
    s.k[i] = n(rng);
    s.v[i] = n(rng);
  }
  return s;
}

double rel_error(const std::vector<float>& a, const std::vector<float>& b) {
  double e = 0;
  double t = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    e += (a[i] - b[i]) * static_cast<double>(a[i] - b[i]);
    t += a[i] * static_cast<double>(a[i]);
  }
  return std::sqrt(e / t);
}

// Quantizes and dequantizes a page; returns the K and V relative errors.
template <class Layout>
std::pair<double, double> round_trip(const Layout& l, std::int32_t tokens, const float* scales,
                                     std::uint64_t seed) {
  const auto s = make(tokens, l.num_kv_heads(), l.head_dim(), seed);
  std::vector<std::byte> page(static_cast<std::size_t>(l.bytes_per_page()), std::byte{0xAB});
  REQUIRE(
      kvkit::reference::quantize_page(l, s.k.data(), s.v.data(), tokens, page.data(), scales).ok());
  std::vector<float> k(s.k.size(), -999.0F);
  std::vector<float> v(s.v.size(), -999.0F);
  REQUIRE(
      kvkit::reference::dequantize_page(l, page.data(), tokens, k.data(), v.data(), scales).ok());
  return {rel_error(s.k, k), rel_error(s.v, v)};
}

} // namespace

TEST_CASE("every codec round-trips a page within its error bound", "[reference][quant]") {
  const std::uint64_t seed = kvkit_test::test_seed(41);
  INFO("seed " << seed);
  std::vector<float> scales(2 * 4, 4.5F / 448.0F);
  const auto check = [&](auto layout, double bound) {
    const auto [ek, ev] = round_trip(layout, layout.page_size(), scales.data(), seed);
    CHECK(ek < bound);
    CHECK(ev < bound);
  };
  check(kvkit::paged_layout<kvkit::fp16_codec>(16, 4, 64), 1e-3);
  check(kvkit::paged_layout<kvkit::bf16_codec, kvkit::bf16_codec, kv_order::hnd>(16, 4, 64), 5e-3);
  check(kvkit::paged_layout<kvkit::fp8_e4m3_codec>(16, 4, 64), 0.05);
  check(kvkit::paged_layout<kvkit::fp8_e5m2_codec, kvkit::fp8_e5m2_codec, kv_order::hnd>(16, 4, 64),
        0.1);
  check(kvkit::paged_layout<kvkit::int8_codec>(16, 4, 64), 0.02);
  check(
      kvkit::paged_layout<kvkit::int4_group_codec<32>, kvkit::int4_group_codec<32>, kv_order::hnd>(
          16, 4, 64),
      0.15);
  check(kvkit::paged_layout<kvkit::int4_group_codec<64>>(8, 4, 128), 0.15);
  check(kvkit::paged_layout<kvkit::int4_channel_codec, kvkit::int4_group_codec<128>>(16, 4, 128),
        0.15);
}

TEST_CASE("NHD and HND pages decode to the same values", "[reference][quant]") {
  const auto s = make(7, 3, 64, 5);
  const kvkit::paged_layout<kvkit::int4_channel_codec, kvkit::int8_codec, kv_order::nhd> a(8, 3,
                                                                                           64);
  const kvkit::paged_layout<kvkit::int4_channel_codec, kvkit::int8_codec, kv_order::hnd> b(8, 3,
                                                                                           64);
  std::vector<std::byte> pa(static_cast<std::size_t>(a.bytes_per_page()));
  std::vector<std::byte> pb(static_cast<std::size_t>(b.bytes_per_page()));
  REQUIRE(kvkit::reference::quantize_page(a, s.k.data(), s.v.data(), 7, pa.data()).ok());
  REQUIRE(kvkit::reference::quantize_page(b, s.k.data(), s.v.data(), 7, pb.data()).ok());
  std::vector<float> ka(s.k.size()), va(s.k.size()), kb(s.k.size()), vb(s.k.size());
  REQUIRE(kvkit::reference::dequantize_page(a, pa.data(), 7, ka.data(), va.data()).ok());
  REQUIRE(kvkit::reference::dequantize_page(b, pb.data(), 7, kb.data(), vb.data()).ok());
  CHECK(ka == kb);
  CHECK(va == vb);
}

TEST_CASE("a partial page leaves the other tokens' bytes alone", "[reference][quant]") {
  const kvkit::paged_layout<kvkit::int8_codec> l(4, 1, 16);
  const auto s = make(2, 1, 16, 9);
  std::vector<std::byte> page(static_cast<std::size_t>(l.bytes_per_page()), std::byte{0x5A});
  REQUIRE(kvkit::reference::quantize_page(l, s.k.data(), s.v.data(), 2, page.data()).ok());
  for (std::int32_t t = 2; t < 4; ++t) {
    for (std::int32_t c = 0; c < 16; ++c) {
      CHECK(page[static_cast<std::size_t>(l.k_data_offset() + l.element_index(t, 0, c))] ==
            std::byte{0x5A});
    }
  }
}

TEST_CASE("bad arguments are rejected before anything is written", "[reference][quant]") {
  const auto s = make(4, 2, 32, 1);
  std::vector<std::byte> page(4096, std::byte{0x11});
  const auto untouched = page;
  const kvkit::paged_layout<kvkit::fp8_e4m3_codec> fp8(4, 2, 32);
  const std::vector<float> zero_scales(4, 0.0F);
  const std::vector<float> nan_scales(4, std::nanf(""));
  CHECK(kvkit::reference::quantize_page(fp8, s.k.data(), s.v.data(), 4, page.data()).error() ==
        kvkit::errc::bad_argument); // fp8 needs its static scales
  CHECK_FALSE(kvkit::reference::quantize_page(fp8, s.k.data(), s.v.data(), 4, page.data(),
                                              zero_scales.data())
                  .ok());
  CHECK_FALSE(kvkit::reference::quantize_page(fp8, s.k.data(), s.v.data(), 4, page.data(),
                                              nan_scales.data())
                  .ok());
  // A subnormal scale: its reciprocal is infinite, which would code zeros as NaN.
  const std::vector<float> subnormal_scales(4, 1e-39F);
  CHECK_FALSE(kvkit::reference::quantize_page(fp8, s.k.data(), s.v.data(), 4, page.data(),
                                              subnormal_scales.data())
                  .ok());
  const kvkit::paged_layout<kvkit::int8_codec> int8(4, 2, 32);
  CHECK_FALSE(kvkit::reference::quantize_page(int8, s.k.data(), s.v.data(), 5, page.data()).ok());
  CHECK_FALSE(kvkit::reference::quantize_page(int8, s.k.data(), nullptr, 4, page.data()).ok());
  const kvkit::paged_layout<kvkit::int4_group_codec<32>> bad(4, 2, 48);
  CHECK_FALSE(kvkit::reference::quantize_page(bad, s.k.data(), s.v.data(), 1, page.data()).ok());
  CHECK(page == untouched);
  std::vector<float> out(s.k.size());
  std::vector<float> out_v(s.v.size(), -3.0F);
  std::fill(out.begin(), out.end(), -3.0F);
  CHECK_FALSE(
      kvkit::reference::dequantize_page(int8, page.data(), -1, out.data(), out_v.data()).ok());
  CHECK_FALSE(
      kvkit::reference::dequantize_page(int8, page.data(), 5, out.data(), out_v.data()).ok());
  CHECK_FALSE(kvkit::reference::dequantize_page(int8, nullptr, 4, out.data(), out_v.data()).ok());
  CHECK_FALSE(kvkit::reference::dequantize_page(int8, page.data(), 4, nullptr, out_v.data()).ok());
  CHECK_FALSE(kvkit::reference::dequantize_page(int8, page.data(), 4, out.data(), nullptr).ok());
  // fp8 pages decode only with their static scales, and positive normal ones.
  CHECK(kvkit::reference::dequantize_page(fp8, page.data(), 4, out.data(), out_v.data()).error() ==
        kvkit::errc::bad_argument);
  CHECK_FALSE(kvkit::reference::dequantize_page(fp8, page.data(), 4, out.data(), out_v.data(),
                                                zero_scales.data())
                  .ok());
  CHECK_FALSE(kvkit::reference::dequantize_page(fp8, page.data(), 4, out.data(), out_v.data(),
                                                subnormal_scales.data())
                  .ok());
  // No refused call wrote an output.
  CHECK(std::all_of(out.begin(), out.end(), [](float x) { return x == -3.0F; }));
  CHECK(std::all_of(out_v.begin(), out_v.end(), [](float x) { return x == -3.0F; }));
}
