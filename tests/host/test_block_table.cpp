#include <array>
#include <limits>
#include <map>
#include <vector>

#include <catch2/catch.hpp>

#include "kvkit/block/block_pool.hpp"
#include "kvkit/block/block_table.hpp"

using kvkit::block_copy;
using kvkit::block_id;
using kvkit::block_pool;
using kvkit::errc;
using kvkit::seq_id;
using kvkit::token_slot;

namespace {

using table_t = kvkit::block_table<block_pool>;

std::vector<block_id> blocks_of(const table_t& t, seq_id s) {
  const auto b = t.blocks(s);
  REQUIRE(b.ok());
  return {b->begin(), b->end()};
}

std::vector<std::int32_t> refs_of(const block_pool& p) {
  std::vector<std::int32_t> r;
  for (block_id i = 0; i < p.capacity(); ++i) {
    r.push_back(p.ref_count(i));
  }
  return r;
}

} // namespace

TEST_CASE("append allocates blocks on demand and returns slots", "[block_table]") {
  block_pool pool(8);
  table_t table(pool, 4);
  REQUIRE(table.add_sequence(1).ok());
  CHECK(*table.num_tokens(1) == 0);
  CHECK(blocks_of(table, 1).empty());

  std::array<token_slot, 6> slots{};
  const auto info = table.append_tokens(1, 6, slots);
  REQUIRE(info.ok());
  CHECK(info->num_new_blocks == 2);
  CHECK_FALSE(info->copied);
  CHECK(*table.num_tokens(1) == 6);
  const auto blocks = blocks_of(table, 1);
  REQUIRE(blocks.size() == 2);
  for (std::int32_t t = 0; t < 6; ++t) {
    CHECK(slots[static_cast<std::size_t>(t)] ==
          token_slot{blocks[static_cast<std::size_t>(t / 4)], t % 4});
  }
  CHECK(slots[5].flat(4) == blocks[1] * 4 + 1);

  // Two more tokens fill block 1 without a new allocation; the next one needs a third block.
  std::array<token_slot, 2> two{};
  REQUIRE(table.append_tokens(1, 2, two)->num_new_blocks == 0);
  CHECK(two[1] == token_slot{blocks[1], 3});
  CHECK(*table.blocks_needed(1, 1) == 1);
  std::array<token_slot, 1> one{};
  REQUIRE(table.append_tokens(1, 1, one)->num_new_blocks == 1);
  CHECK(one[0].offset == 0);
  CHECK(pool.num_used() == 3);
}

TEST_CASE("append without a slot buffer and of zero tokens", "[block_table]") {
  block_pool pool(4);
  table_t table(pool, 2);
  REQUIRE(table.add_sequence(3).ok());
  REQUIRE(table.append_tokens(3, 3, {}).ok());
  CHECK(*table.num_tokens(3) == 3);
  const auto info = table.append_tokens(3, 0, {});
  REQUIRE(info.ok());
  CHECK(info->num_new_blocks == 0);
  CHECK(pool.num_used() == 2);
}

TEST_CASE("append errors change nothing", "[block_table]") {
  block_pool pool(3);
  table_t table(pool, 4);
  REQUIRE(table.add_sequence(1).ok());
  REQUIRE(table.append_tokens(1, 5, {}).ok()); // 2 blocks
  const auto refs = refs_of(pool);
  const auto blocks = blocks_of(table, 1);

  std::array<token_slot, 2> small{};
  CHECK(table.append_tokens(2, 1, {}).error() == errc::unknown_sequence);
  CHECK(table.append_tokens(1, -1, {}).error() == errc::bad_argument);
  CHECK(table.append_tokens(1, 3, small).error() == errc::buffer_too_small);
  CHECK(table.append_tokens(1, 8, {}).error() == errc::out_of_blocks); // needs 2, 1 free
  CHECK(table.blocks_needed(1, 8).value() == 2);
  CHECK(table.blocks_needed(1, -1).error() == errc::bad_argument);
  CHECK(table.blocks_needed(9, 1).error() == errc::unknown_sequence);
  CHECK(table.append_tokens(1, std::numeric_limits<std::int32_t>::max(), {}).error() ==
        errc::out_of_range);
  CHECK(refs_of(pool) == refs);
  CHECK(blocks_of(table, 1) == blocks);
  CHECK(*table.num_tokens(1) == 5);
  CHECK(pool.check_consistency());
}

