#pragma once
//! kvkit's K/V codecs: fp16/bf16 passthrough, fp8 e4m3/e5m2 with static scales, int8 symmetric
//! per token and head, int4 asymmetric per group of channels, and int4 per channel for K.

#include <cfloat>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <math.h>

#include "kvkit/concepts/kv_codec.hpp"
#include "kvkit/config.hpp"
#include "kvkit/quant/float_conversions.hpp"

namespace kvkit {

namespace detail {

[[nodiscard]] KVKIT_HOST_DEVICE inline bool finite(float x) {
  return (float_bits(x) & 0x7F800000U) != 0x7F800000U;
}

// Round to nearest, ties to even, then clamp to [lo, hi]; NaN gives `nan_code`.
[[nodiscard]] KVKIT_HOST_DEVICE inline std::int32_t
round_clamp(float x, std::int32_t lo, std::int32_t hi, std::int32_t nan_code) {
  if (x != x) {
    return nan_code;
  }
  if (x <= static_cast<float>(lo)) {
    return lo;
  }
  if (x >= static_cast<float>(hi)) {
    return hi;
  }
  return static_cast<std::int32_t>(::rintf(x)); // default rounding mode: ties to even
}

struct no_params {};

struct scale_zero {
  float scale; // step between codes
  float zero;  // value of code 0
  float inv;   // 1 / scale (0 for a constant group): encoders multiply, never divide
};

[[nodiscard]] KVKIT_HOST_DEVICE inline float reciprocal(float scale) {
  return scale > 0.0F ? 1.0F / scale : 0.0F;
}

// The finite range of a group: lo and hi over finite values, `any` false when there are none.
struct finite_range {
  float lo = 0.0F;
  float hi = 0.0F;
  bool any = false;

