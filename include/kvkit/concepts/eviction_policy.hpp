#pragma once
//! The `eviction_policy` concept: how a prefix cache orders unreferenced cached blocks for reuse.

#include <concepts>
#include <cstdint>

namespace kvkit {

//! What a policy knows about a block when it is published.
struct eviction_hint {
  std::int32_t block_index = 0; //!< position of the block in its sequence (0 = first block)
  std::int32_t priority = 0;    //!< the retention priority the engine gave these tokens, 0..100
};

//! Orders cached blocks for eviction by assigning each an eviction level when it is published.
//!
//! Required expressions, for `const P& p`, `eviction_hint hint`:
//!  - `p.num_levels()` -> `std::int32_t`: how many levels it uses, 1 .. block_pool's maximum.
//!  - `p.level(hint)` -> `std::int32_t`: the block's level, 0 .. num_levels()-1.
//!
//! Semantics: once unreferenced, blocks of a lower level are reclaimed before any block of a higher
//! level; within a level the least recently released goes first (the pool keeps that order in
//! O(1)). Sequences release their blocks last first, so a chain's tail goes before its head.
template <class P>
concept eviction_policy = std::copy_constructible<P> &&
    requires(const P& p, const eviction_hint& hint) {
  { p.num_levels() } -> std::same_as<std::int32_t>;
  { p.level(hint) } -> std::same_as<std::int32_t>;
};

} // namespace kvkit
