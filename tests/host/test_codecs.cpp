#include <cfloat>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <limits>
#include <random>
#include <utility>
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
  // Values so small that max|x| / 448 is subnormal: the smallest normal scale, whose reciprocal
  // is finite, so zeros stay zeros (an infinite one coded them NaN) and the values round trip.
  const std::vector<float> tiny{1e-37F, -2e-38F};
  const auto pt = C::fit(tiny.data(), 2);
  CHECK(pt.scale == FLT_MIN);
  CHECK(std::isfinite(pt.inv));
  CHECK(C::encode(0.0F, pt) == 0);
  CHECK(round_trip<C>(1e-37F, pt) == Approx(1e-37F).epsilon(0.07));
  using E = kvkit::fp8_e5m2_codec;
  CHECK(round_trip<E>(1e9F, {1.0F}) == 57344.0F);
}

TEST_CASE("int8 is symmetric per group and bounded by half a step", "[quant][codecs]") {
  using C = kvkit::int8_codec;
  const std::uint64_t seed = kvkit_test::test_seed(3);
  INFO("KVKIT_TEST_SEED=" << seed);
  std::mt19937_64 rng(seed);
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
  const std::uint64_t seed = kvkit_test::test_seed(4);
  INFO("KVKIT_TEST_SEED=" << seed);
  std::mt19937_64 rng(seed);
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

namespace {

// The int4 parameter rule as written first, with a double-precision check: what min_max_params
// (fp32 only, no division on the device) must reproduce bit for bit.
kvkit::detail::scale_zero spec_min_max_params(float lo, float hi) {
  constexpr float fp16_max = 65504.0F;
  if (lo == 0.0F) {
    lo = 0.0F;
  }
  lo = lo < -fp16_max ? -fp16_max : (lo > fp16_max ? fp16_max : lo);
  std::uint16_t zero_bits = kvkit::float_to_fp16_bits(lo);
  if (kvkit::fp16_bits_to_float(zero_bits) > lo) {
    zero_bits = (zero_bits & 0x7FFFU) == 0   ? std::uint16_t{0x8001}
                : (zero_bits & 0x8000U) != 0 ? static_cast<std::uint16_t>(zero_bits + 1U)
                                             : static_cast<std::uint16_t>(zero_bits - 1U);
  }
  const float zero = kvkit::fp16_bits_to_float(zero_bits);
  const float top = hi > zero ? hi : zero;
  const float step = (top - zero) / 15.0F;
  float scale =
      kvkit::fp16_bits_to_float(kvkit::float_to_fp16_bits(step < fp16_max ? step : fp16_max));
  if (scale < fp16_max &&
      static_cast<double>(scale) * 15.0 + static_cast<double>(zero) < static_cast<double>(top)) {
    scale = kvkit::fp16_bits_to_float(
        static_cast<std::uint16_t>(kvkit::float_to_fp16_bits(scale) + 1U));
  }
  return {scale, zero, scale > 0.0F ? 1.0F / scale : 0.0F};
}

float from_bits(std::uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof(x));
  return x;
}

} // namespace

