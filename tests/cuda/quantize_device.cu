#include <cuda_fp8.h>

#include <algorithm>
#include <string>
#include <vector>

#include "cuda/cuda_try.hpp"
#include "cuda/quantize_device.hpp"
#include "cuda/validation.hpp"
#include "kvkit/cuda/quantize_pages.cuh"
#include "kvkit/cuda/write_kv.cuh"
#include "kvkit/layout/page_layout.hpp"
#include "kvkit/quant/codecs.hpp"

namespace kvkit_test {

namespace {

template <class T>
struct device_array {
  explicit device_array(std::size_t n) : size(n) { err = cudaMalloc(&ptr, n * sizeof(T) + 16); }
  ~device_array() { cudaFree(ptr); }
  device_array(const device_array&) = delete;
  device_array& operator=(const device_array&) = delete;
  T* ptr = nullptr;
  std::size_t size;
  cudaError_t err;
};

__device__ std::uint32_t hash32(std::uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return static_cast<std::uint32_t>(x);
}

__global__ void conversion_kernel(std::uint64_t seed, std::int64_t n,
                                  unsigned long long* mismatches) {
  unsigned long long bad = 0;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    std::uint32_t u = hash32(seed * 0x9E3779B97F4A7C15ULL + static_cast<std::uint64_t>(i));
    if ((i & 1) != 0) {
      // Half the draws near the fp8/fp16 ranges: exponent in [2^-30, 2^20].
      u = (u & 0x807FFFFFU) | (static_cast<std::uint32_t>(97 + (u >> 23) % 50) << 23);
    }
    const float x = __uint_as_float(u);
    bad += __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3) !=
                   kvkit::soft_float_to_fp8_bits(x, kvkit::fp8_format::e4m3)
               ? 1
               : 0;
    bad += __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E5M2) !=
                   kvkit::soft_float_to_fp8_bits(x, kvkit::fp8_format::e5m2)
               ? 1
               : 0;
    bad += __half_as_ushort(__float2half_rn(x)) != kvkit::soft_float_to_fp16_bits(x) ? 1 : 0;
    bad +=
        __bfloat16_as_ushort(__float2bfloat16_rn(x)) != kvkit::soft_float_to_bf16_bits(x) ? 1 : 0;
    // And the device path of kvkit's public conversions against the integer versions.
    bad += kvkit::float_to_fp8_bits(x, kvkit::fp8_format::e4m3) !=
                   kvkit::soft_float_to_fp8_bits(x, kvkit::fp8_format::e4m3)
               ? 1
               : 0;
    bad += kvkit::float_to_fp8_bits(x, kvkit::fp8_format::e5m2) !=
                   kvkit::soft_float_to_fp8_bits(x, kvkit::fp8_format::e5m2)
               ? 1
               : 0;
    bad += kvkit::float_to_fp16_bits(x) != kvkit::soft_float_to_fp16_bits(x) ? 1 : 0;
    bad += kvkit::float_to_bf16_bits(x) != kvkit::soft_float_to_bf16_bits(x) ? 1 : 0;
    if (i < 65536) {
      // Every fp16 code, and every fp8 code, decoded both ways (NaN compares as NaN).
      const auto h = static_cast<std::uint16_t>(i);
      const float hw = kvkit::fp16_bits_to_float(h);
      const float sw = kvkit::soft_fp16_bits_to_float(h);
      bad += (hw == sw || (hw != hw && sw != sw)) ? 0 : 1;
      if (i < 256) {
        for (const auto f : {kvkit::fp8_format::e4m3, kvkit::fp8_format::e5m2}) {
          const float a = kvkit::fp8_bits_to_float(static_cast<std::uint8_t>(i), f);
          const float b = kvkit::soft_fp8_bits_to_float(static_cast<std::uint8_t>(i), f);
          bad += (a == b || (a != a && b != b)) ? 0 : 1;
        }
      }
    }
  }
  if (bad != 0) {
    atomicAdd(mismatches, bad);
  }
}

