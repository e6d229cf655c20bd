#include <algorithm>
#include <string>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "cuda/cuda_try.hpp"
#include "cuda/device_buffers.hpp"
#include "cuda/prefill_device.hpp"
#include "cuda/validation.hpp"
#include "kvkit/cuda/paged_prefill.cuh"
#include "kvkit/layout/page_layout.hpp"
#include "kvkit/quant/codecs.hpp"

namespace kvkit_test {

template <class Layout, class T>
prefill_outcome run_prefill(const Layout& layout, const std::vector<std::byte>& cache,
                            std::int32_t capacity, const decode_step& table,
                            const std::vector<std::int32_t>& qo_indptr,
                            const std::vector<std::uint16_t>& q, std::int32_t q_heads,
                            const std::vector<float>& static_scales,
                            const kvkit::attention_options& options, const prefill_mode& mode) {
  prefill_outcome out;
  device_buffers mem;
  const auto batch = static_cast<std::int32_t>(table.last_page_len.size());
  std::int32_t most = 0;
  for (std::size_t b = 0; b + 1 < qo_indptr.size(); ++b) {
    most = std::max(most, qo_indptr[b + 1] - qo_indptr[b]);
  }
  const std::size_t total = q.size() / static_cast<std::size_t>(layout.head_dim());
  std::byte* d_cache = nullptr;
  std::int32_t *d_indptr = nullptr, *d_indices = nullptr, *d_last = nullptr, *d_qo = nullptr,
               *d_check = nullptr;
  T *d_q = nullptr, *d_out = nullptr;
  float *d_lse = nullptr, *d_scales = nullptr;
  KVKIT_TRY(mem.alloc(d_cache, cache.size()));
  KVKIT_TRY(mem.alloc(d_indptr, table.indptr.size()));
  KVKIT_TRY(mem.alloc(d_indices, table.indices.size()));
  KVKIT_TRY(mem.alloc(d_last, table.last_page_len.size()));
  KVKIT_TRY(mem.alloc(d_qo, qo_indptr.size()));
  KVKIT_TRY(mem.alloc(d_check, 1));
  KVKIT_TRY(mem.alloc(d_q, q.size()));
  KVKIT_TRY(mem.alloc(d_out, q.size()));
  KVKIT_TRY(mem.alloc(d_lse, total));
  KVKIT_TRY(mem.alloc(d_scales, static_scales.size()));
  const auto up = [](void* dst, const auto& v) {
    return cudaMemcpy(dst, v.data(), v.size() * sizeof(v[0]), cudaMemcpyHostToDevice);
  };
  KVKIT_TRY(up(d_cache, cache));
  KVKIT_TRY(up(d_indptr, table.indptr));
  KVKIT_TRY(up(d_indices, table.indices));
  KVKIT_TRY(up(d_last, table.last_page_len));
  KVKIT_TRY(up(d_qo, qo_indptr));
  KVKIT_TRY(up(d_q, q));
  KVKIT_TRY(up(d_scales, static_scales));
  KVKIT_TRY(cudaMemset(d_check, 0, sizeof(std::int32_t)));

  kvkit::cuda::prefill_args<Layout, T> a;
  a.layout = layout;
  a.cache = d_cache;
  a.capacity = capacity;
  a.table = kvkit::csr_page_table{d_indptr, d_indices, d_last, batch, layout.page_size()};
  a.qo_indptr = d_qo;
  a.max_queries = std::max(0, most + mode.extra_max_queries);
  a.num_q_heads = q_heads;
  a.q = d_q;
  a.out = d_out;
  a.lse = mode.lse ? d_lse : nullptr;
  a.static_scales = static_scales.empty() ? nullptr : d_scales;
  a.options = options;
  a.page_check = mode.check_pages ? d_check : nullptr;

  cudaStream_t stream = nullptr;
  KVKIT_TRY(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  const auto poison = [&] {
    cudaError_t e = cudaMemsetAsync(d_out, 0xFF, q.size() * sizeof(T), stream);
    return e != cudaSuccess ? e : cudaMemsetAsync(d_lse, 0xFF, total * sizeof(float), stream);
  };
  const auto run = [&]() -> cudaError_t {
    if (!mode.graph) {
      if (const cudaError_t e = poison(); e != cudaSuccess) {
        return e;
      }
      return kvkit::cuda::paged_prefill(a, stream);
    }
    if (cudaError_t e = cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal);
        e != cudaSuccess) {
      return e;
    }
    const cudaError_t launched = kvkit::cuda::paged_prefill(a, stream);
    const cudaError_t ended = cudaStreamEndCapture(stream, &graph);
    if (launched != cudaSuccess || ended != cudaSuccess) {
      return launched != cudaSuccess ? launched : ended;
    }
    if (cudaError_t e = cudaGraphInstantiate(&exec, graph, 0); e != cudaSuccess) {
      return e;
    }
    for (int i = 0; i < 2; ++i) { // replayed: the second replay's outputs are the ones returned
      if (cudaError_t e = poison(); e != cudaSuccess) {
        return e;
      }
      if (cudaError_t e = cudaGraphLaunch(exec, stream); e != cudaSuccess) {
        return e;
      }
    }
    return cudaSuccess;
  };
  out.error = run();
  const cudaError_t synced = cudaStreamSynchronize(stream);
  if (exec != nullptr) {
    cudaGraphExecDestroy(exec);
  }
  if (graph != nullptr) {
    cudaGraphDestroy(graph);
  }
  cudaStreamDestroy(stream);
  if (out.error != cudaSuccess) {
    return out;
  }
  KVKIT_TRY(synced);
  out.out.resize(q.size());
  out.lse.resize(total);
  KVKIT_TRY(cudaMemcpy(out.out.data(), d_out, q.size() * sizeof(T), cudaMemcpyDeviceToHost));
  KVKIT_TRY(cudaMemcpy(out.lse.data(), d_lse, total * sizeof(float), cudaMemcpyDeviceToHost));
  KVKIT_TRY(cudaMemcpy(&out.page_check, d_check, sizeof(std::int32_t), cudaMemcpyDeviceToHost));
  return out;
}

std::vector<std::string> prefill_validation_failures() {
  using layout_t = kvkit::paged_layout<kvkit::bf16_codec>;
  using args_t = kvkit::cuda::prefill_args<layout_t, __nv_bfloat16>;
  std::vector<std::string> failed;
  std::byte* const fake = stand_in();
  auto* p = reinterpret_cast<std::int32_t*>(fake);
  auto* t = reinterpret_cast<__nv_bfloat16*>(fake);
  args_t good;
  good.layout = layout_t(16, 2, 128);
  good.cache = fake;
  good.capacity = 10;
  good.table = kvkit::csr_page_table{p, p, p, 3, 16};
  good.qo_indptr = p;
  good.max_queries = 100;
  good.num_q_heads = 8;
  good.q = t;
  good.out = t;
  const auto with = [&](const char* name, bool expect_ok, auto change) {
    args_t a = good;
    change(a);
    const bool has_work = a.table.batch_size > 0 && a.max_queries > 0;
    if (!launchers_agree(kvkit::cuda::validate(a).ok(), expect_ok, has_work,
                         [&] { return kvkit::cuda::paged_prefill(a, nullptr); })) {
      failed.emplace_back(name);
    }
  };
  with("good", true, [](args_t&) {});
  with("head dim 96", false, [](args_t& a) { a.layout = layout_t(16, 2, 96); });
  with("head dim 32", false, [](args_t& a) { a.layout = layout_t(16, 2, 32); });
  with("invalid layout", false, [](args_t& a) { a.layout = layout_t(0, 2, 128); });
  with("table page size differs", false, [](args_t& a) { a.table.page_size = 8; });
  with("negative batch", false, [](args_t& a) { a.table.batch_size = -1; });
  with("batch past the grid", false, [](args_t& a) { a.table.batch_size = 65536; });
  with("no query heads", false, [](args_t& a) { a.num_q_heads = 0; });
  with("query heads not a multiple", false, [](args_t& a) { a.num_q_heads = 5; });
  with("negative max_queries", false, [](args_t& a) { a.max_queries = -1; });
  with("rows past 2^31", false, [](args_t& a) { a.max_queries = INT32_MAX / 4 + 1; });
  with("negative scale", false, [](args_t& a) { a.options.scale = -1.0F; });
  with("negative window", false, [](args_t& a) { a.options.window = -2; });
  with("subnormal soft cap", false, [](args_t& a) { a.options.logits_soft_cap = 1e-40F; });
  with("null cache", false, [](args_t& a) { a.cache = nullptr; });
  with("no capacity", false, [](args_t& a) { a.capacity = 0; });
  with("null queries", false, [](args_t& a) { a.q = nullptr; });
  with("null outputs", false, [](args_t& a) { a.out = nullptr; });
  with("null qo_indptr", false, [](args_t& a) { a.qo_indptr = nullptr; });
  with("null indptr", false, [&](args_t& a) { a.table.indptr = nullptr; });
  with("null indices", false, [&](args_t& a) { a.table.indices = nullptr; });
  with("null last_page_len", false, [&](args_t& a) { a.table.last_page_len = nullptr; });
  with("misaligned cache", false, [&](args_t& a) { a.cache = fake + 8; });
  with("misaligned queries", false,
       [&](args_t& a) { a.q = reinterpret_cast<const __nv_bfloat16*>(fake + 8); });
  with("misaligned outputs", false,
       [&](args_t& a) { a.out = reinterpret_cast<__nv_bfloat16*>(fake + 2); });
  with("misaligned qo_indptr", false,
       [&](args_t& a) { a.qo_indptr = reinterpret_cast<const std::int32_t*>(fake + 2); });
  with("misaligned lse", false, [&](args_t& a) { a.lse = reinterpret_cast<float*>(fake + 1); });
  with("misaligned debug flag", false,
       [&](args_t& a) { a.page_check = reinterpret_cast<std::int32_t*>(fake + 3); });
  // Nothing to do: accepted without pointers, and nothing launched.
  with("empty batch, no pointers", true, [](args_t& a) {
    a = args_t{};
    a.layout = layout_t(16, 2, 128);
    a.table.page_size = 16;
    a.num_q_heads = 2;
  });
  with("no queries, no pointers", true, [](args_t& a) {
    a.max_queries = 0;
    a.cache = nullptr;
    a.q = nullptr;
  });
  // Layouts the launcher refuses whatever the arguments: fp8 without its scales, and a
  // per-page-channel codec.
  const auto refused = [&](const char* name, auto layout) {
    kvkit::cuda::prefill_args<decltype(layout), __nv_bfloat16> a;
    a.layout = layout;
    a.cache = good.cache;
    a.capacity = good.capacity;
    a.table = good.table;
    a.qo_indptr = good.qo_indptr;
    a.max_queries = 4;
    a.num_q_heads = 2;
    a.q = good.q;
    a.out = good.out;
    if (!launchers_agree(kvkit::cuda::validate(a).ok(), false, true,
                         [&] { return kvkit::cuda::paged_prefill(a, nullptr); })) {
      failed.emplace_back(name);
    }
  };
  refused("fp8 without scales", kvkit::paged_layout<kvkit::fp8_e4m3_codec>(16, 2, 128));
  refused("per-page-channel V",
          kvkit::paged_layout<kvkit::bf16_codec, kvkit::int4_channel_codec>(16, 2, 128));
  return failed;
}

// The variants the tests run (each instantiation compiles the kernels of every head dim).
#define KVKIT_PREFILL_CASE(L, T)                                                                   \
  template prefill_outcome run_prefill<L, T>(                                                      \
      const L&, const std::vector<std::byte>&, std::int32_t, const decode_step&,                   \
      const std::vector<std::int32_t>&, const std::vector<std::uint16_t>&, std::int32_t,           \
      const std::vector<float>&, const kvkit::attention_options&, const prefill_mode&);

using kvkit::kv_order;
using kvkit::paged_layout;
using bf16_nhd = paged_layout<kvkit::bf16_codec>;
using fp16_hnd = paged_layout<kvkit::fp16_codec, kvkit::fp16_codec, kv_order::hnd>;
using e4m3_nhd = paged_layout<kvkit::fp8_e4m3_codec>;
using e5m2_hnd = paged_layout<kvkit::fp8_e5m2_codec, kvkit::fp8_e5m2_codec, kv_order::hnd>;
using int8_nhd = paged_layout<kvkit::int8_codec>;
using int4_32 = paged_layout<kvkit::int4_group_codec<32>>;
using int8_k_int4_v = paged_layout<kvkit::int8_codec, kvkit::int4_group_codec<64>>;

KVKIT_PREFILL_CASE(bf16_nhd, __nv_bfloat16)
KVKIT_PREFILL_CASE(bf16_nhd, __half)
KVKIT_PREFILL_CASE(fp16_hnd, __half)
KVKIT_PREFILL_CASE(e4m3_nhd, __nv_bfloat16)
KVKIT_PREFILL_CASE(e5m2_hnd, __half)
KVKIT_PREFILL_CASE(int8_nhd, __nv_bfloat16)
KVKIT_PREFILL_CASE(int4_32, __half)
KVKIT_PREFILL_CASE(int8_k_int4_v, __nv_bfloat16)

} // namespace kvkit_test