TEST_CASE("int4 parameters follow the double-precision rule bit for bit", "[quant][codecs]") {
  const std::uint64_t seed = kvkit_test::test_seed(15);
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  // Edges: signed zeros, fp16 subnormals and their midpoints, the fp16 limits and past them,
  // values whose range divides by 15 exactly, and float extremes.
  std::vector<float> edges{0.0F,      -0.0F,    1e-30F,    -1e-30F, 5.96e-8F, 2.98e-8F, -2.98e-8F,
                           6.1e-5F,   -6.1e-5F, 1.0F,      -1.0F,   15.0F,    -15.0F,   65504.0F,
                           -65504.0F, 65519.0F, -65520.0F, 1e9F,    -1e9F,    3.4e38F,  -3.4e38F,
                           0.1F,      -0.1F,    7.5F,      -7.5F};
  for (std::uint32_t h = 0; h < 0x7C00U; h += 97) { // fp16 values and the midpoints above them
    const float v = kvkit::fp16_bits_to_float(static_cast<std::uint16_t>(h));
    const float next = kvkit::fp16_bits_to_float(static_cast<std::uint16_t>(h + 1));
    edges.insert(edges.end(), {v, -v, (v + next) / 2, -(v + next) / 2});
  }
  std::int64_t mismatches = 0;
  const auto check = [&](float lo, float hi) {
    const auto got = kvkit::detail::min_max_params({lo, hi, true});
    const auto want = spec_min_max_params(lo, hi);
    const bool same = std::memcmp(&got.scale, &want.scale, 4) == 0 &&
                      std::memcmp(&got.zero, &want.zero, 4) == 0 &&
                      std::memcmp(&got.inv, &want.inv, 4) == 0;
    if (!same && mismatches < 5) {
      UNSCOPED_INFO("lo " << lo << " hi " << hi);
    }
    mismatches += same ? 0 : 1;
  };
  for (const float a : edges) {
    for (const float b : edges) {
      if (a <= b) {
        check(a, b);
      }
    }
  }
  std::uniform_real_distribution<float> unit(-1.0F, 1.0F);
  for (int i = 0; i < 2'000'000; ++i) {
    float lo;
    float hi;
    switch (i % 4) {
    case 0: { // raw finite bit patterns
      lo = from_bits(static_cast<std::uint32_t>(rng()) & 0xFF7FFFFFU);
      hi = from_bits(static_cast<std::uint32_t>(rng()) & 0xFF7FFFFFU);
      break;
    }
    case 1: { // a typical K channel at some magnitude
      const float scale = std::ldexp(1.0F, static_cast<int>(rng() % 40) - 24);
      lo = unit(rng) * scale;
      hi = unit(rng) * scale;
      break;
    }
    case 2: { // narrow ranges: hi a few float steps above lo
      lo = unit(rng) * std::ldexp(1.0F, static_cast<int>(rng() % 30) - 14);
      hi = lo;
      for (auto n = rng() % 64; n > 0; --n) {
        hi = std::nextafter(hi, 1e30F);
      }
      break;
    }
    default: { // lo an fp16 value or a midpoint, so the zero point meets its rounding ties
      const auto h = static_cast<std::uint16_t>((rng() % 0x7C00U) | (rng() & 0x8000U)); // finite
      lo = kvkit::fp16_bits_to_float(h);
      if ((rng() & 1) != 0 && (h & 0x7FFFU) < 0x7BFFU) {
        lo = (lo + kvkit::fp16_bits_to_float(static_cast<std::uint16_t>(h + 1))) / 2;
      }
      hi = lo + std::fabs(unit(rng)) * std::ldexp(1.0F, static_cast<int>(rng() % 20) - 10);
      break;
    }
    }
    if (lo > hi) {
      std::swap(lo, hi);
    }
    check(lo, hi);
  }
  CHECK(mismatches == 0);
}

TEST_CASE("kv_format names and dispatch", "[quant][codecs]") {
  for (const auto f : kvkit::all_kv_formats) {
    const auto parsed = kvkit::parse_kv_format(kvkit::to_string(f));
    REQUIRE(parsed.ok());
    CHECK(*parsed == f);
  }
  CHECK(kvkit::parse_kv_format("int3").error() == kvkit::errc::bad_argument);
  CHECK(kvkit::to_string(static_cast<kvkit::kv_format>(200)) == "unknown");
  CHECK(kvkit::visit_codec(kvkit::kv_format::int4_g64,
                           [](auto c) { return decltype(c)::group_size; }) == 64);
  CHECK(kvkit::visit_codec(kvkit::kv_format::fp8_e5m2, [](auto c) { return decltype(c)::bits; }) ==
        8);
}
