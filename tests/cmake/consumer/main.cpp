// A downstream program: a paged KV cache for two sequences with a prefix cache, and its page table.
#include <array>
#include <cstdio>
#include <vector>

#include <kvkit/kvkit.hpp>

int main() {
  kvkit::block_pool pool(16);
  kvkit::block_table table(pool, 4);
  kvkit::prefix_cache<> cache(pool, 4);
  const std::vector<kvkit::token_id> prompt{1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
  if (!cache.admit(table, 7, prompt) || !cache.publish(7, *table.blocks(7), prompt)) {
    return 1;
  }
  const auto hit = cache.admit(table, 8, prompt); // shares the two full blocks of sequence 7
  if (!hit || hit->hit.num_tokens != 8) {
    return 2;
  }
  const std::array<kvkit::seq_id, 2> batch{7, 8};
  std::array<std::int32_t, 3> indptr{};
  std::array<std::int32_t, 6> indices{};
  std::array<std::int32_t, 2> last{};
  if (!table.export_csr(batch, indptr, indices, last)) {
    return 3;
  }
  const bool ok = indptr[2] == 6 && last[0] == 2 && last[1] == 2 && pool.num_used() == 4 &&
                  indices[0] == indices[3] && pool.ref_count(indices[0]) == 2;
  std::printf("kvkit %d.%d.%d consumer: %s\n", kvkit::version.major, kvkit::version.minor,
              kvkit::version.patch, ok ? "ok" : "FAILED");
  return ok ? 0 : 4;
}
