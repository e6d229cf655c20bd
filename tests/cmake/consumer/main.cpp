// A downstream program: allocates a paged KV cache for two sequences and exports its page table.
#include <array>
#include <cstdio>

#include <kvkit/kvkit.hpp>

int main() {
  kvkit::block_pool pool(16);
  kvkit::block_table table(pool, 4);
  if (!table.add_sequence(7) || !table.append_tokens(7, 10, {}) || !table.fork(7, 8)) {
    return 1;
  }
  const std::array<kvkit::seq_id, 2> batch{7, 8};
  std::array<std::int32_t, 3> indptr{};
  std::array<std::int32_t, 6> indices{};
  std::array<std::int32_t, 2> last{};
  if (!table.export_csr(batch, indptr, indices, last)) {
    return 2;
  }
  // Both sequences share the same 3 blocks; the last block holds 10 - 8 = 2 tokens.
  const bool ok = indptr[2] == 6 && last[0] == 2 && last[1] == 2 && pool.num_used() == 3 &&
                  pool.ref_count(indices[0]) == 2;
  std::printf("kvkit %d.%d.%d consumer: %s\n", kvkit::version.major, kvkit::version.minor,
              kvkit::version.patch, ok ? "ok" : "FAILED");
  return ok ? 0 : 3;
}