TEST_CASE("an append of more blocks than the pool has fails before the block list grows",
          "[block_table]") {
  // Blocks of one token: the largest append in range asks for 2^31 - 2 blocks, whose list alone
  // would take 8 GiB. It must fail as any short pool does, at once and with nothing allocated.
  block_pool pool(4);
  table_t table(pool, 1);
  REQUIRE(table.add_sequence(1).ok());
  REQUIRE(table.append_tokens(1, 1, {}).ok());
  CHECK(table.append_tokens(1, std::numeric_limits<std::int32_t>::max() - 1, {}).error() ==
        errc::out_of_blocks);
  CHECK(blocks_of(table, 1).size() == 1);
  CHECK(*table.num_tokens(1) == 1);
  CHECK(pool.num_free() == 3);
}

TEST_CASE("sequence ids must be unique and known", "[block_table]") {
  block_pool pool(4);
  table_t table(pool, 4);
  REQUIRE(table.add_sequence(5).ok());
  REQUIRE(table.append_tokens(5, 6, {}).ok());
  const auto blocks = blocks_of(table, 5);
  const auto refs = refs_of(pool);
  CHECK(table.add_sequence(5).error() == errc::duplicate_sequence);
  CHECK(table.contains(5));
  CHECK_FALSE(table.contains(6));
  CHECK(table.num_tokens(6).error() == errc::unknown_sequence);
  CHECK(table.blocks(6).error() == errc::unknown_sequence);
  CHECK(table.truncate(6, 0).error() == errc::unknown_sequence);
  CHECK(table.free(6).error() == errc::unknown_sequence);
  CHECK(table.fork(6, 7).error() == errc::unknown_sequence);
  CHECK(table.fork(5, 5).error() == errc::duplicate_sequence);
  CHECK(table.num_sequences() == 1);
  // Sequence 5 kept its blocks, tokens and references through every refusal.
  CHECK(blocks_of(table, 5) == blocks);
  CHECK(*table.num_tokens(5) == 6);
  CHECK(refs_of(pool) == refs);
  CHECK(table.pending_copy_sources().empty());
}

TEST_CASE("truncate releases blocks past the end", "[block_table]") {
  block_pool pool(8);
  table_t table(pool, 4);
  REQUIRE(table.add_sequence(1).ok());
  REQUIRE(table.append_tokens(1, 10, {}).ok()); // 3 blocks
  const auto blocks = blocks_of(table, 1);

  const auto refs = refs_of(pool);
  CHECK(table.truncate(1, 11).error() == errc::out_of_range);
  CHECK(table.truncate(1, -1).error() == errc::bad_argument);
  CHECK(pool.num_used() == 3);
  CHECK(refs_of(pool) == refs);
  CHECK(blocks_of(table, 1) == blocks);
  CHECK(*table.num_tokens(1) == 10);
  // A length that would pass int32 is out of range, not wrapped.
  CHECK(table.blocks_needed(1, std::numeric_limits<std::int32_t>::max()).error() ==
        errc::out_of_range);
  CHECK(table.append_tokens(1, std::numeric_limits<std::int32_t>::max(), {}).error() ==
        errc::out_of_range);
  CHECK(refs_of(pool) == refs);

  REQUIRE(table.truncate(1, 8).ok()); // exactly two full blocks
  CHECK(*table.num_tokens(1) == 8);
  CHECK(blocks_of(table, 1) == std::vector<block_id>{blocks[0], blocks[1]});
  CHECK(pool.ref_count(blocks[2]) == 0);
  REQUIRE(table.truncate(1, 5).ok()); // into block 1: kept
  CHECK(pool.num_used() == 2);
  REQUIRE(table.truncate(1, 5).ok()); // no-op
  REQUIRE(table.truncate(1, 0).ok());
  CHECK(blocks_of(table, 1).empty());
  CHECK(pool.num_used() == 0);

  // Rolled-back slots are reused by the next append (speculative decoding rollback).
  std::array<token_slot, 3> slots{};
  REQUIRE(table.append_tokens(1, 3, slots).ok());
  CHECK(slots[0].offset == 0);
  CHECK(pool.check_consistency());
}

