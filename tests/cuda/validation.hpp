#pragma once
// What the tests of the launchers' argument checks share ([host] cases, run with or without a
// GPU): stand-in pointers, and whether validate() and the launchers agree on a case.

#include <cstddef>

#include <cuda_runtime_api.h>

namespace kvkit_test {

// 64 bytes, 16-byte aligned, to stand in for every pointer of a case: validate() never
// dereferences one, and no accepted case with work is launched, so no CUDA call is made.
inline std::byte* stand_in() {
  alignas(16) static std::byte bytes[64];
  return bytes;
}

// Whether validate()'s verdict (`valid`) is `expect_ok` and each launcher agrees: it refuses a
// rejected case (cudaErrorInvalidValue) and returns success without a launch for an accepted one
// without work (`has_work` false). An accepted case with work is not launched.
template <class... Launchers>
bool launchers_agree(bool valid, bool expect_ok, bool has_work, Launchers... launch) {
  if (valid != expect_ok) {
    return false;
  }
  if (expect_ok && has_work) {
    return true;
  }
  const cudaError_t want = expect_ok ? cudaSuccess : cudaErrorInvalidValue;
  return ((launch() == want) && ...);
}

} // namespace kvkit_test