// What both round trips put on the device: the cache between its guard pages, all filled with
// 0xA5 bytes, the new K and V rows, the static scales and the debug mode's flag, zeroed.
template <class T>
struct kv_inputs {
  kv_inputs(std::int64_t page_bytes, std::size_t bytes, std::size_t k_elems, std::size_t v_elems,
            std::size_t num_scales)
      : guard_bytes(static_cast<std::size_t>(guard_pages * page_bytes)), cache_bytes(bytes),
        cache(bytes + 2 * guard_bytes), k(k_elems), v(v_elems), scales(num_scales + 1), flag(1) {}
  // The cache's first page, after the guard pages.
  std::byte* cache_start() const { return cache.ptr + guard_bytes; }
  // The cache into out.cache, and whether the guard pages on either side are still all 0xA5.
  template <class Out>
  cudaError_t download(Out& out) const {
    std::vector<std::byte> all(cache.size);
    const cudaError_t e = cudaMemcpy(all.data(), cache.ptr, all.size(), cudaMemcpyDeviceToHost);
    if (e != cudaSuccess) {
      return e;
    }
    const auto first = all.begin() + static_cast<std::ptrdiff_t>(guard_bytes);
    const auto last = first + static_cast<std::ptrdiff_t>(cache_bytes);
    out.cache.assign(first, last);
    const auto poison = [](std::byte b) {
      return b == std::byte{0xA5};
    };
    out.guards_intact =
        std::all_of(all.begin(), first, poison) && std::all_of(last, all.end(), poison);
    return cudaSuccess;
  }
  // The allocations' first error, else the first of the uploads, which stop there.
  cudaError_t upload(const std::vector<T>& hk, const std::vector<T>& hv,
                     const std::vector<float>& static_scales) {
    for (const cudaError_t e : {cache.err, k.err, v.err, scales.err, flag.err}) {
      if (e != cudaSuccess) {
        return e;
      }
    }
    cudaError_t e = cudaMemset(flag.ptr, 0, sizeof(std::int32_t));
    e = e != cudaSuccess ? e : cudaMemset(cache.ptr, 0xA5, cache.size);
    e = e != cudaSuccess
            ? e
            : cudaMemcpy(k.ptr, hk.data(), hk.size() * sizeof(T), cudaMemcpyHostToDevice);
    e = e != cudaSuccess
            ? e
            : cudaMemcpy(v.ptr, hv.data(), hv.size() * sizeof(T), cudaMemcpyHostToDevice);
    return e != cudaSuccess
               ? e
               : cudaMemcpy(scales.ptr, static_scales.data(), static_scales.size() * sizeof(float),
                            cudaMemcpyHostToDevice);
  }
  std::size_t guard_bytes;
  std::size_t cache_bytes;
  device_array<std::byte> cache;
  device_array<T> k;
  device_array<T> v;
  device_array<float> scales;
  device_array<std::int32_t> flag;
};

} // namespace

template <class Layout, class T>
device_round_trip<T> run_on_device(const Layout& layout, const std::vector<T>& k,
                                   const std::vector<T>& v,
                                   const std::vector<std::int32_t>& page_ids, std::int32_t capacity,
                                   const std::vector<float>& static_scales, bool debug) {
  device_round_trip<T> out;
  const auto cache_bytes = static_cast<std::size_t>(capacity * layout.bytes_per_page());
  kv_inputs<T> in(layout.bytes_per_page(), cache_bytes, k.size(), v.size(), static_scales.size());
  device_array<std::int32_t> ids(page_ids.size());
  KVKIT_TRY(in.upload(k, v, static_scales));
  KVKIT_TRY(ids.err);
  KVKIT_TRY(cudaMemcpy(ids.ptr, page_ids.data(), page_ids.size() * 4, cudaMemcpyHostToDevice));
  auto& dk = in.k;
  auto& dv = in.v;
  auto& scales = in.scales;
  auto& flag = in.flag;
  kvkit::cuda::page_batch<Layout, T> b{
      layout, in.cache_start(), capacity,  ids.ptr, static_cast<std::int32_t>(page_ids.size()),
      dk.ptr, dv.ptr,           scales.ptr};
  b.page_check = debug ? flag.ptr : nullptr;
  KVKIT_TRY(kvkit::cuda::quantize_pages(b, nullptr));
  KVKIT_TRY(cudaDeviceSynchronize());
  if (debug) {
    KVKIT_TRY(
        cudaMemcpy(&out.flag_written, flag.ptr, sizeof(std::int32_t), cudaMemcpyDeviceToHost));
    KVKIT_TRY(cudaMemset(flag.ptr, 0, sizeof(std::int32_t)));
  }
  KVKIT_TRY(in.download(out));
  KVKIT_TRY(cudaMemset(dk.ptr, 0x5A, k.size() * sizeof(T)));
  KVKIT_TRY(cudaMemset(dv.ptr, 0x5A, v.size() * sizeof(T)));
  KVKIT_TRY(kvkit::cuda::dequantize_pages(b, nullptr));
  KVKIT_TRY(cudaDeviceSynchronize());
  if (debug) {
    KVKIT_TRY(cudaMemcpy(&out.flag_read, flag.ptr, sizeof(std::int32_t), cudaMemcpyDeviceToHost));
  }
  out.k.resize(k.size());
  out.v.resize(v.size());
  KVKIT_TRY(cudaMemcpy(out.k.data(), dk.ptr, k.size() * sizeof(T), cudaMemcpyDeviceToHost));
  KVKIT_TRY(cudaMemcpy(out.v.data(), dv.ptr, v.size() * sizeof(T), cudaMemcpyDeviceToHost));
  return out;
}

