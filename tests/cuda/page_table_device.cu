#include "cuda/page_table_device.hpp"

namespace kvkit_test {
namespace {

// One CTA per sequence; the views are read exactly as a paged-attention kernel reads them.
template <class View>
__global__ void resolve_slots_kernel(View view, const std::int32_t* token_offsets,
                                     std::int64_t* out) {
  const std::int32_t b = static_cast<std::int32_t>(blockIdx.x);
  const std::int32_t n = view.num_tokens(b);
  for (std::int32_t t = static_cast<std::int32_t>(threadIdx.x); t < n;
       t += static_cast<std::int32_t>(blockDim.x)) {
    out[token_offsets[b] + t] = view.slot(b, t).flat(view.page_size);
  }
}

template <class View>
cudaError_t launch(const View& view, const std::int32_t* token_offsets, std::int64_t* out,
                   cudaStream_t stream) {
  if (view.batch_size == 0) {
    return cudaSuccess;
  }
  resolve_slots_kernel<<<static_cast<unsigned>(view.batch_size), 128, 0, stream>>>(
      view, token_offsets, out);
  return cudaGetLastError();
}

} // namespace

cudaError_t resolve_slots(const kvkit::csr_page_table& view, const std::int32_t* token_offsets,
                          std::int64_t* out, cudaStream_t stream) {
  return launch(view, token_offsets, out, stream);
}

cudaError_t resolve_slots(const kvkit::padded_page_table& view, const std::int32_t* token_offsets,
                          std::int64_t* out, cudaStream_t stream) {
  return launch(view, token_offsets, out, stream);
}

} // namespace kvkit_test
