// The serving simulation's GPU engine: one model-shaped layer (bf16 K/V in pages) and a pinned
// host tier, driven by the scheduler's plans through swap_blocks_copy_engines, copy_blocks,
// write_kv, paged_decode and paged_prefill.

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <kvkit/cuda/copy_blocks.cuh>
#include <kvkit/cuda/paged_decode.cuh>
#include <kvkit/cuda/paged_prefill.cuh>
#include <kvkit/cuda/write_kv.cuh>

#include "sim_attention.hpp"

namespace sim {

namespace {

// K, V or q rows of `n` tokens: [n][heads][dim], synthetic values rounded to bf16.
__global__ void synth_rows(const kvkit::token_id* tokens, const std::int32_t* positions,
                           std::int32_t n, std::uint32_t what, std::int32_t heads, std::int32_t dim,
                           __nv_bfloat16* out) {
  const std::int64_t total = static_cast<std::int64_t>(n) * heads * dim;
  for (std::int64_t e = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const auto t = static_cast<std::int32_t>(e / (heads * dim));
    const auto h = static_cast<std::int32_t>(e / dim % heads);
    const auto c = static_cast<std::int32_t>(e % dim);
    out[e] =
        __float2bfloat16_rn(synth(static_cast<std::uint32_t>(tokens[t]), positions[t], what, h, c));
  }
}

// A device array that grows on demand (contents are not kept).
template <class T>
struct device_vec {
  T* ptr = nullptr;
  std::size_t size = 0;
  ~device_vec() { cudaFree(ptr); }
  cudaError_t reserve(std::size_t n) {
    if (n <= size) {
      return cudaSuccess;
    }
    cudaFree(ptr);
    ptr = nullptr;
    size = 0;
    const cudaError_t e = cudaMalloc(&ptr, n * sizeof(T));
    if (e == cudaSuccess) {
      size = n;
    }
    return e;
  }
  cudaError_t upload(std::span<const T> h, cudaStream_t s) {
    if (const cudaError_t e = reserve(std::max<std::size_t>(h.size(), 1)); e != cudaSuccess) {
      return e;
    }
    return h.empty() ? cudaSuccess
                     : cudaMemcpyAsync(ptr, h.data(), h.size_bytes(), cudaMemcpyHostToDevice, s);
  }
};

class gpu_engine final : public engine {
public:
  using layout_t = kvkit::paged_layout<kvkit::bf16_codec>;

  gpu_engine(std::int32_t capacity, std::int32_t host_capacity, std::int32_t block_size,
             model_shape m, std::int32_t max_batch, bool check_pages)
      : m_(m), layout_(block_size, m.kv_heads, m.head_dim), capacity_(capacity),
        host_capacity_(host_capacity) {
    cudaDeviceProp prop{};
    check(cudaGetDeviceProperties(&prop, 0));
    sm_count_ = prop.multiProcessorCount;
    stats_.name = std::string("GPU: ") + prop.name + ", one layer of " +
                  std::to_string(m.kv_heads * m.group) + " query / " + std::to_string(m.kv_heads) +
                  " KV heads x " + std::to_string(m.head_dim) + ", bf16 pages" +
                  (check_pages ? ", page ids checked (debug mode)" : "");
    check(cudaStreamCreate(&stream_));
    check(cudaEventCreate(&start_));
    check(cudaEventCreate(&stop_));
    check(cudaEventCreate(&decode_start_));
    check(cudaEventCreate(&decode_stop_));
    check(cudaEventCreate(&prefill_start_));
    check(cudaEventCreate(&prefill_stop_));
    check(cache_.reserve(static_cast<std::size_t>(capacity) *
                         static_cast<std::size_t>(layout_.bytes_per_page())));
    check(cudaMemsetAsync(cache_.ptr, 0, cache_.size, stream_));
    if (check_pages) {
      check(page_check_.reserve(1));
      check(cudaMemsetAsync(page_check_.ptr, 0, sizeof(std::int32_t), stream_));
    }
    std::byte* layer = cache_.ptr;
    check(layers_.upload(std::span<std::byte* const>(&layer, 1), stream_));
    if (host_capacity > 0) {
      void* host = nullptr;
      check(cudaHostAlloc(&host,
                          static_cast<std::size_t>(host_capacity) *
                              static_cast<std::size_t>(layout_.bytes_per_page()),
                          cudaHostAllocDefault));
      host_ = static_cast<std::byte*>(host);
      scratch_.reserve(static_cast<std::size_t>(std::min(capacity, host_capacity)), 1);
    }
    // The decode's arrival counters, for the largest batch, zeroed once: every launch leaves
    // them at zero again, so the launches skip their memset (decode_args::zeroed_counters).
    check(counters_.reserve(static_cast<std::size_t>(std::max(max_batch, 1)) * m.kv_heads));
    check(cudaMemsetAsync(counters_.ptr, 0, counters_.size * sizeof(std::uint32_t), stream_));
    check(cudaStreamSynchronize(stream_));
  }
  ~gpu_engine() override {
    cudaStreamSynchronize(stream_);
    cudaFreeHost(host_);
    cudaStreamDestroy(stream_);
    cudaEventDestroy(start_);
    cudaEventDestroy(stop_);
    cudaEventDestroy(decode_start_);
    cudaEventDestroy(decode_stop_);
    cudaEventDestroy(prefill_start_);
    cudaEventDestroy(prefill_stop_);
  }

