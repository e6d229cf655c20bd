#pragma once
//! The smallest type that models `eviction_policy`.

#include <cstdint>

#include "kvkit/concepts/eviction_policy.hpp"

namespace kvkit::testing {

//! Models `eviction_policy` and nothing more (no default constructor): one level, like LRU.
class eviction_policy_archetype {
public:
  explicit eviction_policy_archetype(int /*tag*/) noexcept {}
  [[nodiscard]] std::int32_t num_levels() const noexcept { return 1; }
  [[nodiscard]] std::int32_t level(const eviction_hint& /*hint*/) const noexcept { return 0; }
};

static_assert(eviction_policy<eviction_policy_archetype>);

} // namespace kvkit::testing
