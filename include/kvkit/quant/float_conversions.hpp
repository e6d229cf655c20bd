#pragma once
//! Bit-exact conversions between float and the 16- and 8-bit floating-point formats KV caches use
//! (fp16, bf16, fp8 e4m3, fp8 e5m2), in plain integer arithmetic so host and device agree.

#include <cstdint>
#include <cstring>

#include "kvkit/config.hpp"

namespace kvkit {

namespace detail {

[[nodiscard]] KVKIT_HOST_DEVICE inline std::uint32_t float_bits(float x) {
  std::uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  return u;
}
[[nodiscard]] KVKIT_HOST_DEVICE inline float bits_float(std::uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof(x));
  return x;
}

// v / 2^s rounded to nearest, ties to even (v < 2^25).
[[nodiscard]] KVKIT_HOST_DEVICE constexpr std::uint32_t round_shift(std::uint32_t v,
                                                                    std::int32_t s) {
  if (s <= 0) {
    return v;
  }
  if (s > 26) {
    return 0;
  }
  const std::uint32_t q = v >> s;
  const std::uint32_t rem = v & ((1U << s) - 1U);
  const std::uint32_t half = 1U << (s - 1);
  return q + ((rem > half || (rem == half && (q & 1U) != 0U)) ? 1U : 0U);
}

// |x| (given as float bits without sign, finite) rounded to a binary format with `ebits` exponent
// bits, `mbits` mantissa bits and bias `bias`, as an unsigned code that may exceed the largest
// finite code (the caller saturates or maps to infinity).
[[nodiscard]] KVKIT_HOST_DEVICE constexpr std::uint32_t
round_to_format(std::uint32_t abs_bits, std::int32_t mbits, std::int32_t bias) {
  const auto fexp = static_cast<std::int32_t>(abs_bits >> 23);
  const std::uint32_t fman = abs_bits & 0x7FFFFFU;
  // value = m * 2^(e - 23) with m < 2^24
  const std::uint32_t m = fexp == 0 ? fman : (fman | 0x800000U);
  const std::int32_t e = fexp == 0 ? -126 : fexp - 127;
  if (e >= 1 - bias) {
    // Normal in the target: round the float's 23-bit fraction to mbits; a carry moves into the
    // exponent field, which is the correct next code.
    const auto combined = (static_cast<std::uint32_t>(e + bias) << 23) | fman;
    return round_shift(combined, 23 - mbits);
  }
  // Subnormal in the target: units of 2^(1 - bias - mbits).
  return round_shift(m, (1 - bias - mbits) - (e - 23) > 0 ? (1 - bias - mbits) - (e - 23) : 0);
}

} // namespace detail

//! float -> IEEE binary16 in integer arithmetic (the host path of float_to_fp16_bits).
[[nodiscard]] KVKIT_HOST_DEVICE inline std::uint16_t soft_float_to_fp16_bits(float x) {
  const std::uint32_t u = detail::float_bits(x);
  const std::uint32_t sign = (u >> 16) & 0x8000U;
  const std::uint32_t a = u & 0x7FFFFFFFU;
  if (a > 0x7F800000U) {
    return 0x7FFF;
  }
  if (a == 0x7F800000U) {
    return static_cast<std::uint16_t>(sign | 0x7C00U);
  }
  std::uint32_t code = detail::round_to_format(a, 10, 15);
  if (code > 0x7C00U) {
    code = 0x7C00U;
  }
  return static_cast<std::uint16_t>(sign | code);
}

//! IEEE binary16 -> float in integer arithmetic (the host path of fp16_bits_to_float).
[[nodiscard]] KVKIT_HOST_DEVICE inline float soft_fp16_bits_to_float(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000U) << 16;
  const std::uint32_t exp = (h >> 10) & 0x1FU;
  const std::uint32_t man = h & 0x3FFU;
  if (exp == 0x1FU) {
    return detail::bits_float(sign | 0x7F800000U | (man << 13));
  }
  if (exp == 0) {
    // subnormal: man * 2^-24, exact in float
    const float mag = static_cast<float>(man) * 5.9604644775390625e-8F;
    return sign != 0 ? -mag : mag;
  }
  return detail::bits_float(sign | ((exp + 112U) << 23) | (man << 13));
}

