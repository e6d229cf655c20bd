#pragma once
//! Straight-line device paths of the page kernels: codes of eight or 32 values at a time in fp32
//! and integer arithmetic, without conversion instructions where a bit trick is exact. Each path
//! gives the bits kvkit's host codecs give for the inputs it accepts (finite values, non-NaN codes,
//! finite parameters) and says so; the kernels send the rest through the codecs' scalar code.
//!
//! The tricks: a small integer n becomes the float n as the bits 0x4B000000 | n (the float
//! 2^23 + n) minus 2^23, both exact; v + 1.5 * 2^23 rounds v to the nearest integer, ties to even,
//! exactly as rintf does for |v| < 2^22, and leaves it in the low bits of the sum.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "kvkit/concepts/kv_codec.hpp"
#include "kvkit/cuda/detail/elements.cuh"
#include "kvkit/layout/page_layout.hpp"
#include "kvkit/quant/codecs.hpp"
#include "kvkit/quant/kv_format.hpp"

namespace kvkit::cuda::detail {

//! Whether the CUDA kernels know codec C: one of the library's codecs (every kv_format's), whose
//! codes and parameter bytes the kernels' device paths are written for. Another kv_codec works
//! with the host reference and the host pieces; the launchers refuse to build for it.
template <class C>
inline constexpr bool device_codec = [] {
  bool known = false;
  for (const kv_format f : all_kv_formats) {
    known = known || visit_codec(f, [](auto codec) { return std::is_same_v<decltype(codec), C>; });
  }
  return known;
}();

//! Whether `Layout` is kvkit's paged_layout, the geometry the launchers' device paths are
//! written for (another model of page_layout serves the host reference and the plans).
template <class Layout>
inline constexpr bool is_paged_layout = false;
template <kv_codec K, kv_codec V, kv_order Order>
inline constexpr bool is_paged_layout<paged_layout<K, V, Order>> = true;

//! Whether `Layout` is a paged_layout of two of the library's codecs: the launchers
//! static_assert it, and their validate() returns bad_argument where it does not hold.
template <class Layout>
inline constexpr bool device_layout =
    std::conjunction_v<std::bool_constant<is_paged_layout<Layout>>,
                       std::bool_constant<device_codec<typename Layout::k_codec>>,
                       std::bool_constant<device_codec<typename Layout::v_codec>>>;

//! fmaxf and fminf that return NaN when either input is NaN (one instruction each).
__device__ inline float max_nan(float a, float b) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
__device__ inline float min_nan(float a, float b) {
  float r;
  asm("min.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

//! kvkit::detail::min_max_params({lo, hi, true}) for finite lo <= hi within ±65504 (a group
//! whose values are all finite and inside fp16's range), bit for bit, in about half the
//! instructions: no clamps, no NaN handling, no saturation (the scale stays below 8736).
__device__ inline kvkit::detail::scale_zero int4_params_in_range(float lo, float hi) {
  // lo + 0 turns -0 into +0 and changes nothing else; the zero point rounds down.
  const float zero = __half2float(__ushort_as_half(float_to_fp16_bits_down(__fadd_rn(lo, 0.0F))));
  const float top = hi > zero ? hi : zero;
  // float_to_fp16_bits without its NaN canonicalization: the step is finite.
  std::uint16_t bits;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(bits) : "f"(kvkit::detail::div15(__fsub_rn(top, zero))));
  if (kvkit::detail::exact_sum_below(__fmul_rn(__half2float(__ushort_as_half(bits)), 15.0F), zero,
                                     top)) {
    ++bits;
  }
  const float scale = __half2float(__ushort_as_half(bits));
  return {scale, zero, scale > 0.0F ? __frcp_rn(scale) : 0.0F};
}

//! Lane-wise lo = min(lo, x) and hi = max(hi, x) over words of two 16-bit T values (fp16 or
//! bf16), NaN when either lane is NaN: exact, one instruction each for two values.
template <class T>
__device__ inline void extend2_nan(std::uint32_t& lo, std::uint32_t& hi, std::uint32_t x) {
  using pair = std::conditional_t<std::is_same_v<T, __half>, __half2, __nv_bfloat162>;
  const auto as_pair = [](const std::uint32_t& w) {
    return *reinterpret_cast<const pair*>(&w);
  };
  const pair l = __hmin2_nan(as_pair(lo), as_pair(x));
  const pair h = __hmax2_nan(as_pair(hi), as_pair(x));
  lo = *reinterpret_cast<const std::uint32_t*>(&l);
  hi = *reinterpret_cast<const std::uint32_t*>(&h);
}

//! p, as a value the compiler cannot see through: offsets added to it stay one 64-bit add
//! instead of being folded back into the index arithmetic that produced it.
template <class P>
__device__ inline P* opaque(P* p) {
  asm("" : "+l"(p));
  return p;
}

//! The bits of v + 1.5 * 2^23: for |v| < 2^22 the low byte holds rintf(v) (two's complement).
__device__ inline std::uint32_t round_bits(float v) {
  return __float_as_uint(__fadd_rn(v, 12582912.0F));
}

//! Whether x is neither infinite nor NaN.
__device__ inline bool finite_float(float x) {
  return (__float_as_uint(x) & 0x7F800000U) != 0x7F800000U;
}

//! Half `h` (0: low, 1: high) of a word holding two 16-bit T values (fp16 or bf16), widened to
//! float (exact).
template <class T>
__device__ inline float widen_half(std::uint32_t w, int h) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __uint_as_float(h == 0 ? w << 16 : w & 0xFFFF0000U);
  } else {
    return fp16_bits_to_float(static_cast<std::uint16_t>(h == 0 ? w & 0xFFFFU : w >> 16));
  }
}