template <class Layout, class T>
device_round_trip<T> run_write_kv(const Layout& layout, const std::vector<T>& k,
                                  const std::vector<T>& v, const std::vector<std::int64_t>& slots,
                                  std::int32_t capacity, const std::vector<float>& static_scales,
                                  bool debug) {
  device_round_trip<T> out;
  const auto cache_bytes = static_cast<std::size_t>(capacity * layout.bytes_per_page());
  kv_inputs<T> in(layout.bytes_per_page(), cache_bytes, k.size(), v.size(), static_scales.size());
  device_array<std::int64_t> ds(slots.size());
  KVKIT_TRY(in.upload(k, v, static_scales));
  KVKIT_TRY(ds.err);
  KVKIT_TRY(cudaMemcpy(ds.ptr, slots.data(), slots.size() * 8, cudaMemcpyHostToDevice));
  auto& dk = in.k;
  auto& dv = in.v;
  auto& scales = in.scales;
  auto& flag = in.flag;
  kvkit::cuda::kv_write<Layout, T> w{
      layout, in.cache_start(), capacity,  ds.ptr, static_cast<std::int32_t>(slots.size()),
      dk.ptr, dv.ptr,           scales.ptr};
  w.page_check = debug ? flag.ptr : nullptr;
  KVKIT_TRY(kvkit::cuda::write_kv(w, nullptr));
  KVKIT_TRY(cudaDeviceSynchronize());
  if (debug) {
    KVKIT_TRY(
        cudaMemcpy(&out.flag_written, flag.ptr, sizeof(std::int32_t), cudaMemcpyDeviceToHost));
  }
  KVKIT_TRY(in.download(out));
  return out;
}

std::int64_t device_conversion_mismatches(std::uint64_t seed, std::int64_t n) {
  unsigned long long* count = nullptr;
  if (cudaMalloc(&count, sizeof(*count)) != cudaSuccess) {
    return -1;
  }
  unsigned long long host = 0;
  bool ok = cudaMemset(count, 0, sizeof(*count)) == cudaSuccess;
  conversion_kernel<<<1024, 256>>>(seed, n, count);
  ok = ok && cudaGetLastError() == cudaSuccess && cudaDeviceSynchronize() == cudaSuccess &&
       cudaMemcpy(&host, count, sizeof(host), cudaMemcpyDeviceToHost) == cudaSuccess;
  cudaFree(count);
  return ok ? static_cast<std::int64_t>(host) : -1;
}

namespace {

__global__ void int4_params_kernel(const float* lo, const float* hi, std::int64_t n,
                                   kvkit::detail::scale_zero* out) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    out[i] = kvkit::detail::min_max_params({lo[i], hi[i], true});
    // The kernels' short path, for the ranges it takes: both must agree.
    if (lo[i] >= -65504.0F && hi[i] <= 65504.0F) {
      const auto q = kvkit::cuda::detail::int4_params_in_range(lo[i], hi[i]);
      if (__float_as_uint(q.scale) != __float_as_uint(out[i].scale) ||
          __float_as_uint(q.zero) != __float_as_uint(out[i].zero) ||
          __float_as_uint(q.inv) != __float_as_uint(out[i].inv)) {
        out[i].scale = __int_as_float(0x7FC00001); // a NaN no parameter set holds
      }
    }
  }
}

