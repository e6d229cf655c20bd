#pragma once
//! The smallest type that models `scheduling_policy`.

#include "kvkit/concepts/scheduling_policy.hpp"

namespace kvkit::testing {

//! Models `scheduling_policy` and nothing more (no default constructor): arrival order.
class scheduling_policy_archetype {
public:
  explicit scheduling_policy_archetype(int /*tag*/) noexcept {}
  [[nodiscard]] bool before(const request_order_info& a,
                            const request_order_info& b) const noexcept {
    return a.arrival < b.arrival;
  }
};

static_assert(scheduling_policy<scheduling_policy_archetype>);

} // namespace kvkit::testing
