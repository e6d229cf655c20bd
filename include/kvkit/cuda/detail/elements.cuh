#pragma once
//! Device conversions between float and the element types kernels read and write outside the
//! cache (float, fp16, bf16), through kvkit's own conversions so they match the host bit for bit.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "kvkit/quant/float_conversions.hpp"

namespace kvkit::cuda::detail {

template <class T>
__device__ inline float to_float(T x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else if constexpr (std::is_same_v<T, __half>) {
    return fp16_bits_to_float(__half_as_ushort(x));
  } else {
    return bf16_bits_to_float(__bfloat16_as_ushort(x));
  }
}

template <class T>
__device__ inline T from_float(float x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else if constexpr (std::is_same_v<T, __half>) {
    return __ushort_as_half(float_to_fp16_bits(x));
  } else {
    return __ushort_as_bfloat16(float_to_bf16_bits(x));
  }
}

} // namespace kvkit::cuda::detail