__global__ void div15_kernel(unsigned long long* count) {
  unsigned long long bad = 0;
  for (std::uint32_t u = blockIdx.x * blockDim.x + threadIdx.x; u < 0x7F800000U;
       u += gridDim.x * blockDim.x) {
    const float d = __uint_as_float(u);
    bad += __float_as_uint(kvkit::detail::div15(d)) != __float_as_uint(__fdiv_rn(d, 15.0F)) ? 1 : 0;
  }
  atomicAdd(count, bad);
}

} // namespace

std::vector<kvkit::detail::scale_zero> device_int4_params(const std::vector<float>& lo,
                                                          const std::vector<float>& hi) {
  const std::size_t n = lo.size();
  device_array<float> dlo(n);
  device_array<float> dhi(n);
  device_array<kvkit::detail::scale_zero> dout(n);
  std::vector<kvkit::detail::scale_zero> out(n);
  const bool ok =
      dlo.err == cudaSuccess && dhi.err == cudaSuccess && dout.err == cudaSuccess &&
      cudaMemcpy(dlo.ptr, lo.data(), n * 4, cudaMemcpyHostToDevice) == cudaSuccess &&
      cudaMemcpy(dhi.ptr, hi.data(), n * 4, cudaMemcpyHostToDevice) == cudaSuccess &&
      (int4_params_kernel<<<1024, 256>>>(dlo.ptr, dhi.ptr, static_cast<std::int64_t>(n), dout.ptr),
       cudaGetLastError() == cudaSuccess) &&
      cudaMemcpy(out.data(), dout.ptr, n * sizeof(out[0]), cudaMemcpyDeviceToHost) == cudaSuccess;
  return ok ? out : std::vector<kvkit::detail::scale_zero>{};
}

std::int64_t device_div15_mismatches() {
  device_array<unsigned long long> count(1);
  unsigned long long host = 0;
  const bool ok = count.err == cudaSuccess &&
                  cudaMemset(count.ptr, 0, sizeof(host)) == cudaSuccess &&
                  (div15_kernel<<<2048, 256>>>(count.ptr), cudaGetLastError() == cudaSuccess) &&
                  cudaMemcpy(&host, count.ptr, sizeof(host), cudaMemcpyDeviceToHost) == cudaSuccess;
  return ok ? static_cast<std::int64_t>(host) : -1;
}

// The variants the tests run (and CI compiles).
#define KVKIT_WRITE_KV(LAYOUT, T)                                                                  \
  template device_round_trip<T> run_write_kv<LAYOUT, T>(                                           \
      const LAYOUT&, const std::vector<T>&, const std::vector<T>&,                                 \
      const std::vector<std::int64_t>&, std::int32_t, const std::vector<float>&, bool);
#define KVKIT_ROUND_TRIP(LAYOUT, T)                                                                \
  template device_round_trip<T> run_on_device<LAYOUT, T>(                                          \
      const LAYOUT&, const std::vector<T>&, const std::vector<T>&,                                 \
      const std::vector<std::int32_t>&, std::int32_t, const std::vector<float>&, bool);

using kvkit::kv_order;
using kvkit::paged_layout;
using l_fp16 = paged_layout<kvkit::fp16_codec>;
using l_bf16_hnd = paged_layout<kvkit::bf16_codec, kvkit::bf16_codec, kv_order::hnd>;
using l_e4m3 = paged_layout<kvkit::fp8_e4m3_codec>;
using l_e5m2_hnd = paged_layout<kvkit::fp8_e5m2_codec, kvkit::fp8_e5m2_codec, kv_order::hnd>;
using l_int8 = paged_layout<kvkit::int8_codec>;
using l_int8_hnd = paged_layout<kvkit::int8_codec, kvkit::int8_codec, kv_order::hnd>;
using l_g32 = paged_layout<kvkit::int4_group_codec<32>>;
using l_g64_hnd =
    paged_layout<kvkit::int4_group_codec<64>, kvkit::int4_group_codec<64>, kv_order::hnd>;
