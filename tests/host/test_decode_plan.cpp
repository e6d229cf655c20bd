#include <vector>

#include <catch2/catch.hpp>

#include "kvkit/attention/decode_plan.hpp"

using kvkit::decode_plan;
using kvkit::decode_shape;

TEST_CASE("plan_decode splits long sequences to fill the GPU, within its limits",
          "[attention][plan]") {
  const decode_shape shape{1, 32, 8, 128, 0};
  const std::vector<std::int32_t> one{2048};
  const auto plan = kvkit::plan_decode(shape, one, 132);
  REQUIRE(plan.ok());
  CHECK(plan->chunk_tokens % decode_plan::tile_tokens == 0);
  CHECK(plan->max_splits > 1);
  CHECK(static_cast<std::int64_t>(plan->max_splits) * shape.num_kv_heads <= 2 * 132);
  CHECK(plan->workspace_bytes() > plan->counter_bytes());

  // A batch that fills the GPU on its own is not split and needs no workspace.
  const decode_shape big{128, 32, 8, 128, 0};
  const std::vector<std::int32_t> lens(128, 4096);
  const auto whole = kvkit::plan_decode(big, lens, 132);
  REQUIRE(whole.ok());
  CHECK(whole->max_splits == 1);
  CHECK(whole->workspace_bytes() == 0);

  // However many multiprocessors, a sequence is never cut into more than max_splits_limit.
  const std::vector<std::int32_t> long_one{1 << 20};
  const auto many = kvkit::plan_decode({1, 8, 1, 128, 0}, long_one, 1 << 20);
  REQUIRE(many.ok());
  CHECK(many->max_splits <= decode_plan::max_splits_limit);
  const auto graph = kvkit::plan_decode_graph_safe({1, 8, 1, 128, 0}, 1 << 20, 1 << 20);
  REQUIRE(graph.ok());
  CHECK(graph->graph_safe);
  CHECK(graph->max_splits <= decode_plan::max_splits_limit);

  // A window bounds the keys attended, so the split count too.
  const auto windowed = kvkit::plan_decode({1, 32, 8, 128, 256}, long_one, 132);
  REQUIRE(windowed.ok());
  CHECK(static_cast<std::int64_t>(windowed->max_splits) * windowed->chunk_tokens < 256 + 2 * 128);
}

TEST_CASE("plan_decode rejects bad shapes and lengths", "[attention][plan]") {
  const std::vector<std::int32_t> lens{1, 2};
  CHECK(kvkit::plan_decode({2, 8, 2, 128, 0}, lens, 132).ok());
  CHECK(kvkit::plan_decode({2, 8, 2, 96, 0}, lens, 132).error() == kvkit::errc::bad_argument);
  CHECK(kvkit::plan_decode({2, 8, 3, 128, 0}, lens, 132).error() == kvkit::errc::bad_argument);
  CHECK(kvkit::plan_decode({2, 34, 2, 128, 0}, lens, 132).error() == kvkit::errc::bad_argument);
  CHECK(kvkit::plan_decode({3, 8, 2, 128, 0}, lens, 132).error() == kvkit::errc::bad_argument);
  CHECK(kvkit::plan_decode({2, 8, 2, 128, -1}, lens, 132).error() == kvkit::errc::bad_argument);
  CHECK(kvkit::plan_decode({2, 8, 2, 128, 0}, std::vector<std::int32_t>{1, 0}, 132).error() ==
        kvkit::errc::bad_argument);
  CHECK(kvkit::plan_decode({2, 8, 2, 128, 0}, lens, 0).error() == kvkit::errc::bad_argument);
  CHECK(kvkit::plan_decode_graph_safe({2, 8, 2, 128, 0}, 0, 132).error() ==
        kvkit::errc::bad_argument);
}