//! Two floats as a word of two 16-bit T values (a low), by one paired conversion: the bits of
//! from_float for every non-NaN value (from_float gives one canonical NaN; this keeps payloads).
template <class T>
__device__ inline std::uint32_t narrow_pair(float a, float b) {
  if constexpr (std::is_same_v<T, __half>) {
    const __half2 h = __floats2half2_rn(a, b);
    return *reinterpret_cast<const std::uint32_t*>(&h);
  } else {
    const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<const std::uint32_t*>(&h);
  }
}

//! Nonzero when either 16-bit T half of w is NaN: its magnitude bits exceed the infinity's, and
//! adding (0x7FFF - infinity) carries into bit 15 exactly then.
template <class T>
__device__ inline std::uint32_t nan_halves(std::uint32_t w) {
  constexpr std::uint32_t carry = std::is_same_v<T, __nv_bfloat16> ? 0x007F007FU : 0x03FF03FFU;
  return ((w & 0x7FFF7FFFU) + carry) & 0x80008000U;
}

//! Eight floats stored as T with 16-byte (or two 16-byte) accesses, through from_float.
template <class T>
__device__ inline void store8(T* dst, const float (&x)[8]) {
  if constexpr (std::is_same_v<T, float>) {
    reinterpret_cast<float4*>(dst)[0] = make_float4(x[0], x[1], x[2], x[3]);
    reinterpret_cast<float4*>(dst)[1] = make_float4(x[4], x[5], x[6], x[7]);
  } else {
    uint4 raw;
    T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      e[i] = from_float<T>(x[i]);
    }
    *reinterpret_cast<uint4*>(dst) = raw;
  }
}

//! store8 for values that are not NaN, with paired conversions.
template <class T>
__device__ inline void store8_non_nan(T* dst, const float (&x)[8]) {
  if constexpr (std::is_same_v<T, float>) {
    store8(dst, x);
  } else {
    *reinterpret_cast<uint4*>(dst) =
        make_uint4(narrow_pair<T>(x[0], x[1]), narrow_pair<T>(x[2], x[3]),
                   narrow_pair<T>(x[4], x[5]), narrow_pair<T>(x[6], x[7]));
  }
}

// ------------------------------------------------------------------------------------------------
// Decoding: eight codes of one token as they lie in the page.

//! The raw codes of eight values: 16 bytes (16-bit codecs), 8 (8-bit) or 4 (4-bit).
template <kv_codec C>
using code_chunk = std::conditional_t<C::bits == 16, uint4,
                                      std::conditional_t<C::bits == 8, uint2, std::uint32_t>>;

template <kv_codec C>
__device__ inline code_chunk<C> load_chunk(const std::byte* src) {
  return *reinterpret_cast<const code_chunk<C>*>(src);
}

//! What decoding needs of a group's parameters: the scale (int8, int4, fp8) and zero point (int4).
struct chunk_params {
  float scale = 1.0F;
  float zero = 0.0F;
};