using l_g128 = paged_layout<kvkit::int4_group_codec<128>>;
using l_kivi = paged_layout<kvkit::int4_channel_codec, kvkit::int4_group_codec<128>>;
using l_kivi_hnd = paged_layout<kvkit::int4_channel_codec, kvkit::int8_codec, kv_order::hnd>;
KVKIT_ROUND_TRIP(l_fp16, __nv_bfloat16)
KVKIT_ROUND_TRIP(l_bf16_hnd, float)
KVKIT_ROUND_TRIP(l_e4m3, __nv_bfloat16)
KVKIT_ROUND_TRIP(l_e5m2_hnd, __half)
KVKIT_ROUND_TRIP(l_int8, __nv_bfloat16)
KVKIT_ROUND_TRIP(l_int8_hnd, float)
KVKIT_ROUND_TRIP(l_g32, __nv_bfloat16)
KVKIT_ROUND_TRIP(l_g64_hnd, __half)
KVKIT_ROUND_TRIP(l_g128, __nv_bfloat16)
KVKIT_ROUND_TRIP(l_kivi, __nv_bfloat16)
KVKIT_ROUND_TRIP(l_kivi_hnd, float)
using l_g32_hnd =
    paged_layout<kvkit::int4_group_codec<32>, kvkit::int4_group_codec<32>, kv_order::hnd>;
KVKIT_ROUND_TRIP(l_g32_hnd, float)
using l_bf16 = paged_layout<kvkit::bf16_codec>;
KVKIT_ROUND_TRIP(l_bf16, __nv_bfloat16)
KVKIT_ROUND_TRIP(l_g128, __half)
using l_g128_g64 = paged_layout<kvkit::int4_group_codec<128>, kvkit::int4_group_codec<64>>;
KVKIT_WRITE_KV(l_fp16, __nv_bfloat16)
KVKIT_WRITE_KV(l_int8_hnd, float)
KVKIT_WRITE_KV(l_g32, __nv_bfloat16)
KVKIT_WRITE_KV(l_e5m2_hnd, __half)
KVKIT_WRITE_KV(l_int8, __nv_bfloat16)
KVKIT_WRITE_KV(l_g128_g64, __half)
using l_e4m3_g32 = paged_layout<kvkit::fp8_e4m3_codec, kvkit::int4_group_codec<32>>;
KVKIT_WRITE_KV(l_e4m3_g32, __nv_bfloat16)
KVKIT_WRITE_KV(l_kivi, __nv_bfloat16) // rejected: per-channel K needs whole pages

