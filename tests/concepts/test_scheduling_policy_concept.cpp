// scheduling_policy: kvkit's policies and the archetype model it; types that break one rule do
// not; the scheduler asks nothing of its pieces beyond their concepts.

#include <catch2/catch.hpp>

#include "kvkit/concepts/scheduling_policy.hpp"
#include "kvkit/sched/policies.hpp"
#include "kvkit/sched/scheduler.hpp"
#include "kvkit/testing/block_allocator_archetype.hpp"
#include "kvkit/testing/block_mapping_archetype.hpp"
#include "kvkit/testing/prefix_index_archetype.hpp"
#include "kvkit/testing/scheduling_policy_archetype.hpp"

using kvkit::request_order_info;
using kvkit::scheduling_policy;

namespace {

struct before_is_mutable {
  bool before(const request_order_info&, const request_order_info&) { return false; }
};
struct before_returns_int {
  int before(const request_order_info&, const request_order_info&) const { return 0; }
};
struct orders_ids {
  bool before(kvkit::seq_id, kvkit::seq_id) const { return false; }
};
struct not_copyable {
  not_copyable() = default;
  not_copyable(const not_copyable&) = delete;
  bool before(const request_order_info&, const request_order_info&) const { return false; }
};

} // namespace

// The scheduler over the archetypes of every piece it composes.
template class kvkit::scheduler<
    kvkit::testing::block_mapping_archetype, kvkit::testing::prefix_index_archetype,
    kvkit::testing::block_allocator_archetype, kvkit::testing::scheduling_policy_archetype>;

TEST_CASE("scheduling_policy models and one-defect types", "[concepts][scheduler]") {
  STATIC_REQUIRE(scheduling_policy<kvkit::fcfs>);
  STATIC_REQUIRE(scheduling_policy<kvkit::priority_first>);
  STATIC_REQUIRE(scheduling_policy<kvkit::testing::scheduling_policy_archetype>);
  STATIC_REQUIRE_FALSE(scheduling_policy<before_is_mutable>);
  STATIC_REQUIRE_FALSE(scheduling_policy<before_returns_int>);
  STATIC_REQUIRE_FALSE(scheduling_policy<orders_ids>);
  STATIC_REQUIRE_FALSE(scheduling_policy<not_copyable>);
}

TEST_CASE("policies order requests", "[concepts][scheduler]") {
  const request_order_info early{1, 0, 0};
  const request_order_info late_urgent{2, 5, 9};
  CHECK(kvkit::fcfs{}.before(early, late_urgent));
  CHECK_FALSE(kvkit::fcfs{}.before(late_urgent, early));
  CHECK(kvkit::priority_first{}.before(late_urgent, early));
  CHECK(kvkit::priority_first{}.before(early, request_order_info{3, 1, 0}));
}