//! float -> bfloat16 in integer arithmetic (the host path of float_to_bf16_bits).
[[nodiscard]] KVKIT_HOST_DEVICE inline std::uint16_t soft_float_to_bf16_bits(float x) {
  const std::uint32_t u = detail::float_bits(x);
  if ((u & 0x7FFFFFFFU) > 0x7F800000U) {
    return 0x7FFF;
  }
  return static_cast<std::uint16_t>((u + 0x7FFFU + ((u >> 16) & 1U)) >> 16);
}

//! bfloat16 -> float (exact).
[[nodiscard]] KVKIT_HOST_DEVICE inline float bf16_bits_to_float(std::uint16_t b) {
  return detail::bits_float(static_cast<std::uint32_t>(b) << 16);
}

//! The two 8-bit float formats.
enum class fp8_format : std::uint8_t {
  e4m3, //!< 4 exponent, 3 mantissa bits, bias 7; largest finite 448; no infinities
  e5m2, //!< 5 exponent, 2 mantissa bits, bias 15; largest finite 57344
};

//! Largest finite value of an fp8 format.
[[nodiscard]] KVKIT_HOST_DEVICE constexpr float fp8_max(fp8_format f) {
  return f == fp8_format::e4m3 ? 448.0F : 57344.0F;
}

//! float -> fp8 in integer arithmetic (the host path of float_to_fp8_bits).
[[nodiscard]] KVKIT_HOST_DEVICE inline std::uint8_t soft_float_to_fp8_bits(float x, fp8_format f) {
  const std::uint32_t u = detail::float_bits(x);
  const std::uint32_t sign = (u >> 24) & 0x80U;
  const std::uint32_t a = u & 0x7FFFFFFFU;
  if (a > 0x7F800000U) {
    return 0x7F;
  }
  const bool e4m3 = f == fp8_format::e4m3;
  const std::uint32_t max_code = e4m3 ? 0x7EU : 0x7BU;
  if (a == 0x7F800000U) {
    return static_cast<std::uint8_t>(sign | max_code);
  }
  std::uint32_t code = detail::round_to_format(a, e4m3 ? 3 : 2, e4m3 ? 7 : 15);
  if (code > max_code) {
    code = max_code;
  }
  return static_cast<std::uint8_t>(sign | code);
}

//! float -> IEEE binary16, round to nearest even; overflow gives infinity, NaN gives 0x7FFF (what
//! CUDA's __float2half_rn gives). On the device this is the conversion instruction, which the
//! tests prove equal to the integer version bit for bit.
[[nodiscard]] KVKIT_HOST_DEVICE inline std::uint16_t float_to_fp16_bits(float x) {
#if KVKIT_IS_DEVICE_CODE
  std::uint16_t h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
  return (h & 0x7FFFU) > 0x7C00U ? std::uint16_t{0x7FFF} : h; // canonical NaN
#else
  return soft_float_to_fp16_bits(x);
#endif
}

//! float -> bfloat16, round to nearest even; NaN gives 0x7FFF (what CUDA's __float2bfloat16_rn
//! gives). On the device this is the conversion instruction.
[[nodiscard]] KVKIT_HOST_DEVICE inline std::uint16_t float_to_bf16_bits(float x) {
#if KVKIT_IS_DEVICE_CODE && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  std::uint16_t b;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(b) : "f"(x));
  return (b & 0x7FFFU) > 0x7F80U ? std::uint16_t{0x7FFF} : b;
#else
  return soft_float_to_bf16_bits(x);
#endif
}

