#pragma once
// Host-callable wrapper of the GPU prefill kernel for the tests (prefill_device.cu).

#include <cstdint>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "cuda/decode_device.hpp"
#include "kvkit/attention/options.hpp"

namespace kvkit_test {

// How a prefill is launched.
struct prefill_mode {
  bool check_pages = false; // the debug mode (prefill_args::page_check)
  bool lse = true;          // prefill_args::lse set (else null; the LSE buffer stays poisoned)
  // prefill_args::max_queries: the most queries of a sequence plus this (negative: fewer, and the
  // kernel must skip the sequences that have more).
  std::int32_t extra_max_queries = 0;
  bool graph = false; // captured in a CUDA graph and replayed twice (the outputs poisoned between)
};

struct prefill_outcome {
  cudaError_t error = cudaSuccess;
  std::vector<std::uint16_t> out; // [total queries][q_heads][head_dim], raw bits, NaN-poisoned
  std::vector<float> lse;         // [total queries][q_heads], all bits set where not written
  std::int32_t page_check = 0;    // the debug flag after the launch
};

// Runs kvkit::cuda::paged_prefill over a device copy of `cache` (capacity pages): the page table
// of `table` (its q is not used), the queries `q` (raw fp16/bf16 bits, [total][q_heads][head_dim])
// grouped by `qo_indptr`. T is __half or __nv_bfloat16.
template <class Layout, class T>
prefill_outcome run_prefill(const Layout& layout, const std::vector<std::byte>& cache,
                            std::int32_t capacity, const decode_step& table,
                            const std::vector<std::int32_t>& qo_indptr,
                            const std::vector<std::uint16_t>& q, std::int32_t q_heads,
                            const std::vector<float>& static_scales,
                            const kvkit::attention_options& options, const prefill_mode& mode);

// validate() and the launcher on bad arguments: the names of cases that were not rejected with
// bad_argument / cudaErrorInvalidValue (and of a good case that was). Empty when all is well.
std::vector<std::string> prefill_validation_failures();

} // namespace kvkit_test
