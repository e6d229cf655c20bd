#pragma once
// Host-callable wrappers of the GPU page kernels for the tests (quantize_device.cu).

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "kvkit/quant/codecs.hpp"

namespace kvkit_test {

template <class T>
struct device_round_trip {
  cudaError_t error = cudaSuccess;
  std::vector<std::byte> cache; // the whole cache after quantize_pages (poisoned elsewhere)
  std::vector<T> k, v;          // dequantize_pages of the same pages (poisoned before)
  // In the debug mode, the page_check flag after quantize_pages (or write_kv) and after
  // dequantize_pages, each zeroed before its launch; -1 where the mode was off.
  std::int32_t flag_written = -1;
  std::int32_t flag_read = -1;
  // Whether the guard pages (guard_pages of them before the cache and as many after it, in the
  // same allocation, poisoned with 0xA5 as the cache is) were left alone: a launch that wrote a
  // page it flagged as outside the cache would write there.
  bool guards_intact = false;
};

// The pages of poison on each side of the cache in run_on_device and run_write_kv.
inline constexpr std::int32_t guard_pages = 8;

// Quantizes `k`/`v` (num_pages pages) into a cache of `capacity` pages poisoned with 0xA5 at
// `page_ids`, then dequantizes them into buffers poisoned with 0x5A; `debug`: both in the debug
// mode (page_batch::page_check).
template <class Layout, class T>
device_round_trip<T> run_on_device(const Layout& layout, const std::vector<T>& k,
                                   const std::vector<T>& v,
                                   const std::vector<std::int32_t>& page_ids, std::int32_t capacity,
                                   const std::vector<float>& static_scales, bool debug = false);

// write_kv of `k`/`v` (num_tokens rows) to `slots` in a cache of `capacity` pages poisoned with
// 0xA5; returns the cache (or the error). `debug`: in the debug mode (kv_write::page_check).
template <class Layout, class T>
device_round_trip<T> run_write_kv(const Layout& layout, const std::vector<T>& k,
                                  const std::vector<T>& v, const std::vector<std::int64_t>& slots,
                                  std::int32_t capacity, const std::vector<float>& static_scales,
                                  bool debug = false);

// Mismatches between kvkit's conversions run on the device and the device's own conversion
// instructions (cvt.rn.satfinite for fp8, __float2half_rn, __float2bfloat16_rn) over `n` floats
// made from hashed indices (every bit pattern class). Negative on a CUDA error.
std::int64_t device_conversion_mismatches(std::uint64_t seed, std::int64_t n);

// kvkit::detail::min_max_params of each (lo[i], hi[i]) computed on the device, with the scale
// replaced by a NaN where the kernels' short path (int4_params_in_range) disagrees with it for a
// range inside ±65504 (empty on a CUDA error).
std::vector<kvkit::detail::scale_zero> device_int4_params(const std::vector<float>& lo,
                                                          const std::vector<float>& hi);

// Non-negative finite floats d for which the device's div15(d) differs from its division d / 15
// (all 2^31 - 2^23 of them are tried). Negative on a CUDA error.
std::int64_t device_div15_mismatches();

// The argument checks of write_kv, quantize_pages and dequantize_pages: the name of every case
// where validate() or a launcher decided otherwise than expected (bad layouts, counts, missing or
// misaligned pointers, fp8 without its scales, codecs the kernels do not take). Makes no CUDA call.
std::vector<std::string> page_validation_failures();

} // namespace kvkit_test
