#pragma once
//! Page movement on the GPU: copy-on-write copies inside each layer's cache (`copy_blocks`), and
//! swaps between a device cache and pinned host memory (`swap_blocks`), each in one launch for
//! every layer.

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kvkit/block/types.hpp"
#include "kvkit/cuda/detail/checks.cuh"
#include "kvkit/error.hpp"

namespace kvkit::cuda {

//! Pages to copy: for every pair (src, dst) and every layer, page dst becomes a copy of page src.
//! Pointers are device-visible (the layer arrays themselves live in device memory), and each
//! layer's cache is 16-byte aligned (the kernel moves 16 bytes at a time; the layer pointers are
//! on the device, so validate() cannot check them).
struct page_copies {
  std::byte* const* src_layers = nullptr; //!< [num_layers] caches read (device, or pinned host)
  std::byte* const* dst_layers = nullptr; //!< [num_layers] caches written
  std::int32_t num_layers = 0;
  std::int64_t bytes_per_page = 0;   //!< a multiple of 16 (paged_layout guarantees it)
  const block_copy* pairs = nullptr; //!< [num_pairs] (src page, dst page)
  std::int32_t num_pairs = 0;
  //! Debug mode when set (a device int): every pair's src is checked against [0, src_capacity)
  //! and its dst against [0, dst_capacity); a bad pair sets *page_check to 1 and is not copied.
  std::int32_t* page_check = nullptr;
  std::int32_t src_capacity = 0; //!< pages in each source cache (the debug mode's bound)
  std::int32_t dst_capacity = 0; //!< pages in each destination cache (the debug mode's bound)
};

//! bad_argument for a layer count outside 1 to 65535 (copy_blocks runs a layer a grid row), a
//! non-positive page size or one that is not a multiple of 16, a negative pair count, null
//! pointers or arrays not aligned to their elements when there is work, or the debug mode without
//! positive capacities (pairs or none). Page ids must lie inside both caches (checked on the
//! device only in the debug mode, page_copies::page_check), and no page may be both a source and
//! a destination of one batch, nor the destination of two pairs (block_table's copy lists never
//! are).
[[nodiscard]] inline status validate(const page_copies& c) {
  if (c.num_layers <= 0 || c.num_layers > detail::max_grid_rows || c.bytes_per_page <= 0 ||
      c.bytes_per_page % 16 != 0 || c.num_pairs < 0) {
    return errc::bad_argument;
  }
  if (c.page_check != nullptr && (c.src_capacity <= 0 || c.dst_capacity <= 0)) {
    return errc::bad_argument;
  }
  if (c.num_pairs > 0 &&
      (c.src_layers == nullptr || c.dst_layers == nullptr || c.pairs == nullptr ||
       !detail::elements_aligned(c.src_layers, c.dst_layers, c.pairs, c.page_check))) {
    return errc::bad_argument;
  }
  return {};
}

namespace detail {

// One CTA per (pair, layer): 16-byte loads and stores, several in flight per thread. `Checked`:
// the debug mode's kernel (page_check set). A template also so that every translation unit that
// includes this header may define it (a plain __global__ function defined in a header is defined
// again in each, and the link fails).
template <bool Checked>
__global__ void copy_pages_kernel(page_copies c) {
  const block_copy pair = c.pairs[blockIdx.x];
  if (page_guard{c.src_capacity, c.page_check}.rejects<Checked>(pair.src) ||
      page_guard{c.dst_capacity, c.page_check}.rejects<Checked>(pair.dst)) {
    return;
  }
  const auto layer = static_cast<std::int32_t>(blockIdx.y);
  const auto* src =
      reinterpret_cast<const uint4*>(c.src_layers[layer] + pair.src * c.bytes_per_page);
  auto* dst = reinterpret_cast<uint4*>(c.dst_layers[layer] + pair.dst * c.bytes_per_page);
  const std::int64_t n = c.bytes_per_page / 16;
  constexpr int unroll = 4;
  std::int64_t i = threadIdx.x;
  for (; i + (unroll - 1) * static_cast<std::int64_t>(blockDim.x) < n;
       i += unroll * static_cast<std::int64_t>(blockDim.x)) {
    uint4 v[unroll];
#pragma unroll
    for (int u = 0; u < unroll; ++u) {
      v[u] = src[i + u * static_cast<std::int64_t>(blockDim.x)];
    }
#pragma unroll
    for (int u = 0; u < unroll; ++u) {
      dst[i + u * static_cast<std::int64_t>(blockDim.x)] = v[u];
    }
  }
  for (; i < n; i += blockDim.x) {
    dst[i] = src[i];
  }
}

inline cudaError_t launch_copies(const page_copies& c, cudaStream_t stream) {
  if (!validate(c).ok()) {
    return cudaErrorInvalidValue;
  }
  if (c.num_pairs == 0) {
    return cudaSuccess;
  }
  if (const cudaError_t e = take_pending_error(); e != cudaSuccess) {
    return e;
  }
  const dim3 grid(static_cast<unsigned>(c.num_pairs), static_cast<unsigned>(c.num_layers));
  with_page_check(c.page_check, [&](auto checked) {
    copy_pages_kernel<decltype(checked)::value><<<grid, 256, 0, stream>>>(c);
  });
  return cudaGetLastError();
}

} // namespace detail

//! Runs a step's copy-on-write list (block_table's `(src, dst)` pairs) for every layer in one
//! launch, inside the same caches: `c.src_layers` and `c.dst_layers` are the same array.
//! Asynchronous on `stream`; cudaErrorInvalidValue when `validate` fails, and an error an earlier
//! call left pending is returned (taken) before anything launches (detail::take_pending_error).
[[nodiscard]] inline cudaError_t copy_blocks(const page_copies& c, cudaStream_t stream) {
  return detail::launch_copies(c, stream);
}

//! Swaps pages between device caches and pinned host memory (cudaHostAlloc or cudaHostRegister,
//! reached through unified addressing): for swap-out, src_layers are the device caches and
//! dst_layers the host tiers; for swap-in the other way round. One launch for every layer,
//! asynchronous on `stream`; the engine runs swap-outs before swap-ins (the scheduler's order).
[[nodiscard]] inline cudaError_t swap_blocks(const page_copies& c, cudaStream_t stream) {
  return detail::launch_copies(c, stream);
}

} // namespace kvkit::cuda
