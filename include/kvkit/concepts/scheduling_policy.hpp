#pragma once
//! The `scheduling_policy` concept: in which order requests are admitted and preempted.

#include <concepts>
#include <cstdint>

#include "kvkit/block/types.hpp"

namespace kvkit {

//! What a policy may look at when it orders two requests.
struct request_order_info {
  seq_id id = 0;
  std::int64_t arrival = 0;  //!< admission order of add_request calls (0, 1, 2, ...)
  std::int32_t priority = 0; //!< higher runs first under a priority policy
};

//! A strict weak ordering of requests: `p.before(a, b)` -> `bool` is true when `a` should be
//! served before `b`. The scheduler admits waiting requests in this order and, when blocks run
//! out, preempts the running request that comes last. It must be deterministic and must order
//! every two distinct requests (break ties by `arrival`), so scheduling is reproducible.
template <class P>
concept scheduling_policy = std::copy_constructible<P> &&
    requires(const P& p, const request_order_info& a) {
  { p.before(a, a) } -> std::same_as<bool>;
};

} // namespace kvkit
