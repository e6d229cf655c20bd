#pragma once
// Device and pinned host buffers that the test wrappers allocate, freed on every path out of the
// wrapper (an early return on a CUDA error included), so that a failing case leaks nothing into
// the cases after it.

#include <algorithm>
#include <cstddef>
#include <vector>

#include <cuda_runtime_api.h>

namespace kvkit_test {

struct device_buffers {
  std::vector<void*> device;
  std::vector<void*> pinned;
  device_buffers() = default;
  device_buffers(const device_buffers&) = delete;
  device_buffers& operator=(const device_buffers&) = delete;
  ~device_buffers() {
    for (void* p : device) {
      cudaFree(p);
    }
    for (void* p : pinned) {
      cudaFreeHost(p);
    }
  }
  // `count` elements of U on the device (at least one, so that an empty buffer is not null).
  template <class U>
  cudaError_t alloc(U*& p, std::size_t count) {
    void* raw = nullptr;
    const cudaError_t e = cudaMalloc(&raw, std::max<std::size_t>(count, 1) * sizeof(U));
    if (e == cudaSuccess) {
      device.push_back(raw);
      p = static_cast<U*>(raw);
    }
    return e;
  }
  // `count` elements of U in pinned host memory.
  template <class U>
  cudaError_t alloc_pinned(U*& p, std::size_t count) {
    void* raw = nullptr;
    const cudaError_t e =
        cudaHostAlloc(&raw, std::max<std::size_t>(count, 1) * sizeof(U), cudaHostAllocDefault);
    if (e == cudaSuccess) {
      pinned.push_back(raw);
      p = static_cast<U*>(raw);
    }
    return e;
  }
};

} // namespace kvkit_test
