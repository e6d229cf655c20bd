#include <cmath>
#include <cstddef>
#include <limits>
#include <random>
#include <vector>

#include <catch2/catch.hpp>

#include "host/test_seed.hpp"
#include "kvkit/quant/codecs.hpp"
#include "kvkit/quant/kv_format.hpp"

namespace {

const float pinf = std::numeric_limits<float>::infinity();
const float qnan = std::numeric_limits<float>::quiet_NaN();

template <class C>
float round_trip(float x, const typename C::params& p) {
  return C::decode(C::encode(x, p), p);
}

template <class C>
typename C::params stored(const typename C::params& p) {
  std::byte buf[16]{};
  C::store(p, buf);
  return C::param_bytes > 0 ? C::load(buf) : p;
}

} // namespace

TEST_CASE("passthrough codecs round like the formats", "[quant][codecs]") {
  const kvkit::fp16_codec::params none{};
  CHECK(round_trip<kvkit::fp16_codec>(1.0F / 3.0F, none) ==
        kvkit::fp16_bits_to_float(kvkit::float_to_fp16_bits(1.0F / 3.0F)));
  CHECK(round_trip<kvkit::bf16_codec>(3.14159F, none) ==
        kvkit::bf16_bits_to_float(kvkit::float_to_bf16_bits(3.14159F)));
  CHECK(std::isinf(round_trip<kvkit::fp16_codec>(1e6F, none)));
}

TEST_CASE("fp8 codecs apply the static scale and saturate", "[quant][codecs]") {
  using C = kvkit::fp8_e4m3_codec;
  const std::vector<float> calib{0.5F, -2.0F, 1.0F};
  const auto p = C::fit(calib.data(), 3);
  CHECK(p.scale == Approx(2.0F / 448.0F));
  CHECK(round_trip<C>(-2.0F, p) == Approx(-2.0F));
  CHECK(round_trip<C>(100.0F, p) == Approx(2.0F)); // saturates at 448 * scale
  CHECK(round_trip<C>(-pinf, p) == Approx(-2.0F));
  CHECK(std::isnan(round_trip<C>(qnan, p)));
  CHECK(C::encode(0.0F, p) == 0);
  const std::vector<float> zeros{0.0F, 0.0F};
  CHECK(C::fit(zeros.data(), 2).scale == 1.0F); // never a zero scale
  using E = kvkit::fp8_e5m2_codec;
  CHECK(round_trip<E>(1e9F, {1.0F}) == 57344.0F);
}

TEST_CASE("int8 is symmetric per group and bounded by half a step", "[quant][codecs]") {
  using C = kvkit::int8_codec;
  std::mt19937_64 rng(kvkit_test::test_seed(3));
  std::normal_distribution<float> dist(0.0F, 2.0F);
  std::vector<float> x(128);
  for (auto& v : x) {
    v = dist(rng);
  }
  const auto p = stored<C>(C::fit(x.data(), 128));
  float amax = 0;
  for (const float v : x) {
    amax = std::max(amax, std::fabs(v));
  }
  CHECK(p.scale == amax / 127.0F);
  for (const float v : x) {
    const auto code = C::encode(v, p);
    CHECK(code <= 0xFFU);
    CHECK(std::fabs(round_trip<C>(v, p) - v) <= p.scale * 0.5001F);
  }
  // The extreme value maps to ±127 exactly.
  const auto top = std::max_element(x.begin(), x.end(),
                                    [](float a, float b) { return std::fabs(a) < std::fabs(b); });
  CHECK(std::fabs(round_trip<C>(*top, p)) == Approx(amax));
}

TEST_CASE("int8 and int4 handle non-finite input and constant groups", "[quant][codecs]") {
  using I8 = kvkit::int8_codec;
  const std::vector<float> with_bad{1.0F, qnan, -pinf, 2.0F, pinf};
  const auto p8 = I8::fit(with_bad.data(), 5);
  CHECK(p8.scale == 2.0F / 127.0F); // non-finite values do not move the scale
  CHECK(I8::encode(qnan, p8) == 0);
  CHECK(round_trip<I8>(pinf, p8) == Approx(2.0F));
  CHECK(round_trip<I8>(-pinf, p8) == Approx(-2.0F));
  const std::vector<float> zeros(8, 0.0F);
  const auto pz = I8::fit(zeros.data(), 8);
  CHECK(pz.scale == 0.0F);
  CHECK(round_trip<I8>(0.0F, pz) == 0.0F);

  using I4 = kvkit::int4_group_codec<32>;
  const auto p4 = I4::fit(with_bad.data(), 5);
  CHECK(p4.zero == 1.0F);
  CHECK(round_trip<I4>(2.0F, p4) == Approx(2.0F).margin(1e-3));
  CHECK(I4::encode(qnan, p4) == 0);
  CHECK(I4::encode(pinf, p4) == 15);
  const std::vector<float> same(32, 3.5F);
  const auto pc = I4::fit(same.data(), 32);
  CHECK(round_trip<I4>(3.5F, pc) == 3.5F); // a constant group is exact
  const std::vector<float> huge{-1e9F, 1e9F};
  const auto ph = I4::fit(huge.data(), 2); // fp16 parameters saturate instead of overflowing
  CHECK(std::isfinite(ph.scale));
  CHECK(std::isfinite(ph.zero));
  CHECK(std::isfinite(round_trip<I4>(1e9F, ph)));
}

TEST_CASE("int4 codes stay in 0..15 and within a step of the input", "[quant][codecs]") {
  std::mt19937_64 rng(kvkit_test::test_seed(4));
  std::normal_distribution<float> dist(0.5F, 3.0F);
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<float> x(64);
    for (auto& v : x) {
      v = dist(rng);
    }
    using C = kvkit::int4_group_codec<64>;
    const auto p = stored<C>(C::fit(x.data(), 64));
    for (const float v : x) {
      const auto code = C::encode(v, p);
      REQUIRE(code <= 15U);
      // fp16 rounding of scale and zero adds a little to the half-step bound.
      REQUIRE(std::fabs(round_trip<C>(v, p) - v) <= p.scale * 0.51F + std::fabs(v) * 1e-3F);
    }
  }
}

TEST_CASE("kv_format names and dispatch", "[quant][codecs]") {
  for (const auto f : kvkit::all_kv_formats) {
    const auto parsed = kvkit::parse_kv_format(kvkit::to_string(f));
    REQUIRE(parsed.ok());
    CHECK(*parsed == f);
  }
  CHECK(kvkit::parse_kv_format("int3").error() == kvkit::errc::bad_argument);
  CHECK(kvkit::visit_codec(kvkit::kv_format::int4_g64,
                           [](auto c) { return decltype(c)::group_size; }) == 64);
  CHECK(kvkit::visit_codec(kvkit::kv_format::fp8_e5m2, [](auto c) { return decltype(c)::bits; }) ==
        8);
}
