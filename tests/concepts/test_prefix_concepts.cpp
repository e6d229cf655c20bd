// block_hasher, eviction_policy and prefix_index: kvkit's models and the archetypes model them;
// types that break one rule do not; the cache is generic over its hasher and policy.

#include <array>
#include <cstddef>
#include <vector>

#include <catch2/catch.hpp>

#include "kvkit/block/block_table.hpp"
#include "kvkit/concepts/block_hasher.hpp"
#include "kvkit/concepts/eviction_policy.hpp"
#include "kvkit/concepts/prefix_index.hpp"
#include "kvkit/prefix/eviction.hpp"
#include "kvkit/prefix/prefix_cache.hpp"
#include "kvkit/prefix/xxh3_hasher.hpp"
#include "kvkit/testing/block_hasher_archetype.hpp"
#include "kvkit/testing/eviction_policy_archetype.hpp"
#include "kvkit/testing/prefix_index_archetype.hpp"

using kvkit::block_key;
using kvkit::token_id;
using kvkit::testing::block_hasher_archetype;
using kvkit::testing::eviction_policy_archetype;
using kvkit::testing::prefix_index_archetype;

namespace {

struct hasher_without_extra {
  block_key operator()(const block_key& p, std::span<const token_id>) const { return p; }
};
struct hasher_returning_u64 {
  std::uint64_t operator()(const block_key&, std::span<const token_id>,
                           std::span<const std::byte>) const {
    return 0;
  }
};
struct hasher_non_const {
  block_key operator()(const block_key& p, std::span<const token_id>, std::span<const std::byte>) {
    return p;
  }
};
struct hasher_not_copyable {
  hasher_not_copyable() = default;
  hasher_not_copyable(const hasher_not_copyable&) = delete;
  block_key operator()(const block_key& p, std::span<const token_id>,
                       std::span<const std::byte>) const {
    return p;
  }
};

struct policy_without_levels {
  std::int32_t level(const kvkit::eviction_hint&) const { return 0; }
};
struct policy_level_from_int {
  std::int32_t num_levels() const { return 1; }
  std::int32_t level(int) const = delete;
};
struct policy_level_returns_size_t {
  std::int32_t num_levels() const { return 1; }
  std::size_t level(const kvkit::eviction_hint&) const { return 0; }
};

// Blocks starting with token 1 or 7 collide; other keys are distinct.
struct first_block_collider {
  block_key operator()(const block_key& parent, std::span<const token_id> tokens,
                       std::span<const std::byte> extra) const {
    const auto first = tokens.empty() ? 0U : static_cast<std::uint64_t>(tokens[0]);
    const std::uint64_t t = first == 7 ? 1 : first;
    return block_key{parent.lo * 31 + t * 1000 + tokens.size(), parent.hi + extra.size()};
  }
};

using archetype = prefix_index_archetype;
struct index_without_probe : archetype {
  using archetype::archetype;
  kvkit::prefix_match probe(std::span<const token_id>, std::span<const std::byte>) const = delete;
};
struct index_match_returns_count : archetype {
  using archetype::archetype;
  std::int32_t match(kvkit::seq_id, std::span<const token_id>, std::span<const std::byte>,
                     std::span<kvkit::block_id>, const kvkit::retention&) {
    return 0;
  }
};
struct index_without_forget : archetype {
  using archetype::archetype;
  kvkit::status forget(kvkit::seq_id) = delete;
};
struct index_without_truncate : archetype {
  using archetype::archetype;
  kvkit::status truncate(kvkit::seq_id, std::int32_t) = delete;
};

} // namespace

// The cache asks nothing of its hasher and policy beyond their concepts.
template class kvkit::prefix_cache<block_hasher_archetype, eviction_policy_archetype>;

TEST_CASE("block_hasher models and one-defect types", "[concepts][prefix_cache]") {
  STATIC_REQUIRE(kvkit::block_hasher<kvkit::xxh3_hasher>);
  STATIC_REQUIRE(kvkit::block_hasher<block_hasher_archetype>);
  STATIC_REQUIRE_FALSE(kvkit::block_hasher<hasher_without_extra>);
  STATIC_REQUIRE_FALSE(kvkit::block_hasher<hasher_returning_u64>);
  STATIC_REQUIRE_FALSE(kvkit::block_hasher<hasher_non_const>);
  STATIC_REQUIRE_FALSE(kvkit::block_hasher<hasher_not_copyable>);
}

TEST_CASE("eviction_policy models and one-defect types", "[concepts][prefix_cache]") {
  STATIC_REQUIRE(kvkit::eviction_policy<kvkit::lru>);
  STATIC_REQUIRE(kvkit::eviction_policy<kvkit::retention_priority>);
  STATIC_REQUIRE(kvkit::eviction_policy<eviction_policy_archetype>);
  STATIC_REQUIRE_FALSE(kvkit::eviction_policy<policy_without_levels>);
  STATIC_REQUIRE_FALSE(kvkit::eviction_policy<policy_level_from_int>);
  STATIC_REQUIRE_FALSE(kvkit::eviction_policy<policy_level_returns_size_t>);
}

TEST_CASE("prefix_index models and one-defect types", "[concepts][prefix_cache]") {
  STATIC_REQUIRE(kvkit::prefix_index<kvkit::prefix_cache<>>);
  STATIC_REQUIRE(
      kvkit::prefix_index<kvkit::prefix_cache<kvkit::xxh3_hasher, kvkit::retention_priority>>);
  STATIC_REQUIRE(kvkit::prefix_index<archetype>);
  STATIC_REQUIRE_FALSE(kvkit::prefix_index<index_without_probe>);
  STATIC_REQUIRE_FALSE(kvkit::prefix_index<index_match_returns_count>);
  STATIC_REQUIRE_FALSE(kvkit::prefix_index<index_without_forget>);
  STATIC_REQUIRE_FALSE(kvkit::prefix_index<index_without_truncate>);
  STATIC_REQUIRE_FALSE(kvkit::prefix_index<kvkit::block_pool>);
}