//! Reads the parameters stored at `at` (per-token codecs), without the reciprocal that encoding
//! needs.
template <kv_codec C>
__device__ inline chunk_params load_chunk_params(const std::byte* at) {
  if constexpr (std::is_same_v<C, int8_codec>) {
    return {*reinterpret_cast<const float*>(at), 0.0F};
  } else {
    const std::uint32_t w = *reinterpret_cast<const std::uint32_t*>(at);
    return {fp16_bits_to_float(static_cast<std::uint16_t>(w & 0xFFFFU)),
            fp16_bits_to_float(static_cast<std::uint16_t>(w >> 16))};
  }
}

//! The 16-bit element type a passthrough codec stores (void for other codecs).
template <kv_codec C>
using passthrough_element =
    std::conditional_t<std::is_same_v<C, bf16_codec>, __nv_bfloat16,
                       std::conditional_t<std::is_same_v<C, fp16_codec>, __half, void>>;

//! Decodes eight values as C::decode does; false (x undefined) when a code is NaN or a parameter
//! is not finite, where the scalar path must run instead.
template <kv_codec C>
__device__ inline bool decode8(const code_chunk<C>& c, const chunk_params& p, float (&x)[8]) {
  if constexpr (C::bits == 16) {
    using E = passthrough_element<C>;
    const std::uint32_t w[4] = {c.x, c.y, c.z, c.w};
    std::uint32_t nan = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      nan |= nan_halves<E>(w[i]);
      x[2 * i] = widen_half<E>(w[i], 0);
      x[2 * i + 1] = widen_half<E>(w[i], 1);
    }
    return nan == 0;
  } else if constexpr (C::scaling == kv_scaling::static_per_head) { // fp8
    const std::uint32_t w[2] = {c.x, c.y};
    constexpr bool e4m3 = C::format == fp8_format::e4m3;
    // NaN codes: e4m3 S.1111.111; e5m2 S.11111.xx (Inf too, sent to the scalar path as well).
    constexpr std::uint32_t mask = e4m3 ? 0x7F7F7F7FU : 0x7C7C7C7CU;
    constexpr std::uint32_t add = e4m3 ? 0x01010101U : 0x04040404U;
    std::uint32_t bad = 0;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      bad |= ((w[i] & mask) + add) & 0x80808080U;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const auto pair = static_cast<std::uint16_t>(w[i] >> (16 * h));
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
        std::uint32_t halves;
        if constexpr (e4m3) {
          asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(halves) : "h"(pair));
        } else {
          asm("cvt.rn.f16x2.e5m2x2 %0, %1;" : "=r"(halves) : "h"(pair));
        }
        const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&halves));
#else // no paired conversion instruction before compute capability 8.9: CUDA's exact one
        const __half2 f16 = __nv_cvt_fp8x2_to_halfraw2(pair, e4m3 ? __NV_E4M3 : __NV_E5M2);
        const float2 f = __half22float2(f16);
#endif
        x[4 * i + 2 * h] = __fmul_rn(f.x, p.scale);
        x[4 * i + 2 * h + 1] = __fmul_rn(f.y, p.scale);
      }
    }
    return bad == 0;
  } else if constexpr (C::bits == 8) {                                 // int8: float(q) * scale
    const std::uint32_t w[2] = {c.x ^ 0x80808080U, c.y ^ 0x80808080U}; // q + 128, unsigned
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const std::uint32_t bits = __byte_perm(w[i / 4], 0x4B000000U, 0x7650U | (i % 4));
      x[i] = __fmul_rn(__fsub_rn(__uint_as_float(bits), 8388736.0F), p.scale);
    }
    return finite_float(p.scale);
  } else { // int4: fma(float(code), scale, zero)
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float code = __uint_as_float(((c >> (4 * i)) & 0xFU) | 0x4B000000U);
      x[i] = __fmaf_rn(__fsub_rn(code, 8388608.0F), p.scale, p.zero);
    }
    return finite_float(p.scale) && finite_float(p.zero);
  }
}

// ------------------------------------------------------------------------------------------------
// Encoding: eight values with a static scale or none (fp16, bf16, fp8), paired conversions.