//! float -> fp8, round to nearest even, saturating: values beyond the largest finite (±Inf too)
//! become ±largest finite; NaN becomes 0x7F. Bit-exact with CUDA's
//! `__nv_cvt_float_to_fp8(x, __NV_SATFINITE, ...)`; on sm_89 and later devices it is the
//! conversion instruction.
[[nodiscard]] KVKIT_HOST_DEVICE inline std::uint8_t float_to_fp8_bits(float x, fp8_format f) {
#if KVKIT_IS_DEVICE_CODE && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  std::uint16_t pair;
  if (f == fp8_format::e4m3) {
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %2, %1;" : "=h"(pair) : "f"(x), "f"(0.0F));
  } else {
    asm("cvt.rn.satfinite.e5m2x2.f32 %0, %2, %1;" : "=h"(pair) : "f"(x), "f"(0.0F));
  }
  const auto code = static_cast<std::uint8_t>(pair & 0xFFU);
  // NaN: the instruction keeps the sign; kvkit (like cuda_fp8.h's host path) gives 0x7F.
  return x != x ? std::uint8_t{0x7F} : code;
#else
  return soft_float_to_fp8_bits(x, f);
#endif
}

//! fp8 -> float in integer arithmetic (the host path of fp8_bits_to_float).
[[nodiscard]] KVKIT_HOST_DEVICE inline float soft_fp8_bits_to_float(std::uint8_t c, fp8_format f) {
  const std::uint32_t sign = static_cast<std::uint32_t>(c & 0x80U) << 24;
  if (f == fp8_format::e5m2) {
    // e5m2 is the top byte of a binary16
    return soft_fp16_bits_to_float(static_cast<std::uint16_t>(static_cast<std::uint32_t>(c) << 8));
  }
  const std::uint32_t exp = (c >> 3) & 0xFU;
  const std::uint32_t man = c & 0x7U;
  if (exp == 0xFU && man == 0x7U) {
    return detail::bits_float(0x7FFFFFFFU);
  }
  if (exp == 0) {
    const float mag = static_cast<float>(man) * 0.001953125F; // man * 2^-9
    return sign != 0 ? -mag : mag;
  }
  return detail::bits_float(sign | ((exp + 120U) << 23) | (man << 20));
}

//! IEEE binary16 -> float (exact; on the device the conversion instruction).
[[nodiscard]] KVKIT_HOST_DEVICE inline float fp16_bits_to_float(std::uint16_t h) {
#if KVKIT_IS_DEVICE_CODE
  float x;
  asm("cvt.f32.f16 %0, %1;" : "=f"(x) : "h"(h));
  return x;
#else
  return soft_fp16_bits_to_float(h);
#endif
}

//! float -> binary16 rounded toward -Inf, for finite x with |x| <= 65504 (int4 zero points). On
//! the device this is the conversion instruction; on the host, round to nearest and step down
//! when that went up.
[[nodiscard]] KVKIT_HOST_DEVICE inline std::uint16_t float_to_fp16_bits_down(float x) {
#if KVKIT_IS_DEVICE_CODE
  std::uint16_t h;
  asm("cvt.rm.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
  return h;
#else
  const std::uint16_t h = soft_float_to_fp16_bits(x);
  if (!(fp16_bits_to_float(h) > x)) {
    return h;
  }
  if ((h & 0x7FFFU) == 0) {
    return 0x8001; // x is a tiny negative value: the least negative subnormal
  }
  return static_cast<std::uint16_t>((h & 0x8000U) != 0 ? h + 1U : h - 1U);
#endif
}

//! fp8 -> float (exact). e4m3: 0x7F and 0xFF are NaN. e5m2: exponent 31 is Inf or NaN. On sm_89
//! and later devices, the conversion instructions.
[[nodiscard]] KVKIT_HOST_DEVICE inline float fp8_bits_to_float(std::uint8_t c, fp8_format f) {
#if KVKIT_IS_DEVICE_CODE && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  std::uint32_t pair;
  const auto in = static_cast<std::uint16_t>(c);
  if (f == fp8_format::e4m3) {
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(pair) : "h"(in));
  } else {
    asm("cvt.rn.f16x2.e5m2x2 %0, %1;" : "=r"(pair) : "h"(in));
  }
  return fp16_bits_to_float(static_cast<std::uint16_t>(pair & 0xFFFFU));
#else
  return soft_fp8_bits_to_float(c, f);
#endif
}

} // namespace kvkit
