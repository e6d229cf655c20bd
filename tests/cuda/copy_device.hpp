#pragma once
// Host-callable wrappers of the page movement kernels for the tests (copy_device.cu).

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "kvkit/block/types.hpp"

namespace kvkit_test {

// Runs copy_blocks over `layers` device caches (contents given, one vector per layer) and returns
// them afterwards. With `page_check`, in the debug mode (page_copies::page_check), whose flag it
// returns there: the sources' capacity is each layer's pages, the destinations' `dst_capacity`
// (0: the same). `max_blocks`: page_copies::max_blocks.
cudaError_t run_copy_blocks(std::vector<std::vector<std::byte>>& layers,
                            std::int64_t bytes_per_page,
                            const std::vector<kvkit::block_copy>& pairs,
                            std::int32_t* page_check = nullptr, std::int32_t dst_capacity = 0,
                            std::int32_t max_blocks = 0);

// Swaps `out` pairs device -> pinned host, then `in` pairs host -> device, and returns both tiers.
// `max_blocks`: page_copies::max_blocks of both swaps.
cudaError_t run_swaps(std::vector<std::vector<std::byte>>& device,
                      std::vector<std::vector<std::byte>>& host, std::int64_t bytes_per_page,
                      const std::vector<kvkit::block_copy>& out,
                      const std::vector<kvkit::block_copy>& in, std::int32_t max_blocks = 0);

// How swap_blocks_copy_engines is called: on a stream of its own (one batch of copies), on the
// legacy default stream, or captured into a CUDA graph that is then launched (one copy a run and
// layer in both).
enum class swap_stream { own, legacy, captured };

// What swap_blocks_copy_engines reported of the swap-out ([0]) and the swap-in ([1]).
struct copy_engine_report {
  std::size_t runs[2] = {};   // copy_batch::runs
  std::size_t copies[2] = {}; // copy_batch::copies
  bool batched[2] = {};       // copy_batch::batched
};

// As run_swaps, through swap_blocks_copy_engines on `how`.
cudaError_t run_copy_engine_swaps(std::vector<std::vector<std::byte>>& device,
                                  std::vector<std::vector<std::byte>>& host,
                                  std::int64_t bytes_per_page,
                                  const std::vector<kvkit::block_copy>& out,
                                  const std::vector<kvkit::block_copy>& in, swap_stream how,
                                  copy_engine_report& report);

// The runs copy_batch should find in `pairs`: sorted by (source, destination), a pair whose
// source and destination both follow the previous pair's joins its run.
std::size_t expected_runs(std::vector<kvkit::block_copy> pairs);

// The argument checks of swap_blocks_copy_engines (host_page_copies): the name of every case
// where validate() or the launcher decided otherwise than expected, or validate() gave another
// code. Makes no CUDA call.
std::vector<std::string> copy_engine_validation_failures();

// The argument checks of copy_blocks and swap_blocks: the name of every case where validate() or
// a launcher decided otherwise than expected (zero layers, page sizes that are not multiples of
// 16, missing pointers, the debug mode without its capacities; an empty batch is accepted). Makes
// no CUDA call.
std::vector<std::string> copy_validation_failures();

// The launchers' one choice between a kernel's checked and ordinary builds
// (detail::with_page_check, which write_kv, the page kernels and copy_blocks share): the name of
// every case where it chose the other build, lost the launch's result or touched the flag. Makes
// no CUDA call.
std::vector<std::string> page_check_dispatch_failures();

// Leaves an error pending in this thread, as an unchecked failed launch does: launches a kernel
// with more threads a block than any device allows. Returns the pending error (which one is the
// driver's choice: cudaErrorInvalidValue on an H100 with driver 580), which it does not take.
cudaError_t leave_pending_error();

// Each launcher of the page kernels (write_kv, quantize_pages, copy_blocks) called while an
// earlier launch's error is pending: the name of every case where it did not return that error,
// still wrote the cache, left the error pending, or did not write the cache when called again.
std::vector<std::string> pending_error_failures();

} // namespace kvkit_test
