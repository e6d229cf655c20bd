#pragma once
//! Checks shared by the launchers: pointer alignment, which validate() checks on the host before
//! any kernel makes vector accesses through a pointer, an error an earlier call left pending, and
//! the debug mode's page id check, which the page kernels make on the device.

#include <cuda_runtime.h>

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <type_traits>

#include "kvkit/config.hpp"

namespace kvkit::cuda::detail {

//! Whether `p` is a multiple of `Bytes` (a power of two); a null pointer is (null pointers are
//! checked on their own).
template <std::size_t Bytes>
[[nodiscard]] inline bool aligned(const void* p) {
  static_assert(Bytes > 0 && (Bytes & (Bytes - 1)) == 0, "a power of two");
  return reinterpret_cast<std::uintptr_t>(p) % Bytes == 0;
}

//! Whether each of `p...` is aligned for its own element type (a null pointer is): the arrays the
//! kernels read or write an element at a time, where a misaligned one would fault on the device.
template <class... E>
[[nodiscard]] inline bool elements_aligned(const E*... p) {
  return (aligned<alignof(E)>(p) && ...);
}

//! The error an earlier CUDA call of this thread left pending (a failed launch its caller did not
//! check), taken as cudaGetLastError takes it, or cudaSuccess. Each launcher with work to do
//! returns it, once its arguments are valid, before it queries or launches anything: the error a
//! launcher returns after its launches is then its own, and one that returns an earlier error has
//! launched nothing (a retry runs).
[[nodiscard]] inline cudaError_t take_pending_error() {
  return cudaGetLastError();
}

//! The launchers' common start, in its order: cudaErrorInvalidValue where the arguments are not
//! `valid`, cudaSuccess where they are and there is no work (nothing is queued, and an earlier
//! call's error stays pending for its caller), else the error an earlier call left pending
//! (take_pending_error); nullopt where the launcher goes on to queue its work.
[[nodiscard]] inline std::optional<cudaError_t> before_launch(bool valid, bool has_work) {
  if (!valid) {
    return cudaErrorInvalidValue;
  }
  if (!has_work) {
    return cudaSuccess;
  }
  if (const cudaError_t e = take_pending_error(); e != cudaSuccess) {
    return e;
  }
  return std::nullopt;
}

//! The most thread blocks a grid takes along y or z (config.hpp).
using kvkit::detail::max_grid_rows;

//! The most thread blocks a grid takes along x (config.hpp).
using kvkit::detail::max_grid_columns;

//! The debug mode of a kernel that takes page ids (`flag` set): an id outside [0, capacity) sets
//! *flag to 1, and the kernel leaves that page alone instead of touching memory outside the
//! cache. The kernels take the mode as a template argument (`Checked`, true only when the flag is
//! set), so that their ordinary build carries no test at all. rejects() is for ids that are the
//! same in every thread of a block (the block's page or pair), which all leave it alone together.
struct page_guard {
  std::int32_t capacity = 0;
  std::int32_t* flag = nullptr;

  //! Whether `page` is to be left alone (the flag then set); never in the ordinary build.
  template <bool Checked>
  __device__ bool rejects(std::int64_t page) const {
    if constexpr (Checked) {
      if (page < 0 || page >= capacity) {
        if (threadIdx.x == 0) {
          atomicExch(flag, 1);
        }
        return true;
      }
    }
    return false;
  }
  //! For slots (`page * page_size + offset`) in pages of `page_size` tokens: the first slot past
  //! the cache in the debug mode, else the largest slot there is.
  template <bool Checked>
  __device__ std::int64_t slot_limit(std::int32_t page_size) const {
    if constexpr (Checked) {
      return static_cast<std::int64_t>(capacity) * page_size;
    }
    return INT64_MAX;
  }
};

//! The launchers' one choice between a kernel's builds: calls `launch` with std::true_type where
//! the debug mode is on (`flag` set), else with std::false_type, and returns what it returns.
template <class Launch>
requires std::invocable<Launch&, std::true_type> && std::invocable<Launch&, std::false_type>
auto with_page_check(const std::int32_t* flag, Launch&& launch) {
  return flag != nullptr ? launch(std::true_type{}) : launch(std::false_type{});
}

} // namespace kvkit::cuda::detail
