// block_table on its own: grow sequences token by token, fork one, roll one back, and export the
// batch's page table in both kernel formats.
#include <array>
#include <cstdio>
#include <vector>

#include <kvkit/block/block_pool.hpp>
#include <kvkit/block/block_table.hpp>

int main() {
  kvkit::block_pool pool(32);
  kvkit::block_table table(pool, /*block_size=*/4);

  // A prompt of 6 tokens: the slots say where each token's K/V goes (write_kv's slot mapping).
  (void)table.add_sequence(1);
  std::array<kvkit::token_slot, 6> slots{};
  (void)table.append_tokens(1, 6, slots);
  std::printf("sequence 1 prompt slots:");
  for (const auto& s : slots) {
    std::printf(" (%d,%d)", s.block, s.offset);
  }
  std::printf("\n");

  // Parallel sampling: sequence 2 shares all of sequence 1's blocks. Its first decode token lands
  // in the shared, partly filled last block, so that block is copied first.
  (void)table.fork(1, 2);
  const auto info = table.append_tokens(2, 1, {});
  if (info->copied) {
    std::printf("copy-on-write: copy block %d -> %d before this step's K/V write\n", info->copy.src,
                info->copy.dst);
  }
  table.release_copy_sources(); // once the step's copies have run

  // Speculative decoding: reserve 4 draft tokens, accept 1, roll back the other 3.
  (void)table.append_tokens(1, 4, {});
  (void)table.truncate(1, 7);
  std::printf("sequence 1 has %d tokens in %zu blocks\n", *table.num_tokens(1),
              table.blocks(1)->size());

  // Page tables for a decode batch of both sequences.
  const std::array<kvkit::seq_id, 2> batch{1, 2};
  std::array<std::int32_t, 3> indptr{};
  std::vector<std::int32_t> indices(static_cast<std::size_t>(*table.csr_size(batch)));
  std::array<std::int32_t, 2> last_page_len{};
  (void)table.export_csr(batch, indptr, indices, last_page_len);
  std::printf("CSR: indptr {%d %d %d}, indices {", indptr[0], indptr[1], indptr[2]);
  for (const auto i : indices) {
    std::printf(" %d", i);
  }
  std::printf(" }, last_page_len {%d %d}\n", last_page_len[0], last_page_len[1]);

  std::array<std::int32_t, 2 * 4> rows{};
  std::array<std::int32_t, 2> seq_lens{};
  (void)table.export_block_table(batch, 4, rows, seq_lens, /*pad=*/-1);
  std::array<std::int64_t, 2> slot_mapping{};
  const std::array<std::int32_t, 2> query_lens{1, 1};
  (void)table.export_slot_mapping(batch, query_lens, slot_mapping);
  std::printf("padded: {%d %d %d %d | %d %d %d %d}, seq_lens {%d %d}, slot_mapping {%lld %lld}\n",
              rows[0], rows[1], rows[2], rows[3], rows[4], rows[5], rows[6], rows[7], seq_lens[0],
              seq_lens[1], static_cast<long long>(slot_mapping[0]),
              static_cast<long long>(slot_mapping[1]));

  // Bad input is an error value; nothing changes.
  std::printf("truncate past the end -> %s\n",
              kvkit::to_string(table.truncate(2, 100).error()).data());
  std::printf("fork onto an existing id -> %s\n",
              kvkit::to_string(table.fork(1, 2).error()).data());

  (void)table.free(1);
  (void)table.free(2);
  return pool.num_free() == pool.capacity() ? 0 : 1;
}
