#pragma once
// Host-callable wrapper of the GPU decode kernel for the tests (decode_device.cu).

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "kvkit/attention/decode_plan.hpp"
#include "kvkit/attention/options.hpp"

namespace kvkit_test {

// `n` sequence lengths: `longest`, then each shorter by (i * step) % spread keys, so that last
// tiles and pages are partial.
inline std::vector<std::int32_t> lengths_below(std::size_t n, std::int32_t longest,
                                               std::size_t step, std::size_t spread) {
  std::vector<std::int32_t> lens(n);
  for (std::size_t i = 0; i < n; ++i) {
    lens[i] = longest - static_cast<std::int32_t>(i * step % spread);
  }
  return lens;
}

// The lengths of the case "fp8 whole sequences in one wave of two blocks per SM": 32 sequences of
// 2048 keys and up to 96 more, so that last tiles and pages are partial (shared with the host-side
// check of the kernel it runs).
inline std::vector<std::int32_t> fp8_whole_wave_lengths() {
  std::vector<std::int32_t> lens(32);
  for (std::size_t i = 0; i < lens.size(); ++i) {
    lens[i] = 2048 + static_cast<std::int32_t>(i * 37 % 97);
  }
  return lens;
}

// One decode step: a page table over the shared cache, and the queries (raw fp16/bf16 bits).
struct decode_step {
  std::vector<std::int32_t> indptr, indices, last_page_len;
  std::vector<std::uint16_t> q; // [batch][q_heads][head_dim]
};

// How the steps are launched.
struct decode_mode {
  std::int32_t sm_count = 132;  // planning input: fewer multiprocessors means fewer splits
  bool graph = false;           // graph-safe plan, captured once, replayed for every step
  std::int32_t max_seq_len = 0; // the graph-safe plan's bound
  bool check_pages = false;     // the debug page-id check
  // Launches of each step, back to back on one stream with no host synchronization between them
  // (the outputs poisoned again on the stream before each); the last one's results are returned.
  std::int32_t repeats = 1;
  bool dependent_launch = true; // decode_args::dependent_launch
  bool lse = true;              // decode_args::lse set (else null; the LSE buffer stays poisoned)
  // decode_args::zeroed_counters: counters of the caller's own, for the largest batch, zeroed
  // once before the first launch, which must be zero again after the last (the workspace stays
  // garbage).
  bool zeroed_counters = false;
  // The queries reach the decode's buffer through a kernel launched just before each decode,
  // which lets dependents launch at once and then copies late (poisoned queries until then): a
  // decode that read them before waiting for that kernel would see NaN.
  bool late_queries = false;
  bool page_table_ready = false; // decode_args::page_table_ready (the table is uploaded first)
  // With late_queries: each sequence's last page reaches the cache through the same kernel, late
  // (poisoned until then), and the decode is told decode_args::cache_ready_but_last_page: a
  // decode that read a last page before its wait would see NaN.
  bool late_last_pages = false;
  // The shared memory a block may opt in to, as the launcher sees it: a stand-in for a smaller
  // device (an A100's 163 KB runs the short-ring build of the 16-bit kernels at head dim 256);
  // negative: this device's.
  std::int32_t smem_optin = -1;
  // An error left pending (an unchecked failed launch) before the first decode, which must return
  // it and launch nothing (outputs still poisoned); that step is then launched again.
  bool pending_error_first = false;
  // An error of the launcher's own: on the first step's second repeat (repeats >= 2, so that the
  // launcher's per-device answers are already in place), the decode is first launched on the
  // legacy stream while a blocking stream captures, where a launch fails
  // (cudaErrorStreamCaptureImplicit). It must return that error and take it (none left pending
  // for the next launcher), and write nothing; the repeat is then launched as usual.
  bool own_error_on_repeat = false;
  // A plan_decode_graph_safe plan (max_seq_len) launched without a graph: the only plan that takes
  // a batch whose sequences are all empty.
  bool graph_safe_plan = false;
};

struct decode_outcome {
  cudaError_t error = cudaSuccess;
  std::vector<std::vector<std::uint16_t>> out; // per step [batch][q_heads][head_dim], raw bits
  std::vector<std::vector<float>> lse;         // per step [batch][q_heads]
  std::int32_t page_check = 0;                 // the debug flag after the last step
  std::int32_t max_splits = 0;                 // of the (last) plan
  // Whether any launch wrote to the workspace (it starts as garbage, which a launch that merges
  // its splits in thread block clusters leaves as it is), and whether the device has clusters and
  // the kernels were built for them (compute capability 9 or later).
  bool workspace_written = false;
  bool cluster_device = false;
  // The arrival counters all zero after the last launch: the caller's (zeroed_counters), else
  // the last plan's in the workspace (where it merges through the workspace).
  bool counters_zero = false;
  // Whether the bytes just past the workspace (allocated with it, poisoned) are as they were: no
  // launch wrote beyond the plan's workspace_bytes().
  bool past_workspace_intact = false;
  // With pending_error_first: the error left pending, what the first decode returned, whether it
  // took the error (none pending after it) and whether the outputs stayed poisoned.
  cudaError_t pending_error_left = cudaSuccess;
  cudaError_t pending_error_returned = cudaSuccess;
  bool pending_error_taken = false;
  // With own_error_on_repeat: what the failing decode returned and whether it took its error.
  // With either mode: whether the outputs stayed poisoned after the failed call.
  cudaError_t own_error_returned = cudaSuccess;
  bool own_error_taken = false;
  bool untouched_after_error = false;
  // With late_queries: the queries as a copy on the stream right after the last decode found
  // them (the late kernel's copy, if the decode ended after it).
  std::vector<std::uint16_t> queries_after;
};

// Runs paged_decode_dim<HeadDim> on each step over one device copy of `cache` (capacity pages),
// outputs poisoned with NaN before every launch. T is __half or __nv_bfloat16. Without a graph
// each step is planned for its own batch (at most shape.batch_size); one workspace, allocated for
// the largest plan, serves every step, as an engine's would.
template <int HeadDim, class Layout, class T>
decode_outcome run_decode(const Layout& layout, const std::vector<std::byte>& cache,
                          std::int32_t capacity, const kvkit::decode_shape& shape,
                          const std::vector<decode_step>& steps,
                          const std::vector<float>& static_scales,
                          const kvkit::attention_options& options, const decode_mode& mode);

// validate() and the launcher on bad arguments: the names of cases that were not rejected with
// bad_argument / cudaErrorInvalidValue (and of a good case that was). Empty when all is well.
std::vector<std::string> decode_validation_failures();

// The builds the launcher chooses (kvkit::cuda::detail::decode_build_chosen, on the host) for the
// shapes of the decode cases named after a build, planned for 132 multiprocessors (the H200's and
// the H100's) and run there or, where the case says what runs elsewhere, on 66: a line for each
// choice that is not the one the case is named after. Empty when all is well.
std::vector<std::string> decode_choice_failures();

// Every decode kernel of the variants above: one line for each that fits fewer blocks per
// multiprocessor than its grids are cut for, or (blocks of four warps) that the launcher's shared
// memory does not hold to exactly that many. Empty when all is well.
std::vector<std::string> decode_residency_failures();

} // namespace kvkit_test
