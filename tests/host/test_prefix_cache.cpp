#include <algorithm>
#include <array>
#include <cstddef>
#include <numeric>
#include <span>
#include <vector>

#include <catch2/catch.hpp>

#include "kvkit/block/block_pool.hpp"
#include "kvkit/block/block_table.hpp"
#include "kvkit/prefix/prefix_cache.hpp"
#include "kvkit/testing/block_mapping_archetype.hpp"

using kvkit::block_id;
using kvkit::block_pool;
using kvkit::errc;
using kvkit::seq_id;
using kvkit::token_id;

namespace {

using table_t = kvkit::block_table<block_pool>;

std::vector<token_id> iota_tokens(std::int32_t n, token_id first = 1) {
  std::vector<token_id> t(static_cast<std::size_t>(n));
  std::iota(t.begin(), t.end(), first);
  return t;
}

std::vector<token_id> concat(std::vector<token_id> a, const std::vector<token_id>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

std::vector<block_id> blocks_of(const table_t& t, seq_id s) {
  const auto b = t.blocks(s);
  REQUIRE(b.ok());
  return {b->begin(), b->end()};
}

// Admits, publishes the prompt as computed, finishes and frees: the prompt's blocks end up cached.
template <class Cache>
void serve_and_finish(Cache& cache, table_t& table, seq_id s, const std::vector<token_id>& prompt,
                      const kvkit::retention& r = {}) {
  REQUIRE(cache.admit(table, s, prompt, {}, r).ok());
  REQUIRE(cache.publish(s, *table.blocks(s), prompt).ok());
  REQUIRE(cache.finish(s, *table.blocks(s), prompt).ok());
  REQUIRE(table.free(s).ok());
}

} // namespace

TEST_CASE("a repeated prompt hits every full block but the one with its last token",
          "[prefix_cache]") {
  block_pool pool(32);
  table_t table(pool, 4);
  kvkit::prefix_cache<> cache(pool, 4);
  const auto prompt = iota_tokens(10); // blocks: [1..4] [5..8] [9 10]

  const auto first = cache.admit(table, 1, prompt);
  REQUIRE(first.ok());
  CHECK(first->hit.num_tokens == 0);
  CHECK(first->append.num_new_blocks == 3);
  CHECK(*cache.publish(1, *table.blocks(1), prompt) == 2); // two full blocks
  CHECK(cache.num_entries() == 2);
  const auto owner = blocks_of(table, 1);
  CHECK(pool.is_cached(owner[0]));
  CHECK_FALSE(pool.is_cached(owner[2]));

  // While sequence 1 is still running, sequence 2 shares its two full blocks.
  const auto second = cache.admit(table, 2, prompt);
  REQUIRE(second.ok());
  CHECK(second->hit.num_tokens == 8);
  CHECK(second->hit.num_blocks == 2);
  CHECK(second->hit.num_evictable == 0);
  CHECK(second->append.num_new_blocks == 1);
  const auto shared = blocks_of(table, 2);
  CHECK(shared[0] == owner[0]);
  CHECK(shared[1] == owner[1]);
  CHECK(pool.ref_count(owner[0]) == 2);

  // A prompt of exactly two blocks may only reuse the first: its last token must be computed.
  const auto aligned = iota_tokens(8);
  const auto p = cache.probe(aligned);
  CHECK(p.num_tokens == 4);
  CHECK(p.num_blocks == 1);
  CHECK(cache.stats().queries == 2);
  CHECK(cache.stats().hit_tokens == 8);
  CHECK(cache.stats().hit_rate() == Approx(8.0 / 20.0));
}

TEST_CASE("extra bytes separate otherwise equal prefixes", "[prefix_cache]") {
  block_pool pool(32);
  table_t table(pool, 4);
  kvkit::prefix_cache<> cache(pool, 4);
  const auto prompt = iota_tokens(9);
  const std::array<std::byte, 2> lora_a{std::byte{1}, std::byte{0}};
  const std::array<std::byte, 2> lora_b{std::byte{2}, std::byte{0}};
  REQUIRE(cache.admit(table, 1, prompt, lora_a).ok());
  REQUIRE(cache.publish(1, *table.blocks(1), prompt).ok());
  CHECK(cache.probe(prompt, lora_a).num_tokens == 8);
  CHECK(cache.probe(prompt, lora_b).num_tokens == 0);
  CHECK(cache.probe(prompt).num_tokens == 0);
  // A different first block breaks the chain even when later blocks are equal.
  auto other = prompt;
  other[0] = 99;
  CHECK(cache.probe(other, lora_a).num_tokens == 0);
}

TEST_CASE("equal blocks after different prefixes are separate entries", "[prefix_cache]") {
  block_pool pool(32);
  table_t table(pool, 4);
  kvkit::prefix_cache<> cache(pool, 4);
  // The same two blocks (and last token) after two different first blocks.
  const auto tail = concat(concat(iota_tokens(4, 100), iota_tokens(4, 200)), {7});
  const auto a = concat(iota_tokens(4, 1), tail);
  const auto b = concat(iota_tokens(4, 50), tail);
  REQUIRE(cache.admit(table, 1, a).ok());
  CHECK(*cache.publish(1, *table.blocks(1), a) == 3);
  const auto hit_b = cache.admit(table, 2, b);
  REQUIRE(hit_b.ok());
  CHECK(hit_b->hit.num_tokens == 0);
  CHECK(*cache.publish(2, *table.blocks(2), b) == 3); // its own copies of the equal blocks
  CHECK(cache.num_entries() == 6);

  // Each prompt finds its own chain, block for block.
  for (const auto& [prompt, owner] : {std::pair{a, seq_id{1}}, std::pair{b, seq_id{2}}}) {
    std::vector<block_id> out(static_cast<std::size_t>(cache.max_match_blocks(13)));
    const auto m = cache.match(10 + owner, prompt, {}, out);
    REQUIRE(m.ok());
    CHECK(m->num_blocks == 3);
    const auto held = blocks_of(table, owner);
    CHECK(std::vector<block_id>(out.begin(), out.begin() + 3) ==
          std::vector<block_id>(held.begin(), held.begin() + 3));
    for (std::int32_t i = 0; i < m->num_blocks; ++i) {
      REQUIRE(pool.release(out[static_cast<std::size_t>(i)]).ok());
    }
    REQUIRE(cache.forget(10 + owner).ok());
  }
  // The equal blocks alone, after neither first block, find nothing.
  CHECK(cache.probe(concat(iota_tokens(4, 9), tail)).num_tokens == 0);
}

TEST_CASE("released cached blocks stay evictable and are reclaimed tail first", "[prefix_cache]") {
  block_pool pool(8);
  table_t table(pool, 4);
  kvkit::prefix_cache<> cache(pool, 4, {.record_events = true});
  const auto prompt = iota_tokens(17); // 4 full blocks + 1 token
  serve_and_finish(cache, table, 1, prompt);
  CHECK(pool.num_evictable() == 4);
  CHECK(pool.num_free() == 8);
  CHECK(cache.num_entries() == 4);
  auto events = cache.take_events();
  REQUIRE(events.size() == 4);
  CHECK(events[0].what == kvkit::cache_event::kind::stored);
  CHECK(events[1].parent == events[0].key); // chained keys
  CHECK(cache.take_events().empty());

  // Pressure: a new unrelated prompt needs 5 blocks; 4 free ones go first, then the chain's tail.
  REQUIRE(table.add_sequence(9).ok());
  REQUIRE(table.append_tokens(9, 20, {}).ok());
  CHECK(pool.num_evictions() == 1);
  events = cache.take_events();
  REQUIRE(events.size() == 1);
  CHECK(events[0].what == kvkit::cache_event::kind::removed);
  CHECK(cache.num_entries() == 3);
  // The head of the chain survived, so the prompt still hits its first three blocks.
  CHECK(cache.probe(prompt).num_tokens == 12);
  CHECK(cache.stats().removed_blocks == 1);
  REQUIRE(table.free(9).ok());

  // A hit revives evictable blocks.
  const auto hit = cache.admit(table, 2, prompt);
  REQUIRE(hit.ok());
  CHECK(hit->hit.num_tokens == 12);
  CHECK(hit->hit.num_evictable == 3);
  CHECK(pool.num_evictable() == 0);
  CHECK(pool.check_consistency());
}

namespace {

// 12 blocks of 4 tokens in 4 eviction levels under retention priorities, and two chats of 17
// tokens: chat_a after an 8-token system prompt, chat_b after other 8 tokens.
struct retention_setup {
  block_pool pool{12, 4};
  table_t table{pool, 4};
  kvkit::prefix_cache<kvkit::xxh3_hasher, kvkit::retention_priority> cache{
      pool, 4, {}, {}, kvkit::retention_priority(4)};
  std::vector<token_id> chat_a = concat(iota_tokens(8, 1000), iota_tokens(9, 1));
  std::vector<token_id> chat_b = concat(iota_tokens(8, 5000), iota_tokens(9, 1));
};

} // namespace

TEST_CASE("retention priority keeps a system prompt while chats are evicted", "[prefix_cache]") {
  retention_setup r;
  auto& [pool, table, cache, chat_a, chat_b] = r;
  // The system prompt's 8 tokens are kept at priority 90; the rest is default.
  serve_and_finish(cache, table, 1, chat_a, {90, 8});
  serve_and_finish(cache, table, 2, chat_b);
  CHECK(pool.num_evictable() == 8);

  // Memory pressure reclaims 5 blocks: the 4 free ones, then one default-priority chat block.
  // Then more: every chat block goes before the system prompt's.
  REQUIRE(table.add_sequence(9).ok());
  REQUIRE(table.append_tokens(9, 4 * 10, {}).ok()); // 10 blocks: 4 free + 6 evicted
  CHECK(pool.num_evictions() == 6);
  CHECK(cache.probe(chat_a).num_tokens == 8); // the system prompt survived
  CHECK(cache.probe(chat_b).num_tokens == 0);
  REQUIRE(table.free(9).ok());

  // With plain LRU the older system prompt would have gone first.
  block_pool lru_pool(12);
  table_t lru_table(lru_pool, 4);
  kvkit::prefix_cache<> lru_cache(lru_pool, 4);
  serve_and_finish(lru_cache, lru_table, 1, chat_a);
  serve_and_finish(lru_cache, lru_table, 2, chat_b);
  REQUIRE(lru_table.add_sequence(9).ok());
  REQUIRE(lru_table.append_tokens(9, 4 * 10, {}).ok());
  CHECK(lru_cache.probe(chat_a).num_tokens == 0);
}

TEST_CASE("retention reaches the blocks a request matched, and never lowers a level",
          "[prefix_cache]") {
  retention_setup r;
  auto& [pool, table, cache, chat_a, chat_b] = r;
  // The system prompt is first computed without retention; a later request asking for it
  // matches every block and computes none.
  REQUIRE(cache.admit(table, 1, chat_a).ok());
  const std::vector<block_id> computed_by_1 = blocks_of(table, 1);
  REQUIRE(cache.finish(1, computed_by_1, chat_a).ok());
  REQUIRE(table.free(1).ok());
  CHECK(pool.eviction_level(computed_by_1[0]) == 0);
  serve_and_finish(cache, table, 3, chat_a, {90, 8});
  const std::int32_t kept = pool.eviction_level(computed_by_1[0]);
  CHECK(kept > 0);
  CHECK(pool.eviction_level(computed_by_1[1]) == kept);
  CHECK(pool.eviction_level(computed_by_1[2]) == 0); // past the retained 8 tokens
  // A later request without retention leaves the level as it is.
  serve_and_finish(cache, table, 4, chat_a);
  CHECK(pool.eviction_level(computed_by_1[0]) == kept);
  serve_and_finish(cache, table, 2, chat_b);

  // Under pressure every other block goes before the system prompt's.
  REQUIRE(table.add_sequence(9).ok());
  REQUIRE(table.append_tokens(9, 4 * 10, {}).ok());
  CHECK(cache.probe(chat_a).num_tokens == 8);
  CHECK(cache.probe(chat_b).num_tokens == 0);
  REQUIRE(table.free(9).ok());

  // Two requests compute one new prompt at once; the one asking for retention finishes second,
  // while the first still holds the blocks it published at those places: those are raised.
  const auto chat_c = concat(iota_tokens(8, 7000), iota_tokens(5, 1));
  REQUIRE(cache.admit(table, 10, chat_c).ok());
  REQUIRE(cache.admit(table, 11, chat_c, {}, {90, 8}).ok());
  const std::vector<block_id> first = blocks_of(table, 10);
  REQUIRE(cache.publish(10, first, chat_c).ok());
  CHECK(pool.eviction_level(first[0]) == 0);
  REQUIRE(cache.finish(11, blocks_of(table, 11), chat_c).ok());
  CHECK(pool.eviction_level(first[0]) == kept);
  CHECK(pool.eviction_level(first[1]) == kept);
  CHECK(pool.eviction_level(first[2]) == 0);
  REQUIRE(cache.finish(10, first, chat_c).ok());
  REQUIRE(table.free(10).ok());
  REQUIRE(table.free(11).ok());
}

TEST_CASE("partial blocks are shared through copy-on-write", "[prefix_cache]") {
  block_pool pool(16);
  table_t table(pool, 4);
  kvkit::prefix_cache<> cache(pool, 4, {.share_partial_blocks = true});
  const auto system = iota_tokens(6, 100); // not block aligned: [100..103] [104 105 | ...]
  const auto first = concat(system, iota_tokens(3, 1));
  const auto second = concat(system, iota_tokens(3, 50));

  REQUIRE(cache.admit(table, 1, first).ok());
  REQUIRE(cache.publish(1, *table.blocks(1), first).ok());
  const auto owner = blocks_of(table, 1);

  // Block 1 of sequence 1 is full ([104 105 1 2]); the second prompt shares its first 2 tokens.
  std::vector<kvkit::token_slot> slots(9);
  const auto hit = cache.admit(table, 2, second, {}, {}, slots);
  REQUIRE(hit.ok());
  CHECK(hit->hit.num_tokens == 6);
  CHECK(hit->hit.num_blocks == 2);
  CHECK(hit->hit.partial_last);
  CHECK(hit->append.copied); // the shared block is copied before tokens 50.. land
  CHECK(hit->append.copy.src == owner[1]);
  const auto mine = blocks_of(table, 2);
  CHECK(mine[0] == owner[0]);
  CHECK(mine[1] == hit->append.copy.dst);
  CHECK(slots[0] == kvkit::token_slot{hit->append.copy.dst, 2});
  CHECK(cache.stats().partial_hits == 1);

  // Finishing publishes the partly filled last block, so a later prompt with the same
  // unaligned tail reuses it too.
  const auto short_prompt = iota_tokens(7, 200); // [200..203] [204 205 206]
  serve_and_finish(cache, table, 3, short_prompt);
  const auto longer = concat(short_prompt, iota_tokens(2, 1));
  const auto p = cache.probe(longer);
  CHECK(p.num_tokens == 7);
  CHECK(p.partial_last);
  CHECK(pool.check_consistency());
}

TEST_CASE("speculative lookahead and rollback keep published blocks intact", "[prefix_cache]") {
  block_pool pool(16);
  table_t table(pool, 4);
  kvkit::prefix_cache<> cache(pool, 4);
  const auto prompt = iota_tokens(9);
  serve_and_finish(cache, table, 1, prompt);

  // A hit on the two full blocks, then 3 lookahead slots reserved for draft tokens.
  auto tokens = prompt;
  const auto hit = cache.admit(table, 2, tokens);
  REQUIRE(hit.ok());
  CHECK(hit->hit.num_tokens == 8);
  const auto matched = blocks_of(table, 2);
  REQUIRE(table.append_tokens(2, 3, {}).ok());
  // One draft token accepted: roll the other two back. The matched blocks stay, still published.
  REQUIRE(table.truncate(2, 10).ok());
  REQUIRE(cache.truncate(2, 10).ok());
  tokens.push_back(42);
  CHECK(blocks_of(table, 2)[0] == matched[0]);
  CHECK(blocks_of(table, 2)[1] == matched[1]);
  CHECK(cache.is_published(matched[1]));

  // A rollback that reaches into a published block makes the next write copy it first.
  REQUIRE(table.truncate(2, 7).ok());
  REQUIRE(cache.truncate(2, 7).ok());
  const auto write = table.append_tokens(2, 1, {});
  REQUIRE(write.ok());
  CHECK(write->copied);
  CHECK(write->copy.src == matched[1]);
  CHECK(cache.probe(prompt).num_tokens == 8); // the cache still serves the original content
}

TEST_CASE("the same prefix computed twice is published once", "[prefix_cache]") {
  block_pool pool(16);
  table_t table(pool, 4);
  kvkit::prefix_cache<> cache(pool, 4);
  const auto prompt = iota_tokens(9);
  REQUIRE(cache.admit(table, 1, prompt).ok());
  REQUIRE(cache.admit(table, 2, prompt).ok()); // nothing published yet: computes its own
  CHECK(*cache.publish(1, *table.blocks(1), prompt) == 2);
  CHECK(*cache.publish(2, *table.blocks(2), prompt) == 0);
  CHECK(*cache.publish(2, *table.blocks(2), prompt) == 0); // idempotent
  CHECK(cache.num_entries() == 2);
  CHECK_FALSE(pool.is_cached(blocks_of(table, 2)[0]));
}

TEST_CASE("forks keep publishing their own continuation", "[prefix_cache]") {
  block_pool pool(16);
  table_t table(pool, 4);
  kvkit::prefix_cache<> cache(pool, 4);
  const auto prompt = iota_tokens(6);
  REQUIRE(cache.admit(table, 1, prompt).ok());
  REQUIRE(table.fork(1, 2).ok());
  REQUIRE(cache.fork(1, 2).ok());
  CHECK(cache.fork(1, 2).error() == errc::duplicate_sequence);
  CHECK(cache.fork(7, 8).error() == errc::unknown_sequence);
  auto a = prompt;
  auto b = prompt;
  for (token_id t = 0; t < 3; ++t) {
    REQUIRE(table.append_tokens(1, 1, {}).ok());
    REQUIRE(table.append_tokens(2, 1, {}).ok());
    a.push_back(70 + t);
    b.push_back(80 + t);
  }
  CHECK(*cache.publish(1, *table.blocks(1), a) == 2);
  CHECK(*cache.publish(2, *table.blocks(2), b) == 1); // block 0 is shared and published already
  CHECK(cache.probe(concat(a, {1})).num_tokens == 8);
  CHECK(cache.probe(concat(b, {1})).num_tokens == 8);
}

TEST_CASE("bad input is rejected and changes nothing", "[prefix_cache]") {
  block_pool pool(4);
  table_t table(pool, 4);
  kvkit::prefix_cache<> cache(pool, 4);
  const auto prompt = iota_tokens(9);
  serve_and_finish(cache, table, 1, prompt);
  const auto stats_before = cache.stats();
  const auto free_before = pool.num_free();
  const auto evictable_before = pool.num_evictable();

  std::vector<block_id> out(8);
  CHECK(cache.match(2, {}, {}, out).error() == errc::bad_argument);
  CHECK(cache.match(2, prompt, {}, std::span<block_id>(out.data(), 1)).error() ==
        errc::buffer_too_small);
  CHECK(cache.match(2, prompt, {}, out, {101, 4}).error() == errc::bad_argument);
  CHECK(cache.match(2, prompt, {}, out, {10, -1}).error() == errc::bad_argument);
  CHECK(cache.admit(table, 2, std::vector<token_id>{}).error() == errc::bad_argument);
  table_t other_size(pool, 8);
  CHECK(cache.admit(other_size, 2, prompt).error() == errc::bad_argument);
  block_pool other_pool(4);
  table_t other_allocator(other_pool, 4);
  CHECK(cache.admit(other_allocator, 2, prompt).error() == errc::bad_argument);
  CHECK(other_pool.num_free() == 4);
  std::vector<kvkit::token_slot> small(1);
  CHECK(cache.admit(table, 2, iota_tokens(5, 700), {}, {}, small).error() ==
        errc::buffer_too_small);
  CHECK(cache.publish(5, {}, {}).error() == errc::unknown_sequence);
  CHECK(cache.truncate(5, 0).error() == errc::unknown_sequence);
  CHECK(cache.finish(5, {}, {}).error() == errc::unknown_sequence);
  CHECK(cache.forget(5).error() == errc::unknown_sequence);

  // The pool cannot hold this prompt's uncached part: out_of_blocks, nothing retained.
  const auto big = concat(prompt, iota_tokens(12, 500)); // 21 tokens: 2 hit + 4 more blocks
  CHECK(cache.admit(table, 3, big).error() == errc::out_of_blocks);
  CHECK_FALSE(table.contains(3));
  CHECK_FALSE(cache.tracks(3));
  CHECK(pool.num_free() == free_before);
  CHECK(pool.num_evictable() == evictable_before);
  CHECK(cache.stats().queries == stats_before.queries);
  CHECK(cache.num_entries() == 2);

  // Tracked-sequence errors.
  REQUIRE(cache.admit(table, 4, iota_tokens(3, 900)).ok());
  CHECK(cache.admit(table, 4, prompt).error() == errc::duplicate_sequence);
  CHECK(cache.publish(4, *table.blocks(4), iota_tokens(7, 900)).error() == errc::bad_argument);
  CHECK(cache.truncate(4, -1).error() == errc::bad_argument);
  CHECK(pool.check_consistency());
}

TEST_CASE("publish and finish refuse blocks not in use and publish nothing", "[prefix_cache]") {
  block_pool pool(8);
  table_t table(pool, 4);
  kvkit::prefix_cache<> cache(pool, 4, {.record_events = true});
  const auto prompt = iota_tokens(9); // two full blocks and one of a single token
  REQUIRE(cache.admit(table, 1, prompt).ok());
  const auto blocks = blocks_of(table, 1);
  REQUIRE(blocks.size() == 3);
  block_id unused = 0;
  while (std::find(blocks.begin(), blocks.end(), unused) != blocks.end()) {
    ++unused;
  }
  REQUIRE(pool.ref_count(unused) == 0);
  for (const block_id wrong : {unused, block_id{-1}, block_id{8}}) {
    auto bad = blocks;
    bad[2] = wrong; // the first two, which would be published, are right
    CHECK(cache.publish(1, bad, prompt).error() == errc::invalid_block);
    CHECK(cache.finish(1, bad, prompt).error() == errc::invalid_block);
    CHECK(cache.num_entries() == 0);
    CHECK(cache.tracks(1));
    CHECK_FALSE(pool.is_cached(blocks[0]));
    CHECK_FALSE(pool.is_cached(blocks[1]));
    CHECK(cache.take_events().empty());
    CHECK(cache.stats().stored_blocks == 0);
  }
  CHECK(*cache.publish(1, blocks, prompt) == 2);
  REQUIRE(cache.finish(1, blocks, prompt).ok());
  REQUIRE(table.free(1).ok());
  CHECK(pool.num_evictable() == 2);
  CHECK(pool.check_consistency());
}

TEST_CASE("an admission its mapping refuses after the match leaves the statistics as they were",
          "[prefix_cache]") {
  // A mapping that names no allocator skips admit's pool check; this one refuses every adoption,
  // after the match has counted the query and revived the hit blocks.
  block_pool pool(8);
  table_t table(pool, 1);
  kvkit::prefix_cache<> cache(pool, 1);
  serve_and_finish(cache, table, 1, iota_tokens(4));
  const auto before = cache.stats();
  const auto evictable_before = pool.num_evictable();
  kvkit::testing::block_mapping_archetype refusing(0);
  REQUIRE(cache.probe(iota_tokens(4)).num_blocks == 3);
  CHECK(cache.admit(refusing, 2, iota_tokens(4)).error() == errc::bad_argument);
  const auto after = cache.stats();
  CHECK(after.queries == before.queries);
  CHECK(after.query_tokens == before.query_tokens);
  CHECK(after.hit_tokens == before.hit_tokens);
  CHECK(after.hit_blocks == before.hit_blocks);
  CHECK(after.partial_hits == before.partial_hits);
  CHECK_FALSE(cache.tracks(2));
  CHECK(pool.num_evictable() == evictable_before);
  CHECK(pool.check_consistency());
}

namespace {
// A block_table that names no allocator and refuses every append: an admission it takes the hit
// of, then refuses the rest of.
class refusing_appends {
public:
  explicit refusing_appends(table_t& t) : t_(&t) {}
  std::int32_t block_size() const { return t_->block_size(); }
  bool contains(seq_id s) const { return t_->contains(s); }
  kvkit::result<std::int32_t> num_tokens(seq_id s) const { return t_->num_tokens(s); }
  kvkit::result<std::span<const block_id>> blocks(seq_id s) const { return t_->blocks(s); }
  kvkit::result<std::int32_t> blocks_needed(seq_id s, std::int32_t n) const {
    return t_->blocks_needed(s, n);
  }
  kvkit::status add_sequence(seq_id s) { return t_->add_sequence(s); }
  kvkit::status adopt_sequence(seq_id s, std::span<const block_id> b, std::int32_t n) {
    return t_->adopt_sequence(s, b, n);
  }
  kvkit::result<kvkit::append_info> append_tokens(seq_id, std::int32_t,
                                                  std::span<kvkit::token_slot>) {
    return errc::out_of_blocks;
  }
  kvkit::status truncate(seq_id s, std::int32_t n) { return t_->truncate(s, n); }
  kvkit::status fork(seq_id s, seq_id t) { return t_->fork(s, t); }
  kvkit::status free(seq_id s) { return t_->free(s); }
  void release_copy_sources() { t_->release_copy_sources(); }
  kvkit::status export_csr(std::span<const seq_id> b, std::span<std::int32_t> p,
                           std::span<std::int32_t> i, std::span<std::int32_t> l) const {
    return t_->export_csr(b, p, i, l);
  }
  kvkit::status export_block_table(std::span<const seq_id> b, std::int32_t n,
                                   std::span<std::int32_t> r, std::span<std::int32_t> l) const {
    return t_->export_block_table(b, n, r, l);
  }
  kvkit::status export_slot_mapping(std::span<const seq_id> b, std::span<const std::int32_t> q,
                                    std::span<std::int64_t> o) const {
    return t_->export_slot_mapping(b, q, o);
  }

private:
  table_t* t_;
};
static_assert(kvkit::block_mapping<refusing_appends>);
} // namespace

TEST_CASE("an admission refused after its hit was adopted gives every block back",
          "[prefix_cache]") {
  block_pool pool(8);
  table_t table(pool, 4);
  kvkit::prefix_cache<> cache(pool, 4);
  const auto prompt = iota_tokens(9);
  serve_and_finish(cache, table, 1, prompt); // two full blocks cached
  const auto before = cache.stats();
  const auto used_before = pool.num_used();
  const auto evictable_before = pool.num_evictable();
  refusing_appends refusing(table);
  const auto longer = concat(prompt, iota_tokens(6, 500));
  REQUIRE(cache.probe(longer).num_blocks == 2);
  CHECK(cache.admit(refusing, 2, longer).error() == errc::out_of_blocks);
  CHECK_FALSE(table.contains(2));
  CHECK_FALSE(cache.tracks(2));
  CHECK(pool.num_used() == used_before);
  CHECK(pool.num_evictable() == evictable_before);
  CHECK(cache.num_entries() == 2);
  CHECK(cache.stats().queries == before.queries);
  CHECK(cache.stats().hit_tokens == before.hit_tokens);
  CHECK(pool.check_consistency());
  // The cache still serves the prefix.
  const auto a = cache.admit(table, 3, longer);
  REQUIRE(a.ok());
  CHECK(a->hit.num_tokens == 8);
}

TEST_CASE("publish refuses blocks other than those the sequence matched or published",
          "[prefix_cache]") {
  block_pool pool(16);
  table_t table(pool, 4);
  kvkit::prefix_cache<> cache(pool, 4);
  const auto prompt = iota_tokens(9);
  REQUIRE(cache.admit(table, 1, prompt).ok());
  REQUIRE(cache.publish(1, *table.blocks(1), prompt).ok());
  REQUIRE(cache.num_entries() == 2);

  // The table truncated into the published blocks without the cache told, then grown again
  // with other tokens: block 0 was copied before the write, so the sequence's first block is
  // not the one it published, and publishing its third block would put it after the old second.
  REQUIRE(table.truncate(1, 2).ok());
  const auto other = concat(iota_tokens(2), iota_tokens(11, 300));
  REQUIRE(table.append_tokens(1, 11, {}).ok());
  table.release_copy_sources();
  CHECK(cache.publish(1, *table.blocks(1), other).error() == errc::bad_argument);
  CHECK(cache.finish(1, *table.blocks(1), other).error() == errc::bad_argument);
  CHECK(cache.num_entries() == 2);
  // Told, it publishes the new blocks.
  REQUIRE(cache.truncate(1, 2).ok());
  const auto published = cache.publish(1, *table.blocks(1), other);
  REQUIRE(published.ok());
  CHECK(*published == 3);
  REQUIRE(cache.finish(1, *table.blocks(1), other).ok());
  REQUIRE(table.free(1).ok());

  // A sequence freed from the table while the cache still tracks it, and its id used again.
  const auto third = iota_tokens(9, 600);
  REQUIRE(cache.admit(table, 2, third).ok());
  REQUIRE(cache.publish(2, *table.blocks(2), third).ok());
  REQUIRE(table.free(2).ok()); // no finish or forget
  const auto reused = concat(iota_tokens(4, 700), iota_tokens(9, 604));
  REQUIRE(table.add_sequence(2).ok());
  REQUIRE(table.append_tokens(2, 13, {}).ok());
  const auto entries = cache.num_entries();
  CHECK(cache.publish(2, *table.blocks(2), reused).error() == errc::bad_argument);
  CHECK(cache.num_entries() == entries);
  REQUIRE(cache.forget(2).ok());
  CHECK(pool.check_consistency());
}

TEST_CASE("evict and clear give cached blocks back", "[prefix_cache]") {
  block_pool pool(8);
  table_t table(pool, 4);
  kvkit::prefix_cache<> cache(pool, 4, {.record_events = true});
  serve_and_finish(cache, table, 1, iota_tokens(13)); // 3 full blocks
  CHECK(pool.num_evictable() == 3);
  CHECK(cache.evict(1) == 1);
  CHECK(pool.num_evictable() == 2);
  CHECK(cache.num_entries() == 2);
  REQUIRE(cache.admit(table, 2, iota_tokens(13)).ok()); // holds the remaining two
  cache.clear();
  CHECK(cache.num_entries() == 0);
  CHECK(pool.num_evictable() == 0);
  CHECK_FALSE(pool.is_cached(blocks_of(table, 2)[0]));
  const auto events = cache.take_events();
  REQUIRE_FALSE(events.empty());
  CHECK(events.back().what == kvkit::cache_event::kind::cleared);
  CHECK(cache.evict(5) == 0);
  // Sequence 2 continued entries that are gone: it publishes nothing more (nothing unreachable).
  CHECK(*cache.publish(2, *table.blocks(2), iota_tokens(13)) == 0);
  CHECK(cache.num_entries() == 0);
  REQUIRE(table.free(2).ok());
  CHECK(pool.num_free() == 8);
}

TEST_CASE("a sequence rolled back to no blocks after a clear publishes again", "[prefix_cache]") {
  block_pool pool(16);
  table_t table(pool, 4);
  kvkit::prefix_cache<> cache(pool, 4);
  const auto prompt = iota_tokens(9);
  REQUIRE(cache.admit(table, 1, prompt).ok());
  CHECK(*cache.publish(1, *table.blocks(1), prompt) == 2);
  cache.clear();
  // Its chain continues entries that are gone: nothing it publishes now could be found.
  CHECK(*cache.publish(1, *table.blocks(1), prompt) == 0);
  CHECK(cache.probe(prompt).num_tokens == 0);
  // Rolled back to its first block: still after a gone entry.
  REQUIRE(table.truncate(1, 4).ok());
  REQUIRE(cache.truncate(1, 4).ok());
  REQUIRE(table.append_tokens(1, 5, {}).ok());
  CHECK(*cache.publish(1, *table.blocks(1), prompt) == 0);
  // Rolled back to nothing: it starts from its root again, and what it computes is found.
  REQUIRE(table.truncate(1, 0).ok());
  REQUIRE(cache.truncate(1, 0).ok());
  REQUIRE(table.append_tokens(1, 9, {}).ok());
  CHECK(*cache.publish(1, *table.blocks(1), prompt) == 2);
  CHECK(cache.probe(prompt).num_tokens == 8);
  REQUIRE(cache.finish(1, *table.blocks(1), prompt).ok());
  REQUIRE(table.free(1).ok());
  CHECK(pool.num_evictable() == 2);
  CHECK(pool.check_consistency());
}

TEST_CASE("the cache detaches from the pool when destroyed", "[prefix_cache]") {
  block_pool pool(4);
  table_t table(pool, 4);
  {
    kvkit::prefix_cache<> cache(pool, 4);
    serve_and_finish(cache, table, 1, iota_tokens(9));
    CHECK(pool.num_evictable() == 2);
  }
  CHECK(pool.num_evictable() == 0);
  std::array<block_id, 4> all{};
  CHECK(pool.allocate(all).ok()); // no callback into a dead cache
}

namespace {
struct entry_visitor {
  void operator()(block_id, std::span<const token_id>, const kvkit::block_key&) const {}
};
template <class F>
concept visits_entries = requires(const kvkit::prefix_cache<>& c, F f) {
  c.for_each_entry(f);
};
} // namespace

TEST_CASE("for_each_entry takes only callables of an entry", "[prefix_cache]") {
  STATIC_REQUIRE(visits_entries<entry_visitor>);
  STATIC_REQUIRE_FALSE(visits_entries<int>);
  STATIC_REQUIRE_FALSE(visits_entries<void (*)(block_id)>);
}

TEST_CASE("entries hold exactly the tokens they were published with", "[prefix_cache]") {
  block_pool pool(8);
  table_t table(pool, 4);
  kvkit::prefix_cache<> cache(pool, 4);
  const auto prompt = iota_tokens(9, 300);
  serve_and_finish(cache, table, 1, prompt);
  std::int32_t seen = 0;
  cache.for_each_entry([&](block_id, std::span<const token_id> toks, const kvkit::block_key&) {
    CHECK(toks.size() == 4);
    CHECK((toks[0] == 300 || toks[0] == 304));
    ++seen;
  });
  CHECK(seen == 2);
}

TEST_CASE("clearing a cached mark through the pool drops the cache entry", "[prefix_cache]") {
  block_pool pool(8);
  table_t table(pool, 4);
  kvkit::prefix_cache<> cache(pool, 4);
  const auto prompt = iota_tokens(9);
  REQUIRE(cache.admit(table, 1, prompt).ok());
  REQUIRE(cache.publish(1, *table.blocks(1), prompt).ok());
  const auto blocks = blocks_of(table, 1);
  // In use: the entry goes, so the holder may write into the block again.
  REQUIRE(pool.set_cached(blocks[1], false).ok());
  CHECK_FALSE(cache.is_published(blocks[1]));
  CHECK(cache.num_entries() == 1);
  REQUIRE(cache.finish(1, *table.blocks(1), prompt).ok());
  REQUIRE(table.free(1).ok());
  // Evictable: the block becomes free and the entry goes with it.
  REQUIRE(pool.set_cached(blocks[0], false).ok());
  CHECK(cache.num_entries() == 0);
  CHECK(cache.probe(prompt).num_tokens == 0);
  CHECK(pool.num_evictable() == 0);
}

TEST_CASE("a dropped block's children are not found under the next entry in its place",
          "[prefix_cache]") {
  block_pool pool(4);
  table_t table(pool, 4);
  kvkit::prefix_cache<> cache(pool, 4);
  const auto p = iota_tokens(9); // [1..4] [5..8] [9]
  REQUIRE(cache.admit(table, 1, p).ok());
  REQUIRE(cache.publish(1, *table.blocks(1), p).ok());
  const auto first = blocks_of(table, 1);
  REQUIRE(cache.finish(1, *table.blocks(1), p).ok());
  REQUIRE(table.free(1).ok());
  // The head goes; its child [5..8] stays cached, indexed under the head as it was.
  REQUIRE(pool.set_cached(first[0], false).ok());
  CHECK(cache.num_entries() == 1);
  CHECK(cache.probe(p).num_tokens == 0);
  // Another prompt whose second block is the child's tokens gets the head's block id back.
  const auto q = concat(iota_tokens(4, 20), concat(iota_tokens(4, 5), {9}));
  REQUIRE(cache.admit(table, 2, q).ok());
  const auto second = blocks_of(table, 2);
  REQUIRE(std::find(second.begin(), second.end(), first[0]) != second.end());
  const auto at =
      static_cast<std::size_t>(std::find(second.begin(), second.end(), first[0]) - second.begin());
  INFO("the head's id is block " << at << " of the second prompt");
  // Published up to its first block only, the second prompt finds that block and not the old
  // child, whose K/V followed [1..4].
  REQUIRE(cache.publish(2, std::span(second).first(1), std::span(q).first(4)).ok());
  CHECK(cache.probe(q).num_tokens == 4);
  REQUIRE(cache.publish(2, *table.blocks(2), q).ok());
  CHECK(cache.probe(q).num_tokens == 8);
  CHECK(cache.probe(p).num_tokens == 0);
}

TEST_CASE("a second cache on a pool that has one stays detached and finds nothing",
          "[prefix_cache]") {
  block_pool pool(8);
  table_t table(pool, 4);
  kvkit::prefix_cache<> first(pool, 4);
  const auto prompt = iota_tokens(9);
  serve_and_finish(first, table, 1, prompt);
  REQUIRE(first.probe(prompt).num_tokens == 8);
  {
    kvkit::prefix_cache<> second(pool, 4);
    CHECK(first.attached());
    CHECK_FALSE(second.attached());
    CHECK(pool.eviction_context() == &first);
    // The second cache's contents are empty, but were it to find the first cache's blocks it
    // would never hear of their eviction: it refuses every lookup instead.
    CHECK(second.probe(prompt).num_tokens == 0);
    std::vector<block_id> out(static_cast<std::size_t>(second.max_match_blocks(9)));
    CHECK(second.match(2, prompt, {}, out).error() == errc::bad_argument);
    CHECK(second.admit(table, 2, prompt).error() == errc::bad_argument);
    CHECK_FALSE(second.tracks(2));
    CHECK_FALSE(table.contains(2));
    // Nor does it reclaim the first cache's evictable blocks.
    CHECK(&second.pool() == &pool);
    CHECK(second.evict(8) == 0);
    CHECK(pool.num_evictable() == 2);
    CHECK(first.num_entries() == 2);
  }
  // The detached cache's end leaves the first attached, and its entries served.
  CHECK(pool.eviction_context() == &first);
  CHECK(first.probe(prompt).num_tokens == 8);
  // Pressure reclaims the first cache's blocks, and it hears of it.
  REQUIRE(table.add_sequence(3).ok());
  REQUIRE(table.append_tokens(3, 32, {}).ok());
  CHECK(first.num_entries() == 0);
  CHECK(first.probe(prompt).num_tokens == 0);
}

TEST_CASE("a cache on a pool with an eviction callback of the engine's stays detached",
          "[prefix_cache]") {
  // The engine's callback takes no context; the cache must neither replace it nor serve blocks
  // whose eviction it would not hear of.
  static std::vector<block_id> heard;
  heard.clear();
  block_pool pool(4);
  pool.set_eviction_callback([](void*, block_id id) noexcept { heard.push_back(id); }, nullptr);
  table_t table(pool, 4);
  kvkit::prefix_cache<> cache(pool, 4);
  CHECK_FALSE(cache.attached());
  CHECK(pool.has_eviction_callback());
  const auto prompt = iota_tokens(9);
  CHECK(cache.admit(table, 1, prompt).error() == errc::bad_argument);
  CHECK_FALSE(table.contains(1));
  // The engine's callback still hears of a reclaimed block.
  const auto b = pool.allocate();
  REQUIRE(b.ok());
  REQUIRE(pool.set_cached(*b, true).ok());
  REQUIRE(pool.release(*b).ok());
  std::array<block_id, 4> all{};
  REQUIRE(pool.allocate(all).ok());
  CHECK(heard == std::vector<block_id>{*b});
  for (const block_id id : all) {
    REQUIRE(pool.release(id).ok());
  }
}

TEST_CASE("caches can follow each other on one pool", "[prefix_cache]") {
  block_pool pool(4);
  table_t table(pool, 4);
  {
    kvkit::prefix_cache<> first(pool, 4);
    serve_and_finish(first, table, 1, iota_tokens(9));
  }
  kvkit::prefix_cache<> second(pool, 4);
  CHECK(pool.eviction_context() == &second);
  serve_and_finish(second, table, 2, iota_tokens(9, 50));
  CHECK(second.num_entries() == 2);
  // Pressure reclaims the second cache's blocks, and it hears of it.
  REQUIRE(table.add_sequence(3).ok());
  REQUIRE(table.append_tokens(3, 16, {}).ok());
  CHECK(second.num_entries() == 0);
}
