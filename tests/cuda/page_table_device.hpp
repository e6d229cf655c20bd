#pragma once
// Launchers of the device-side page-table test kernels (page_table_device.cu).

#include <cstdint>

#include <cuda_runtime_api.h>

#include "kvkit/block/page_table.hpp"

namespace kvkit_test {

// For each sequence b and token t < num_tokens(b), writes the flat slot the view resolves to
// at out[token_offsets[b] + t]. All pointers are device pointers, the views' included.
cudaError_t resolve_slots(const kvkit::csr_page_table& view, const std::int32_t* token_offsets,
                          std::int64_t* out, cudaStream_t stream);
cudaError_t resolve_slots(const kvkit::padded_page_table& view, const std::int32_t* token_offsets,
                          std::int64_t* out, cudaStream_t stream);

} // namespace kvkit_test