TEST_CASE("fork shares every block without copying", "[block_table]") {
  block_pool pool(8);
  table_t table(pool, 4);
  REQUIRE(table.add_sequence(1).ok());
  REQUIRE(table.append_tokens(1, 8, {}).ok()); // two full blocks
  REQUIRE(table.fork(1, 2).ok());
  REQUIRE(table.fork(1, 3).ok());
  CHECK(table.fork(1, 2).error() == errc::duplicate_sequence);
  const auto blocks = blocks_of(table, 1);
  CHECK(blocks_of(table, 2) == blocks);
  CHECK(*table.num_tokens(3) == 8);
  CHECK(pool.ref_count(blocks[0]) == 3);
  CHECK(pool.num_used() == 2);

  // Appends after a block boundary need no copy: each child gets its own new block.
  std::array<token_slot, 1> a{};
  std::array<token_slot, 1> b{};
  REQUIRE_FALSE(table.append_tokens(2, 1, a)->copied);
  REQUIRE_FALSE(table.append_tokens(3, 1, b)->copied);
  CHECK(a[0].block != b[0].block);
  CHECK(pool.num_used() == 4);

  REQUIRE(table.free(1).ok());
  CHECK(pool.ref_count(blocks[0]) == 2);
  REQUIRE(table.free(2).ok());
  REQUIRE(table.free(3).ok());
  CHECK(pool.num_free() == 8);
}

TEST_CASE("appending into a shared partial block copies it first", "[block_table]") {
  block_pool pool(8);
  table_t table(pool, 4);
  REQUIRE(table.add_sequence(1).ok());
  REQUIRE(table.append_tokens(1, 6, {}).ok()); // block 1 holds 2 tokens
  REQUIRE(table.fork(1, 2).ok());
  const auto shared = blocks_of(table, 1);
  CHECK(*table.blocks_needed(2, 1) == 1);

  std::array<token_slot, 1> slot{};
  const auto info = table.append_tokens(2, 1, slot);
  REQUIRE(info.ok());
  REQUIRE(info->copied);
  CHECK(info->num_new_blocks == 1);
  CHECK(info->copy.src == shared[1]);
  CHECK(info->copy.dst != shared[1]);
  CHECK(slot[0] == token_slot{info->copy.dst, 2}); // writes land after the copied tokens
  CHECK(blocks_of(table, 2) == std::vector<block_id>{shared[0], info->copy.dst});
  CHECK(blocks_of(table, 1) == shared);
  // The source keeps sequence 2's reference until the engine has run the copy, and the
  // destination one more than its sequence's.
  CHECK(pool.ref_count(shared[1]) == 2);
  CHECK(pool.ref_count(info->copy.dst) == 2);
  REQUIRE(table.pending_copy_sources().size() == 1);
  CHECK(table.pending_copy_sources()[0] == shared[1]);
  REQUIRE(table.pending_copy_destinations().size() == 1);
  CHECK(table.pending_copy_destinations()[0] == info->copy.dst);
  table.release_copy_sources();
  CHECK(table.pending_copy_sources().empty());
  CHECK(table.pending_copy_destinations().empty());
  CHECK(pool.ref_count(shared[1]) == 1);
  CHECK(pool.ref_count(info->copy.dst) == 1);
  CHECK(pool.ref_count(shared[0]) == 2);

  // The parent now owns its last block alone: no further copy.
  std::array<token_slot, 1> parent{};
  const auto own = table.append_tokens(1, 1, parent);
  REQUIRE(own.ok());
  CHECK_FALSE(own->copied);
  CHECK(parent[0] == token_slot{shared[1], 2});
  CHECK(pool.check_consistency());
}

