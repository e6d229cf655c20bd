// block_mapping: kvkit's table and the archetype model it; types that break one rule do not.

#include <catch2/catch.hpp>

#include "kvkit/block/block_pool.hpp"
#include "kvkit/block/block_table.hpp"
#include "kvkit/concepts/block_mapping.hpp"
#include "kvkit/testing/block_allocator_archetype.hpp"
#include "kvkit/testing/block_mapping_archetype.hpp"

using kvkit::block_mapping;
using kvkit::result;
using kvkit::seq_id;
using kvkit::status;
using kvkit::testing::block_mapping_archetype;

namespace {

using archetype = block_mapping_archetype;

struct no_fork : archetype {
  using archetype::archetype;
  status fork(seq_id, seq_id) = delete;
};
struct no_truncate : archetype {
  using archetype::archetype;
  status truncate(seq_id, std::int32_t) = delete;
};
struct plain_token_count : archetype {
  using archetype::archetype;
  std::int32_t num_tokens(seq_id) const { return 0; }
};
struct append_returns_status : archetype {
  using archetype::archetype;
  status append_tokens(seq_id, std::int32_t, std::span<kvkit::token_slot>) { return {}; }
};
struct no_csr_export : archetype {
  using archetype::archetype;
  status export_csr(std::span<const seq_id>, std::span<std::int32_t>, std::span<std::int32_t>,
                    std::span<std::int32_t>) const = delete;
};
struct slot_mapping_of_int32 : archetype {
  using archetype::archetype;
  status export_slot_mapping(std::span<const seq_id>, std::span<const std::int32_t>,
                             std::span<std::int64_t>) const = delete;
  status export_slot_mapping(std::span<const seq_id>, std::span<const std::int32_t>,
                             std::span<std::int32_t>) const {
    return {};
  }
};
struct no_free : archetype {
  using archetype::archetype;
  status free(seq_id) = delete;
};
struct non_const_blocks : archetype {
  using archetype::archetype;
  result<std::span<const kvkit::block_id>> blocks(seq_id) const = delete;
  result<std::span<const kvkit::block_id>> blocks(seq_id) { return kvkit::errc::bad_argument; }
};

} // namespace

TEST_CASE("block_mapping models and one-defect types", "[concepts][block_table]") {
  STATIC_REQUIRE(block_mapping<kvkit::block_table<kvkit::block_pool>>);
  STATIC_REQUIRE(block_mapping<kvkit::block_table<kvkit::testing::block_allocator_archetype>>);
  STATIC_REQUIRE(block_mapping<archetype>);
  STATIC_REQUIRE_FALSE(block_mapping<no_fork>);
  STATIC_REQUIRE_FALSE(block_mapping<no_truncate>);
  STATIC_REQUIRE_FALSE(block_mapping<plain_token_count>);
  STATIC_REQUIRE_FALSE(block_mapping<append_returns_status>);
  STATIC_REQUIRE_FALSE(block_mapping<no_csr_export>);
  STATIC_REQUIRE_FALSE(block_mapping<slot_mapping_of_int32>);
  STATIC_REQUIRE_FALSE(block_mapping<no_free>);
  STATIC_REQUIRE_FALSE(block_mapping<non_const_blocks>);
  STATIC_REQUIRE_FALSE(block_mapping<kvkit::block_pool>);
}

TEST_CASE("the mapping archetype answers every call with an error", "[concepts][block_table]") {
  archetype m(0);
  CHECK_FALSE(m.contains(1));
  CHECK(m.num_tokens(1).error() == kvkit::errc::unknown_sequence);
  CHECK_FALSE(m.add_sequence(1).ok());
  CHECK_FALSE(m.append_tokens(1, 1, {}).ok());
}
