// Page tables exported by block_table resolve on the device to the slots append_tokens returned.

#include <cstdint>
#include <random>
#include <vector>

#include <catch2/catch.hpp>
#include <cuda_runtime_api.h>

#include "cuda/page_table_device.hpp"
#include "host/test_seed.hpp"
#include "kvkit/block/block_pool.hpp"
#include "kvkit/block/block_table.hpp"

namespace {

#define CUDA_REQUIRE(expr)                                                                         \
  do {                                                                                             \
    const cudaError_t err_ = (expr);                                                               \
    INFO(#expr << ": " << cudaGetErrorString(err_));                                               \
    REQUIRE(err_ == cudaSuccess);                                                                  \
  } while (false)

template <class T>
struct device_buffer {
  explicit device_buffer(std::size_t n) : size(n) {
    CUDA_REQUIRE(cudaMalloc(reinterpret_cast<void**>(&ptr), n * sizeof(T) + 1));
  }
  device_buffer(const std::vector<T>& host) : device_buffer(host.size()) {
    CUDA_REQUIRE(cudaMemcpy(ptr, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  ~device_buffer() { cudaFree(ptr); }
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;
  std::vector<T> to_host() const {
    std::vector<T> host(size);
    CUDA_REQUIRE(cudaMemcpy(host.data(), ptr, size * sizeof(T), cudaMemcpyDeviceToHost));
    return host;
  }
  T* ptr = nullptr;
  std::size_t size;
};

} // namespace

TEST_CASE("exported page tables resolve on the device", "[cuda][page_table]") {
  const std::uint64_t seed = kvkit_test::test_seed(77);
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  constexpr std::int32_t page_size = 16;
  kvkit::block_pool pool(4096);
  kvkit::block_table table(pool, page_size);

  // Wildly different lengths, forks (shared pages) and copy-on-write, scattered page ids.
  std::vector<kvkit::seq_id> batch;
  std::vector<std::vector<std::int64_t>> expected;
  for (kvkit::seq_id s = 0; s < 48; ++s) {
    REQUIRE(table.add_sequence(s).ok());
    batch.push_back(s);
  }
  for (int round = 0; round < 6; ++round) {
    for (const kvkit::seq_id s : batch) {
      const auto n = std::uniform_int_distribution<std::int32_t>(0, 300)(rng);
      REQUIRE(table.append_tokens(s, n, {}).ok());
    }
  }
  for (kvkit::seq_id s = 0; s < 8; ++s) {
    REQUIRE(table.fork(s, 100 + s).ok());
    REQUIRE(table.append_tokens(100 + s, 3, {}).ok());
    batch.push_back(100 + s);
  }
  REQUIRE(table.add_sequence(999).ok()); // an empty sequence
  batch.push_back(999);

  const auto batch_size = static_cast<std::int32_t>(batch.size());
  std::vector<std::int32_t> token_offsets(batch.size() + 1, 0);
  std::vector<std::int64_t> want;
  std::int32_t max_blocks = 0;
  for (std::size_t b = 0; b < batch.size(); ++b) {
    const std::int32_t len = *table.num_tokens(batch[b]);
    const std::vector<std::int32_t> q{len};
    std::vector<std::int64_t> slots(static_cast<std::size_t>(len));
    REQUIRE(table.export_slot_mapping(std::span(&batch[b], 1), q, slots).ok());
    want.insert(want.end(), slots.begin(), slots.end());
    token_offsets[b + 1] = token_offsets[b] + len;
    max_blocks = std::max(max_blocks, kvkit::blocks_for_tokens(len, page_size));
  }

  const auto nnz = static_cast<std::size_t>(*table.csr_size(batch));
  std::vector<std::int32_t> indptr(batch.size() + 1);
  std::vector<std::int32_t> indices(nnz);
  std::vector<std::int32_t> last(batch.size());
  REQUIRE(table.export_csr(batch, indptr, indices, last).ok());
  std::vector<std::int32_t> rows(batch.size() * static_cast<std::size_t>(max_blocks));
  std::vector<std::int32_t> lens(batch.size());
  REQUIRE(table.export_block_table(batch, max_blocks, rows, lens).ok());

  device_buffer<std::int32_t> d_indptr(indptr);
  device_buffer<std::int32_t> d_indices(indices);
  device_buffer<std::int32_t> d_last(last);
  device_buffer<std::int32_t> d_rows(rows);
  device_buffer<std::int32_t> d_lens(lens);
  device_buffer<std::int32_t> d_offsets(token_offsets);
  device_buffer<std::int64_t> d_out(want.size());

  SECTION("CSR view") {
    CUDA_REQUIRE(cudaMemset(d_out.ptr, 0xA5, want.size() * sizeof(std::int64_t))); // poison
    const kvkit::csr_page_table view{d_indptr.ptr, d_indices.ptr, d_last.ptr, batch_size,
                                     page_size};
    CUDA_REQUIRE(kvkit_test::resolve_slots(view, d_offsets.ptr, d_out.ptr, nullptr));
    CUDA_REQUIRE(cudaDeviceSynchronize());
    CHECK(d_out.to_host() == want);
  }
  SECTION("padded view") {
    CUDA_REQUIRE(cudaMemset(d_out.ptr, 0x5A, want.size() * sizeof(std::int64_t))); // poison
    const kvkit::padded_page_table view{d_rows.ptr, d_lens.ptr, batch_size, max_blocks, page_size};
    CUDA_REQUIRE(kvkit_test::resolve_slots(view, d_offsets.ptr, d_out.ptr, nullptr));
    CUDA_REQUIRE(cudaDeviceSynchronize());
    CHECK(d_out.to_host() == want);
  }
}