//! Codes of eight values as C::encode gives them (x scaled by `inv` first for fp8): packed
//! conversions, then NaN codes made canonical as the scalar code makes them.
template <kv_codec C>
__device__ inline code_chunk<C> encode8(const float (&x)[8], float inv) {
  if constexpr (C::bits == 16) {
    using E = passthrough_element<C>;
    std::uint32_t w[4];
    std::uint32_t nan = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      w[i] = narrow_pair<E>(x[2 * i], x[2 * i + 1]);
      nan |= nan_halves<E>(w[i]);
    }
    if (nan != 0) { // rare: the scalar conversion gives the canonical NaN 0x7FFF
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        w[i] = C::encode(x[2 * i], {}) | (C::encode(x[2 * i + 1], {}) << 16);
      }
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
  } else { // fp8
    constexpr bool e4m3 = C::format == fp8_format::e4m3;
    std::uint32_t w[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      std::uint16_t lo;
      std::uint16_t hi;
      const float a = __fmul_rn(x[4 * i], inv);
      const float b = __fmul_rn(x[4 * i + 1], inv);
      const float c = __fmul_rn(x[4 * i + 2], inv);
      const float d = __fmul_rn(x[4 * i + 3], inv);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
      if constexpr (e4m3) {
        asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(b), "f"(a));
        asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(d), "f"(c));
      } else {
        asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(b), "f"(a));
        asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(d), "f"(c));
      }
#else // CUDA's conversion of the same rounding and saturation (the first value in the low byte)
      constexpr __nv_fp8_interpretation_t kind = e4m3 ? __NV_E4M3 : __NV_E5M2;
      lo = __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, kind);
      hi = __nv_cvt_float2_to_fp8x2(make_float2(c, d), __NV_SATFINITE, kind);
#endif
      std::uint32_t v = static_cast<std::uint32_t>(lo) | (static_cast<std::uint32_t>(hi) << 16);
      // Saturation keeps every non-NaN result off the exponent-all-ones codes, so those are the
      // NaNs: make each 0x7F, the scalar code's NaN.
      constexpr std::uint32_t mask = e4m3 ? 0x7F7F7F7FU : 0x7C7C7C7CU;
      constexpr std::uint32_t add = e4m3 ? 0x01010101U : 0x04040404U;
      const std::uint32_t nan_bytes = (((v & mask) + add) & 0x80808080U) >> 7; // 1 per NaN byte
      const std::uint32_t nan_mask = nan_bytes * 0xFFU;
      v = (v & ~nan_mask) | (0x7F7F7F7FU & nan_mask);
      w[i] = v;
    }
    return make_uint2(w[0], w[1]);
  }
}

// ------------------------------------------------------------------------------------------------
// Encoding: 32 adjacent values of one token (a lane's run), per-token-parameter codecs.

//! A lane's run of 32 adjacent input values, kept as loaded (16-bit types two to a register, so a
//! run takes 16 registers instead of 32) and widened to float where used.
template <class T>
struct run_values {
  static constexpr int per_vector = 16 / static_cast<int>(sizeof(T)); // values per 16 bytes
  uint4 v[32 / per_vector];

  __device__ void load(const T* src) {
#pragma unroll
    for (int j = 0; j < 32 / per_vector; ++j) {
      v[j] = reinterpret_cast<const uint4*>(src)[j];
    }
  }
  __device__ void clear() {
#pragma unroll
    for (int j = 0; j < 32 / per_vector; ++j) {
      v[j] = make_uint4(0, 0, 0, 0);
    }
  }
  // Value i (a constant once loops are unrolled).
  __device__ float operator[](int i) const {
    return widen(word(i), i);
  }

  // Value i widened anew: the compiler cannot reuse an earlier widening, so the 32 floats of a
  // run are not kept alive from the range pass to the coding pass (the run stays 16 registers).
  __device__ float fresh(int i) const {
    std::uint32_t w = word(i);
    asm volatile("" : "+r"(w));
    return widen(w, i);
  }

private:
  __device__ std::uint32_t word(int i) const {
    const uint4& q = v[i / per_vector];
    const int k = (i % per_vector) / (std::is_same_v<T, float> ? 1 : 2);
    return k == 0 ? q.x : k == 1 ? q.y : k == 2 ? q.z : q.w;
  }
  __device__ static float widen(std::uint32_t w, int i) {
    if constexpr (std::is_same_v<T, float>) {
      return __uint_as_float(w);
    } else {
      return widen_half<T>(w, i % 2);
    }
  }
};

