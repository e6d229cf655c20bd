// A build of kvkit's kernels for devices other than Hopper, compiled with warnings as errors and
// never run: compute capability 8.0 (A100), 8.9 (L4, L40S, RTX 4090) and, where nvcc has them,
// 10.0 (B200) and 12.0 (RTX 5090). Their code paths must keep compiling: before compute capability
// 9 no thread block clusters and no dependent launches, and before 8.9 fp8 converted without the
// paired instruction. It takes the decode kernels of every kind the launcher has: the one-tile,
// two-tile and wide kernels, the four-stage build for long blocks, and the two builds of the
// 16-bit caches at head dim 256 for devices with less shared memory a block than Hopper (the
// two-stage build an A100 runs, decode_short_ring_fit, and the narrow one that devices of
// compute capability 8.6, 8.9 and 12.x run, decode_narrow_fit); the prefill kernels of an fp8
// cache (every head dim); and the page kernels.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kvkit/cuda/copy_blocks.cuh"
#include "kvkit/cuda/paged_decode.cuh"
#include "kvkit/cuda/paged_prefill.cuh"
#include "kvkit/cuda/quantize_pages.cuh"
#include "kvkit/cuda/write_kv.cuh"

namespace kvkit_arch_build {

using bf16_pages = kvkit::paged_layout<kvkit::bf16_codec>;
using fp8_pages = kvkit::paged_layout<kvkit::fp8_e4m3_codec>;
using int4_pages = kvkit::paged_layout<kvkit::int4_group_codec<32>>;

cudaError_t decode_bf16_256(const kvkit::cuda::decode_args<bf16_pages, __nv_bfloat16>& a,
                            const kvkit::decode_plan& plan, void* workspace, std::size_t bytes,
                            cudaStream_t stream) {
  return kvkit::cuda::paged_decode_dim<256>(a, plan, workspace, bytes, stream);
}

cudaError_t decode_fp8_128(const kvkit::cuda::decode_args<fp8_pages, __half>& a,
                           const kvkit::decode_plan& plan, void* workspace, std::size_t bytes,
                           cudaStream_t stream) {
  return kvkit::cuda::paged_decode_dim<128>(a, plan, workspace, bytes, stream);
}

cudaError_t decode_int4_128(const kvkit::cuda::decode_args<int4_pages, __nv_bfloat16>& a,
                            const kvkit::decode_plan& plan, void* workspace, std::size_t bytes,
                            cudaStream_t stream) {
  return kvkit::cuda::paged_decode_dim<128>(a, plan, workspace, bytes, stream);
}

cudaError_t prefill_fp8(const kvkit::cuda::prefill_args<fp8_pages, __nv_bfloat16>& a,
                        cudaStream_t stream) {
  return kvkit::cuda::paged_prefill(a, stream);
}

cudaError_t write_fp8(const kvkit::cuda::kv_write<fp8_pages, __nv_bfloat16>& w,
                      cudaStream_t stream) {
  return kvkit::cuda::write_kv(w, stream);
}

cudaError_t quantize_int4(const kvkit::cuda::page_batch<int4_pages, __half>& b,
                          cudaStream_t stream) {
  const cudaError_t e = kvkit::cuda::quantize_pages(b, stream);
  return e != cudaSuccess ? e : kvkit::cuda::dequantize_pages(b, stream);
}

cudaError_t move_pages(const kvkit::cuda::page_copies& c, cudaStream_t stream) {
  const cudaError_t e = kvkit::cuda::copy_blocks(c, stream);
  return e != cudaSuccess ? e : kvkit::cuda::swap_blocks(c, stream);
}

} // namespace kvkit_arch_build
