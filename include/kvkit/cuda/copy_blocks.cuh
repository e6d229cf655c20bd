#pragma once
//! Page movement on the GPU: copy-on-write copies inside each layer's cache (`copy_blocks`), and
//! swaps between a device cache and pinned host memory, each in one launch for every layer
//! (`swap_blocks`, a kernel on the SMs) or in one batch of copies on the copy engines
//! (`swap_blocks_copy_engines`, which leaves the SMs to the work a swap overlaps).

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

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
  //! The most thread blocks the launch runs (0: one for each page of each layer). Each block then
  //! moves several pages in turn. A swap of a few blocks still fills the bus while the other SMs
  //! stay with the work of other streams (docs/kernels.md, "Swaps beside a decode").
  std::int32_t max_blocks = 0;
};

//! bad_argument for a non-positive layer count, a non-positive page size or one that is not a
//! multiple of 16, a negative pair count or block limit, null pointers or arrays not aligned to
//! their elements when there is work, or the debug mode without positive capacities (pairs or
//! none). Page ids must lie inside both caches (checked on the device only in the debug mode,
//! page_copies::page_check), and no page may be both a source and a destination of one batch, nor
//! the destination of two pairs (block_table's copy lists never are).
[[nodiscard]] inline status validate(const page_copies& c) {
  if (c.num_layers <= 0 || c.bytes_per_page <= 0 || c.bytes_per_page % 16 != 0 || c.num_pairs < 0 ||
      c.max_blocks < 0) {
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

// A CTA per (pair, layer) page, pairs fastest, or fewer CTAs that take the pages in turn
// (page_copies::max_blocks): 16-byte loads and stores, several in flight per thread. `Checked`:
// the debug mode's kernel (page_check set). A template also so that every translation unit that
// includes this header may define it (a plain __global__ function defined in a header is defined
// again in each, and the link fails).
template <bool Checked>
__global__ void copy_pages_kernel(page_copies c) {
  const std::int64_t pages = std::int64_t{c.num_pairs} * c.num_layers;
  for (std::int64_t page = blockIdx.x; page < pages; page += gridDim.x) {
    const block_copy pair = c.pairs[page % c.num_pairs];
    if (page_guard{c.src_capacity, c.page_check}.rejects<Checked>(pair.src) ||
        page_guard{c.dst_capacity, c.page_check}.rejects<Checked>(pair.dst)) {
      continue;
    }
    const auto layer = static_cast<std::int32_t>(page / c.num_pairs);
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
}

inline cudaError_t launch_copies(const page_copies& c, cudaStream_t stream) {
  if (const auto done = before_launch(validate(c).ok(), c.num_pairs > 0)) {
    return *done;
  }
  const std::int64_t pages = std::int64_t{c.num_pairs} * c.num_layers;
  const std::int64_t limit = c.max_blocks > 0 ? c.max_blocks : max_grid_columns;
  const dim3 grid(static_cast<unsigned>(std::min(pages, limit)));
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

//! Pages to swap through the copy engines (swap_blocks_copy_engines): the pages of page_copies,
//! with every array in host memory, so that the launcher reads the pairs and checks each page id
//! against its cache before anything moves.
struct host_page_copies {
  std::byte* const* src_layers = nullptr; //!< [num_layers] host array: caches read
  std::byte* const* dst_layers = nullptr; //!< [num_layers] host array: caches written
  std::int32_t num_layers = 0;
  std::int64_t bytes_per_page = 0;   //!< positive
  const block_copy* pairs = nullptr; //!< [num_pairs] host array: (src page, dst page)
  std::int32_t num_pairs = 0;
  std::int32_t src_capacity = 0; //!< pages in each source cache
  std::int32_t dst_capacity = 0; //!< pages in each destination cache
};

//! bad_argument for a non-positive layer count, page size or capacity, a negative pair count, or,
//! when there are pairs, a null array or a null layer pointer; invalid_block for a pair whose
//! source lies outside [0, src_capacity) or whose destination lies outside [0, dst_capacity).
//! Reads the host arrays; makes no CUDA call. As with page_copies, within one batch no page may be
//! both a source and a destination (where both sides are one cache), nor the destination of two
//! pairs (the copies run in no set order).
[[nodiscard]] inline status validate(const host_page_copies& c) {
  if (c.num_layers <= 0 || c.bytes_per_page <= 0 || c.num_pairs < 0 || c.src_capacity <= 0 ||
      c.dst_capacity <= 0) {
    return errc::bad_argument;
  }
  if (c.num_pairs == 0) {
    return {};
  }
  if (c.src_layers == nullptr || c.dst_layers == nullptr || c.pairs == nullptr) {
    return errc::bad_argument;
  }
  for (std::int32_t l = 0; l < c.num_layers; ++l) {
    if (c.src_layers[l] == nullptr || c.dst_layers[l] == nullptr) {
      return errc::bad_argument;
    }
  }
  for (std::int32_t i = 0; i < c.num_pairs; ++i) {
    const block_copy p = c.pairs[i];
    if (p.src < 0 || p.src >= c.src_capacity || p.dst < 0 || p.dst >= c.dst_capacity) {
      return errc::invalid_block;
    }
  }
  return {};
}

//! The host arrays of one batch of copies, which the caller keeps from step to step so that
//! swap_blocks_copy_engines allocates nothing once they have grown to a step's size (reserve()
//! sizes them up front). Not shared between threads calling at once.
class copy_batch {
public:
  //! Room for `num_pairs` pairs of `num_layers` layers, so that no later call of that size or
  //! less allocates.
  void reserve(std::size_t num_pairs, std::size_t num_layers) {
    runs_.reserve(num_pairs);
    lengths_.reserve(num_pairs);
    dsts_.reserve(num_pairs * num_layers);
    srcs_.reserve(num_pairs * num_layers);
    sizes_.reserve(num_pairs * num_layers);
  }

  //! Runs of pages the last build() found (pairs whose sources and destinations both follow on
  //! from the previous pair's, once sorted by source, move as one copy). swap_blocks_copy_engines
  //! builds only once its arguments pass its checks: a call that returned before queueing
  //! anything leaves the previous call's lists.
  [[nodiscard]] std::size_t runs() const noexcept { return runs_.size(); }

  //! Copies of the last build(): runs() in every layer.
  [[nodiscard]] std::size_t copies() const noexcept { return sizes_.size(); }

  //! Whether the last swap_blocks_copy_engines call queued its copies as one cudaMemcpyBatchAsync
  //! (else one cudaMemcpyAsync a copy: the legacy stream, a capture, a runtime before CUDA 12.8 or
  //! a driver without the batch call).
  [[nodiscard]] bool batched() const noexcept { return batched_; }

  //! Fills the arrays for `c`, which must pass validate(): sorts the pairs by source, merges runs
  //! and lists each run's copy in every layer. swap_blocks_copy_engines calls it; it is public so
  //! that an engine may inspect or queue the lists itself (dsts(), srcs(), sizes(), copies()).
  void build(const host_page_copies& c) {
    runs_.assign(c.pairs, c.pairs + c.num_pairs);
    // By source, then destination: one source may go to several pages (a host copy that two
    // requests share, swapped back into each).
    std::sort(runs_.begin(), runs_.end(), [](const block_copy& a, const block_copy& b) {
      return a.src != b.src ? a.src < b.src : a.dst < b.dst;
    });
    lengths_.clear();
    std::size_t kept = 0;
    for (std::size_t i = 0; i < runs_.size(); ++i) {
      if (kept > 0) {
        const block_copy last = runs_[kept - 1];
        const std::int32_t n = lengths_.back();
        if (runs_[i].src == last.src + n && runs_[i].dst == last.dst + n) {
          ++lengths_.back();
          continue;
        }
      }
      runs_[kept++] = runs_[i];
      lengths_.push_back(1);
    }
    runs_.resize(kept);
    dsts_.clear();
    srcs_.clear();
    sizes_.clear();
    const auto page = static_cast<std::size_t>(c.bytes_per_page);
    for (std::int32_t l = 0; l < c.num_layers; ++l) {
      for (std::size_t r = 0; r < kept; ++r) {
        srcs_.push_back(c.src_layers[l] + static_cast<std::size_t>(runs_[r].src) * page);
        dsts_.push_back(c.dst_layers[l] + static_cast<std::size_t>(runs_[r].dst) * page);
        sizes_.push_back(static_cast<std::size_t>(lengths_[r]) * page);
      }
    }
  }

  [[nodiscard]] void* const* dsts() const noexcept { return dsts_.data(); }
  [[nodiscard]] const void* const* srcs() const noexcept { return srcs_.data(); }
  [[nodiscard]] const std::size_t* sizes() const noexcept { return sizes_.data(); }

  //! Set by swap_blocks_copy_engines: how it queued the lists (batched()).
  void set_batched(bool b) noexcept { batched_ = b; }

private:
  std::vector<block_copy> runs_;      // each run's first pair
  std::vector<std::int32_t> lengths_; // each run's pages
  std::vector<void*> dsts_;
  std::vector<const void*> srcs_;
  std::vector<std::size_t> sizes_;
  bool batched_ = false;
};

namespace detail {

//! Whether cudaMemcpyBatchAsync takes `stream`: not the legacy default stream (nor 0 where that
//! names it), and not a stream being captured (a batch cannot be captured; the runtime refuses
//! it without ending the capture, and the graph would then lack the copies). Whether 0 is the
//! legacy stream is the translation unit's choice (nvcc's --default-stream): build every unit that
//! calls swap_blocks_copy_engines with the same one.
[[nodiscard]] inline cudaError_t batch_takes(cudaStream_t stream, bool& takes) {
#if CUDART_VERSION >= 12080
#if defined(CUDA_API_PER_THREAD_DEFAULT_STREAM)
  const bool legacy = stream == cudaStreamLegacy;
#else
  const bool legacy = stream == nullptr || stream == cudaStreamLegacy;
#endif
  takes = false;
  if (legacy) {
    return cudaSuccess;
  }
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  const cudaError_t e = cudaStreamIsCapturing(stream, &capture);
  takes = e == cudaSuccess && capture == cudaStreamCaptureStatusNone;
  return e;
#else
  (void)stream;
  takes = false;
  return cudaSuccess;
#endif
}

} // namespace detail

//! Swaps pages between device caches and pinned host memory through the GPU's copy engines rather
//! than a kernel: the SMs stay free for the decode or prefill the swap overlaps. The same pages
//! as swap_blocks, described by host arrays (host_page_copies), with every page id checked on the
//! host first. Runs of consecutive pages (sources and destinations both consecutive) move as one
//! copy. One cudaMemcpyBatchAsync of every layer's runs, ordered on `stream` (sources read in
//! stream order) and flagged to prefer overlap with compute; on the legacy default stream or a
//! stream being captured into a CUDA graph, which a batch does not take, and where the runtime
//! (before CUDA 12.8) or the driver lacks the batch call, one cudaMemcpyAsync a run and layer
//! instead (copy_batch::batched() tells which). The host arrays may be reused as soon as the call
//! returns; `scratch` keeps the copy lists between calls. cudaErrorInvalidValue when `validate`
//! fails (nothing queued), an error an earlier call left pending (taken, nothing queued), else the
//! runtime's answer.
[[nodiscard]] inline cudaError_t
swap_blocks_copy_engines(const host_page_copies& c, copy_batch& scratch, cudaStream_t stream) {
  if (const auto done = detail::before_launch(validate(c).ok(), c.num_pairs > 0)) {
    return *done;
  }
  bool batch = false;
  if (const cudaError_t e = detail::batch_takes(stream, batch); e != cudaSuccess) {
    return e;
  }
  scratch.build(c);
  scratch.set_batched(false);
  const std::size_t n = scratch.copies();
#if CUDART_VERSION >= 12080
  if (batch) {
    cudaMemcpyAttributes attr{};
    attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
    std::size_t first = 0;
#if CUDART_VERSION >= 13000
    const cudaError_t e = cudaMemcpyBatchAsync(scratch.dsts(), scratch.srcs(), scratch.sizes(), n,
                                               &attr, &first, 1, stream);
#else
    std::size_t failed = 0;
    const cudaError_t e = cudaMemcpyBatchAsync(
        const_cast<void**>(scratch.dsts()), const_cast<void**>(scratch.srcs()),
        const_cast<std::size_t*>(scratch.sizes()), n, &attr, &first, 1, &failed, stream);
#endif
    if (e != cudaErrorCallRequiresNewerDriver && e != cudaErrorNotSupported) {
      scratch.set_batched(e == cudaSuccess);
      return e;
    }
    (void)cudaGetLastError(); // a driver without the batch call: the copies one at a time
  }
#endif
  for (std::size_t i = 0; i < n; ++i) {
    if (const cudaError_t e = cudaMemcpyAsync(scratch.dsts()[i], scratch.srcs()[i],
                                              scratch.sizes()[i], cudaMemcpyDefault, stream);
        e != cudaSuccess) {
      return e;
    }
  }
  return cudaSuccess;
}

} // namespace kvkit::cuda