//! Codes of 32 values: 32 bytes (int8) or 16 bytes (int4).
template <kv_codec C>
struct run_codes {
  uint4 word[C::bits == 8 ? 2 : 1];
};

//! The largest |x| of a run; NaN when the run holds a NaN, Inf when it holds an Inf.
template <class V>
__device__ inline float run_amax(const V& x) {
  float m = 0.0F;
#pragma unroll
  for (int i = 0; i < 32; ++i) {
    m = max_nan(m, fabsf(x[i]));
  }
  return m;
}

//! The least and largest values of a run; NaN when the run holds a NaN. 16-bit inputs are
//! compared two at a time in their own format (exact: widening preserves order).
template <class T>
__device__ inline void run_range(const run_values<T>& x, float& lo, float& hi) {
  if constexpr (std::is_same_v<T, float>) {
    lo = x[0];
    hi = x[0];
#pragma unroll
    for (int i = 1; i < 32; ++i) {
      lo = min_nan(lo, x[i]);
      hi = max_nan(hi, x[i]);
    }
  } else {
    std::uint32_t l = x.v[0].x;
    std::uint32_t h = l;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const std::uint32_t w[4] = {x.v[j].x, x.v[j].y, x.v[j].z, x.v[j].w};
#pragma unroll
      for (int k = j == 0 ? 1 : 0; k < 4; ++k) {
        extend2_nan<T>(l, h, w[k]);
      }
    }
    lo = min_nan(widen_half<T>(l, 0), widen_half<T>(l, 1));
    hi = max_nan(widen_half<T>(h, 0), widen_half<T>(h, 1));
  }
}

//! int8 codes of a run, as int8_codec::encode gives them for finite x and a finite `inv`: the
//! product's rounding stays below 127.5 in magnitude, so no clamp is needed, and a zero scale
//! (inv 0) gives code 0.
template <class V>
__device__ inline run_codes<int8_codec> encode_run_int8(const V& x, float inv) {
  run_codes<int8_codec> out;
  std::uint32_t w[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const std::uint32_t t0 = round_bits(__fmul_rn(x.fresh(4 * j), inv));
    const std::uint32_t t1 = round_bits(__fmul_rn(x.fresh(4 * j + 1), inv));
    const std::uint32_t t2 = round_bits(__fmul_rn(x.fresh(4 * j + 2), inv));
    const std::uint32_t t3 = round_bits(__fmul_rn(x.fresh(4 * j + 3), inv));
    w[j] = __byte_perm(__byte_perm(t0, t1, 0x0040U), __byte_perm(t2, t3, 0x0040U), 0x5410U);
  }
  out.word[0] = make_uint4(w[0], w[1], w[2], w[3]);
  out.word[1] = make_uint4(w[4], w[5], w[6], w[7]);
  return out;
}

//! Eight 4-bit codes, each in the low byte of a word (as round_bits leaves them), packed into
//! one word: code i in nibble i.
__device__ inline std::uint32_t pack_nibbles(const std::uint32_t (&t)[8]) {
  const std::uint32_t even =
      __byte_perm(__byte_perm(t[0], t[2], 0x0040U), __byte_perm(t[4], t[6], 0x0040U), 0x5410U);
  const std::uint32_t odd =
      __byte_perm(__byte_perm(t[1], t[3], 0x0040U), __byte_perm(t[5], t[7], 0x0040U), 0x5410U);
  return even | (odd << 4);
}

//! int4 codes of a run, as encode_min_max gives them for finite x when the parameters are not
//! saturated (scale below 65504, least value of the group at least -65504): the zero point is at
//! most the group's least value and 15 steps reach its largest, so (x - zero) * inv lies in
//! [0, 15.5) and needs no clamp; a zero scale (inv 0) gives code 0.
template <class V>
__device__ inline run_codes<int4_group_codec<32>> encode_run_int4(const V& x, float zero,
                                                                  float inv) {
  run_codes<int4_group_codec<32>> out;
  std::uint32_t w[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    std::uint32_t t[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      // Low byte: the code, 0..15.
      t[i] = round_bits(__fmul_rn(__fsub_rn(x.fresh(8 * j + i), zero), inv));
    }
    w[j] = pack_nibbles(t);
  }
  out.word[0] = make_uint4(w[0], w[1], w[2], w[3]);
  return out;
}

} // namespace kvkit::cuda::detail