  //! Takes x into the range when it is finite.
  KVKIT_HOST_DEVICE void add(float x) {
    if (finite(x)) {
      lo = any ? (x < lo ? x : lo) : x;
      hi = any ? (x > hi ? x : hi) : x;
      any = true;
    }
  }
};

[[nodiscard]] KVKIT_HOST_DEVICE inline finite_range range_of(const float* xs, std::int32_t n) {
  finite_range r;
  for (std::int32_t i = 0; i < n; ++i) {
    r.add(xs[i]);
  }
  return r;
}

// RN(d / 15) for finite d >= 0. On the device a product and one fused correction, which is the
// correctly rounded quotient for every such float (checked for all of them, and by the GPU tests
// against the host's division); the host divides.
[[nodiscard]] KVKIT_HOST_DEVICE inline float div15(float d) {
#if KVKIT_IS_DEVICE_CODE
  constexpr float inv15 = 1.0F / 15.0F;
  const float q = __fmul_rn(d, inv15);
  return __fmaf_rn(__fmaf_rn(-15.0F, q, d), inv15, q);
#else
  return d / 15.0F;
#endif
}

// Whether the exact sum a + b is below t (the sum must not overflow). The rounded sum decides
// unless it equals t; then the sign of the rounding error does (Knuth's TwoSum: exact).
[[nodiscard]] KVKIT_HOST_DEVICE inline bool exact_sum_below(float a, float b, float t) {
  const float s = a + b;
  if (s != t) {
    return s < t;
  }
  const float b_part = s - a;
  const float a_part = s - b_part;
  return (a - a_part) + (b - b_part) < 0.0F;
}

// Scale and zero point mapping a range onto codes 0..15, stored as fp16 (the encoder uses the
// fp16-rounded values, so encode and decode agree with what the page holds). Kernels reduce a
// group's range in parallel and call this same function, so host and device agree bit for bit.
[[nodiscard]] KVKIT_HOST_DEVICE inline scale_zero min_max_params(finite_range r) {
  constexpr float levels = 15.0F;
  if (!r.any) {
    r.lo = 0.0F;
    r.hi = 0.0F;
  }
  // A least value of zero is +0 whichever sign it had, so the zero point's bits do not depend on
  // the order in which a range met -0 and +0.
  if (r.lo == 0.0F) {
    r.lo = 0.0F;
  }
  // Parameters are fp16: a range beyond ±65504 saturates rather than becoming infinite.
  constexpr float fp16_max = 65504.0F;
  constexpr std::uint16_t fp16_max_bits = 0x7BFF;
  const float lo = r.lo < -fp16_max ? -fp16_max : (r.lo > fp16_max ? fp16_max : r.lo);
  // The zero point is rounded down, never up: no value of the range lies below it, so no value
  // is clipped at code 0 (and an encoder needs no lower clamp).
  const float zero = fp16_bits_to_float(float_to_fp16_bits_down(lo));
  const float top = r.hi > zero ? r.hi : zero;
  const float step = div15(top - zero);
  std::uint16_t scale_bits = float_to_fp16_bits(step < fp16_max ? step : fp16_max);
  // fp16 rounding of the scale may fall short of reaching hi; never let codes saturate early.
  // scale * 15 is exact in float (an 11-bit significand times a 4-bit one).
  if (scale_bits < fp16_max_bits &&
      exact_sum_below(fp16_bits_to_float(scale_bits) * levels, zero, top)) {
    ++scale_bits;
  }
  const float scale = fp16_bits_to_float(scale_bits);
  return {scale, zero, reciprocal(scale)};
}

[[nodiscard]] KVKIT_HOST_DEVICE inline scale_zero fit_min_max(const float* xs, std::int32_t n) {
  return min_max_params(range_of(xs, n));
}

[[nodiscard]] KVKIT_HOST_DEVICE inline float finite_amax(const float* xs, std::int32_t n) {
  float amax = 0.0F;
  for (std::int32_t i = 0; i < n; ++i) {
    const float a = ::fabsf(xs[i]);
    amax = finite(a) && a > amax ? a : amax;
  }
  return amax;
}

KVKIT_HOST_DEVICE inline void store_fp16_pair(const scale_zero& p, std::byte* out) {
  const std::uint16_t v[2] = {float_to_fp16_bits(p.scale), float_to_fp16_bits(p.zero)};
  std::memcpy(out, v, sizeof(v));
}
[[nodiscard]] KVKIT_HOST_DEVICE inline scale_zero load_fp16_pair(const std::byte* in) {
  std::uint16_t v[2];
  std::memcpy(v, in, sizeof(v));
  const float scale = fp16_bits_to_float(v[0]);
  return {scale, fp16_bits_to_float(v[1]), reciprocal(scale)};
}

[[nodiscard]] KVKIT_HOST_DEVICE inline std::uint32_t encode_min_max(float x, const scale_zero& p,
                                                                    std::int32_t levels) {
  if (!(p.scale > 0.0F)) {
    return 0; // a constant group: every value is the zero point
  }
  // +Inf clamps to the top code, -Inf and NaN to code 0 (the group's minimum).
  return static_cast<std::uint32_t>(round_clamp((x - p.zero) * p.inv, 0, levels, 0));
}

[[nodiscard]] KVKIT_HOST_DEVICE inline float decode_min_max(std::uint32_t code,
                                                            const scale_zero& p) {
  return ::fmaf(static_cast<float>(code), p.scale, p.zero);
}

} // namespace detail

namespace detail {

// A 16-bit float stored as is: binary16 or bfloat16, rounded to nearest even.
template <bool Bfloat16>
struct float16_passthrough {
  using params = no_params;
  static constexpr std::int32_t bits = 16;
  static constexpr kv_scaling scaling = kv_scaling::none;
  static constexpr std::int32_t group_size = 0;
  static constexpr std::int32_t param_bytes = 0;
  KVKIT_HOST_DEVICE static params fit(const float* /*xs*/, std::int32_t /*n*/) { return {}; }
  KVKIT_HOST_DEVICE static std::uint32_t encode(float x, const params& /*p*/) {
    return Bfloat16 ? float_to_bf16_bits(x) : float_to_fp16_bits(x);
  }
  KVKIT_HOST_DEVICE static float decode(std::uint32_t code, const params& /*p*/) {
    const auto bits16 = static_cast<std::uint16_t>(code);
    return Bfloat16 ? bf16_bits_to_float(bits16) : fp16_bits_to_float(bits16);
  }
  KVKIT_HOST_DEVICE static void store(const params& /*p*/, std::byte* /*out*/) {}
  KVKIT_HOST_DEVICE static params load(const std::byte* /*in*/) { return {}; }
};

} // namespace detail

//! fp16 passthrough: the value rounded to IEEE binary16 (overflow to infinity).
struct fp16_codec : detail::float16_passthrough<false> {};

//! bf16 passthrough: the value rounded to bfloat16.
struct bf16_codec : detail::float16_passthrough<true> {};

//! fp8 with a static scale per KV head (or one per tensor): stores fp8(x * (1 / scale)), the
//! reciprocal rounded to fp32 (a product, not a quotient: it may differ from fp8(x / scale) on a
//! rounding tie), saturating at the format's largest finite value; NaN stays NaN. The scale is a
//! calibration result passed to the kernels (`fit` computes max|x| / fp8_max for calibration, at
//! least the smallest normal float); it is not stored in pages.
template <fp8_format Format>
struct fp8_codec {
  struct params {
    float scale = 1.0F; // a positive normal float (the reference checks; the GPU launchers take
                        // the scales on the device and check only that they are given): from
                        // 2^-128 down, 1 / scale is infinite and 0 codes as NaN
    float inv = 1.0F;   // 1 / scale
  };
  //! Parameters for a calibrated scale.
  KVKIT_HOST_DEVICE static params with_scale(float scale) { return {scale, 1.0F / scale}; }
  static constexpr fp8_format format = Format;
  static constexpr std::int32_t bits = 8;
  static constexpr kv_scaling scaling = kv_scaling::static_per_head;
  static constexpr std::int32_t group_size = 0;
  static constexpr std::int32_t param_bytes = 0;
  KVKIT_HOST_DEVICE static params fit(const float* xs, std::int32_t n) {
    const float amax = detail::finite_amax(xs, n);
    // Values so small that max|x| / fp8_max is subnormal take the smallest normal scale instead
    // (the scale's reciprocal is infinite from 2^-128 down, and 0 * inf codes zeros as NaN).
    const float scale = amax / fp8_max(Format);
    return with_scale(amax > 0.0F ? (scale >= FLT_MIN ? scale : FLT_MIN) : 1.0F);
  }
  KVKIT_HOST_DEVICE static std::uint32_t encode(float x, const params& p) {
    return float_to_fp8_bits(x * p.inv, Format);
  }
  KVKIT_HOST_DEVICE static float decode(std::uint32_t code, const params& p) {
    return fp8_bits_to_float(static_cast<std::uint8_t>(code), Format) * p.scale;
  }
  KVKIT_HOST_DEVICE static void store(const params& /*p*/, std::byte* /*out*/) {}
  KVKIT_HOST_DEVICE static params load(const std::byte* /*in*/) { return {}; }
};

using fp8_e4m3_codec = fp8_codec<fp8_format::e4m3>;
using fp8_e5m2_codec = fp8_codec<fp8_format::e5m2>;

//! int8 symmetric, one float scale per token and KV head: code = round(x * (1/scale)) in -127..127
//! with scale = max|x| / 127 over the head's channels. ±Inf clamp to ±127, NaN encodes as 0.
struct int8_codec {
  struct params {
    float scale = 0.0F;
    float inv = 0.0F; // 1 / scale, not stored
  };
  static constexpr std::int32_t bits = 8;
  static constexpr kv_scaling scaling = kv_scaling::per_token_head;
  static constexpr std::int32_t group_size = 0;
  static constexpr std::int32_t param_bytes = 4;
  KVKIT_HOST_DEVICE static params fit(const float* xs, std::int32_t n) {
    return from_amax(detail::finite_amax(xs, n));
  }
  //! Parameters from a group's largest finite magnitude (what `fit` reduces to).
  KVKIT_HOST_DEVICE static params from_amax(float amax) {
    const float scale = amax / 127.0F;
    return {scale, detail::reciprocal(scale)};
  }
  KVKIT_HOST_DEVICE static std::uint32_t encode(float x, const params& p) {
    if (!(p.scale > 0.0F)) {
      return 0;
    }
    const std::int32_t q = detail::round_clamp(x * p.inv, -127, 127, 0);
    return static_cast<std::uint32_t>(q) & 0xFFU;
  }
  KVKIT_HOST_DEVICE static float decode(std::uint32_t code, const params& p) {
    return static_cast<float>(static_cast<std::int8_t>(static_cast<std::uint8_t>(code))) * p.scale;
  }
  KVKIT_HOST_DEVICE static void store(const params& p, std::byte* out) {
    std::memcpy(out, &p.scale, sizeof(float));
  }
  KVKIT_HOST_DEVICE static params load(const std::byte* in) {
    params p;
    std::memcpy(&p.scale, in, sizeof(float));
    p.inv = detail::reciprocal(p.scale);
    return p;
  }
};

namespace detail {

// The arithmetic both int4 codecs share: codes 0..15 over a min/max range, fp16 scale and zero.
struct int4_min_max {
  using params = scale_zero;
  static constexpr std::int32_t bits = 4;
  static constexpr std::int32_t param_bytes = 4;
  KVKIT_HOST_DEVICE static params fit(const float* xs, std::int32_t n) {
    return fit_min_max(xs, n);
  }
  //! Parameters from a group's finite range (what `fit` reduces to).
  KVKIT_HOST_DEVICE static params from_range(finite_range r) { return min_max_params(r); }
  KVKIT_HOST_DEVICE static std::uint32_t encode(float x, const params& p) {
    return encode_min_max(x, p, 15);
  }
  KVKIT_HOST_DEVICE static float decode(std::uint32_t code, const params& p) {
    return decode_min_max(code & 0xFU, p);
  }
  KVKIT_HOST_DEVICE static void store(const params& p, std::byte* out) { store_fp16_pair(p, out); }
  KVKIT_HOST_DEVICE static params load(const std::byte* in) { return load_fp16_pair(in); }
};

} // namespace detail

//! int4 asymmetric over groups of `Group` channels (32, 64 or 128) per token and KV head:
//! code = round((x - min) / scale) in 0..15, scale = (max - min) / 15, both stored as fp16.
//! +Inf clamps to 15, -Inf and NaN to 0; non-finite values do not move the group's range.
template <std::int32_t Group>
requires(Group == 32 || Group == 64 || Group == 128) struct int4_group_codec
    : detail::int4_min_max {
  static constexpr kv_scaling scaling = kv_scaling::per_token_group;
  static constexpr std::int32_t group_size = Group;
};

//! int4 asymmetric per channel over a page's tokens (for K, whose outliers sit in fixed channels):
//! one fp16 scale and zero point per page, KV head and channel. Quantizes whole pages.
struct int4_channel_codec : detail::int4_min_max {
  static constexpr kv_scaling scaling = kv_scaling::per_page_channel;
  static constexpr std::int32_t group_size = 0;
};

static_assert(kv_codec<fp16_codec>);
static_assert(kv_codec<bf16_codec>);
static_assert(kv_codec<fp8_e4m3_codec>);
static_assert(kv_codec<fp8_e5m2_codec>);
static_assert(kv_codec<int8_codec>);
static_assert(kv_codec<int4_group_codec<32>>);
static_assert(kv_codec<int4_group_codec<64>>);
static_assert(kv_codec<int4_group_codec<128>>);
static_assert(kv_codec<int4_channel_codec>);

} // namespace kvkit
