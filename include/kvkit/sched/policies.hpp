#pragma once
//! Scheduling policies: first come first served, and priorities.

#include "kvkit/concepts/scheduling_policy.hpp"

namespace kvkit {

//! First come, first served: requests run in arrival order; the newest is preempted first.
struct fcfs {
  [[nodiscard]] bool before(const request_order_info& a,
                            const request_order_info& b) const noexcept {
    return a.arrival < b.arrival;
  }
};

//! Higher priority first, arrival order among equals; the lowest-priority, newest request is
//! preempted first.
struct priority_first {
  [[nodiscard]] bool before(const request_order_info& a,
                            const request_order_info& b) const noexcept {
    return a.priority != b.priority ? a.priority > b.priority : a.arrival < b.arrival;
  }
};

static_assert(scheduling_policy<fcfs>);
static_assert(scheduling_policy<priority_first>);

} // namespace kvkit
