#include <cmath>
#include <cstdint>
#include <limits>

#include <catch2/catch.hpp>

#include "kvkit/quant/float_conversions.hpp"

using kvkit::fp8_format;

TEST_CASE("every fp8 code decodes and re-encodes to itself", "[quant]") {
  for (const auto f : {fp8_format::e4m3, fp8_format::e5m2}) {
    for (std::uint32_t c = 0; c < 256; ++c) {
      const auto code = static_cast<std::uint8_t>(c);
      const float x = kvkit::fp8_bits_to_float(code, f);
      if (std::isnan(x)) {
        CHECK(kvkit::float_to_fp8_bits(x, f) == 0x7F);
        continue;
      }
      if (std::isinf(x)) {
        CHECK(f == fp8_format::e5m2);
        CHECK(kvkit::float_to_fp8_bits(x, f) == ((c & 0x80U) | 0x7BU)); // saturates
        continue;
      }
      INFO("format " << static_cast<int>(f) << " code " << c);
      CHECK(kvkit::float_to_fp8_bits(x, f) == code);
    }
  }
}

TEST_CASE("fp8 saturation, rounding and special values", "[quant]") {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  CHECK(kvkit::float_to_fp8_bits(448.0F, fp8_format::e4m3) == 0x7E);
  CHECK(kvkit::float_to_fp8_bits(1e30F, fp8_format::e4m3) == 0x7E);
  CHECK(kvkit::float_to_fp8_bits(-inf, fp8_format::e4m3) == 0xFE);
  CHECK(kvkit::float_to_fp8_bits(inf, fp8_format::e5m2) == 0x7B);
  CHECK(kvkit::float_to_fp8_bits(nan, fp8_format::e4m3) == 0x7F);
  CHECK(kvkit::float_to_fp8_bits(-nan, fp8_format::e5m2) == 0x7F);
  CHECK(kvkit::float_to_fp8_bits(-0.0F, fp8_format::e4m3) == 0x80);
  // 1.0625 lies halfway between 1.0 (0x38) and 1.125 (0x39) in e4m3: ties to even.
  CHECK(kvkit::float_to_fp8_bits(1.0625F, fp8_format::e4m3) == 0x38);
  CHECK(kvkit::float_to_fp8_bits(1.1875F, fp8_format::e4m3) == 0x3A);
  // Smallest e4m3 subnormal is 2^-9; half of it rounds to zero (even), just above rounds up.
  CHECK(kvkit::float_to_fp8_bits(std::ldexp(1.0F, -10), fp8_format::e4m3) == 0x00);
  CHECK(kvkit::float_to_fp8_bits(std::ldexp(1.01F, -10), fp8_format::e4m3) == 0x01);
  CHECK(kvkit::fp8_max(fp8_format::e5m2) == 57344.0F);
  CHECK(kvkit::fp8_bits_to_float(0x7E, fp8_format::e4m3) == 448.0F);
  CHECK(kvkit::fp8_bits_to_float(0x01, fp8_format::e4m3) == std::ldexp(1.0F, -9));
}

TEST_CASE("fp16 and bf16 round trip every code", "[quant]") {
  for (std::uint32_t c = 0; c < 65536; ++c) {
    const auto code = static_cast<std::uint16_t>(c);
    const float h = kvkit::fp16_bits_to_float(code);
    if (!std::isnan(h)) {
      REQUIRE(kvkit::float_to_fp16_bits(h) == code);
    }
    const float b = kvkit::bf16_bits_to_float(code);
    if (!std::isnan(b)) {
      REQUIRE(kvkit::float_to_bf16_bits(b) == code);
    }
  }
  CHECK(kvkit::float_to_fp16_bits(65520.0F) == 0x7C00); // rounds past the largest finite: Inf
  CHECK(kvkit::float_to_fp16_bits(std::numeric_limits<float>::quiet_NaN()) == 0x7FFF);
  CHECK(kvkit::float_to_bf16_bits(std::numeric_limits<float>::quiet_NaN()) == 0x7FFF);
  CHECK(kvkit::float_to_bf16_bits(1.00390625F) == 0x3F80); // tie to even
}