namespace {

// The cases that kv_write and page_batch share, each a change to the accepted `good` arguments
// handed to `check(name, args, expect_ok)`: `count` is the token or page count and `ids` the slots
// or page ids. `fake` is 16-byte aligned.
template <class Args, class Ids, class Check>
void shared_argument_cases(const Args& good, std::int32_t Args::*count, Ids Args::*ids,
                           std::byte* fake, Check&& check) {
  using layout_t = decltype(good.layout);
  const auto with = [&](const char* name, bool expect_ok, auto change) {
    Args a = good;
    change(a);
    check(name, a, expect_ok);
  };
  check("good", good, true);
  with("no work, no pointers", true, [&](Args& a) {
    a.*count = 0;
    a.*ids = nullptr;
    a.cache = nullptr;
    a.k = nullptr;
    a.v = nullptr;
  });
  with("negative count", false, [&](Args& a) { a.*count = -1; });
  with("page size 0", false, [](Args& a) { a.layout = layout_t(0, 8, 128); });
  with("no kv heads", false, [](Args& a) { a.layout = layout_t(16, 0, 128); });
  with("head dim not a multiple of 8", false, [](Args& a) { a.layout = layout_t(16, 8, 100); });
  // The kernels locate codes in 32-bit arithmetic: a 16-bit page region of 2^27 elements (2^31
  // bits) is the largest they take, though a page of twice that is a valid layout.
  with("a page region of 2^31 bits", true, [](Args& a) { a.layout = layout_t(4096, 128, 256); });
  static_assert(layout_t(8192, 128, 256).validate().ok());
  with("a page region over 2^31 bits", false, [](Args& a) { a.layout = layout_t(8192, 128, 256); });
  with("null ids", false, [&](Args& a) { a.*ids = nullptr; });
  with("null cache", false, [](Args& a) { a.cache = nullptr; });
  with("null k", false, [](Args& a) { a.k = nullptr; });
  with("null v", false, [](Args& a) { a.v = nullptr; });
  with("no capacity", false, [](Args& a) { a.capacity = 0; });
  with("negative capacity", false, [](Args& a) { a.capacity = -4; });
  with("misaligned cache", false, [&](Args& a) { a.cache = fake + 8; });
  with("misaligned k", false, [](Args& a) { a.k += 1; });
  with("misaligned v", false, [](Args& a) { a.v += 4; });
  // The arrays read or written an element at a time need only their element's alignment.
  with("ids at their element's alignment", true,
       [&](Args& a) { a.*ids = reinterpret_cast<Ids>(fake + sizeof(*(a.*ids))); });
  with("misaligned ids", false, [&](Args& a) { a.*ids = reinterpret_cast<Ids>(fake + 2); });
  with("debug flag", true,
       [&](Args& a) { a.page_check = reinterpret_cast<std::int32_t*>(fake + 4); });
  with("misaligned debug flag", false,
       [&](Args& a) { a.page_check = reinterpret_cast<std::int32_t*>(fake + 2); });
}

// An fp8 cache's arguments `a` without their static scales (rejected), then with `scales`.
template <class Args, class Check>
void static_scale_cases(Args a, const float* scales, Check&& check) {
  check("fp8 without static scales", a, false);
  a.static_scales = reinterpret_cast<const float*>(reinterpret_cast<const std::byte*>(scales) + 2);
  check("fp8 with misaligned static scales", a, false);
  a.static_scales = scales;
  check("fp8 with static scales", a, true);
}

} // namespace

