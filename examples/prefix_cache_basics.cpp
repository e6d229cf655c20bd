// prefix_cache on its own: two requests with the same system prompt share its blocks, the second
// skips their prefill, released blocks stay cached until the pool needs them (least recently
// released first), and the cache reports what it stored and dropped.
#include <cstdio>
#include <vector>

#include <kvkit/block/block_pool.hpp>
#include <kvkit/block/block_table.hpp>
#include <kvkit/prefix/prefix_cache.hpp>

namespace {

constexpr std::int32_t block_size = 4;

// A system prompt of 8 tokens (two full blocks) and a question of `n` tokens starting at `first`.
std::vector<kvkit::token_id> prompt_with(kvkit::token_id first, std::int32_t n) {
  std::vector<kvkit::token_id> p{101, 102, 103, 104, 105, 106, 107, 108};
  for (std::int32_t i = 0; i < n; ++i) {
    p.push_back(first + i);
  }
  return p;
}

// Admits a request, "computes" its uncached tokens (here: reports how many), publishes its full
// blocks, and ends it: the table frees it and its published blocks stay cached.
bool serve(kvkit::prefix_cache<>& cache, kvkit::block_table<>& table, kvkit::seq_id id,
           const std::vector<kvkit::token_id>& prompt) {
  const auto a = cache.admit(table, id, prompt);
  if (!a) {
    std::printf("request %d: admit -> %s\n", static_cast<int>(id),
                kvkit::to_string(a.error()).data());
    return false;
  }
  std::printf("request %d: %zu prompt tokens, %d from the cache (%d blocks), %zu to compute\n",
              static_cast<int>(id), prompt.size(), a->hit.num_tokens, a->hit.num_blocks,
              prompt.size() - static_cast<std::size_t>(a->hit.num_tokens));
  // ... the engine writes the K/V of the tokens it computes, then:
  return cache.publish(id, *table.blocks(id), prompt).ok() &&
         cache.finish(id, *table.blocks(id), prompt).ok() && table.free(id).ok();
}

} // namespace

int main() {
  kvkit::block_pool pool(6);
  kvkit::block_table table(pool, block_size);
  kvkit::prefix_cache<> cache(pool, block_size, {.record_events = true});

  // The first request computes everything; the second finds the system prompt's two blocks.
  bool ok = serve(cache, table, 1, prompt_with(200, 3));
  ok = serve(cache, table, 2, prompt_with(300, 5)) && ok;
  // Both ended: their published blocks are cached but held by no one, so still allocatable.
  std::printf(
      "cached entries %d, of them evictable %d; allocatable blocks %d of %d; hit rate %.2f\n",
      cache.num_entries(), pool.num_evictable(), pool.num_free(), pool.capacity(),
      cache.stats().hit_rate());

  // A long request needs more blocks than are free: the pool reclaims cached blocks, least
  // recently released first, and the cache drops their entries as it happens.
  (void)table.add_sequence(3);
  const auto grown = table.append_tokens(3, 5 * block_size, {});
  std::printf("request 3 takes 5 blocks -> %s; cached entries now %d\n",
              grown ? "ok" : kvkit::to_string(grown.error()).data(), cache.num_entries());
  (void)table.free(3);

  // What a router mirroring the cache would have been told.
  std::int32_t stored = 0;
  std::int32_t removed = 0;
  for (const auto& e : cache.take_events()) {
    stored += e.what == kvkit::cache_event::kind::stored ? 1 : 0;
    removed += e.what == kvkit::cache_event::kind::removed ? 1 : 0;
  }
  std::printf("events: %d stored, %d removed\n", stored, removed);

  // Bad input is an error value, and nothing changes.
  const std::vector<kvkit::token_id> empty;
  std::printf("admit an empty prompt -> %s\n",
              kvkit::to_string(cache.admit(table, 4, empty).error()).data());

  // The second request hit 8 of its 13 tokens; three full blocks were published (the system
  // prompt's two and request 2's third), and request 3 took two of them back from the cache.
  ok = ok && cache.stats().hit_tokens == 8 && stored == 3 && removed == 2 &&
       cache.num_entries() == 1 && pool.num_used() == 0;
  return ok ? 0 : 1;
}
