#pragma once
//! Eviction policies for the prefix cache: plain LRU, and retention priorities over LRU.

#include <algorithm>
#include <cstdint>

#include "kvkit/concepts/eviction_policy.hpp"

namespace kvkit {

//! Least recently used first, every block alike.
struct lru {
  [[nodiscard]] std::int32_t num_levels() const noexcept { return 1; }
  [[nodiscard]] std::int32_t level(const eviction_hint& /*hint*/) const noexcept { return 0; }
};

//! Retention priorities: tokens an engine marks as valuable (a shared system prompt, a document
//! many requests query) outlive one-off conversation turns under memory pressure.
//!
//! A block's priority (0..100, from the `retention` the engine gave its sequence) maps to one of
//! `num_levels` levels; every block of a lower level is reclaimed before any block of a higher
//! one, LRU within a level. Priority 0 is the default, so without retention hints this is LRU.
class retention_priority {
public:
  //! `num_levels` priority bands (clamped to 2..8); priority p falls in band p * levels / 101.
  explicit retention_priority(std::int32_t num_levels = 4) noexcept
      : levels_(std::clamp(num_levels, 2, 8)) {}

  [[nodiscard]] std::int32_t num_levels() const noexcept { return levels_; }
  [[nodiscard]] std::int32_t level(const eviction_hint& hint) const noexcept {
    return std::clamp(hint.priority, 0, 100) * levels_ / 101;
  }

private:
  std::int32_t levels_;
};

static_assert(eviction_policy<lru>);
static_assert(eviction_policy<retention_priority>);

} // namespace kvkit