std::vector<std::string> page_validation_failures() {
  std::vector<std::string> failed;
  // Stand-in pointers: validate never dereferences them, and no accepted case with work is
  // launched, so no CUDA call is made.
  std::byte* const fake = stand_in();
  auto* t = reinterpret_cast<__nv_bfloat16*>(fake);
  auto* ids = reinterpret_cast<std::int32_t*>(fake);
  auto* slots = reinterpret_cast<std::int64_t*>(fake);
  auto* scales = reinterpret_cast<float*>(fake);

  const auto write = [&](const char* name, const auto& w, bool expect_ok) {
    if (!launchers_agree(kvkit::cuda::validate(w).ok(), expect_ok, w.num_tokens > 0,
                         [&] { return kvkit::cuda::write_kv(w, nullptr); })) {
      failed.emplace_back(std::string("write_kv: ") + name);
    }
  };
  using w_fp16 = kvkit::cuda::kv_write<l_fp16, __nv_bfloat16>;
  shared_argument_cases(w_fp16{l_fp16(16, 8, 128), fake, 4, slots, 3, t, t, nullptr},
                        &w_fp16::num_tokens, &w_fp16::slots, fake, write);
  using w_fp8 = kvkit::cuda::kv_write<l_e4m3_g32, __nv_bfloat16>;
  static_scale_cases(w_fp8{l_e4m3_g32(16, 8, 128), fake, 4, slots, 3, t, t, nullptr}, scales,
                     write);
  using w_kivi = kvkit::cuda::kv_write<l_kivi, __nv_bfloat16>;
  write("per-channel K", w_kivi{l_kivi(16, 8, 128), fake, 4, slots, 3, t, t, nullptr}, false);
  // Per-channel V too (only validate is called: no kernel is built for this layout).
  using l_channel_v = paged_layout<kvkit::int8_codec, kvkit::int4_channel_codec>;
  if (kvkit::cuda::validate(kvkit::cuda::kv_write<l_channel_v, __nv_bfloat16>{
                                l_channel_v(16, 8, 128), fake, 4, slots, 3, t, t, nullptr})
          .ok()) {
    failed.emplace_back("write_kv: per-channel V");
  }
  // int8's quantizer reduces a head's row across 2, 4 or 8 lanes, as quantize_pages' does.
  using w_int8 = kvkit::cuda::kv_write<l_int8, __nv_bfloat16>;
  write("int8 (one scale a head vector) at head dim 96",
        w_int8{l_int8(16, 8, 96), fake, 4, slots, 3, t, t, nullptr}, false);
  write("int8 at head dim 80", w_int8{l_int8(16, 8, 80), fake, 4, slots, 3, t, t, nullptr}, false);
  write("int8 at head dim 256", w_int8{l_int8(16, 8, 256), fake, 4, slots, 3, t, t, nullptr}, true);
  // A kv_codec of the caller's own (int8's twin): the kernels are written for the library's
  // codecs, so both launchers' validate() refuse it (only validate is called: no kernel is built).
  struct own_int8 : kvkit::int8_codec {};
  static_assert(kvkit::kv_codec<own_int8>);
  using l_own = kvkit::paged_layout<own_int8>;
  if (kvkit::cuda::validate(kvkit::cuda::kv_write<l_own, __nv_bfloat16>{l_own(16, 8, 128), fake, 4,
                                                                        slots, 3, t, t, nullptr})
          .ok() ||
      kvkit::cuda::validate(kvkit::cuda::page_batch<l_own, __nv_bfloat16>{l_own(16, 8, 128), fake,
                                                                          4, ids, 2, t, t, nullptr})
          .ok()) {
    failed.emplace_back("a codec of the caller's own");
  }
  // Tokens in blocks of four along the grid's x, counted in 32 bits.
  write("INT32_MAX - 3 tokens",
        w_fp16{l_fp16(16, 8, 128), fake, 4, slots, INT32_MAX - 3, t, t, nullptr}, true);
  write("INT32_MAX - 2 tokens",
        w_fp16{l_fp16(16, 8, 128), fake, 4, slots, INT32_MAX - 2, t, t, nullptr}, false);

  // quantize_pages and dequantize_pages: one validate, two launchers.
  const auto pages = [&](const char* name, const auto& b, bool expect_ok) {
    if (!launchers_agree(
            kvkit::cuda::validate(b).ok(), expect_ok, b.num_pages > 0,
            [&] { return kvkit::cuda::quantize_pages(b, nullptr); },
            [&] { return kvkit::cuda::dequantize_pages(b, nullptr); })) {
      failed.emplace_back(std::string("quantize_pages: ") + name);
    }
  };
  using b_fp16 = kvkit::cuda::page_batch<l_fp16, __nv_bfloat16>;
  shared_argument_cases(b_fp16{l_fp16(16, 8, 128), fake, 4, ids, 2, t, t, nullptr},
                        &b_fp16::num_pages, &b_fp16::page_ids, fake, pages);
  using b_fp8 = kvkit::cuda::page_batch<l_e4m3, __nv_bfloat16>;
  static_scale_cases(b_fp8{l_e4m3(16, 8, 128), fake, 4, ids, 2, t, t, nullptr}, scales, pages);
  using b_int8 = kvkit::cuda::page_batch<l_int8, __nv_bfloat16>;
  pages("int8 (one scale a head vector) at head dim 96",
        b_int8{l_int8(16, 8, 96), fake, 4, ids, 2, t, t, nullptr}, false);
  pages("int8 at head dim 64", b_int8{l_int8(16, 8, 64), fake, 4, ids, 2, t, t, nullptr}, true);
  // A per-channel codec's quads of four channels in CTAs of 896 along the grid's y (at most
  // 65535): 1834980 heads of 128 channels fill 65535 CTAs.
  using b_kivi = kvkit::cuda::page_batch<l_kivi, __nv_bfloat16>;
  pages("per-channel K on 65535 CTAs of a page",
        b_kivi{l_kivi(1, 1834980, 128), fake, 4, ids, 2, t, t, nullptr}, true);
  pages("per-channel K on 65536 CTAs of a page",
        b_kivi{l_kivi(1, 1834981, 128), fake, 4, ids, 2, t, t, nullptr}, false);
  // A page's tokens in blocks of four along the grid's y (at most 65535).
  pages("pages of 262140 tokens", b_fp16{l_fp16(262140, 1, 64), fake, 4, ids, 2, t, t, nullptr},
        true);
  pages("pages of 262144 tokens", b_fp16{l_fp16(262144, 1, 64), fake, 4, ids, 2, t, t, nullptr},
        false);
  return failed;
}

} // namespace kvkit_test
