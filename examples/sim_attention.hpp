#pragma once
// The serving simulation's model: what the engine does with the scheduler's plan each step.
//
// K, V and queries are synthetic but deterministic functions of (token id, position), like a
// model's: a prompt block served from the prefix cache must hold exactly what recomputing it
// would write. Each step the engine executes the plan's swaps (out to a host tier, then back in)
// and copy-on-write copies, writes the K/V of every computed token into its slot (the slot mapping
// from block_table), and runs decode attention for the sequences that decode (the CSR page table
// from block_table), and prefill attention for the sequences whose prompt chunk is computed this
// step (their chunk's tokens as queries over their whole paged cache: paged_prefill on the GPU).
//
// Two engines: the GPU one (sim_attention_gpu.cu: swap_blocks_copy_engines, copy_blocks, write_kv,
// paged_decode and paged_prefill over a model-shaped bf16 cache of one layer and a pinned host
// tier), and a CPU one (kvkit::reference::paged_decode and paged_attention over a reduced head
// count and width, a few decode sequences and the last queries of one prefill chunk a step). Both
// check decode and prefill outputs against a dense float64 attention recomputed from the sequences'
// tokens, so a wrong slot, a stale shared block, a missed copy or a swap that lost a page shows as
// an error.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include <kvkit/kvkit.hpp>
#include <kvkit/reference/paged_attention.hpp>

namespace sim {

// What one step asks of the engine. Tokens are listed per computed token (all sequences of the
// batch, concatenated); decode sequences are those whose attention runs this step.
struct step_work {
  std::span<const kvkit::block_copy> swap_out; // {device page, host page}, first
  std::span<const kvkit::block_copy> swap_in;  // {host page, device page}, after the swap-outs
  std::span<const kvkit::block_copy> copies;   // copy-on-write, after the swaps
  std::span<const std::int64_t> slots;         // per computed token: block * block_size + offset
  std::span<const kvkit::token_id> tokens;     // per computed token
  std::span<const std::int32_t> positions;     // per computed token
  // Decode sequences: CSR page table, and their query token and position.
  std::span<const std::int32_t> indptr, indices, last_page_len;
  std::span<const kvkit::token_id> query_tokens;
  std::span<const std::int32_t> query_positions;
  // The full token history of each decode sequence (for the dense check), by batch index.
  std::span<const std::vector<kvkit::token_id>* const> histories;
  // Prefill sequences: CSR page table (their tokens so far, this step's chunk included), their
  // queries (the chunk's tokens, its last ones last) grouped by p_qo, and each one's history.
  std::span<const std::int32_t> p_indptr, p_indices, p_last_page_len, p_qo;
  std::span<const kvkit::token_id> p_query_tokens;
  std::span<const std::int32_t> p_query_positions;
  std::span<const std::vector<kvkit::token_id>* const> p_histories;
};

struct engine_stats {
  std::string name;
  std::int64_t written_tokens = 0;
  std::int64_t decode_tokens = 0; // decode attention computed
  std::int64_t checked = 0;       // decode outputs checked against the dense recomputation
  std::int64_t swap_checked = 0; // of those, outputs of a sequence with a page swapped in that step
  std::int64_t prefill_tokens = 0;  // queries of prefill attention computed
  std::int64_t prefill_checked = 0; // prefill outputs checked against the dense recomputation
  double max_rel_error = 0.0;       // worst relative error of a checked output
  std::int64_t swapped_pages = 0;   // pages swapped out or in
  double kernel_seconds = 0.0;      // device time of swaps + copies + writes + decode (GPU engine)
  double decode_bytes = 0.0;        // K/V bytes the decode kernels read
  double decode_seconds = 0.0;      // device time of the decode kernels alone
  double prefill_seconds = 0.0;     // device time of the prefill kernels alone
  double prefill_flops = 0.0;       // their causal attention's useful work
  std::string failure;              // why the engine stopped (empty: it did not)