TEST_CASE("the last sequence on a forked block writes in place while the copies wait",
          "[block_table]") {
  // Three sequences share a partly filled block. Within one step the first two to append move to
  // copies; the third is then the block's only holder (the table's pending references belong to
  // sequences that have left), so it writes in place: two copies, not three.
  block_pool pool(8);
  table_t table(pool, 4);
  REQUIRE(table.add_sequence(1).ok());
  REQUIRE(table.append_tokens(1, 6, {}).ok()); // block 1 holds 2 tokens
  REQUIRE(table.fork(1, 2).ok());
  REQUIRE(table.fork(1, 3).ok());
  const auto shared = blocks_of(table, 1);

  std::array<token_slot, 1> slot{};
  const auto second = table.append_tokens(2, 1, slot);
  REQUIRE(second.ok());
  REQUIRE(second->copied);
  CHECK(*table.blocks_needed(3, 1) == 1); // sequence 1 still shares the block
  const auto third = table.append_tokens(3, 1, slot);
  REQUIRE(third.ok());
  REQUIRE(third->copied);
  CHECK(third->copy.src == shared[1]);
  CHECK(third->copy.dst != second->copy.dst);
  CHECK(pool.ref_count(shared[1]) == 3); // sequence 1 and two pending copies

  CHECK(*table.blocks_needed(1, 1) == 0);
  const auto first = table.append_tokens(1, 1, slot);
  REQUIRE(first.ok());
  CHECK_FALSE(first->copied);
  CHECK(first->num_new_blocks == 0);
  CHECK(slot[0] == token_slot{shared[1], 2});
  CHECK(blocks_of(table, 1) == shared);
  // A later append of the same step that fills the block and opens a new one copies nothing.
  const auto more = table.append_tokens(1, 3, {});
  REQUIRE(more.ok());
  CHECK_FALSE(more->copied);
  CHECK(more->num_new_blocks == 1);

  table.release_copy_sources();
  CHECK(pool.ref_count(shared[1]) == 1);
  CHECK(pool.check_consistency());
}

TEST_CASE("copy sources are not reused until the copies have run", "[block_table]") {
  // The hazard: a published block with one holder is copied away; were it released at once, the
  // next allocation of the same step could hand it out as another copy's destination, and a
  // batched copy kernel would read and write it at the same time.
  block_pool pool(3);
  table_t table(pool, 4);
  REQUIRE(table.add_sequence(1).ok());
  REQUIRE(table.append_tokens(1, 6, {}).ok()); // blocks 0, 1
  const auto blocks = blocks_of(table, 1);
  REQUIRE(pool.set_cached(blocks[1], true).ok());
  const auto first = table.append_tokens(1, 1, {}); // copies block 1 into block 2
  REQUIRE(first.ok());
  REQUIRE(first->copied);
  REQUIRE(table.add_sequence(2).ok());
  // Within the same step nothing is left to allocate: the source is still held.
  CHECK(table.append_tokens(2, 1, {}).error() == errc::out_of_blocks);
  table.release_copy_sources(); // the step's copies have run
  const auto later = table.append_tokens(2, 1, {});
  REQUIRE(later.ok());
  CHECK(blocks_of(table, 2)[0] == first->copy.src); // reused only now
}

