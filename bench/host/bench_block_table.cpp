// block_table: append per token, and page-table export of 256 sequences x 512 blocks (target
// <= 30 us), each beside a memcpy of the same bytes measured in the same run.

#include <array>
#include <cstring>
#include <numeric>
#include <vector>

#include <benchmark/benchmark.h>

#include "host/bench_report.hpp"
#include "kvkit/block/block_pool.hpp"
#include "kvkit/block/block_table.hpp"

namespace {

constexpr std::int32_t block_size = 16;
constexpr std::int32_t num_seqs = 256;
constexpr std::int32_t blocks_per_seq = 512;
constexpr double export_target_us = 30.0;

// 256 sequences of 512 blocks each (8192 tokens), on pages scattered by a random fill order.
struct big_batch {
  kvkit::block_pool pool{num_seqs * blocks_per_seq + 1024};
  kvkit::block_table<kvkit::block_pool> table{pool, block_size};
  std::vector<kvkit::seq_id> batch;

  big_batch() {
    for (std::int32_t s = 0; s < num_seqs; ++s) {
      (void)table.add_sequence(static_cast<kvkit::seq_id>(s) * 7919);
      batch.push_back(static_cast<kvkit::seq_id>(s) * 7919);
    }
    // Interleave growth so each sequence's pages are spread across the pool.
    for (std::int32_t round = 0; round < blocks_per_seq; ++round) {
      for (const auto s : batch) {
        (void)table.append_tokens(s, block_size - (round == blocks_per_seq - 1 ? 3 : 0), {});
      }
    }
  }
};

// Decode: every sequence of a 256-wide batch grows by one token per step; a sequence that reaches
// 4096 tokens finishes and a new one takes its place.
void BM_table_append_per_token(benchmark::State& state) {
  kvkit::block_pool pool(num_seqs * 4096 / block_size + 256);
  kvkit::block_table<kvkit::block_pool> table(pool, block_size);
  std::vector<kvkit::seq_id> seqs(num_seqs);
  std::iota(seqs.begin(), seqs.end(), kvkit::seq_id{0});
  kvkit::seq_id next = num_seqs;
  for (std::size_t i = 0; i < seqs.size(); ++i) {
    (void)table.add_sequence(seqs[i]);
    (void)table.append_tokens(seqs[i], static_cast<std::int32_t>(i * 16), {});
  }
  std::array<kvkit::token_slot, 1> slot{};
  for (auto _ : state) {
    for (auto& s : seqs) {
      if (!table.append_tokens(s, 1, slot).ok() || *table.num_tokens(s) >= 4096) {
        (void)table.free(s);
        s = next++;
        (void)table.add_sequence(s);
      }
      benchmark::DoNotOptimize(slot);
    }
  }
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations()) * num_seqs);
}
BENCHMARK(BM_table_append_per_token);

void BM_export_csr_256x512(benchmark::State& state) {
  big_batch b;
  std::vector<std::int32_t> indptr(num_seqs + 1);
  std::vector<std::int32_t> indices(static_cast<std::size_t>(*b.table.csr_size(b.batch)));
  std::vector<std::int32_t> last(num_seqs);
  std::vector<std::int32_t> src(indices.size(), 1);
  const double memcpy_us = kvkit_bench::median_us([&] {
    std::memcpy(indices.data(), src.data(), src.size() * sizeof(std::int32_t));
    benchmark::ClobberMemory();
  });
  for (auto _ : state) {
    if (!b.table.export_csr(b.batch, indptr, indices, last).ok()) {
      state.SkipWithError("export failed");
      break;
    }
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) *
                          static_cast<std::int64_t>(indices.size() * sizeof(std::int32_t)));
  kvkit_bench::report_time_target(state, export_target_us);
  kvkit_bench::report_peer_time(state, "memcpy", memcpy_us);
}
BENCHMARK(BM_export_csr_256x512)->Unit(benchmark::kMicrosecond);

void BM_export_block_table_256x512(benchmark::State& state) {
  big_batch b;
  std::vector<std::int32_t> rows(static_cast<std::size_t>(num_seqs) * blocks_per_seq);
  std::vector<std::int32_t> lens(num_seqs);
  std::vector<std::int32_t> src(rows.size(), 1);
  const double memcpy_us = kvkit_bench::median_us([&] {
    std::memcpy(rows.data(), src.data(), src.size() * sizeof(std::int32_t));
    benchmark::ClobberMemory();
  });
  for (auto _ : state) {
    if (!b.table.export_block_table(b.batch, blocks_per_seq, rows, lens).ok()) {
      state.SkipWithError("export failed");
      break;
    }
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) *
                          static_cast<std::int64_t>(rows.size() * sizeof(std::int32_t)));
  kvkit_bench::report_time_target(state, export_target_us);
  kvkit_bench::report_peer_time(state, "memcpy", memcpy_us);
}
BENCHMARK(BM_export_block_table_256x512)->Unit(benchmark::kMicrosecond);

// The slot mapping of one decode step: the newest token of each of the 256 sequences.
void BM_export_slot_mapping_decode_256(benchmark::State& state) {
  big_batch b;
  const std::vector<std::int32_t> query_lens(num_seqs, 1);
  std::vector<std::int64_t> mapping(num_seqs);
  for (auto _ : state) {
    (void)b.table.export_slot_mapping(b.batch, query_lens, mapping);
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations()) * num_seqs);
}
BENCHMARK(BM_export_slot_mapping_decode_256)->Unit(benchmark::kMicrosecond);

} // namespace