  // Stops the engine's checks with `why` (the first reason is kept).
  void fail(const std::string& why) {
    if (failure.empty()) {
      failure = why;
      name += " -- FAILED: " + why;
      max_rel_error = INFINITY;
    }
  }
};

class engine {
public:
  virtual ~engine() = default;
  virtual void step(const step_work& w) = 0;
  [[nodiscard]] virtual const engine_stats& stats() const = 0;
};

// Model shape of an engine.
struct model_shape {
  std::int32_t kv_heads;
  std::int32_t group; // query heads per KV head
  std::int32_t head_dim;
};

// Synthetic activations, the same on host and device: uniform in [-1, 1).
#if defined(__CUDACC__)
__host__ __device__
#endif
    inline float
    synth(std::uint32_t token, std::int32_t position, std::uint32_t what, std::int32_t head,
          std::int32_t channel) {
  std::uint32_t x = token * 0x9E3779B1U ^ static_cast<std::uint32_t>(position) * 0x85EBCA77U ^
                    (what * 65536U + static_cast<std::uint32_t>(head) * 1024U +
                     static_cast<std::uint32_t>(channel)) *
                        0xC2B2AE3DU;
  x ^= x >> 16;
  x *= 0x7FEB352DU;
  x ^= x >> 15;
  x *= 0x846CA68BU;
  x ^= x >> 16;
  return static_cast<float>(x >> 8) * (2.0F / 16777216.0F) - 1.0F;
}
inline constexpr std::uint32_t synth_k = 0;
inline constexpr std::uint32_t synth_v = 1;
inline constexpr std::uint32_t synth_q = 2;

// Relative error of `out` ([q_heads][head_dim]) against dense float64 attention of the query at
// position len-1 over the sequence's K/V as the cache stores them (rounded to bf16), in one pass
// with a running maximum.
inline double dense_check(const model_shape& m, const std::vector<kvkit::token_id>& history,
                          std::int32_t len, const float* out) {
  const std::int32_t qh = m.kv_heads * m.group;
  const auto d = static_cast<std::size_t>(m.head_dim);
  const double scale = 1.0 / std::sqrt(static_cast<double>(m.head_dim));
  const auto bf16 = [](float x) {
    return static_cast<double>(kvkit::bf16_bits_to_float(kvkit::float_to_bf16_bits(x)));
  };
  const auto tok = [&](std::int32_t p) {
    return static_cast<std::uint32_t>(history[static_cast<std::size_t>(p)]);
  };
  std::vector<double> q(static_cast<std::size_t>(qh) * d),
      k(static_cast<std::size_t>(m.kv_heads) * d), v(k.size()), acc(q.size(), 0.0),
      mx(static_cast<std::size_t>(qh), -1e300), z(static_cast<std::size_t>(qh), 0.0);
  for (std::int32_t h = 0; h < qh; ++h) {
    for (std::size_t c = 0; c < d; ++c) {
      q[static_cast<std::size_t>(h) * d + c] =
          bf16(synth(tok(len - 1), len - 1, synth_q, h, static_cast<std::int32_t>(c)));
    }
  }
  for (std::int32_t t = 0; t < len; ++t) {
    for (std::int32_t h = 0; h < m.kv_heads; ++h) {
      for (std::size_t c = 0; c < d; ++c) {
        k[static_cast<std::size_t>(h) * d + c] =
            bf16(synth(tok(t), t, synth_k, h, static_cast<std::int32_t>(c)));
        v[static_cast<std::size_t>(h) * d + c] =
            bf16(synth(tok(t), t, synth_v, h, static_cast<std::int32_t>(c)));
      }
    }
    for (std::int32_t h = 0; h < qh; ++h) {
      const double* kh = k.data() + static_cast<std::size_t>(h / m.group) * d;
      const double* vh = v.data() + static_cast<std::size_t>(h / m.group) * d;
      double dot = 0.0;
      for (std::size_t c = 0; c < d; ++c) {
        dot += q[static_cast<std::size_t>(h) * d + c] * kh[c];
      }
      const double l = dot * scale;
      const auto hs = static_cast<std::size_t>(h);
      const double m_new = std::max(mx[hs], l);
      const double corr = std::exp(mx[hs] - m_new);
      const double p = std::exp(l - m_new);
      z[hs] = z[hs] * corr + p;
      for (std::size_t c = 0; c < d; ++c) {
        acc[hs * d + c] = acc[hs * d + c] * corr + p * vh[c];
      }
      mx[hs] = m_new;
    }
  }
  double num = 0.0;
  double den = 0.0;
  for (std::size_t i = 0; i < acc.size(); ++i) {
    const double ref = acc[i] / z[i / d];
    num += (out[i] - ref) * (out[i] - ref);
    den += ref * ref;
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

// The batch index of the first decode sequence whose pages include one swapped in this step, or -1:
// the engines check its output that step, so that a swap that lost or misplaced a page fails the
// run where it happened.
inline std::int32_t swapped_in_sequence(const step_work& w) {
  if (w.swap_in.empty()) {
    return -1;
  }
  std::vector<std::int32_t> in;
  in.reserve(w.swap_in.size());
  for (const auto& c : w.swap_in) {
    in.push_back(c.dst);
  }
  std::sort(in.begin(), in.end());
  for (std::size_t b = 0; b + 1 < w.indptr.size(); ++b) {
    for (std::int32_t i = w.indptr[b]; i < w.indptr[b + 1]; ++i) {
      if (std::binary_search(in.begin(), in.end(), w.indices[static_cast<std::size_t>(i)])) {
        return static_cast<std::int32_t>(b);
      }
    }
  }
  return -1;
}

// The CPU engine: a bf16 paged cache of `capacity` pages in host memory and a swap tier of
// `host_capacity` pages, K/V written element by element, kvkit::reference::paged_decode for up to
// `per_step` decode sequences a step (in turn) and kvkit::reference::paged_attention for the last
// queries of one prefill sequence a step (in turn).
class cpu_engine final : public engine {
public:
  cpu_engine(std::int32_t capacity, std::int32_t host_capacity, std::int32_t block_size,
             model_shape m, std::int32_t per_step)
      : m_(m), layout_(block_size, m.kv_heads, m.head_dim), per_step_(per_step) {
    const auto page = static_cast<std::size_t>(layout_.bytes_per_page());
    cache_.assign(static_cast<std::size_t>(capacity) * page, std::byte{0});
    host_.assign(static_cast<std::size_t>(host_capacity) * page, std::byte{0});
    capacity_ = capacity;
    host_capacity_ = host_capacity;
    stats_.name = "CPU reference (kvkit::reference::paged_decode, paged_attention), " +
                  std::to_string(m.kv_heads) + " KV heads x " + std::to_string(m.head_dim) +
                  ", group " + std::to_string(m.group) + ", " + std::to_string(per_step) +
                  " decode sequences and one prefill chunk's last queries a step";
  }

  void step(const step_work& w) override {
    const auto bpp = static_cast<std::size_t>(layout_.bytes_per_page());
    const std::int32_t bs = layout_.page_size();
    // Page ids are checked on the host here (the GPU engine's kernels check them in their debug
    // mode): one outside the cache fails the run instead of writing past it. Negative slots are
    // padding, skipped, as write_kv skips them.
    const auto outside = [&](std::int64_t page) {
      return page < 0 || page >= capacity_;
    };
    const auto outside_host = [&](std::int64_t page) {
      return page < 0 || page >= host_capacity_;
    };
    if (std::any_of(
            w.swap_out.begin(), w.swap_out.end(),
            [&](const kvkit::block_copy& c) { return outside(c.src) || outside_host(c.dst); }) ||
        std::any_of(
            w.swap_in.begin(), w.swap_in.end(),
            [&](const kvkit::block_copy& c) { return outside_host(c.src) || outside(c.dst); }) ||
        std::any_of(w.copies.begin(), w.copies.end(),
                    [&](const kvkit::block_copy& c) { return outside(c.src) || outside(c.dst); }) ||
        std::any_of(w.slots.begin(), w.slots.end(),
                    [&](std::int64_t s) { return s >= 0 && outside(s / bs); })) {
      stats_.fail("a page id outside the cache");
    }
    if (!stats_.failure.empty()) {
      return;
    }
    const auto move = [&](const std::vector<std::byte>& from, std::int64_t f,
                          std::vector<std::byte>& to, std::int64_t t) {
      std::copy_n(from.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(f) * bpp),
                  bpp, to.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(t) * bpp));
    };
    for (const auto& c : w.swap_out) {
      move(cache_, c.src, host_, c.dst);
    }
    for (const auto& c : w.swap_in) {
      move(host_, c.src, cache_, c.dst);
    }
    stats_.swapped_pages += static_cast<std::int64_t>(w.swap_out.size() + w.swap_in.size());
    for (const auto& c : w.copies) {
      move(cache_, c.src, cache_, c.dst);
    }
    for (std::size_t i = 0; i < w.slots.size(); ++i) {
      if (w.slots[i] < 0) {
        continue;
      }
      std::byte* page = cache_.data() + static_cast<std::size_t>(w.slots[i] / bs) * bpp;
      const auto slot = static_cast<std::int32_t>(w.slots[i] % bs);
      for (std::int32_t h = 0; h < m_.kv_heads; ++h) {
        for (std::int32_t c = 0; c < m_.head_dim; ++c) {
          const auto tok = static_cast<std::uint32_t>(w.tokens[i]);
          put(page + layout_.k_data_offset(), layout_.element_index(slot, h, c),
              synth(tok, w.positions[i], synth_k, h, c));
          put(page + layout_.v_data_offset(), layout_.element_index(slot, h, c),
              synth(tok, w.positions[i], synth_v, h, c));
        }
      }
    }
    stats_.written_tokens += static_cast<std::int64_t>(w.slots.size());
    // Decode attention for a few sequences, in turn, each checked against the dense version; the
    // first of them a sequence with a page swapped in this step, where there is one.
    const auto n = static_cast<std::int32_t>(w.query_tokens.size());
    const std::int32_t qh = m_.kv_heads * m_.group;
    const std::int32_t swapped = swapped_in_sequence(w);
    for (std::int32_t k = 0; k < std::min(n, per_step_); ++k) {
      const std::int32_t b =
          k == 0 && swapped >= 0
              ? swapped
              : static_cast<std::int32_t>((next_ + static_cast<std::uint64_t>(k)) %
                                          static_cast<std::uint64_t>(n));
      const std::int32_t one_ptr[2] = {0, w.indptr[static_cast<std::size_t>(b) + 1] -
                                              w.indptr[static_cast<std::size_t>(b)]};
      const kvkit::csr_page_table t{one_ptr,
                                    w.indices.data() + w.indptr[static_cast<std::size_t>(b)],
                                    w.last_page_len.data() + b, 1, bs};
      std::vector<float> q(static_cast<std::size_t>(qh * m_.head_dim));
      std::vector<float> out(q.size());
      const std::int32_t pos = w.query_positions[static_cast<std::size_t>(b)];
      query(w.query_tokens[static_cast<std::size_t>(b)], pos, q.data());
      if (!kvkit::reference::paged_decode(layout_, cache_.data(), capacity_, t, q.data(), qh,
                                          out.data())
               .ok()) {
        stats_.fail("the reference paged_decode rejected its arguments");
        return;
      }
      ++stats_.decode_tokens;
      const double err =
          dense_check(m_, *w.histories[static_cast<std::size_t>(b)], pos + 1, out.data());
      ++stats_.checked;
      stats_.swap_checked += b == swapped ? 1 : 0;
      stats_.max_rel_error = std::max(stats_.max_rel_error, err);
    }
    next_ += static_cast<std::uint64_t>(std::min(n, per_step_));
    // Prefill attention for the last queries (up to four) of one prefill sequence a step, in turn,
    // each checked against the dense version.
    const auto np = static_cast<std::uint64_t>(w.p_histories.size());
    if (np > 0) {
      const auto b = static_cast<std::size_t>(next_prefill_++ % np);
      const std::int32_t k = std::min(w.p_qo[b + 1] - w.p_qo[b], 4);
      const std::int32_t one_ptr[2] = {0, w.p_indptr[b + 1] - w.p_indptr[b]};
      const kvkit::csr_page_table t{one_ptr, w.p_indices.data() + w.p_indptr[b],
                                    w.p_last_page_len.data() + b, 1, bs};
      const std::int32_t qo[2] = {0, k};
      const auto row_elems = static_cast<std::size_t>(qh * m_.head_dim);
      std::vector<float> q(static_cast<std::size_t>(k) * row_elems);
      std::vector<float> out(q.size());
      const auto first = static_cast<std::size_t>(w.p_qo[b + 1] - k);
      for (std::size_t i = 0; i < static_cast<std::size_t>(k); ++i) {
        query(w.p_query_tokens[first + i], w.p_query_positions[first + i],
              q.data() + i * row_elems);
      }
      if (!kvkit::reference::paged_attention(layout_, cache_.data(), capacity_, t, qo, q.data(), qh,
                                             out.data())
               .ok()) {
        stats_.fail("the reference paged_attention rejected its arguments");
        return;
      }
      stats_.prefill_tokens += k;
      for (std::size_t i = 0; i < static_cast<std::size_t>(k); ++i) {
        const double err = dense_check(m_, *w.p_histories[b], w.p_query_positions[first + i] + 1,
                                       out.data() + i * row_elems);
        ++stats_.prefill_checked;
        stats_.max_rel_error = std::max(stats_.max_rel_error, err);
      }
    }
  }
  [[nodiscard]] const engine_stats& stats() const override { return stats_; }

private:
  // The query heads of token `tok` at `pos`, rounded to bf16: [q_heads][head_dim] at `q`.
  void query(kvkit::token_id tok, std::int32_t pos, float* q) const {
    for (std::int32_t h = 0; h < m_.kv_heads * m_.group; ++h) {
      for (std::int32_t c = 0; c < m_.head_dim; ++c) {
        q[h * m_.head_dim + c] = kvkit::bf16_bits_to_float(
            kvkit::float_to_bf16_bits(synth(static_cast<std::uint32_t>(tok), pos, synth_q, h, c)));
      }
    }
  }

  static void put(std::byte* region, std::int64_t index, float x) {
    const std::uint16_t bits = kvkit::float_to_bf16_bits(x);
    std::memcpy(region + index * 2, &bits, 2);
  }

  model_shape m_;
  kvkit::paged_layout<kvkit::bf16_codec> layout_;
  std::int32_t per_step_;
  std::int32_t capacity_ = 0;
  std::int32_t host_capacity_ = 0;
  std::vector<std::byte> cache_;
  std::vector<std::byte> host_; // the swap tier
  std::uint64_t next_ = 0;
  std::uint64_t next_prefill_ = 0;
  engine_stats stats_;
};

// The GPU engine (sim_attention_gpu.cu), or null when this build has no CUDA or the machine no
// GPU; `why` says which. A swap tier of `host_capacity` pages in pinned host memory.
// `check_pages`: its kernels run in their debug mode (page_check), and a page id outside the
// cache fails the run (swap page ids are checked on the host always).
std::unique_ptr<engine> make_gpu_engine(std::int32_t capacity, std::int32_t host_capacity,
                                        std::int32_t block_size, model_shape m,
                                        std::int32_t max_batch, bool check_pages, std::string& why);

} // namespace sim