TEST_CASE("copy destinations are not reused until the copies have run", "[block_table]") {
  // The hazard: a sequence that moved onto a copy is freed (or truncated) later in the same step;
  // were its destination released at once, the next copy of the step could take it as its own
  // destination, and a batched copy kernel would write it twice at the same time.
  for (const bool truncate : {false, true}) {
    block_pool pool(8);
    table_t table(pool, 4);
    REQUIRE(table.add_sequence(1).ok());
    REQUIRE(table.append_tokens(1, 2, {}).ok());
    REQUIRE(table.add_sequence(3).ok());
    REQUIRE(table.append_tokens(3, 2, {}).ok());
    REQUIRE(table.fork(1, 2).ok());
    REQUIRE(table.fork(3, 4).ok());
    // One step: sequence 2 moves onto a copy, is dropped, then sequence 4 moves onto one.
    const auto first = table.append_tokens(2, 1, {});
    REQUIRE(first.ok());
    REQUIRE(first->copied);
    REQUIRE((truncate ? table.truncate(2, 0) : table.free(2)).ok());
    CHECK(pool.ref_count(first->copy.dst) == 1); // only the pending copy's
    const auto second = table.append_tokens(4, 1, {});
    REQUIRE(second.ok());
    REQUIRE(second->copied);
    INFO("truncate " << truncate);
    CHECK(second->copy.dst != first->copy.dst);
    table.release_copy_sources(); // the step's copies have run
    CHECK(pool.ref_count(first->copy.dst) == 0);
    CHECK(pool.ref_count(second->copy.dst) == 1);
    CHECK(pool.check_consistency());
  }
}

TEST_CASE("copy on write is all or nothing when the pool is exhausted", "[block_table]") {
  block_pool pool(2);
  table_t table(pool, 4);
  REQUIRE(table.add_sequence(1).ok());
  REQUIRE(table.append_tokens(1, 6, {}).ok()); // uses both blocks
  REQUIRE(table.fork(1, 2).ok());
  const auto refs = refs_of(pool);
  CHECK(table.append_tokens(2, 1, {}).error() == errc::out_of_blocks);
  CHECK(refs_of(pool) == refs);
  CHECK(blocks_of(table, 2) == blocks_of(table, 1));
  CHECK(*table.num_tokens(2) == 6);
}

TEST_CASE("the destructor releases every block", "[block_table]") {
  block_pool pool(8);
  {
    table_t table(pool, 2);
    REQUIRE(table.add_sequence(1).ok());
    REQUIRE(table.append_tokens(1, 7, {}).ok());
    REQUIRE(table.fork(1, 2).ok());
    table_t moved(std::move(table));
    CHECK(moved.num_sequences() == 2);
    CHECK(pool.num_used() == 4);
  }
  CHECK(pool.num_free() == 8);
  CHECK(pool.check_consistency());
}

TEST_CASE("freed sequence ids can be reused", "[block_table]") {
  block_pool pool(4);
  table_t table(pool, 4);
  REQUIRE(table.add_sequence(1).ok());
  REQUIRE(table.append_tokens(1, 5, {}).ok());
  REQUIRE(table.free(1).ok());
  CHECK_FALSE(table.contains(1));
  REQUIRE(table.add_sequence(1).ok());
  CHECK(*table.num_tokens(1) == 0);
  CHECK(blocks_of(table, 1).empty());
  CHECK(pool.num_free() == 4);
}

TEST_CASE("CSR export matches each sequence's blocks", "[block_table]") {
  block_pool pool(16);
  table_t table(pool, 4);
  const std::array<std::int32_t, 4> lens{5, 0, 8, 1};
  for (seq_id s = 0; s < 4; ++s) {
    REQUIRE(table.add_sequence(s).ok());
    REQUIRE(table.append_tokens(s, lens[s], {}).ok());
  }
  const std::array<seq_id, 4> batch{2, 0, 1, 3};
  CHECK(*table.csr_size(batch) == 2 + 2 + 0 + 1);

  std::array<std::int32_t, 5> indptr{};
  std::array<std::int32_t, 5> indices{};
  std::array<std::int32_t, 4> last{};
  REQUIRE(table.export_csr(batch, indptr, indices, last).ok());
  CHECK(indptr == std::array<std::int32_t, 5>{0, 2, 4, 4, 5});
  CHECK(last == std::array<std::int32_t, 4>{4, 1, 0, 1});
  for (std::size_t b = 0; b < batch.size(); ++b) {
    const auto blocks = blocks_of(table, batch[b]);
    const std::vector<block_id> exported(indices.begin() + indptr[b],
                                         indices.begin() + indptr[b + 1]);
    CHECK(exported == blocks);
  }
}

