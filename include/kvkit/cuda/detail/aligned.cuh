#pragma once
//! Pointer alignment, as the launchers' validate() checks it before any kernel makes vector
//! accesses through a pointer.

#include <cstddef>
#include <cstdint>

namespace kvkit::cuda::detail {

//! Whether `p` is a multiple of `Bytes` (a power of two); a null pointer is (null pointers are
//! checked on their own).
template <std::size_t Bytes>
[[nodiscard]] inline bool aligned(const void* p) {
  static_assert(Bytes > 0 && (Bytes & (Bytes - 1)) == 0, "a power of two");
  return reinterpret_cast<std::uintptr_t>(p) % Bytes == 0;
}

} // namespace kvkit::cuda::detail
