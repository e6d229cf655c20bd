// block_allocator: kvkit's pool and the archetype model it; types that break one rule do not.

#include <cstddef>

#include <catch2/catch.hpp>

#include "kvkit/block/block_pool.hpp"
#include "kvkit/block/block_table.hpp"
#include "kvkit/concepts/block_allocator.hpp"
#include "kvkit/testing/block_allocator_archetype.hpp"

using kvkit::block_allocator;
using kvkit::block_id;
using kvkit::status;
using kvkit::testing::block_allocator_archetype;

namespace {

struct no_allocate : block_allocator_archetype {
  using block_allocator_archetype::block_allocator_archetype;
  status allocate(std::span<block_id>) = delete;
};
struct allocate_returns_bool : block_allocator_archetype {
  using block_allocator_archetype::block_allocator_archetype;
  bool allocate(std::span<block_id>) { return false; }
};
struct allocate_takes_count : block_allocator_archetype {
  using block_allocator_archetype::block_allocator_archetype;
  status allocate(std::span<block_id>) = delete;
  status allocate(int) { return {}; }
};
struct no_retain : block_allocator_archetype {
  using block_allocator_archetype::block_allocator_archetype;
  status retain(block_id) = delete;
};
struct no_release : block_allocator_archetype {
  using block_allocator_archetype::block_allocator_archetype;
  status release(block_id) = delete;
};
struct mutable_ref_count : block_allocator_archetype {
  using block_allocator_archetype::block_allocator_archetype;
  std::int32_t ref_count(block_id) const = delete;
  std::int32_t ref_count(block_id) { return 0; }
};
struct size_t_free_count : block_allocator_archetype {
  using block_allocator_archetype::block_allocator_archetype;
  std::size_t num_free() const { return 0; }
};
struct no_capacity : block_allocator_archetype {
  using block_allocator_archetype::block_allocator_archetype;
  std::int32_t capacity() const = delete;
};

} // namespace

// The generic table asks nothing of its allocator beyond the concept.
template class kvkit::block_table<block_allocator_archetype>;

TEST_CASE("block_allocator models and one-defect types", "[concepts][block_pool]") {
  STATIC_REQUIRE(block_allocator<kvkit::block_pool>);
  STATIC_REQUIRE(block_allocator<block_allocator_archetype>);
  STATIC_REQUIRE_FALSE(block_allocator<no_allocate>);
  STATIC_REQUIRE_FALSE(block_allocator<allocate_returns_bool>);
  STATIC_REQUIRE_FALSE(block_allocator<allocate_takes_count>);
  STATIC_REQUIRE_FALSE(block_allocator<no_retain>);
  STATIC_REQUIRE_FALSE(block_allocator<no_release>);
  STATIC_REQUIRE_FALSE(block_allocator<mutable_ref_count>);
  STATIC_REQUIRE_FALSE(block_allocator<size_t_free_count>);
  STATIC_REQUIRE_FALSE(block_allocator<no_capacity>);
  STATIC_REQUIRE_FALSE(block_allocator<int>);
}

TEST_CASE("block_table over the archetype fails cleanly at run time", "[concepts][block_table]") {
  block_allocator_archetype alloc(0);
  kvkit::block_table<block_allocator_archetype> table(alloc, 16);
  REQUIRE(table.add_sequence(1).ok());
  CHECK(table.append_tokens(1, 1, {}).error() == kvkit::errc::out_of_blocks);
  CHECK(*table.num_tokens(1) == 0);
  REQUIRE(table.append_tokens(1, 0, {}).ok());
}
