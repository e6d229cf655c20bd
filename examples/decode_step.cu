// One decode step on the GPU, end to end: a block_table hands out pages for four sequences of
// different lengths, write_kv stores their K/V (quantized to fp8 e4m3 on the fly), and
// paged_decode runs attention for one new query token per sequence over the CSR page table.
// The result is checked against kvkit::reference::paged_decode on a copy of the cache. Both
// kernels run in the debug mode (page_check), which checks every page id against the cache.
// Without a GPU it says so and exits 0 (the serving simulation shows the CPU path).

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include <kvkit/cuda/paged_decode.cuh>
#include <kvkit/cuda/write_kv.cuh>
#include <kvkit/kvkit.hpp>
#include <kvkit/reference/paged_attention.hpp>

namespace {

#define CHECK_CUDA(expr)                                                                           \
  do {                                                                                             \
    const cudaError_t e_ = (expr);                                                                 \
    if (e_ != cudaSuccess) {                                                                       \
      std::fprintf(stderr, "%s: %s\n", #expr, cudaGetErrorString(e_));                             \
      return 1;                                                                                    \
    }                                                                                              \
  } while (false)

template <class T>
T* to_device(const std::vector<T>& h) {
  T* d = nullptr;
  if (cudaMalloc(&d, std::max<std::size_t>(h.size(), 1) * sizeof(T)) != cudaSuccess) {
    return nullptr;
  }
  if (cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice) != cudaSuccess) {
    cudaFree(d);
    return nullptr;
  }
  return d;
}

} // namespace