TEST_CASE("CSR export rejects small buffers and unknown sequences", "[block_table]") {
  block_pool pool(8);
  table_t table(pool, 4);
  REQUIRE(table.add_sequence(1).ok());
  REQUIRE(table.append_tokens(1, 9, {}).ok()); // 3 blocks
  const std::array<seq_id, 1> batch{1};
  const std::array<seq_id, 2> unknown{1, 4};
  std::array<std::int32_t, 2> indptr{};
  std::array<std::int32_t, 2> small_indices{};
  std::array<std::int32_t, 3> indices{};
  std::array<std::int32_t, 1> last{};
  std::array<std::int32_t, 1> short_indptr{};
  CHECK(table.export_csr(batch, indptr, small_indices, last).error() == errc::buffer_too_small);
  CHECK(table.export_csr(batch, short_indptr, indices, last).error() == errc::buffer_too_small);
  CHECK(table.export_csr(batch, indptr, indices, std::span<std::int32_t>{}).error() ==
        errc::buffer_too_small);
  std::array<std::int32_t, 3> indptr3{};
  std::array<std::int32_t, 2> last2{};
  CHECK(table.export_csr(unknown, indptr3, indices, last2).error() == errc::unknown_sequence);
  CHECK(table.csr_size(unknown).error() == errc::unknown_sequence);
  REQUIRE(table.export_csr(batch, indptr, indices, last).ok());
  CHECK(last[0] == 1);
  // An empty batch exports indptr = {0}.
  CHECK(table.export_csr({}, indptr, indices, last).ok());
  CHECK(indptr[0] == 0);
}

TEST_CASE("padded export pads rows and reports lengths", "[block_table]") {
  block_pool pool(16);
  table_t table(pool, 4);
  REQUIRE(table.add_sequence(10).ok());
  REQUIRE(table.add_sequence(11).ok());
  REQUIRE(table.append_tokens(10, 9, {}).ok());
  REQUIRE(table.append_tokens(11, 2, {}).ok());
  const std::array<seq_id, 2> batch{10, 11};
  std::array<std::int32_t, 8> rows{};
  std::array<std::int32_t, 2> lens{};
  REQUIRE(table.export_block_table(batch, 4, rows, lens, -1).ok());
  const auto a = blocks_of(table, 10);
  const auto b = blocks_of(table, 11);
  CHECK(rows == std::array<std::int32_t, 8>{a[0], a[1], a[2], -1, b[0], -1, -1, -1});
  CHECK(lens == std::array<std::int32_t, 2>{9, 2});

  CHECK(table.export_block_table(batch, 2, rows, lens).error() == errc::buffer_too_small);
  CHECK(table.export_block_table(batch, 5, rows, lens).error() == errc::buffer_too_small);
  CHECK(table.export_block_table(batch, -1, rows, lens).error() == errc::bad_argument);
  std::array<std::int32_t, 1> one_len{};
  CHECK(table.export_block_table(batch, 4, rows, one_len).error() == errc::buffer_too_small);
  const std::array<seq_id, 1> unknown{12};
  CHECK(table.export_block_table(unknown, 4, rows, lens).error() == errc::unknown_sequence);
}

