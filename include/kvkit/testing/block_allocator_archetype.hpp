#pragma once
//! The smallest type that models `block_allocator`: instantiate generic code with it to prove the
//! code asks nothing of an allocator beyond the concept.

#include <cstdint>
#include <span>

#include "kvkit/block/types.hpp"
#include "kvkit/concepts/block_allocator.hpp"
#include "kvkit/error.hpp"

namespace kvkit::testing {

//! Models `block_allocator` and nothing more: no default constructor, no copies, no extras.
//! It owns no blocks: every allocation fails, so it is fit for compile-time checks only.
class block_allocator_archetype {
public:
  explicit block_allocator_archetype(int /*tag*/) noexcept {}
  block_allocator_archetype(const block_allocator_archetype&) = delete;
  block_allocator_archetype& operator=(const block_allocator_archetype&) = delete;

  [[nodiscard]] status allocate(std::span<block_id> out) noexcept {
    return out.empty() ? status{} : status{errc::out_of_blocks};
  }
  [[nodiscard]] status retain(block_id /*id*/) noexcept { return errc::invalid_block; }
  [[nodiscard]] status release(block_id /*id*/) noexcept { return errc::invalid_block; }
  [[nodiscard]] std::int32_t ref_count(block_id /*id*/) const noexcept { return -1; }
  [[nodiscard]] std::int32_t num_free() const noexcept { return 0; }
  [[nodiscard]] std::int32_t capacity() const noexcept { return 0; }
};

static_assert(block_allocator<block_allocator_archetype>);

} // namespace kvkit::testing
