// block_pool on its own: allocate, share, release, and keep cached blocks for reuse.
#include <array>
#include <cstdio>

#include <kvkit/block/block_pool.hpp>

int main() {
  kvkit::block_pool pool(8);

  std::array<kvkit::block_id, 3> pages{};
  if (const kvkit::status st = pool.allocate(pages); !st) {
    std::printf("allocate failed: %s\n", kvkit::to_string(st.error()).data());
    return 1;
  }
  std::printf("allocated pages %d %d %d, %d free\n", pages[0], pages[1], pages[2], pool.num_free());

  // A second reader shares page 0 (a forked sequence): one more reference, no copy.
  (void)pool.retain(pages[0]);
  std::printf("page %d has %d references\n", pages[0], pool.ref_count(pages[0]));

  // Errors come back as values and change nothing.
  std::array<kvkit::block_id, 9> too_many{};
  std::printf("allocate 9 of %d free -> %s\n", pool.num_free(),
              kvkit::to_string(pool.allocate(too_many).error()).data());
  std::printf("release of page 7 (free) -> %s\n", kvkit::to_string(pool.release(7).error()).data());

  // A page whose contents a prefix cache published stays evictable after its last release.
  (void)pool.set_cached(pages[1], true);
  for (const kvkit::block_id p : pages) {
    (void)pool.release(p);
  }
  (void)pool.release(pages[0]);
  std::printf("after release: %d free, of which %d evictable (page %d keeps its contents)\n",
              pool.num_free(), pool.num_evictable(), pool.evictable_front());

  // A prefix hit takes it back; only when free pages run out is it reclaimed for new data.
  (void)pool.retain(pages[1]);
  std::printf("prefix hit on page %d: %d reference, %d evictable\n", pages[1],
              pool.ref_count(pages[1]), pool.num_evictable());
  (void)pool.release(pages[1]);
  return pool.num_free() == pool.capacity() && pool.check_consistency() ? 0 : 1;
}