TEST_CASE("a cache over a colliding hasher still serves only exact prefixes",
          "[concepts][prefix_cache]") {
  // The archetype's keys depend only on token counts, so every block of equal position collides:
  // the stored tokens and parent keys checked on each hit must keep prefixes apart.
  kvkit::block_pool pool(16);
  kvkit::block_table<kvkit::block_pool> table(pool, 4);
  kvkit::prefix_cache<block_hasher_archetype, eviction_policy_archetype> cache(
      pool, 4, {}, block_hasher_archetype(0), eviction_policy_archetype(0));
  const std::vector<token_id> a{1, 2, 3, 4, 5, 6, 7, 8, 9};
  const std::vector<token_id> b{1, 2, 3, 4, 9, 9, 9, 9, 9};
  REQUIRE(cache.admit(table, 1, a).ok());
  REQUIRE(cache.publish(1, *table.blocks(1), a).ok());
  CHECK(cache.probe(a).num_tokens == 8);
  CHECK(cache.probe(b).num_tokens == 4); // the second block collides but differs
  // Keys do not find blocks, so b's second block is published beside a's despite the equal key,
  // and each prompt finds its own.
  REQUIRE(cache.admit(table, 2, b).ok());
  CHECK(*cache.publish(2, *table.blocks(2), b) == 1);
  CHECK(cache.probe(b).num_tokens == 8);
  CHECK(cache.probe(a).num_tokens == 8);
  std::vector<kvkit::block_id> out(2);
  REQUIRE(cache.match(3, b, {}, out).ok());
  CHECK(out[1] == (*table.blocks(2))[1]);
  CHECK(out[1] != (*table.blocks(1))[1]);
}

TEST_CASE("a chain that meets a colliding key is found only after its own blocks",
          "[concepts][prefix_cache]") {
  // P publishes [p0 p1]. Q's first block has P's first key but other tokens; the second blocks'
  // keys differ. Were Q's second block found under that key, the prompt [p0 q1 ...] would be
  // served q1's K/V, computed after q0. Blocks are found under their parent block, so Q
  // publishes both of its blocks and the mixed prompt still stops after p0.
  kvkit::block_pool pool(16);
  kvkit::block_table<kvkit::block_pool> table(pool, 4);
  kvkit::prefix_cache<first_block_collider> cache(pool, 4);
  const std::vector<token_id> p{1, 2, 3, 4, 5, 6, 7, 8, 9};
  const std::vector<token_id> q{7, 7, 7, 7, 8, 8, 8, 8, 9};
  REQUIRE(cache.admit(table, 1, p).ok());
  REQUIRE(cache.publish(1, *table.blocks(1), p).ok());
  REQUIRE(cache.admit(table, 2, q).ok());
  CHECK(*cache.publish(2, *table.blocks(2), q) == 2);
  const std::vector<token_id> mixed{1, 2, 3, 4, 8, 8, 8, 8, 9};
  CHECK(cache.probe(mixed).num_tokens == 4);
  CHECK(cache.probe(p).num_tokens == 8);
  CHECK(cache.probe(q).num_tokens == 8);
}

TEST_CASE("roots that share a root tag do not share blocks", "[concepts][prefix_cache]") {
  // The collider's root key is {0, size of the extra bytes}: extras of one and two bytes give
  // different roots with the same lower bits. Q computes the first block P cached under the
  // other root; it must not continue P's chain, or a prompt under P's root would be served Q's
  // second block, computed under Q's extra bytes.
  kvkit::block_pool pool(16);
  kvkit::block_table<kvkit::block_pool> table(pool, 4);
  kvkit::prefix_cache<first_block_collider> cache(pool, 4);
  const std::array<std::byte, 1> one{std::byte{1}};
  const std::array<std::byte, 2> two{std::byte{1}, std::byte{2}};
  const std::vector<token_id> p{1, 2, 3, 4, 5, 6, 7, 8, 9};
  const std::vector<token_id> q{1, 2, 3, 4, 8, 8, 8, 8, 9};
  REQUIRE(cache.admit(table, 1, p, one).ok());
  REQUIRE(cache.publish(1, *table.blocks(1), p).ok());
  const auto hit = cache.admit(table, 2, q, two);
  REQUIRE(hit.ok());
  CHECK(hit->hit.num_tokens == 0); // P's first block is under the other root
  (void)cache.publish(2, *table.blocks(2), q);
  CHECK(cache.probe(q, one).num_tokens == 4); // P's first block only
  CHECK(cache.probe(p, one).num_tokens == 8);
  CHECK(cache.probe(p, two).num_tokens == 0);
}

TEST_CASE("the prefix index archetype caches nothing", "[concepts][prefix_cache]") {
  archetype index(16);
  const std::vector<token_id> prompt{1, 2, 3};
  std::vector<kvkit::block_id> out(4);
  CHECK(index.probe(prompt, {}).num_tokens == 0);
  CHECK(index.match(1, prompt, {}, out, {})->num_blocks == 0);
  CHECK(index.match(1, {}, {}, out, {}).error() == kvkit::errc::bad_argument);
  CHECK(index.block_size() == 16);
}
