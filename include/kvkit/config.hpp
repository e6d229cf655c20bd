#pragma once
//! kvkit configuration: version and the host/device function annotations.

#include <cstdint>

#define KVKIT_VERSION_MAJOR 0
#define KVKIT_VERSION_MINOR 1
#define KVKIT_VERSION_PATCH 0
#define KVKIT_VERSION                                                                              \
  (KVKIT_VERSION_MAJOR * 10000 + KVKIT_VERSION_MINOR * 100 + KVKIT_VERSION_PATCH)

// Value types that kernels share with the host (ids, page-table views, codec parameters) mark
// their members KVKIT_HOST_DEVICE. The macro vanishes without a CUDA compiler, so every *.hpp
// header builds with a plain C++20 compiler.
#if defined(__CUDACC__)
#define KVKIT_HOST_DEVICE __host__ __device__
#define KVKIT_DEVICE __device__
#else
#define KVKIT_HOST_DEVICE
#define KVKIT_DEVICE
#endif

#if defined(__CUDA_ARCH__)
#define KVKIT_IS_DEVICE_CODE 1
#else
#define KVKIT_IS_DEVICE_CODE 0
#endif

// Inlines every call inside the function it marks (GCC and Clang); a hint, so it may vanish.
#if defined(__GNUC__)
#define KVKIT_FLATTEN [[gnu::flatten]]
#else
#define KVKIT_FLATTEN
#endif

// Inlines the function it marks into every caller (GCC and Clang), for small functions on a hot
// chain where a call would cost more than the work; plain `inline` elsewhere.
#if defined(__GNUC__)
#define KVKIT_ALWAYS_INLINE [[gnu::always_inline]] inline
#else
#define KVKIT_ALWAYS_INLINE inline
#endif

namespace kvkit {

//! The library version as {major, minor, patch}.
struct version_info {
  int major;
  int minor;
  int patch;
};

//! The version of the kvkit headers in use.
inline constexpr version_info version{KVKIT_VERSION_MAJOR, KVKIT_VERSION_MINOR,
                                      KVKIT_VERSION_PATCH};

} // namespace kvkit

namespace kvkit::detail {

//! The most thread blocks a CUDA grid takes along y or z (CUDA's limit): the launchers that put
//! layers, tokens, channels, KV heads or sequences there bound their counts by it in validate(),
//! and so do the decode plans (decode_shape::max_rows).
inline constexpr std::int64_t max_grid_rows = 65535;

//! The most thread blocks a CUDA grid takes along x (CUDA's limit, compute capability 3.0 on).
inline constexpr std::int64_t max_grid_columns = 2147483647;

} // namespace kvkit::detail
