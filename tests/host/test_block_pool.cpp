#include <array>
#include <type_traits>
#include <vector>

#include <catch2/catch.hpp>

#include "kvkit/block/block_pool.hpp"

using kvkit::block_id;
using kvkit::block_pool;
using kvkit::errc;

namespace {

// Everything observable about a pool, to prove a failed call changed nothing.
struct snapshot {
  std::vector<std::int32_t> refs;
  std::vector<bool> cached;
  std::vector<std::int32_t> levels;
  std::vector<block_id> evictable;
  std::int32_t num_free;
  std::int32_t num_evictable;
  std::int64_t num_evictions;
  std::int64_t num_revivals;
  friend bool operator==(const snapshot&, const snapshot&) = default;
};

snapshot take(const block_pool& p) {
  snapshot s{{}, {}, {}, {}, p.num_free(), p.num_evictable(), p.num_evictions(), p.num_revivals()};
  for (block_id i = 0; i < p.capacity(); ++i) {
    s.refs.push_back(p.ref_count(i));
    s.cached.push_back(p.is_cached(i));
    s.levels.push_back(p.eviction_level(i));
  }
  for (block_id i = p.evictable_front(); i != kvkit::invalid_block_id; i = p.evictable_next(i)) {
    s.evictable.push_back(i);
  }
  return s;
}

} // namespace

TEST_CASE("a fresh pool is all free", "[block_pool]") {
  const block_pool pool(8);
  CHECK(pool.capacity() == 8);
  CHECK(pool.num_free() == 8);
  CHECK(pool.num_used() == 0);
  CHECK(pool.num_evictable() == 0);
  for (block_id i = 0; i < 8; ++i) {
    CHECK(pool.ref_count(i) == 0);
  }
  CHECK(pool.ref_count(8) == -1);
  CHECK(pool.ref_count(-1) == -1);
  CHECK(pool.evictable_front() == kvkit::invalid_block_id);
  CHECK(pool.check_consistency());
}

TEST_CASE("allocate hands out distinct blocks with one reference", "[block_pool]") {
  block_pool pool(4);
  std::array<block_id, 3> ids{};
  REQUIRE(pool.allocate(ids).ok());
  CHECK(ids == std::array<block_id, 3>{0, 1, 2});
  for (const block_id id : ids) {
    CHECK(pool.ref_count(id) == 1);
  }
  CHECK(pool.num_free() == 1);
  CHECK(pool.num_used() == 3);
  const auto last = pool.allocate();
  REQUIRE(last.ok());
  CHECK(*last == 3);
  CHECK(pool.num_free() == 0);
  CHECK(pool.check_consistency());
}

TEST_CASE("allocate is all or nothing", "[block_pool]") {
  block_pool pool(4);
  std::array<block_id, 3> three{};
  REQUIRE(pool.allocate(three).ok());
  const snapshot before = take(pool);
  std::array<block_id, 2> two{-7, -7};
  CHECK(pool.allocate(two).error() == errc::out_of_blocks);
  CHECK(two == std::array<block_id, 2>{-7, -7});
  CHECK(take(pool) == before);
  CHECK(pool.allocate(std::span<block_id>{}).ok());
  CHECK(take(pool) == before);
  REQUIRE(pool.allocate().ok());
  CHECK(pool.allocate().error() == errc::out_of_blocks);
}

TEST_CASE("retain and release count references", "[block_pool]") {
  block_pool pool(2);
  const block_id id = *pool.allocate();
  REQUIRE(pool.retain(id).ok());
  REQUIRE(pool.retain(id).ok());
  CHECK(pool.ref_count(id) == 3);
  REQUIRE(pool.release(id).ok());
  REQUIRE(pool.release(id).ok());
  CHECK(pool.ref_count(id) == 1);
  CHECK(pool.num_free() == 1);
  REQUIRE(pool.release(id).ok());
  CHECK(pool.ref_count(id) == 0);
  CHECK(pool.num_free() == 2);
  CHECK(pool.check_consistency());
  // The block released last is handed out first (LIFO keeps recently used pages warm).
  CHECK(*pool.allocate() == id);
}

TEST_CASE("bad ids and double releases are errors that change nothing", "[block_pool]") {
  block_pool pool(3);
  const block_id used = *pool.allocate();
  const snapshot before = take(pool);
  CHECK(pool.retain(3).error() == errc::invalid_block);
  CHECK(pool.retain(-1).error() == errc::invalid_block);
  CHECK(pool.release(3).error() == errc::invalid_block);
  CHECK(pool.release(-5).error() == errc::invalid_block);
  CHECK(pool.retain(used + 1).error() == errc::invalid_block); // free block
  CHECK(pool.release(used + 1).error() == errc::double_release);
  CHECK(pool.set_cached(used + 1, true).error() == errc::invalid_block);
  CHECK(pool.set_cached(used + 1, false).error() == errc::invalid_block);
  CHECK(pool.set_cached(99, true).error() == errc::invalid_block);
  CHECK(take(pool) == before);
  REQUIRE(pool.release(used).ok());
  CHECK(pool.release(used).error() == errc::double_release);
  CHECK(pool.check_consistency());
}