  void step(const step_work& w) override {
    if (!stats_.failure.empty()) {
      return;
    }
    check(cudaEventRecord(start_, stream_));
    // Swaps on the copy engines, in the plan's order on this stream: what a swap-out reads was
    // written by earlier steps' kernels, and the pages it frees may be written by this step's.
    swap(w.swap_out, cache_.ptr, capacity_, host_, host_capacity_);
    swap(w.swap_in, host_, host_capacity_, cache_.ptr, capacity_);
    if (!w.copies.empty()) {
      check(pairs_.upload(w.copies, stream_));
      kvkit::cuda::page_copies c{layers_.ptr, layers_.ptr,
                                 1,           layout_.bytes_per_page(),
                                 pairs_.ptr,  static_cast<std::int32_t>(w.copies.size())};
      c.page_check = page_check_.ptr;
      c.src_capacity = capacity_;
      c.dst_capacity = capacity_;
      check(kvkit::cuda::copy_blocks(c, stream_));
    }
    const auto n = static_cast<std::int32_t>(w.slots.size());
    if (n > 0) {
      check(slots_.upload(w.slots, stream_));
      check(tokens_.upload(w.tokens, stream_));
      check(positions_.upload(w.positions, stream_));
      const auto elems = static_cast<std::size_t>(n) * m_.kv_heads * m_.head_dim;
      check(k_.reserve(elems));
      check(v_.reserve(elems));
      synth_rows<<<264, 256, 0, stream_>>>(tokens_.ptr, positions_.ptr, n, synth_k, m_.kv_heads,
                                           m_.head_dim, k_.ptr);
      synth_rows<<<264, 256, 0, stream_>>>(tokens_.ptr, positions_.ptr, n, synth_v, m_.kv_heads,
                                           m_.head_dim, v_.ptr);
      check(cudaGetLastError());
      kvkit::cuda::kv_write<layout_t, __nv_bfloat16> kw{layout_, cache_.ptr, capacity_, slots_.ptr,
                                                        n,       k_.ptr,     v_.ptr,    nullptr};
      kw.page_check = page_check_.ptr;
      check(kvkit::cuda::write_kv(kw, stream_));
      stats_.written_tokens += n;
    }
    const auto batch = static_cast<std::int32_t>(w.query_tokens.size());
    const std::int32_t qh = m_.kv_heads * m_.group;
    bool decoded = false;
    if (batch > 0) {
      lens_.resize(static_cast<std::size_t>(batch));
      double bytes = 0.0;
      for (std::int32_t b = 0; b < batch; ++b) {
        const auto i = static_cast<std::size_t>(b);
        const std::int32_t pages = w.indptr[i + 1] - w.indptr[i];
        lens_[i] = (pages - 1) * layout_.page_size() + w.last_page_len[i];
        bytes += static_cast<double>(lens_[i]) * m_.kv_heads * m_.head_dim * 2 * 2;
      }
      const auto plan =
          kvkit::plan_decode(kvkit::decode_shape_for(layout_, batch, qh), lens_, sm_count_);
      if (!plan.ok()) {
        fail("decode plan rejected");
        return;
      }
      // The workspace grows when a plan needs more (it needs no initialization).
      check(workspace_.reserve(plan->workspace_bytes()));
      check(indptr_.upload(w.indptr, stream_));
      check(indices_.upload(w.indices, stream_));
      check(last_.upload(w.last_page_len, stream_));
      check(q_tokens_.upload(w.query_tokens, stream_));
      check(q_positions_.upload(w.query_positions, stream_));
      const auto q_elems = static_cast<std::size_t>(batch) * qh * m_.head_dim;
      check(q_.reserve(q_elems));
      check(out_.reserve(q_elems));
      synth_rows<<<264, 256, 0, stream_>>>(q_tokens_.ptr, q_positions_.ptr, batch, synth_q, qh,
                                           m_.head_dim, q_.ptr);
      check(cudaGetLastError());
      kvkit::cuda::decode_args<layout_t, __nv_bfloat16> a;
      a.layout = layout_;
      a.cache = cache_.ptr;
      a.capacity = capacity_;
      a.table =
          kvkit::csr_page_table{indptr_.ptr, indices_.ptr, last_.ptr, batch, layout_.page_size()};
      a.q = q_.ptr;
      a.out = out_.ptr;
      a.zeroed_counters = counters_.ptr;
      a.zeroed_counter_count = static_cast<std::int64_t>(counters_.size);
      a.page_table_ready = true; // uploaded above, before the kernel the decode follows
      a.page_check = page_check_.ptr;
      check(cudaEventRecord(decode_start_, stream_));
      check(kvkit::cuda::paged_decode(a, *plan, workspace_.ptr, workspace_.size, stream_));
      check(cudaEventRecord(decode_stop_, stream_));
      stats_.decode_tokens += batch;
      stats_.decode_bytes += bytes;
      decoded = true;
    }
    // Prefill attention: every prefill sequence's chunk attends over its whole paged cache.
    const auto p_batch = static_cast<std::int32_t>(w.p_histories.size());
    const std::int32_t p_rows = p_batch > 0 ? w.p_qo[static_cast<std::size_t>(p_batch)] : 0;
    bool prefilled = false;
    if (p_rows > 0) {
      std::int32_t most = 0;
      double pairs = 0.0; // (query, key seen) pairs
      for (std::size_t b = 0; b < static_cast<std::size_t>(p_batch); ++b) {
        const std::int32_t nq = w.p_qo[b + 1] - w.p_qo[b];
        const std::int32_t len =
            (w.p_indptr[b + 1] - w.p_indptr[b] - 1) * layout_.page_size() + w.p_last_page_len[b];
        most = std::max(most, nq);
        pairs += static_cast<double>(nq) * (len - nq + (nq + 1) / 2.0);
      }
      check(p_indptr_.upload(w.p_indptr, stream_));
      check(p_indices_.upload(w.p_indices, stream_));
      check(p_last_.upload(w.p_last_page_len, stream_));
      check(p_qo_.upload(w.p_qo, stream_));
      check(p_tokens_.upload(w.p_query_tokens, stream_));
      check(p_positions_.upload(w.p_query_positions, stream_));
      const auto q_elems = static_cast<std::size_t>(p_rows) * qh * m_.head_dim;
      check(p_q_.reserve(q_elems));
      check(p_out_.reserve(q_elems));
      synth_rows<<<264, 256, 0, stream_>>>(p_tokens_.ptr, p_positions_.ptr, p_rows, synth_q, qh,
                                           m_.head_dim, p_q_.ptr);
      check(cudaGetLastError());
      kvkit::cuda::prefill_args<layout_t, __nv_bfloat16> a;
      a.layout = layout_;
      a.cache = cache_.ptr;
      a.capacity = capacity_;
      a.table = kvkit::csr_page_table{p_indptr_.ptr, p_indices_.ptr, p_last_.ptr, p_batch,
                                      layout_.page_size()};
      a.qo_indptr = p_qo_.ptr;
      a.max_queries = most;
      a.num_q_heads = qh;
      a.q = p_q_.ptr;
      a.out = p_out_.ptr;
      a.page_check = page_check_.ptr;
      check(cudaEventRecord(prefill_start_, stream_));
      check(kvkit::cuda::paged_prefill(a, stream_));
      check(cudaEventRecord(prefill_stop_, stream_));
      stats_.prefill_tokens += p_rows;
      stats_.prefill_flops += 4.0 * m_.head_dim * qh * pairs;
      prefilled = true;
    }
    check(cudaEventRecord(stop_, stream_));
    check(cudaEventSynchronize(stop_));
    if (page_check_.ptr != nullptr) {
      std::int32_t flagged = 0;
      check(cudaMemcpy(&flagged, page_check_.ptr, sizeof(flagged), cudaMemcpyDeviceToHost));
      if (flagged != 0) {
        fail("a page id outside the cache (debug mode)");
        return;
      }
    }
    float ms = 0.0F;
    check(cudaEventElapsedTime(&ms, start_, stop_));
    stats_.kernel_seconds += ms * 1e-3;
    if (decoded) {
      check(cudaEventElapsedTime(&ms, decode_start_, decode_stop_));
      stats_.decode_seconds += ms * 1e-3;
      // Every 16th decode step, one sequence's output against the dense recomputation, and at
      // every step with swap-ins, a sequence holding a page swapped in.
      const std::int32_t swapped = swapped_in_sequence(w);
      if (steps_++ % 16 == 0 || swapped >= 0) {
        const std::size_t b =
            swapped >= 0 ? static_cast<std::size_t>(swapped)
                         : static_cast<std::size_t>(steps_ / 16) % static_cast<std::size_t>(batch);
        std::vector<__nv_bfloat16> o(static_cast<std::size_t>(qh * m_.head_dim));
        check(cudaMemcpy(o.data(), out_.ptr + b * o.size(), o.size() * 2, cudaMemcpyDeviceToHost));
        std::vector<float> of(o.size());
        for (std::size_t i = 0; i < o.size(); ++i) {
          of[i] = __bfloat162float(o[i]);
        }
        const double err = dense_check(m_, *w.histories[b], w.query_positions[b] + 1, of.data());
        ++stats_.checked;
        stats_.swap_checked += swapped >= 0 ? 1 : 0;
        stats_.max_rel_error = std::max(stats_.max_rel_error, err);
      }
    }
    if (prefilled) {
      check(cudaEventElapsedTime(&ms, prefill_start_, prefill_stop_));
      stats_.prefill_seconds += ms * 1e-3;
      // Every 4th prefill step, one sequence's first and last queries (the fewest and the most
      // keys seen) against the dense recomputation.
      if (prefill_steps_++ % 4 == 0) {
        const auto b =
            static_cast<std::size_t>(prefill_steps_ / 4) % static_cast<std::size_t>(p_batch);
        const auto row_elems = static_cast<std::size_t>(qh * m_.head_dim);
        for (const std::int32_t row : {w.p_qo[b], w.p_qo[b + 1] - 1}) {
          std::vector<__nv_bfloat16> o(row_elems);
          check(cudaMemcpy(o.data(), p_out_.ptr + static_cast<std::size_t>(row) * row_elems,
                           row_elems * 2, cudaMemcpyDeviceToHost));
          std::vector<float> of(o.size());
          for (std::size_t i = 0; i < o.size(); ++i) {
            of[i] = __bfloat162float(o[i]);
          }
          const double err =
              dense_check(m_, *w.p_histories[b],
                          w.p_query_positions[static_cast<std::size_t>(row)] + 1, of.data());
          ++stats_.prefill_checked;
          stats_.max_rel_error = std::max(stats_.max_rel_error, err);
        }
      }
    }
  }
  [[nodiscard]] const engine_stats& stats() const override { return stats_; }

private:
  void swap(std::span<const kvkit::block_copy> pairs, std::byte* from, std::int32_t from_capacity,
            std::byte* to, std::int32_t to_capacity) {
    if (pairs.empty()) {
      return;
    }
    const kvkit::cuda::host_page_copies c{&from,
                                          &to,
                                          1,
                                          layout_.bytes_per_page(),
                                          pairs.data(),
                                          static_cast<std::int32_t>(pairs.size()),
                                          from_capacity,
                                          to_capacity};
    if (!kvkit::cuda::validate(c).ok()) {
      fail("a swap page id outside the cache or the host tier");
      return;
    }
    check(kvkit::cuda::swap_blocks_copy_engines(c, scratch_, stream_));
    stats_.swapped_pages += static_cast<std::int64_t>(pairs.size());
  }

