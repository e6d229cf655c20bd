#pragma once
//! The smallest type that models `block_hasher`.

#include <cstddef>
#include <span>

#include "kvkit/block/types.hpp"
#include "kvkit/concepts/block_hasher.hpp"

namespace kvkit::testing {

//! Models `block_hasher` and nothing more (no default constructor). Its key is the parent key with
//! the token count added: a valid but weak hash, fit for compile-time checks and tests that want
//! collisions.
class block_hasher_archetype {
public:
  explicit block_hasher_archetype(int /*tag*/) noexcept {}
  [[nodiscard]] block_key operator()(const block_key& parent, std::span<const token_id> tokens,
                                     std::span<const std::byte> extra) const noexcept {
    return block_key{parent.lo + tokens.size(), parent.hi + extra.size()};
  }
};

static_assert(block_hasher<block_hasher_archetype>);

} // namespace kvkit::testing