TEST_CASE("refusals on cached and evictable blocks change nothing and tell no one",
          "[block_pool]") {
  static int heard = 0;
  heard = 0;
  block_pool pool(4, 2);
  pool.set_eviction_callback([](void*, block_id) noexcept { ++heard; }, nullptr);
  std::array<block_id, 3> ids{};
  REQUIRE(pool.allocate(ids).ok());
  const block_id evictable_high = ids[0];
  const block_id evictable_low = ids[1];
  const block_id in_use = ids[2];
  REQUIRE(pool.set_cached(evictable_high, true, 1).ok());
  REQUIRE(pool.set_cached(evictable_low, true, 0).ok());
  REQUIRE(pool.set_cached(in_use, true, 1).ok());
  REQUIRE(pool.release(evictable_high).ok());
  REQUIRE(pool.release(evictable_low).ok());
  const snapshot before = take(pool);
  CHECK(pool.set_cached(evictable_high, true).error() == errc::invalid_block); // not in use
  CHECK(pool.set_cached(evictable_low, true, 1).error() == errc::invalid_block);
  CHECK(pool.release(evictable_high).error() == errc::double_release);
  CHECK(pool.set_cached(in_use, true, 2).error() == errc::bad_argument); // levels 0 and 1
  CHECK(pool.set_cached(in_use, false, -1).error() == errc::bad_argument);
  CHECK(pool.set_cached(evictable_low, false, 2).error() == errc::bad_argument);
  CHECK(take(pool) == before);
  CHECK(heard == 0);
  CHECK(pool.check_consistency());
  // The order stays: the low level's block first, then the high level's.
  CHECK(pool.evictable_front() == evictable_low);
  CHECK(pool.evictable_next(evictable_low) == evictable_high);
}

TEST_CASE("cached blocks stay evictable and come back on retain", "[block_pool]") {
  block_pool pool(4);
  std::array<block_id, 4> ids{};
  REQUIRE(pool.allocate(ids).ok());
  REQUIRE(pool.set_cached(ids[1], true).ok());
  REQUIRE(pool.set_cached(ids[2], true).ok());
  CHECK(pool.is_cached(ids[1]));
  CHECK_FALSE(pool.is_cached(ids[0]));

  REQUIRE(pool.release(ids[2]).ok()); // released first: reclaimed first
  REQUIRE(pool.release(ids[1]).ok());
  REQUIRE(pool.release(ids[0]).ok()); // not cached: free
  CHECK(pool.num_free() == 3);
  CHECK(pool.num_evictable() == 2);
  CHECK(pool.ref_count(ids[1]) == 0);
  CHECK(pool.is_cached(ids[1]));
  CHECK(pool.evictable_front() == ids[2]);
  CHECK(pool.evictable_next(ids[2]) == ids[1]);
  CHECK(pool.evictable_next(ids[1]) == kvkit::invalid_block_id);
  // Blocks that are not evictable (in use, free) and ids outside the pool have no next.
  CHECK(pool.evictable_next(ids[3]) == kvkit::invalid_block_id);
  CHECK(pool.evictable_next(ids[0]) == kvkit::invalid_block_id);
  CHECK(pool.evictable_next(-1) == kvkit::invalid_block_id);
  CHECK(pool.evictable_next(4) == kvkit::invalid_block_id);
  CHECK(pool.check_consistency());

  // A prefix hit brings an evictable block back into use with its mark intact.
  REQUIRE(pool.retain(ids[1]).ok());
  CHECK(pool.ref_count(ids[1]) == 1);
  CHECK(pool.is_cached(ids[1]));
  CHECK(pool.num_evictable() == 1);
  CHECK(pool.num_revivals() == 1);
  CHECK(pool.check_consistency());
}

