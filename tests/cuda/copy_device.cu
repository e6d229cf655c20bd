#include <cstring>

#include "cuda/copy_device.hpp"
#include "kvkit/cuda/copy_blocks.cuh"

namespace kvkit_test {

namespace {

#define KVKIT_CHECK(expr)                                                                          \
  do {                                                                                             \
    const cudaError_t e_ = (expr);                                                                 \
    if (e_ != cudaSuccess) {                                                                       \
      return e_;                                                                                   \
    }                                                                                              \
  } while (false)

} // namespace

cudaError_t run_copy_blocks(std::vector<std::vector<std::byte>>& layers,
                            std::int64_t bytes_per_page,
                            const std::vector<kvkit::block_copy>& pairs) {
  std::vector<std::byte*> ptrs(layers.size(), nullptr);
  for (std::size_t l = 0; l < layers.size(); ++l) {
    KVKIT_CHECK(cudaMalloc(&ptrs[l], layers[l].size()));
    KVKIT_CHECK(cudaMemcpy(ptrs[l], layers[l].data(), layers[l].size(), cudaMemcpyHostToDevice));
  }
  std::byte** d_ptrs = nullptr;
  kvkit::block_copy* d_pairs = nullptr;
  KVKIT_CHECK(cudaMalloc(&d_ptrs, ptrs.size() * sizeof(std::byte*)));
  KVKIT_CHECK(cudaMalloc(&d_pairs, pairs.size() * sizeof(kvkit::block_copy) + 1));
  KVKIT_CHECK(
      cudaMemcpy(d_ptrs, ptrs.data(), ptrs.size() * sizeof(std::byte*), cudaMemcpyHostToDevice));
  KVKIT_CHECK(cudaMemcpy(d_pairs, pairs.data(), pairs.size() * sizeof(kvkit::block_copy),
                         cudaMemcpyHostToDevice));
  const kvkit::cuda::page_copies c{
      d_ptrs,         d_ptrs,  static_cast<std::int32_t>(layers.size()),
      bytes_per_page, d_pairs, static_cast<std::int32_t>(pairs.size())};
  KVKIT_CHECK(kvkit::cuda::copy_blocks(c, nullptr));
  KVKIT_CHECK(cudaDeviceSynchronize());
  for (std::size_t l = 0; l < layers.size(); ++l) {
    KVKIT_CHECK(cudaMemcpy(layers[l].data(), ptrs[l], layers[l].size(), cudaMemcpyDeviceToHost));
    KVKIT_CHECK(cudaFree(ptrs[l]));
  }
  KVKIT_CHECK(cudaFree(d_ptrs));
  KVKIT_CHECK(cudaFree(d_pairs));
  return cudaSuccess;
}

cudaError_t run_swaps(std::vector<std::vector<std::byte>>& device,
                      std::vector<std::vector<std::byte>>& host, std::int64_t bytes_per_page,
                      const std::vector<kvkit::block_copy>& out,
                      const std::vector<kvkit::block_copy>& in) {
  const std::size_t layers = device.size();
  std::vector<std::byte*> d(layers), h(layers);
  for (std::size_t l = 0; l < layers; ++l) {
    KVKIT_CHECK(cudaMalloc(&d[l], device[l].size()));
    KVKIT_CHECK(cudaMemcpy(d[l], device[l].data(), device[l].size(), cudaMemcpyHostToDevice));
    KVKIT_CHECK(cudaHostAlloc(&h[l], host[l].size(), cudaHostAllocDefault)); // pinned
    std::memcpy(h[l], host[l].data(), host[l].size());
  }
  std::byte** dd = nullptr;
  std::byte** dh = nullptr;
  kvkit::block_copy* pairs = nullptr;
  KVKIT_CHECK(cudaMalloc(&dd, layers * sizeof(std::byte*)));
  KVKIT_CHECK(cudaMalloc(&dh, layers * sizeof(std::byte*)));
  KVKIT_CHECK(cudaMalloc(&pairs, (out.size() + in.size()) * sizeof(kvkit::block_copy) + 1));
  KVKIT_CHECK(cudaMemcpy(dd, d.data(), layers * sizeof(std::byte*), cudaMemcpyHostToDevice));
  KVKIT_CHECK(cudaMemcpy(dh, h.data(), layers * sizeof(std::byte*), cudaMemcpyHostToDevice));
  KVKIT_CHECK(cudaMemcpy(pairs, out.data(), out.size() * sizeof(kvkit::block_copy),
                         cudaMemcpyHostToDevice));
  KVKIT_CHECK(cudaMemcpy(pairs + out.size(), in.data(), in.size() * sizeof(kvkit::block_copy),
                         cudaMemcpyHostToDevice));
  const auto n = static_cast<std::int32_t>(layers);
  KVKIT_CHECK(kvkit::cuda::swap_blocks(
      {dd, dh, n, bytes_per_page, pairs, static_cast<std::int32_t>(out.size())}, nullptr));
  KVKIT_CHECK(kvkit::cuda::swap_blocks(
      {dh, dd, n, bytes_per_page, pairs + out.size(), static_cast<std::int32_t>(in.size())},
      nullptr));
  KVKIT_CHECK(cudaDeviceSynchronize());
  for (std::size_t l = 0; l < layers; ++l) {
    KVKIT_CHECK(cudaMemcpy(device[l].data(), d[l], device[l].size(), cudaMemcpyDeviceToHost));
    std::memcpy(host[l].data(), h[l], host[l].size());
    KVKIT_CHECK(cudaFree(d[l]));
    KVKIT_CHECK(cudaFreeHost(h[l]));
  }
  KVKIT_CHECK(cudaFree(dd));
  KVKIT_CHECK(cudaFree(dh));
  KVKIT_CHECK(cudaFree(pairs));
  return cudaSuccess;
}

bool copy_validation_works() {
  kvkit::cuda::page_copies c{};
  bool ok = kvkit::cuda::validate(c).error() == kvkit::errc::bad_argument;
  c.num_layers = 2;
  c.bytes_per_page = 40;
  ok = ok && !kvkit::cuda::validate(c).ok();
  c.bytes_per_page = 64;
  ok = ok && kvkit::cuda::validate(c).ok() && kvkit::cuda::copy_blocks(c, nullptr) == cudaSuccess;
  c.num_pairs = 3; // pointers missing
  ok = ok && kvkit::cuda::copy_blocks(c, nullptr) == cudaErrorInvalidValue;
  return ok;
}

} // namespace kvkit_test