int main() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("decode_step: no CUDA device here; nothing to run (serving_sim --engine cpu shows "
                "the CPU reference path)\n");
    return 0;
  }
  // Llama-3-8B attention shape: 32 query heads over 8 KV heads of 128 channels; 16-token pages.
  constexpr std::int32_t page = 16, kv_heads = 8, q_heads = 32, dim = 128, capacity = 1024;
  // HND pages: a quantized cache reads faster when each head's rows of a page are contiguous
  // (docs/kernels.md).
  using layout_t =
      kvkit::paged_layout<kvkit::fp8_e4m3_codec, kvkit::fp8_e4m3_codec, kvkit::kv_order::hnd>;
  const layout_t layout(page, kv_heads, dim);
  const std::vector<float> scales(2 * kv_heads, 4.0F / 448.0F); // calibrated K, V scales

  // 1. Pages for four sequences; each appends its whole context (the prompt, then the new token).
  kvkit::block_pool pool(capacity);
  kvkit::block_table<kvkit::block_pool> table(pool, page);
  const std::vector<kvkit::seq_id> batch{0, 1, 2, 3};
  const std::vector<std::int32_t> lens{1, 37, 900, 4000};
  std::vector<kvkit::token_slot> slots_scratch;
  for (std::size_t b = 0; b < batch.size(); ++b) {
    slots_scratch.resize(static_cast<std::size_t>(lens[b]));
    if (!table.add_sequence(batch[b]).ok() ||
        !table.append_tokens(batch[b], lens[b], slots_scratch).ok()) {
      std::fprintf(stderr, "block_table refused the batch\n");
      return 1;
    }
  }
  // 2. Slots of every token (here the whole context is written at once, as a prefill would).
  std::int32_t total = 0;
  for (const auto l : lens) {
    total += l;
  }
  std::vector<std::int64_t> slots(static_cast<std::size_t>(total));
  if (const auto st = table.export_slot_mapping(batch, lens, slots); !st.ok()) {
    std::fprintf(stderr, "export_slot_mapping: %s\n", kvkit::to_string(st.error()).data());
    return 1;
  }
  std::mt19937 rng(42);
  std::normal_distribution<float> normal(0.0F, 1.0F);
  std::vector<__nv_bfloat16> k(static_cast<std::size_t>(total) * kv_heads * dim), v(k.size()),
      q(batch.size() * q_heads * dim);
  for (auto* xs : {&k, &v, &q}) {
    for (auto& x : *xs) {
      x = __float2bfloat16(normal(rng));
    }
  }
  // 3. The CSR page table of the batch.
  std::vector<std::int32_t> indptr(batch.size() + 1), last(batch.size()),
      indices(static_cast<std::size_t>(*table.csr_size(batch)));
  if (const auto st = table.export_csr(batch, indptr, indices, last); !st.ok()) {
    std::fprintf(stderr, "export_csr: %s\n", kvkit::to_string(st.error()).data());
    return 1;
  }

  std::byte* cache = nullptr;
  CHECK_CUDA(cudaMalloc(&cache, static_cast<std::size_t>(capacity) * layout.bytes_per_page()));
  auto* d_slots = to_device(slots);
  auto* d_k = to_device(k);
  auto* d_v = to_device(v);
  auto* d_q = to_device(q);
  auto* d_scales = to_device(scales);
  auto* d_indptr = to_device(indptr);
  auto* d_indices = to_device(indices);
  auto* d_last = to_device(last);
  __nv_bfloat16* d_out = nullptr;
  CHECK_CUDA(cudaMalloc(&d_out, q.size() * sizeof(__nv_bfloat16)));
  if (d_slots == nullptr || d_k == nullptr || d_v == nullptr || d_q == nullptr ||
      d_scales == nullptr || d_indptr == nullptr || d_indices == nullptr || d_last == nullptr) {
    std::fprintf(stderr, "device allocation failed\n");
    return 1;
  }

  // The debug mode, as an engine's debug build would run it: every kernel checks each page id
  // (and write_kv each slot) against the cache's capacity, and sets this flag instead of touching
  // memory outside the cache.
  std::int32_t* d_page_check = nullptr;
  CHECK_CUDA(cudaMalloc(&d_page_check, sizeof(std::int32_t)));
  CHECK_CUDA(cudaMemset(d_page_check, 0, sizeof(std::int32_t)));

  // 4. write_kv: K and V into their slots, quantized to fp8 with the static scales.
  kvkit::cuda::kv_write<layout_t, __nv_bfloat16> w{layout, cache, capacity, d_slots,
                                                   total,  d_k,   d_v,      d_scales};
  w.page_check = d_page_check;
  CHECK_CUDA(kvkit::cuda::write_kv(w, nullptr));

  // 5. paged_decode: plan on the host (the lengths are known there); the workspace needs no
  //    initialization.
  int sms = 0;
  CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const kvkit::decode_shape shape =
      kvkit::decode_shape_for(layout, static_cast<std::int32_t>(batch.size()), q_heads);
  const auto plan = kvkit::plan_decode(shape, lens, sms);
  if (!plan.ok()) {
    std::fprintf(stderr, "plan_decode: %s\n", kvkit::to_string(plan.error()).data());
    return 1;
  }
  void* workspace = nullptr;
  CHECK_CUDA(cudaMalloc(&workspace, std::max<std::size_t>(plan->workspace_bytes(), 16)));
  kvkit::cuda::decode_args<layout_t, __nv_bfloat16> a;
  a.layout = layout;
  a.cache = cache;
  a.capacity = capacity;
  a.table = kvkit::csr_page_table{d_indptr, d_indices, d_last,
                                  static_cast<std::int32_t>(batch.size()), page};
  a.q = d_q;
  a.out = d_out;
  a.static_scales = d_scales;
  a.page_check = d_page_check;
  CHECK_CUDA(kvkit::cuda::paged_decode(a, *plan, workspace, plan->workspace_bytes(), nullptr));
  CHECK_CUDA(cudaDeviceSynchronize());
  std::int32_t page_check = 0;
  CHECK_CUDA(cudaMemcpy(&page_check, d_page_check, sizeof(page_check), cudaMemcpyDeviceToHost));

  // 6. The same attention on the CPU from a copy of the cache.
  std::vector<std::byte> host_cache(static_cast<std::size_t>(capacity) * layout.bytes_per_page());
  std::vector<__nv_bfloat16> out(q.size());
  CHECK_CUDA(cudaMemcpy(host_cache.data(), cache, host_cache.size(), cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(out.data(), d_out, out.size() * 2, cudaMemcpyDeviceToHost));
  std::vector<float> qf(q.size()), ref(q.size());
  for (std::size_t i = 0; i < q.size(); ++i) {
    qf[i] = __bfloat162float(q[i]);
  }
  const kvkit::csr_page_table host_table{indptr.data(), indices.data(), last.data(),
                                         static_cast<std::int32_t>(batch.size()), page};
  if (const auto st =
          kvkit::reference::paged_decode(layout, host_cache.data(), capacity, host_table, qf.data(),
                                         q_heads, ref.data(), nullptr, scales.data());
      !st.ok()) {
    std::fprintf(stderr, "reference::paged_decode: %s\n", kvkit::to_string(st.error()).data());
    return 1;
  }
  double num = 0, den = 0;
  for (std::size_t i = 0; i < out.size(); ++i) {
    const double d = __bfloat162float(out[i]) - ref[i];
    num += d * d;
    den += static_cast<double>(ref[i]) * ref[i];
  }
  const double rel = std::sqrt(num / den);
  std::printf("decode_step: %zu sequences (lengths 1, 37, 900, 4000), %d pages used, fp8 e4m3 KV, "
              "%d splits at most; relative error vs the CPU reference %.2e; page ids %s\n",
              batch.size(), pool.num_used(), plan->max_splits, rel,
              page_check == 0 ? "all inside the cache" : "OUTSIDE the cache (debug flag set)");
  for (void* p :
       {static_cast<void*>(cache), static_cast<void*>(d_slots), static_cast<void*>(d_k),
        static_cast<void*>(d_v), static_cast<void*>(d_q), static_cast<void*>(d_scales),
        static_cast<void*>(d_indptr), static_cast<void*>(d_indices), static_cast<void*>(d_last),
        static_cast<void*>(d_out), workspace, static_cast<void*>(d_page_check)}) {
    cudaFree(p);
  }
  return rel < 1e-2 && page_check == 0 ? 0 : 1;
}