TEST_CASE("allocate takes free blocks before evicting, oldest evictable first", "[block_pool]") {
  block_pool pool(3);
  std::vector<block_id> evicted;
  pool.set_eviction_callback(
      [](void* ctx, block_id id) noexcept {
        static_cast<std::vector<block_id>*>(ctx)->push_back(id);
      },
      &evicted);
  std::array<block_id, 3> ids{};
  REQUIRE(pool.allocate(ids).ok());
  REQUIRE(pool.set_cached(ids[0], true).ok());
  REQUIRE(pool.set_cached(ids[2], true).ok());
  REQUIRE(pool.release(ids[2]).ok());
  REQUIRE(pool.release(ids[0]).ok());
  REQUIRE(pool.release(ids[1]).ok());

  CHECK(*pool.allocate() == ids[1]); // the free block goes first
  CHECK(evicted.empty());
  std::array<block_id, 2> two{};
  REQUIRE(pool.allocate(two).ok());
  CHECK(two == std::array<block_id, 2>{ids[2], ids[0]});
  CHECK(evicted == std::vector<block_id>{ids[2], ids[0]});
  CHECK(pool.num_evictions() == 2);
  CHECK_FALSE(pool.is_cached(ids[0])); // a reclaimed block starts clean
  CHECK(pool.ref_count(ids[0]) == 1);
  CHECK(pool.check_consistency());
}

TEST_CASE("clearing the cached mark of an evictable block frees it", "[block_pool]") {
  block_pool pool(2);
  const block_id id = *pool.allocate();
  REQUIRE(pool.set_cached(id, true).ok());
  REQUIRE(pool.release(id).ok());
  CHECK(pool.num_evictable() == 1);
  REQUIRE(pool.set_cached(id, false).ok());
  CHECK(pool.num_evictable() == 0);
  CHECK(pool.num_free() == 2);
  CHECK_FALSE(pool.is_cached(id));
  CHECK(pool.retain(id).error() == errc::invalid_block); // now really free
  CHECK(pool.check_consistency());

  // On a block in use the mark just flips.
  const block_id other = *pool.allocate();
  REQUIRE(pool.set_cached(other, true).ok());
  REQUIRE(pool.set_cached(other, false).ok());
  REQUIRE(pool.release(other).ok());
  CHECK(pool.num_evictable() == 0);
  CHECK(pool.check_consistency());
}

TEST_CASE("a zero or negative capacity pool hands out nothing", "[block_pool]") {
  block_pool empty(0);
  block_pool negative(-3);
  CHECK(negative.capacity() == 0);
  CHECK(empty.allocate().error() == errc::out_of_blocks);
  std::array<block_id, 1> one{};
  CHECK(negative.allocate(one).error() == errc::out_of_blocks);
  CHECK(empty.retain(0).error() == errc::invalid_block);
  CHECK(empty.check_consistency());
}

TEST_CASE("a pool stays where it was made", "[block_pool]") {
  // Tables, caches and schedulers hold its address, and a cache's callback its own.
  STATIC_REQUIRE_FALSE(std::is_copy_constructible_v<block_pool>);
  STATIC_REQUIRE_FALSE(std::is_copy_assignable_v<block_pool>);
  STATIC_REQUIRE_FALSE(std::is_move_constructible_v<block_pool>);
  STATIC_REQUIRE_FALSE(std::is_move_assignable_v<block_pool>);
}

TEST_CASE("eviction levels: lower levels are reclaimed first, LRU within a level", "[block_pool]") {
  block_pool pool(6, 3);
  CHECK(pool.num_eviction_levels() == 3);
  std::array<block_id, 6> ids{};
  REQUIRE(pool.allocate(ids).ok());
  const std::array<std::int32_t, 5> levels{2, 0, 1, 0, 2};
  for (std::size_t i = 0; i < levels.size(); ++i) {
    REQUIRE(pool.set_cached(ids[i], true, levels[i]).ok());
    CHECK(pool.eviction_level(ids[i]) == levels[i]);
  }
  CHECK(pool.set_cached(ids[5], true, 3).error() == errc::bad_argument);
  CHECK(pool.set_cached(ids[5], true, -1).error() == errc::bad_argument);
  CHECK_FALSE(pool.is_cached(ids[5]));
  for (std::size_t i = 0; i < 5; ++i) {
    REQUIRE(pool.release(ids[i]).ok());
  }
  CHECK(pool.check_consistency());
  // Order: level 0 (ids[1], ids[3]), level 1 (ids[2]), level 2 (ids[0], ids[4]).
  std::vector<block_id> order;
  for (block_id b = pool.evictable_front(); b != kvkit::invalid_block_id;
       b = pool.evictable_next(b)) {
    order.push_back(b);
  }
  CHECK(order == std::vector<block_id>{ids[1], ids[3], ids[2], ids[0], ids[4]});
  REQUIRE(pool.release(ids[5]).ok()); // the one free block goes first
  std::vector<block_id> reclaimed(6);
  REQUIRE(pool.allocate(reclaimed).ok());
  CHECK(reclaimed == std::vector<block_id>{ids[5], ids[1], ids[3], ids[2], ids[0], ids[4]});
  CHECK(pool.eviction_level(ids[0]) == 0);
  CHECK(pool.check_consistency());
  CHECK(block_pool(4, 99).num_eviction_levels() == block_pool::max_eviction_levels);
  CHECK(block_pool(4, 0).num_eviction_levels() == 1);
}