  void check(cudaError_t e) {
    if (e != cudaSuccess) {
      fail(cudaGetErrorString(e));
    }
  }
  void fail(const char* why) { stats_.fail(why); }

  model_shape m_;
  layout_t layout_;
  std::int32_t capacity_;
  std::int32_t host_capacity_;
  std::byte* host_ = nullptr;       // the swap tier (pinned)
  kvkit::cuda::copy_batch scratch_; // the swaps' copy lists, kept from step to step
  std::int32_t sm_count_ = 0;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t start_ = nullptr, stop_ = nullptr, decode_start_ = nullptr, decode_stop_ = nullptr;
  cudaEvent_t prefill_start_ = nullptr, prefill_stop_ = nullptr;
  device_vec<std::byte> cache_, workspace_;
  device_vec<std::byte*> layers_;
  device_vec<kvkit::block_copy> pairs_;
  device_vec<std::int64_t> slots_;
  device_vec<kvkit::token_id> tokens_, q_tokens_;
  device_vec<std::int32_t> positions_, q_positions_, indptr_, indices_, last_;
  device_vec<__nv_bfloat16> k_, v_, q_, out_;
  // The prefill's page table, query groups, query tokens and positions, queries and outputs.
  device_vec<std::int32_t> p_indptr_, p_indices_, p_last_, p_qo_, p_positions_;
  device_vec<kvkit::token_id> p_tokens_;
  device_vec<__nv_bfloat16> p_q_, p_out_;
  device_vec<std::int32_t> page_check_; // the debug mode's flag (null: off)
  device_vec<std::uint32_t> counters_;  // the decode's arrival counters, kept at zero
  std::vector<std::int32_t> lens_;
  std::uint64_t steps_ = 0;
  std::uint64_t prefill_steps_ = 0;
  engine_stats stats_;
};

} // namespace

std::unique_ptr<engine> make_gpu_engine(std::int32_t capacity, std::int32_t host_capacity,
                                        std::int32_t block_size, model_shape m,
                                        std::int32_t max_batch, bool check_pages,
                                        std::string& why) {
  int devices = 0;
  const cudaError_t e = cudaGetDeviceCount(&devices);
  if (e != cudaSuccess || devices == 0) {
    why = e != cudaSuccess ? cudaGetErrorString(e) : "no CUDA device";
    return nullptr;
  }
  return std::make_unique<gpu_engine>(capacity, host_capacity, block_size, m, max_batch,
                                      check_pages);
}

} // namespace sim
