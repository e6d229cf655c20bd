// kvkit's fp8, fp16 and bf16 conversions against CUDA's own (the host implementations in
// cuda_fp8.h, cuda_fp16.h and cuda_bf16.h, which define the device results). Needs the CUDA
// Toolkit's headers, not a GPU.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>

#include <catch2/catch.hpp>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "host/test_seed.hpp"
#include "kvkit/quant/float_conversions.hpp"

namespace {

__nv_fp8_interpretation_t cuda_format(kvkit::fp8_format f) {
  return f == kvkit::fp8_format::e4m3 ? __NV_E4M3 : __NV_E5M2;
}

// Random floats across every class: raw bit patterns (NaN, ±Inf, subnormals, huge), values near
// the fp8 ranges, exact ties and their neighbours.
float draw(std::mt19937_64& rng, std::uint64_t i) {
  switch (i % 4) {
  case 0: {
    const auto u = static_cast<std::uint32_t>(rng());
    float x;
    std::memcpy(&x, &u, sizeof(x));
    return x;
  }
  case 1:
    return std::ldexp(static_cast<float>(rng() % 2000000) / 1e6F,
                      static_cast<int>(rng() % 50) - 30) *
           ((rng() & 1) != 0 ? -1.0F : 1.0F);
  case 2: {
    const float base =
        kvkit::fp8_bits_to_float(static_cast<std::uint8_t>(rng() % 0x7E), kvkit::fp8_format::e4m3);
    return std::nextafter(base, (rng() & 1) != 0 ? 1e9F : -1e9F);
  }
  default: {
    // Exactly halfway between two adjacent e5m2 codes.
    const auto c = static_cast<std::uint8_t>(rng() % 0x7A);
    const float a = kvkit::fp8_bits_to_float(c, kvkit::fp8_format::e5m2);
    const float b =
        kvkit::fp8_bits_to_float(static_cast<std::uint8_t>(c + 1), kvkit::fp8_format::e5m2);
    return (a + b) / 2;
  }
  }
}

} // namespace

TEST_CASE("fp8 encode is bit-exact with cuda_fp8.h on 12 M floats", "[quant][cuda_headers]") {
  const std::uint64_t seed = kvkit_test::test_seed(8);
  std::mt19937_64 rng(seed);
  std::int64_t mismatches = 0;
  for (std::uint64_t i = 0; i < 12'000'000; ++i) {
    const float x = draw(rng, i);
    for (const auto f : {kvkit::fp8_format::e4m3, kvkit::fp8_format::e5m2}) {
      const auto want = __nv_cvt_float_to_fp8(x, __NV_SATFINITE, cuda_format(f));
      const auto got = kvkit::float_to_fp8_bits(x, f);
      if (want != got && ++mismatches <= 5) {
        std::uint32_t u;
        std::memcpy(&u, &x, 4);
        FAIL_CHECK("seed " << seed << ": x bits 0x" << std::hex << u << " format "
                           << static_cast<int>(f) << " cuda 0x" << +want << " kvkit 0x" << +got);
      }
    }
  }
  CHECK(mismatches == 0);
}

TEST_CASE("all 256 fp8 codes decode as cuda_fp8.h decodes them", "[quant][cuda_headers]") {
  for (const auto f : {kvkit::fp8_format::e4m3, kvkit::fp8_format::e5m2}) {
    for (std::uint32_t c = 0; c < 256; ++c) {
      const __half_raw raw =
          __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(c), cuda_format(f));
      const float want = __half2float(__half(raw));
      const float got = kvkit::fp8_bits_to_float(static_cast<std::uint8_t>(c), f);
      INFO("code " << c);
      CHECK((want == got || (std::isnan(want) && std::isnan(got))));
    }
  }
}

TEST_CASE("fp16 and bf16 encode are bit-exact with CUDA's", "[quant][cuda_headers]") {
  const std::uint64_t seed = kvkit_test::test_seed(16);
  INFO("KVKIT_TEST_SEED=" << seed);
  std::mt19937_64 rng(seed);
  std::int64_t mismatches = 0;
  for (std::uint64_t i = 0; i < 4'000'000; ++i) {
    const float x = draw(rng, i);
    const __half h = __float2half_rn(x);
    const __nv_bfloat16 b = __float2bfloat16_rn(x);
    std::uint16_t hb;
    std::uint16_t bb;
    std::memcpy(&hb, &h, 2);
    std::memcpy(&bb, &b, 2);
    mismatches += hb != kvkit::float_to_fp16_bits(x) ? 1 : 0;
    mismatches += bb != kvkit::float_to_bf16_bits(x) ? 1 : 0;
  }
  CHECK(mismatches == 0);
}

TEST_CASE("fp16 round-down is bit-exact with CUDA's", "[quant][cuda_headers]") {
  const std::uint64_t seed = kvkit_test::test_seed(17);
  INFO("KVKIT_TEST_SEED=" << seed);
  std::mt19937_64 rng(seed);
  std::int64_t mismatches = 0;
  const auto check = [&](float x) {
    const __half h = __float2half_rd(x);
    std::uint16_t hb;
    std::memcpy(&hb, &h, 2);
    mismatches += hb != kvkit::float_to_fp16_bits_down(x) ? 1 : 0;
  };
  for (std::uint32_t b = 0; b < 0x7C00U; ++b) { // every finite fp16 value, its neighbours
    const float v = kvkit::fp16_bits_to_float(static_cast<std::uint16_t>(b));
    for (const float x : {v, std::nextafter(v, 1e9F), std::nextafter(v, -1e9F)}) {
      if (std::fabs(x) <= 65504.0F) {
        check(x);
        check(-x);
      }
    }
  }
  for (std::uint64_t i = 0; i < 4'000'000; ++i) {
    const float x = draw(rng, i);
    if (std::fabs(x) <= 65504.0F) { // the documented domain (NaN fails the test too)
      check(x);
    }
  }
  CHECK(mismatches == 0);
}