TEST_CASE("slot mapping lists the flat slots of each sequence's last tokens", "[block_table]") {
  block_pool pool(16);
  table_t table(pool, 4);
  REQUIRE(table.add_sequence(1).ok());
  REQUIRE(table.add_sequence(2).ok());
  std::array<token_slot, 6> s1{};
  std::array<token_slot, 3> s2{};
  REQUIRE(table.append_tokens(1, 6, s1).ok());
  REQUIRE(table.append_tokens(2, 3, s2).ok());

  const std::array<seq_id, 2> batch{1, 2};
  const std::array<std::int32_t, 2> query_lens{3, 1}; // e.g. a prefill chunk and a decode
  std::array<std::int64_t, 4> mapping{};
  REQUIRE(table.export_slot_mapping(batch, query_lens, mapping).ok());
  CHECK(mapping ==
        std::array<std::int64_t, 4>{s1[3].flat(4), s1[4].flat(4), s1[5].flat(4), s2[2].flat(4)});

  const std::array<std::int32_t, 2> too_long{7, 1};
  const std::array<std::int32_t, 2> negative{-1, 1};
  const std::array<std::int32_t, 1> short_lens{1};
  std::array<std::int64_t, 3> small{};
  CHECK(table.export_slot_mapping(batch, too_long, mapping).error() == errc::out_of_range);
  CHECK(table.export_slot_mapping(batch, negative, mapping).error() == errc::bad_argument);
  CHECK(table.export_slot_mapping(batch, short_lens, mapping).error() == errc::bad_argument);
  const std::array<std::int32_t, 2> four{3, 1};
  const std::array<std::int32_t, 2> five{4, 1};
  CHECK(table.export_slot_mapping(batch, four, small).error() == errc::buffer_too_small);
  CHECK(table.export_slot_mapping(batch, five, mapping).error() == errc::buffer_too_small);
  const std::array<seq_id, 1> unknown{3};
  CHECK(table.export_slot_mapping(unknown, query_lens, mapping).error() == errc::unknown_sequence);
}

namespace {

// A different allocator behind the same concept: ids from a sorted free set, counts in a map.
class map_allocator {
public:
  explicit map_allocator(std::int32_t capacity) : capacity_(capacity) {
    for (block_id i = capacity - 1; i >= 0; --i) {
      free_.push_back(i);
    }
  }
  kvkit::status allocate(std::span<block_id> out) {
    if (out.size() > free_.size()) {
      return errc::out_of_blocks;
    }
    for (block_id& id : out) {
      id = free_.back();
      free_.pop_back();
      refs_[id] = 1;
    }
    return {};
  }
  kvkit::status retain(block_id id) {
    const auto it = refs_.find(id);
    if (it == refs_.end()) {
      return errc::invalid_block;
    }
    if (retains_left_ == 0) {
      return errc::out_of_range; // as a count at its maximum would
    }
    --retains_left_;
    ++it->second;
    return {};
  }
  //! The next `n` retains succeed and the one after fails (-1: none fails).
  void fail_retain_after(std::int32_t n) { retains_left_ = n; }
  kvkit::status release(block_id id) {
    const auto it = refs_.find(id);
    if (it == refs_.end()) {
      return errc::double_release;
    }
    if (--it->second == 0) {
      refs_.erase(it);
      free_.push_back(id);
    }
    return {};
  }
  std::int32_t ref_count(block_id id) const {
    const auto it = refs_.find(id);
    return it == refs_.end() ? 0 : it->second;
  }
  std::int32_t num_free() const { return static_cast<std::int32_t>(free_.size()); }
  std::int32_t capacity() const { return capacity_; }

private:
  std::int32_t capacity_;
  std::int32_t retains_left_ = -1;
  std::vector<block_id> free_;
  std::map<block_id, std::int32_t> refs_;
};

static_assert(kvkit::block_allocator<map_allocator>);

} // namespace

TEST_CASE("block_table works over any block_allocator", "[block_table]") {
  map_allocator alloc(4);
  kvkit::block_table<map_allocator> table(alloc, 2);
  REQUIRE(table.add_sequence(1).ok());
  REQUIRE(table.append_tokens(1, 3, {}).ok());
  REQUIRE(table.fork(1, 2).ok());
  const auto info = table.append_tokens(2, 1, {});
  REQUIRE(info.ok());
  CHECK(info->copied);
  CHECK(alloc.num_free() == 1);
  CHECK(table.append_tokens(1, 5, {}).error() == errc::out_of_blocks);
  table.release_copy_sources();
  REQUIRE(table.free(1).ok());
  REQUIRE(table.free(2).ok());
  CHECK(alloc.num_free() == 4);
}

TEST_CASE("a fork whose allocator refuses a reference partway takes none", "[block_table]") {
  map_allocator alloc(8);
  kvkit::block_table<map_allocator> table(alloc, 2);
  REQUIRE(table.add_sequence(1).ok());
  REQUIRE(table.append_tokens(1, 5, {}).ok()); // three blocks
  const auto parent = std::vector<block_id>(table.blocks(1)->begin(), table.blocks(1)->end());
  REQUIRE(parent.size() == 3);
  for (std::int32_t ok_retains = 0; ok_retains < 3; ++ok_retains) {
    alloc.fail_retain_after(ok_retains);
    CHECK(table.fork(1, 2).error() == errc::out_of_range);
    CHECK_FALSE(table.contains(2));
    CHECK(table.num_sequences() == 1);
    for (const block_id b : parent) {
      CHECK(alloc.ref_count(b) == 1);
    }
    CHECK(alloc.num_free() == 5);
  }
  alloc.fail_retain_after(-1);
  REQUIRE(table.fork(1, 2).ok());
  for (const block_id b : parent) {
    CHECK(alloc.ref_count(b) == 2);
  }
  CHECK(*table.num_tokens(2) == 5);
  REQUIRE(table.free(1).ok());
  REQUIRE(table.free(2).ok());
  CHECK(alloc.num_free() == 8);
}

TEST_CASE("adopt_sequence takes over references the caller holds", "[block_table]") {
  block_pool pool(8);
  table_t table(pool, 4);
  std::array<block_id, 2> held{};
  REQUIRE(pool.allocate(held).ok());
  const auto refs = refs_of(pool);
  CHECK(table.adopt_sequence(1, held, 9).error() == errc::bad_argument); // 9 tokens need 3
  CHECK(table.adopt_sequence(1, held, 4).error() == errc::bad_argument); // 4 tokens need 1
  CHECK(table.adopt_sequence(1, held, -1).error() == errc::bad_argument);
  const std::array<block_id, 2> freed{held[0], 7};
  CHECK(table.adopt_sequence(1, freed, 6).error() == errc::invalid_block);
  // One block in two places, even with a reference for each: its pages would be one page.
  REQUIRE(pool.retain(held[0]).ok());
  const std::array<block_id, 2> twice{held[0], held[0]};
  CHECK(table.adopt_sequence(1, twice, 6).error() == errc::bad_argument);
  CHECK_FALSE(table.contains(1));
  REQUIRE(pool.release(held[0]).ok());
  CHECK(refs_of(pool) == refs);
  REQUIRE(table.adopt_sequence(1, held, 6).ok());
  CHECK(table.adopt_sequence(1, held, 6).error() == errc::duplicate_sequence);
  CHECK(*table.num_tokens(1) == 6);
  CHECK(blocks_of(table, 1) == std::vector<block_id>(held.begin(), held.end()));
  CHECK(refs_of(pool) == refs); // no new references: the table owns the caller's
  REQUIRE(table.free(1).ok());
  CHECK(pool.num_free() == 8);
}

TEST_CASE("a published block is copied before a write even with one holder", "[block_table]") {
  block_pool pool(8);
  table_t table(pool, 4);
  REQUIRE(table.add_sequence(1).ok());
  REQUIRE(table.append_tokens(1, 8, {}).ok());
  const auto blocks = blocks_of(table, 1);
  REQUIRE(pool.set_cached(blocks[1], true).ok()); // a prefix cache published block 1
  REQUIRE(table.truncate(1, 6).ok());             // speculative rollback into it
  std::array<token_slot, 1> slot{};
  const auto info = table.append_tokens(1, 1, slot);
  REQUIRE(info.ok());
  CHECK(info->copied);
  CHECK(info->copy.src == blocks[1]);
  CHECK(slot[0] == token_slot{info->copy.dst, 2});
  CHECK(pool.ref_count(blocks[1]) == 1); // held until the copy has run
  table.release_copy_sources();
  CHECK(pool.ref_count(blocks[1]) == 0); // evictable, its contents intact
  CHECK(pool.num_evictable() == 1);
  CHECK(pool.check_consistency());
}
