#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include <catch2/catch.hpp>

#include "host/test_seed.hpp"
#include "kvkit/attention/decode_plan.hpp"
#include "kvkit/layout/page_layout.hpp"
#include "kvkit/quant/codecs.hpp"

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

TEST_CASE("a plan's workspace holds every partial result where the kernel puts it",
          "[attention][plan]") {
  // The kernel stores partial outputs 16 bytes at a time from partial_outputs_offset(), after the
  // counters and one log-sum-exp a row; with a row count that is not a multiple of four (one
  // query head, one sequence, 17 splits) the outputs start past the log-sum-exps' own bytes, and
  // the workspace must still hold them all.
  const kvkit::paged_layout<kvkit::bf16_codec> layout(16, 1, 128);
  for (const std::int32_t batch : {1, 2, 3, 5}) {
    for (const std::int32_t len : {300, 2077, 2199, 2321, 5000}) {
      const std::vector<std::int32_t> lens(static_cast<std::size_t>(batch), len);
      const auto plan = kvkit::plan_decode(kvkit::decode_shape_for(layout, batch, 1, 0), lens, 132);
      REQUIRE(plan.ok());
      INFO("batch " << batch << " len " << len << " splits " << plan->max_splits);
      if (plan->max_splits <= 1) {
        CHECK(plan->workspace_bytes() == 0);
        continue;
      }
      const std::size_t rows = plan->partial_rows();
      CHECK(rows == static_cast<std::size_t>(batch) * static_cast<std::size_t>(plan->max_splits));
      CHECK(plan->counter_count() == static_cast<std::size_t>(batch)); // one KV head
      CHECK(plan->counter_bytes() >= plan->counter_count() * sizeof(std::uint32_t));
      CHECK(plan->counter_bytes() % 16 == 0);
      CHECK(plan->partial_outputs_offset() % 16 == 0);
      CHECK(plan->partial_outputs_offset() >= plan->counter_bytes() + rows * sizeof(float));
      CHECK(plan->workspace_bytes() == plan->partial_outputs_offset() + rows * 128 * sizeof(float));
    }
  }
  // The case that once ran past the end: 17 rows, whose log-sum-exps take 68 bytes and the
  // outputs start 80 bytes after the counters.
  const auto odd = kvkit::plan_decode(kvkit::decode_shape_for(layout, 1, 1, 0),
                                      std::vector<std::int32_t>{2077}, 132);
  REQUIRE(odd.ok());
  REQUIRE(odd->max_splits == 17);
  CHECK(odd->partial_outputs_offset() == odd->counter_bytes() + 80);
  CHECK(odd->workspace_bytes() == odd->counter_bytes() + 80 + 17 * 128 * 4);
}

TEST_CASE("a plan's counters grow with its batch, over the bytes a smaller batch's plan writes",
          "[attention][plan]") {
  // Why decode_args::zeroed_counters live apart from the workspace: a workspace zeroed once
  // would hold, where a plan for 40 sequences of 2 KV heads counts arrivals (80 counters), the
  // partial log-sum-exps of a plan for 2 sequences (4 counters, 256 bytes of them).
  const kvkit::paged_layout<kvkit::bf16_codec> layout(16, 2, 128);
  const auto small = kvkit::plan_decode(kvkit::decode_shape_for(layout, 2, 8, 0),
                                        std::vector<std::int32_t>{1, 6000}, 4096);
  const auto large = kvkit::plan_decode(kvkit::decode_shape_for(layout, 40, 8, 0),
                                        std::vector<std::int32_t>(40, 600), 4096);
  REQUIRE(small.ok());
  REQUIRE(large.ok());
  CHECK(small->counter_count() == 4);
  CHECK(large->counter_count() == 80);
  REQUIRE(small->workspace_bytes() > 0);
  CHECK(large->counter_count() * sizeof(std::uint32_t) > small->counter_bytes());
  CHECK(small->partial_outputs_offset() > small->counter_bytes()); // its log-sum-exps are there
}

TEST_CASE("plan_decode keeps a sequence within a cluster's splits where that costs little",
          "[attention][plan]") {
  const decode_shape shape{1, 32, 8, 128, 0};
  const auto splits = [&](std::int32_t len) {
    const auto plan = kvkit::plan_decode(shape, std::vector<std::int32_t>{len}, 132);
    REQUIRE(plan.ok());
    CHECK(plan->chunk_tokens % decode_plan::tile_tokens == 0);
    CHECK(static_cast<std::int64_t>(plan->max_splits) * plan->chunk_tokens >= len);
    return plan->max_splits;
  };
  // 16 splits of 128 keys would fill more of the GPU; 8 of 256 merge in a cluster.
  CHECK(splits(2048) == decode_plan::max_cluster_splits);
  // 32 splits of 256 keys stay: 8 would be four times as long.
  CHECK(splits(8192) == 32);
  // Room for twice the blocks: down to one 64-key tile a warp.
  CHECK(splits(512) == decode_plan::max_cluster_splits);
  CHECK(splits(100) == 2);
  // A batch that fills the GPU keeps its plan: 4 splits for 8 sequences of 8192 keys.
  const auto batch =
      kvkit::plan_decode({8, 32, 8, 128, 0}, std::vector<std::int32_t>(8, 8192), 132);
  REQUIRE(batch.ok());
  CHECK(batch->max_splits == 4);
  // Cut evenly: 4 splits of 2048 keys, not 3 of 2112 and a last one of 1856.
  CHECK(batch->chunk_tokens == 2048);
  // Unless the even cut takes more blocks: the sequence of 2100 keys would need two of 2048.
  std::vector<std::int32_t> mixed(8, 8192);
  mixed[7] = 2100;
  const auto uneven = kvkit::plan_decode({8, 32, 8, 128, 0}, mixed, 132);
  REQUIRE(uneven.ok());
  CHECK(uneven->max_splits == 4);
  CHECK(uneven->chunk_tokens == 2112);
}

TEST_CASE("plan_decode cuts the longest sequence evenly where that adds no block",
          "[attention][plan]") {
  // Every plan of a sweep: its chunk is the fewest whole tiles that give the longest sequence
  // its split count, or the even chunk would take more blocks.
  const auto blocks = [](const std::vector<std::int32_t>& lens, std::int64_t chunk) {
    std::int64_t n = 0;
    for (const std::int32_t len : lens) {
      n += (len + chunk - 1) / chunk;
    }
    return n;
  };
  std::uint32_t seed = 7;
  const auto next = [&] {
    seed = seed * 1664525U + 1013904223U;
    return seed >> 8;
  };
  for (int trial = 0; trial < 300; ++trial) {
    const auto batch = static_cast<std::int32_t>(1 + next() % 64);
    std::vector<std::int32_t> lens(static_cast<std::size_t>(batch));
    for (auto& len : lens) {
      len = static_cast<std::int32_t>(1 + next() % 40000);
    }
    const std::int32_t bits = trial % 3 == 0 ? 16 : (trial % 3 == 1 ? 8 : 4);
    decode_shape shape{batch, 32, 8, 128, 0, bits, bits < 16, 16};
    const auto plan = kvkit::plan_decode(shape, lens, 132);
    INFO("trial " << trial << " seed " << seed << " batch " << batch << " bits " << bits);
    REQUIRE(plan.ok());
    const std::int64_t max_len = *std::max_element(lens.begin(), lens.end());
    const std::int64_t tile = decode_plan::tile_tokens;
    const std::int64_t even =
        std::max<std::int64_t>((max_len + plan->max_splits - 1) / plan->max_splits, 1);
    const std::int64_t even_tiles = (even + tile - 1) / tile * tile;
    CHECK(plan->max_splits == (max_len + plan->chunk_tokens - 1) / plan->chunk_tokens);
    CHECK((plan->chunk_tokens <= even_tiles ||
           blocks(lens, even_tiles) > blocks(lens, plan->chunk_tokens)));
  }
}

// The plan's kv_bits of a layout: the narrower of its codecs.
static_assert(kvkit::decode_kv_bits<kvkit::paged_layout<kvkit::bf16_codec>> == 16);
static_assert(kvkit::decode_kv_bits<kvkit::paged_layout<kvkit::fp8_e4m3_codec>> == 8);
static_assert(
    kvkit::decode_kv_bits<kvkit::paged_layout<kvkit::int8_codec, kvkit::int4_group_codec<32>>> ==
    4);

TEST_CASE("plan_decode splits a quantized cache for four resident blocks per multiprocessor",
          "[attention][plan]") {
  CHECK(kvkit::decode_blocks_per_sm(16, 128, 8) == 2);
  CHECK(kvkit::decode_blocks_per_sm(8, 128, 8) == 4);
  CHECK(kvkit::decode_blocks_per_sm(4, 64, 1) == 4);
  CHECK(kvkit::decode_blocks_per_sm(8, 256, 8) == 2);
  CHECK(kvkit::decode_blocks_per_sm(16, 256, 8) == 1);
  CHECK(kvkit::decode_blocks_per_sm(16, 256, 16) == 1);
  CHECK(kvkit::decode_blocks_per_sm(4, 128, 16) == 2);
  const std::vector<std::int32_t> lens(8, 8192);
  const auto wide = kvkit::plan_decode({8, 32, 8, 128, 0, 16}, lens, 132);
  const auto narrow = kvkit::plan_decode({8, 32, 8, 128, 0, 8}, lens, 132);
  REQUIRE(wide.ok());
  REQUIRE(narrow.ok());
  CHECK(static_cast<std::int64_t>(wide->max_splits) * 8 * 8 <= 2 * 132);
  CHECK(static_cast<std::int64_t>(narrow->max_splits) * 8 * 8 <= 4 * 132);
  // A 16-bit cache at head dim 256: one block per multiprocessor, and at B=1 the chunks of a
  // cluster merge (8 splits) only where they are four tiles or shorter.
  const auto bf16_256 = kvkit::plan_decode({8, 32, 8, 256, 0, 16}, lens, 132);
  REQUIRE(bf16_256.ok());
  CHECK(static_cast<std::int64_t>(bf16_256->max_splits) * 8 * 8 <= 132);
  for (const auto& [len, splits] : {std::pair{2048, 8}, {8192, 16}, {32768, 16}}) {
    const auto b1 = kvkit::plan_decode({1, 32, 8, 256, 0, 16}, std::vector<std::int32_t>{len}, 132);
    REQUIRE(b1.ok());
    INFO("L=" << len);
    CHECK(b1->max_splits == splits);
  }
  CHECK(narrow->max_splits > wide->max_splits);
  // Not below 16 tiles a block for the extra blocks: one sequence is split as for bf16.
  const std::vector<std::int32_t> one(1, 8192);
  const auto one_wide = kvkit::plan_decode({1, 32, 8, 128, 0, 16}, one, 132);
  const auto one_narrow = kvkit::plan_decode({1, 32, 8, 128, 0, 8}, one, 132);
  REQUIRE(one_wide.ok());
  REQUIRE(one_narrow.ok());
  CHECK(one_narrow->max_splits == one_wide->max_splits);
  CHECK(narrow->chunk_tokens >= 16 * decode_plan::tile_tokens);
  // Where four blocks do not fit (groups above 8), a quantized cache is planned like bf16.
  const auto big_group = kvkit::plan_decode({8, 128, 8, 128, 0, 4}, lens, 132);
  const auto big_group_wide = kvkit::plan_decode({8, 128, 8, 128, 0, 16}, lens, 132);
  REQUIRE(big_group.ok());
  REQUIRE(big_group_wide.ok());
  CHECK(big_group->max_splits == big_group_wide->max_splits);
}

// kv_scaled_one_width of a layout: K and V of one width, at least one scaled per token.
static_assert(!kvkit::decode_kv_scaled_one_width<kvkit::paged_layout<kvkit::bf16_codec>>);
static_assert(!kvkit::decode_kv_scaled_one_width<kvkit::paged_layout<kvkit::fp8_e4m3_codec>>);
static_assert(kvkit::decode_kv_scaled_one_width<kvkit::paged_layout<kvkit::int8_codec>>);
static_assert(kvkit::decode_kv_scaled_one_width<
              kvkit::paged_layout<kvkit::int8_codec, kvkit::fp8_e5m2_codec>>);
static_assert(kvkit::decode_kv_scaled_one_width<
              kvkit::paged_layout<kvkit::int4_group_codec<32>, kvkit::int4_group_codec<128>>>);
static_assert(!kvkit::decode_kv_scaled_one_width<
              kvkit::paged_layout<kvkit::fp8_e5m2_codec, kvkit::int4_group_codec<32>>>);
static_assert(
    !kvkit::decode_kv_scaled_one_width<kvkit::paged_layout<kvkit::int8_codec, kvkit::bf16_codec>>);

TEST_CASE("decode_shape_for takes the cache's fields from the layout", "[attention][plan]") {
  const kvkit::paged_layout<kvkit::int8_codec> int8(16, 4, 64);
  const decode_shape s = kvkit::decode_shape_for(int8, 3, 12, 100);
  CHECK(s.batch_size == 3);
  CHECK(s.num_q_heads == 12);
  CHECK(s.num_kv_heads == 4);
  CHECK(s.head_dim == 64);
  CHECK(s.window == 100);
  CHECK(s.kv_bits == 8);
  CHECK(s.kv_scaled_one_width);
  CHECK(s.validate().ok());
  const decode_shape f =
      kvkit::decode_shape_for(kvkit::paged_layout<kvkit::fp8_e4m3_codec>(16, 8, 128), 1, 32);
  CHECK(f.kv_bits == 8);
  CHECK(!f.kv_scaled_one_width);
  CHECK(f.window == 0);
  CHECK(f.page_size == 16);
  CHECK(f.order == kvkit::kv_order::nhd);
  CHECK(kvkit::decode_shape_for(
            kvkit::paged_layout<kvkit::fp8_e4m3_codec, kvkit::fp8_e4m3_codec, kvkit::kv_order::hnd>(
                16, 8, 128),
            1, 32)
            .order == kvkit::kv_order::hnd);
  // The flag with a 16-bit cache describes no cache.
  decode_shape wrong =
      kvkit::decode_shape_for(kvkit::paged_layout<kvkit::bf16_codec>(16, 8, 128), 1, 32);
  CHECK(wrong.validate().ok());
  wrong.kv_scaled_one_width = true;
  CHECK(wrong.validate().error() == kvkit::errc::bad_argument);
}

TEST_CASE("plan_decode takes the two-tile kernel for int8 from two_tiles_min_keys on any grid",
          "[attention][plan]") {
  // Shapes the one-wave rule rejects (512 blocks; blocks over 2048 keys; blocks of 128 keys):
  // int8 takes two tiles there by its length alone, int4 and fp8 do not.
  const kvkit::paged_layout<kvkit::int8_codec> int8(16, 8, 128);
  const kvkit::paged_layout<kvkit::int4_group_codec<32>> int4(16, 8, 128);
  const kvkit::paged_layout<kvkit::fp8_e4m3_codec> fp8(16, 8, 128);
  struct shape_case {
    std::int32_t batch, q_heads, len;
  };
  for (const shape_case c : {shape_case{64, 32, 2048}, shape_case{8, 32, 16384},
                             shape_case{1, 8, 4096}, shape_case{128, 32, 32768}}) {
    INFO("B=" << c.batch << " q_heads " << c.q_heads << " L=" << c.len);
    const std::vector<std::int32_t> lens(static_cast<std::size_t>(c.batch), c.len);
    const auto i8 =
        kvkit::plan_decode(kvkit::decode_shape_for(int8, c.batch, c.q_heads), lens, 132);
    const auto i4 =
        kvkit::plan_decode(kvkit::decode_shape_for(int4, c.batch, c.q_heads), lens, 132);
    const auto f8 = kvkit::plan_decode(kvkit::decode_shape_for(fp8, c.batch, c.q_heads), lens, 132);
    REQUIRE(i8.ok());
    REQUIRE(i4.ok());
    REQUIRE(f8.ok());
    CHECK(i8->two_tiles);
    CHECK(!i4->two_tiles);
    CHECK(!f8->two_tiles);
    // Two tiles a warp or more: the launcher runs the two-tile kernel only then.
    CHECK(i8->chunk_tokens >= 2 * decode_plan::tile_tokens);
  }
  // Just below the bound, where no wave rule applies: the one-tile kernel's plan.
  const std::vector<std::int32_t> below(64, decode_plan::two_tiles_min_keys - 1);
  CHECK(!kvkit::plan_decode(kvkit::decode_shape_for(int8, 64, 32), below, 132)->two_tiles);
  const std::vector<std::int32_t> at(64, decode_plan::two_tiles_min_keys);
  CHECK(kvkit::plan_decode(kvkit::decode_shape_for(int8, 64, 32), at, 132)->two_tiles);
  // K and V of different widths have no two-tile kernel: never planned for it.
  const kvkit::paged_layout<kvkit::int8_codec, kvkit::bf16_codec> int8_bf16(16, 8, 128);
  const kvkit::paged_layout<kvkit::int4_group_codec<32>, kvkit::int8_codec> int4_int8(16, 8, 128);
  for (const std::int32_t len : {512, 2048, 8192}) {
    const std::vector<std::int32_t> lens(32, len);
    CHECK(!kvkit::plan_decode(kvkit::decode_shape_for(int8_bf16, 32, 32), lens, 132)->two_tiles);
    CHECK(!kvkit::plan_decode(kvkit::decode_shape_for(int4_int8, 32, 32), lens, 132)->two_tiles);
  }
}

TEST_CASE("plan_decode keeps an 8-bit cache's sequences whole where two blocks an SM load it as "
          "evenly as four",
          "[attention][plan]") {
  const kvkit::paged_layout<kvkit::fp8_e4m3_codec> fp8(16, 8, 128);
  const kvkit::paged_layout<kvkit::int4_group_codec<32>> int4(16, 8, 128);
  const auto plan = [](const auto& layout, std::int32_t batch, std::int32_t len) {
    const std::vector<std::int32_t> lens(static_cast<std::size_t>(batch), len);
    const auto p = kvkit::plan_decode(kvkit::decode_shape_for(layout, batch, 32), lens, 132);
    REQUIRE(p.ok());
    return *p;
  };
  for (const std::int32_t len : {2048, 8192, 32768}) {
    INFO("L=" << len);
    // B=32: 256 blocks of whole sequences put two on the busiest SM, as 512 half sequences put
    // four; the whole ones need no merge.
    CHECK(plan(fp8, 32, len).max_splits == 1);
    CHECK(plan(fp8, 33, len).max_splits == 1);
    // B=24: 192 whole sequences put two on some SMs, 384 halves three a SM: halves stream less
    // on the busiest one.
    CHECK(plan(fp8, 24, len).max_splits == 2);
    // int4 keeps four blocks an SM (its loop is bound by instructions; at L=2048 its plan is the
    // two-tile kernel's): 2 splits of one KV head a block, which its NHD pages take as 8 splits
    // of a quarter on blocks of four heads where that quarter is head_split_min_keys or more.
    if (len >= 8192) {
      const bool split_heads = len / 2 / 4 >= decode_plan::head_split_min_keys;
      CHECK(plan(int4, 32, len).max_splits == (split_heads ? 8 : 2));
      CHECK(plan(int4, 32, len).heads_per_block ==
            (split_heads ? decode_plan::head_split_heads : 1));
      CHECK(!plan(int4, 32, len).two_tiles);
    }
  }
  // A batch whose longest sequence would need splitting for two blocks an SM is planned as before.
  CHECK(plan(fp8, 8, 8192).max_splits == 8);
  // Pages under 16 tokens, or a shape that gives none, are split for four blocks an SM.
  const kvkit::paged_layout<kvkit::fp8_e4m3_codec> fp8_p1(1, 8, 128);
  const kvkit::paged_layout<kvkit::fp8_e4m3_codec> fp8_p8(8, 8, 128);
  CHECK(plan(fp8_p1, 32, 2048).max_splits == 2);
  CHECK(plan(fp8_p8, 32, 2048).max_splits == 2);
  kvkit::decode_shape no_pages = kvkit::decode_shape_for(fp8, 32, 32);
  CHECK(no_pages.page_size == 16);
  no_pages.page_size = 0;
  const std::vector<std::int32_t> lens(32, 2048);
  CHECK(kvkit::plan_decode(no_pages, lens, 132)->max_splits == 2);
  no_pages.page_size = -1;
  CHECK(!no_pages.validate().ok());
  CHECK(!kvkit::plan_decode(no_pages, lens, 132).ok());
}

TEST_CASE("plan_decode plans an int8 cache on long sequences for the two-tile kernel",
          "[attention][plan]") {
  const kvkit::paged_layout<kvkit::int8_codec> int8(16, 8, 128);
  const kvkit::paged_layout<kvkit::fp8_e4m3_codec> fp8(16, 8, 128);
  const std::vector<std::int32_t> lens(32, 2048);
  const auto i8 = kvkit::plan_decode(kvkit::decode_shape_for(int8, 32, 32), lens, 132);
  const auto f8 = kvkit::plan_decode(kvkit::decode_shape_for(fp8, 32, 32), lens, 132);
  REQUIRE(i8.ok());
  REQUIRE(f8.ok());
  CHECK(i8->two_tiles);
  CHECK(!f8->two_tiles);
  // Split for two resident blocks per multiprocessor, not four: one split of 2048 keys for 256
  // (sequence, KV head) pairs. fp8 keeps its sequences whole there too (next test case).
  CHECK(i8->max_splits == 1);
  CHECK(f8->max_splits == 1);
  CHECK(static_cast<std::int64_t>(i8->max_splits) * 32 * 8 <= 2 * 132);
  // Shorter sequences (where the plan for two blocks is not one wave), head dim 256, groups over
  // 8: the one-tile kernel's plan.
  const std::vector<std::int32_t> short_lens(64, decode_plan::two_tiles_min_keys - 1);
  const auto i8_short = kvkit::plan_decode(kvkit::decode_shape_for(int8, 64, 32), short_lens, 132);
  REQUIRE(i8_short.ok());
  CHECK(!i8_short->two_tiles);
  const kvkit::paged_layout<kvkit::int8_codec> wide_heads(16, 8, 256);
  CHECK(!kvkit::plan_decode(kvkit::decode_shape_for(wide_heads, 32, 32), lens, 132)->two_tiles);
  CHECK(!kvkit::plan_decode(kvkit::decode_shape_for(int8, 32, 128), lens, 132)->two_tiles);
  // The longest sequence decides, and a graph-safe plan decides by its bound.
  std::vector<std::int32_t> mixed(32, 10);
  mixed[5] = decode_plan::two_tiles_min_keys;
  CHECK(kvkit::plan_decode(kvkit::decode_shape_for(int8, 32, 32), mixed, 132)->two_tiles);
  const auto graph = kvkit::plan_decode_graph_safe(kvkit::decode_shape_for(int8, 32, 32),
                                                   decode_plan::two_tiles_min_keys, 132);
  REQUIRE(graph.ok());
  CHECK(graph->two_tiles);
  // Below two_tiles_min_keys, where two blocks of 256 to 2048 keys per multiprocessor are one
  // wave of more blocks than multiprocessors, as for int4: 256 blocks of 512 keys.
  const auto one_wave = kvkit::plan_decode(kvkit::decode_shape_for(int8, 32, 32),
                                           std::vector<std::int32_t>(32, 512), 132);
  REQUIRE(one_wave.ok());
  CHECK(one_wave->two_tiles);
  CHECK(one_wave->max_splits == 1);
  CHECK(!kvkit::plan_decode(kvkit::decode_shape_for(fp8, 32, 32),
                            std::vector<std::int32_t>(32, 512), 132)
             ->two_tiles);
  CHECK(!kvkit::plan_decode(kvkit::decode_shape_for(int8, 8, 32), std::vector<std::int32_t>(8, 512),
                            132)
             ->two_tiles); // 128 keys a block
  CHECK(!kvkit::plan_decode(kvkit::decode_shape_for(int8, 64, 32),
                            std::vector<std::int32_t>(64, 512), 132)
             ->two_tiles); // 512 blocks
}

TEST_CASE("plan_decode plans an int4 cache for the two-tile kernel where one wave of two blocks "
          "per multiprocessor covers it",
          "[attention][plan]") {
  const kvkit::paged_layout<kvkit::int4_group_codec<32>> int4(16, 8, 128);
  const auto plan = [&](std::int32_t batch, std::int32_t len) {
    const auto p = kvkit::plan_decode(kvkit::decode_shape_for(int4, batch, 32),
                                      std::vector<std::int32_t>(batch, len), 132);
    REQUIRE(p.ok());
    INFO("B=" << batch << " L=" << len << " chunk " << p->chunk_tokens << " splits "
              << p->max_splits);
    if (p->two_tiles) {
      // Blocks of 256 to 2048 keys, in one wave of two per multiprocessor, more than one.
      CHECK(p->chunk_tokens >= 4 * decode_plan::tile_tokens);
      CHECK(p->chunk_tokens <= 32 * decode_plan::tile_tokens);
      CHECK(static_cast<std::int64_t>(p->max_splits) * batch * 8 <= 2 * 132);
      CHECK(static_cast<std::int64_t>(p->max_splits) * batch * 8 > 132);
    }
    return *p;
  };
  CHECK(plan(8, 2048).two_tiles);   // 4 splits of 512
  CHECK(plan(32, 512).two_tiles);   // 1 split of 512
  CHECK(plan(32, 2048).two_tiles);  // 1 split of 2048
  CHECK(!plan(64, 2048).two_tiles); // 512 blocks: four a multiprocessor
  CHECK(!plan(32, 8192).two_tiles); // blocks of 8192 keys
  CHECK(!plan(8, 512).two_tiles);   // blocks of 128 keys
  CHECK(!plan(1, 2048).two_tiles);  // 64 blocks: not more than one a multiprocessor
  CHECK(plan(1, 8192).two_tiles);   // 32 splits of 256
  // Split for two blocks where it takes the two-tile kernel, for four otherwise.
  CHECK(plan(32, 2048).max_splits == 1);
  CHECK(plan(64, 2048).max_splits == 1);
  // Whole sequences of one KV head a block, too short for blocks of four heads (a quarter of
  // 2048 keys is under head_split_min_keys); at L=32768, 4 splits of 8192 on blocks of four.
  CHECK(plan(64, 2048).heads_per_block == 1);
  CHECK(plan(64, 32768).heads_per_block == decode_plan::head_split_heads);
  CHECK(plan(64, 32768).max_splits == 4);
  // 8192 keys cut evenly for two blocks a multiprocessor: 4 splits of 2048, two tiles a step.
  CHECK(plan(8, 8192).two_tiles);
  CHECK(plan(8, 8192).max_splits == 4);
  CHECK(plan(8, 8192).chunk_tokens == 2048);
  // In HND pages the same batch decides on the chunk as grown (2112 keys, over the bound) and
  // keeps the one-tile kernel: 8 splits of 1024 for four blocks a multiprocessor.
  const kvkit::paged_layout<kvkit::int4_group_codec<32>, kvkit::int4_group_codec<32>,
                            kvkit::kv_order::hnd>
      int4_hnd(16, 8, 128);
  const decode_shape hnd = kvkit::decode_shape_for(int4_hnd, 8, 32);
  CHECK(hnd.order == kvkit::kv_order::hnd);
  const auto hnd_plan = kvkit::plan_decode(hnd, std::vector<std::int32_t>(8, 8192), 132);
  REQUIRE(hnd_plan.ok());
  CHECK(!hnd_plan->two_tiles);
  CHECK(hnd_plan->max_splits == 8);
  // Elsewhere both orders plan alike, but for the NHD pages' blocks of four KV heads with a
  // quarter of the keys (decode_plan::heads_per_block).
  for (const std::int32_t batch : {1, 8, 32, 64}) {
    for (const std::int32_t len : {512, 2048, 32768}) {
      INFO("B=" << batch << " L=" << len);
      const std::vector<std::int32_t> lens(static_cast<std::size_t>(batch), len);
      const auto n = kvkit::plan_decode(kvkit::decode_shape_for(int4, batch, 32), lens, 132);
      const auto h = kvkit::plan_decode(kvkit::decode_shape_for(int4_hnd, batch, 32), lens, 132);
      REQUIRE(n.ok());
      REQUIRE(h.ok());
      CHECK(n->two_tiles == h->two_tiles);
      CHECK(h->heads_per_block == 1);
      CHECK(n->chunk_tokens ==
            kvkit::detail::whole_tiles((h->chunk_tokens + n->heads_per_block - 1) /
                                       n->heads_per_block));
    }
  }
}

TEST_CASE("one_wave_of_two holds for more blocks than multiprocessors, at most twice as many",
          "[attention][plan]") {
  using kvkit::detail::one_wave_of_two;
  STATIC_REQUIRE(!one_wave_of_two(0, 132));
  STATIC_REQUIRE(!one_wave_of_two(132, 132)); // one block a multiprocessor at most
  STATIC_REQUIRE(one_wave_of_two(133, 132));
  STATIC_REQUIRE(one_wave_of_two(256, 132));
  STATIC_REQUIRE(one_wave_of_two(264, 132));
  STATIC_REQUIRE(!one_wave_of_two(265, 132)); // a second wave at two a multiprocessor
  STATIC_REQUIRE(!one_wave_of_two(1, 1));
  STATIC_REQUIRE(one_wave_of_two(2, 1));
  // The int4 plans of the case above that take the two-tile kernel are all such grids.
  const kvkit::paged_layout<kvkit::int4_group_codec<32>> int4(16, 8, 128);
  for (const std::int32_t batch : {1, 8, 16, 32, 64}) {
    for (const std::int32_t len : {512, 1024, 2048, 4096}) {
      const auto p = kvkit::plan_decode(kvkit::decode_shape_for(int4, batch, 32),
                                        std::vector<std::int32_t>(batch, len), 132);
      REQUIRE(p.ok());
      INFO("B=" << batch << " L=" << len << " splits " << p->max_splits);
      if (p->two_tiles) {
        CHECK(one_wave_of_two(static_cast<std::int64_t>(p->max_splits) * batch * 8, 132));
      }
    }
  }
}

TEST_CASE("plan_decode rejects bad shapes and lengths", "[attention][plan]") {
  const std::vector<std::int32_t> lens{1, 2};
  CHECK(kvkit::plan_decode({2, 8, 2, 128, 0}, lens, 132).ok());
  CHECK(kvkit::plan_decode({2, 8, 2, 96, 0}, lens, 132).error() == kvkit::errc::bad_argument);
  CHECK(kvkit::plan_decode({2, 8, 3, 128, 0}, lens, 132).error() == kvkit::errc::bad_argument);
  CHECK(kvkit::plan_decode({2, 34, 2, 128, 0}, lens, 132).error() == kvkit::errc::bad_argument);
  CHECK(kvkit::plan_decode({3, 8, 2, 128, 0}, lens, 132).error() == kvkit::errc::bad_argument);
  CHECK(kvkit::plan_decode({2, 8, 2, 128, -1}, lens, 132).error() == kvkit::errc::bad_argument);
  CHECK(kvkit::plan_decode({2, 8, 2, 128, 0, 6}, lens, 132).error() == kvkit::errc::bad_argument);
  CHECK(kvkit::plan_decode({2, 8, 2, 128, 0, 32}, lens, 132).error() == kvkit::errc::bad_argument);
  CHECK(kvkit::plan_decode({2, 8, 2, 128, 0}, std::vector<std::int32_t>{1, 0}, 132).error() ==
        kvkit::errc::bad_argument);
  CHECK(kvkit::plan_decode({2, 8, 2, 128, 0}, lens, 0).error() == kvkit::errc::bad_argument);
  CHECK(kvkit::plan_decode_graph_safe({2, 8, 2, 128, 0}, 0, 132).error() ==
        kvkit::errc::bad_argument);
  // More sequences or KV heads than a launch's grid rows: refused by the plans too (a graph-safe
  // plan would otherwise count every one of 2^31 padded sequences).
  constexpr std::int32_t rows = kvkit::decode_shape::max_rows;
  CHECK(kvkit::plan_decode_graph_safe({rows, rows, rows, 128, 0}, 4096, 132).ok());
  CHECK(kvkit::plan_decode_graph_safe({rows + 1, 8, 2, 128, 0}, 4096, 132).error() ==
        kvkit::errc::bad_argument);
  CHECK(kvkit::plan_decode_graph_safe({2, rows + 1, rows + 1, 128, 0}, 4096, 132).error() ==
        kvkit::errc::bad_argument);
  CHECK(kvkit::plan_decode_graph_safe({INT32_MAX, 8, 1, 128, 0}, 1 << 30, 132).error() ==
        kvkit::errc::bad_argument);
}

namespace {

// The furthest the decode kernel's 32-bit key arithmetic reaches for a sequence of `len` keys
// under `plan` (as the launch runs it: `grid_splits` blocks a sequence and KV head, chunks of
// `chunk` keys): the chunk grown to cover the sequence in that many blocks, n + chunk - 1 (its
// split count's numerator) and the end of its last split, window start included.
std::int64_t furthest_key(std::int64_t len, std::int32_t window, std::int64_t chunk,
                          std::int64_t grid_splits) {
  const std::int64_t lo = window > 0 && len > window ? len - window : 0;
  const std::int64_t n = len - lo;
  const std::int64_t need = (n + grid_splits - 1) / grid_splits;
  chunk = std::max(chunk, (need + 63) / 64 * 64);
  const std::int64_t nsplit = (n + chunk - 1) / chunk;
  return std::max({n + chunk - 1, lo + nsplit * chunk, need + 63});
}

} // namespace

TEST_CASE("plans serve sequences of at most 2^30 keys, window or not, and every split ends in "
          "32 bits",
          "[attention][plan]") {
  constexpr std::int32_t most = 1 << 30;
  const kvkit::decode_shape many{64, 32, 8, 128, 0}; // 512 pairs: one split each
  const kvkit::decode_shape one{1, 8, 1, 128, 0};    // one pair: many splits
  kvkit::decode_shape windowed = many;
  windowed.window = 4096;
  kvkit::decode_shape fp8 = one;
  fp8.kv_bits = 8;
  for (const kvkit::decode_shape& shape : {many, one, windowed, fp8}) {
    INFO("batch " << shape.batch_size << ", window " << shape.window << ", bits " << shape.kv_bits);
    CHECK(kvkit::plan_decode_graph_safe(shape, most + 1, 132).error() == kvkit::errc::bad_argument);
    CHECK(kvkit::plan_decode_graph_safe(shape, INT32_MAX, 132).error() ==
          kvkit::errc::bad_argument);
    std::vector<std::int32_t> lens(static_cast<std::size_t>(shape.batch_size), most);
    lens.back() = most + 1;
    CHECK(kvkit::plan_decode(shape, lens, 132).error() == kvkit::errc::bad_argument);
    lens.back() = most;
    for (const std::int32_t sms : {1, 132, 4096}) {
      const auto longest = kvkit::plan_decode(shape, lens, sms);
      REQUIRE(longest.ok());
      CHECK(longest->chunk_tokens % kvkit::decode_plan::tile_tokens == 0);
      CHECK(furthest_key(most, shape.window, longest->chunk_tokens, longest->max_splits) <=
            INT32_MAX);
      // The fp8 launch may run half as many splits of twice the keys (below 2^29 keys a chunk).
      if (longest->chunk_tokens <= most / 2) {
        CHECK(furthest_key(most, shape.window, 2 * std::int64_t{longest->chunk_tokens},
                           (longest->max_splits + 1) / 2) <= INT32_MAX);
      }
      // A graph-safe plan for short sequences serves one of 2^30 keys with longer chunks.
      for (const std::int32_t bound : {1, 4096, most}) {
        const auto graph = kvkit::plan_decode_graph_safe(shape, bound, sms);
        REQUIRE(graph.ok());
        CHECK(furthest_key(most, shape.window, graph->chunk_tokens, graph->max_splits) <=
              INT32_MAX);
      }
    }
  }
}

TEST_CASE("plan_decode's plans hold their invariants over random shapes, lengths and devices",
          "[attention][plan]") {
  // Every valid shape (head dims, groups, widths, pages, orders, windows), batches of wildly
  // different lengths and devices of 1 to 4096 multiprocessors: the plan covers every attended
  // key with whole tiles, leaves no split of the longest sequence empty, stays within
  // max_splits_limit, asks for workspace exactly when it splits, chooses the two-tile kernel only
  // for a cache that has one, and is the same plan when asked again. A graph-safe plan for a
  // bound covers every batch within it. A failure prints the seed and trial; KVKIT_TEST_SEED
  // replays it.
  const std::uint64_t seed = kvkit_test::test_seed(20261204);
  std::mt19937_64 rng(seed);
  const auto pick = [&](std::int64_t lo, std::int64_t hi) {
    return std::uniform_int_distribution<std::int64_t>(lo, hi)(rng);
  };
  constexpr std::int32_t head_dims[] = {64, 128, 256};
  constexpr std::int32_t widths[] = {16, 8, 4};
  constexpr std::int32_t pages[] = {0, 1, 4, 16, 64, 128};
  for (int trial = 0; trial < 2000; ++trial) {
    decode_shape shape;
    shape.batch_size = static_cast<std::int32_t>(pick(1, trial % 4 == 0 ? 512 : 64));
    shape.num_kv_heads = static_cast<std::int32_t>(pick(1, 16));
    shape.num_q_heads = shape.num_kv_heads * static_cast<std::int32_t>(pick(1, 16));
    shape.head_dim = head_dims[pick(0, 2)];
    shape.kv_bits = widths[pick(0, 2)];
    shape.kv_scaled_one_width = shape.kv_bits < 16 && pick(0, 1) == 1;
    shape.page_size = pages[pick(0, 5)];
    shape.order = pick(0, 1) == 1 ? kvkit::kv_order::hnd : kvkit::kv_order::nhd;
    shape.window = pick(0, 3) == 0 ? static_cast<std::int32_t>(pick(1, 9000)) : 0;
    // Lengths from one token to a million, drawn on a log scale so that short and long mix.
    std::vector<std::int32_t> lens(static_cast<std::size_t>(shape.batch_size));
    for (auto& len : lens) {
      len = static_cast<std::int32_t>(std::max<std::int64_t>(1, std::int64_t{1} << pick(0, 20)) -
                                      1 + pick(1, 64));
    }
    const auto sms = static_cast<std::int32_t>(pick(0, 2) == 0 ? pick(1, 4096) : 132);
    INFO("seed " << seed << " (KVKIT_TEST_SEED=" << seed << "), trial " << trial << ": batch "
                 << shape.batch_size << ", heads " << shape.num_q_heads << "/" << shape.num_kv_heads
                 << ", head dim " << shape.head_dim << ", bits " << shape.kv_bits
                 << (shape.kv_scaled_one_width ? " scaled" : "") << ", page " << shape.page_size
                 << ", window " << shape.window << ", sms " << sms);
    REQUIRE(shape.validate().ok());

    std::int64_t max_len = 0;
    for (const std::int32_t len : lens) {
      max_len = std::max<std::int64_t>(max_len, kvkit::detail::attended(len, shape.window));
    }
    const auto plan = kvkit::plan_decode(shape, lens, sms);
    REQUIRE(plan.ok());
    INFO("chunk " << plan->chunk_tokens << ", splits " << plan->max_splits << ", longest "
                  << max_len);
    const std::int64_t chunk = plan->chunk_tokens;
    REQUIRE(chunk >= decode_plan::tile_tokens);
    CHECK(chunk % decode_plan::tile_tokens == 0);
    CHECK(plan->max_splits >= 1);
    CHECK(plan->max_splits <= decode_plan::max_splits_limit);
    CHECK(plan->max_splits * chunk >= max_len);
    CHECK((plan->max_splits - 1) * chunk < max_len);
    CHECK((plan->workspace_bytes() == 0) == (plan->max_splits == 1));
    CHECK((!plan->two_tiles || kvkit::detail::two_tiles_cache(shape)));
    // Blocks of several KV heads only for a cache that has that build, off the two-tile kernel,
    // with splits their merge holds and a quarter chunk of head_split_min_keys or more (any plan,
    // graph-safe too), where the grid of one head a block exceeded the multiprocessors (its
    // chunk's grid has no more blocks than the quarter chunk's at one head a block, checked here).
    const auto heads_allowed = [&](const decode_plan& p) {
      return p.heads_per_block == 1 || (p.heads_per_block == decode_plan::head_split_heads &&
                                        kvkit::detail::head_split_cache(shape) && !p.two_tiles &&
                                        p.max_splits <= decode_plan::head_split_max_splits &&
                                        p.chunk_tokens >= decode_plan::head_split_min_keys);
    };
    auto attended_lengths = [&](auto&& f) {
      for (const std::int32_t len : lens) {
        f(kvkit::detail::attended(len, shape.window));
      }
    };
    CHECK(heads_allowed(*plan));
    CHECK((plan->heads_per_block == 1 ||
           kvkit::detail::block_count(shape, attended_lengths, chunk) > sms));
    CHECK(!plan->graph_safe);
    const auto again = kvkit::plan_decode(shape, lens, sms);
    REQUIRE(again.ok());
    CHECK(again->chunk_tokens == plan->chunk_tokens);
    CHECK(again->max_splits == plan->max_splits);
    CHECK(again->two_tiles == plan->two_tiles);
    CHECK(again->heads_per_block == plan->heads_per_block);

    const std::int32_t bound = *std::max_element(lens.begin(), lens.end());
    const auto graph = kvkit::plan_decode_graph_safe(shape, bound, sms);
    REQUIRE(graph.ok());
    CHECK(graph->graph_safe);
    CHECK(graph->chunk_tokens % decode_plan::tile_tokens == 0);
    CHECK(graph->max_splits <= decode_plan::max_splits_limit);
    CHECK(static_cast<std::int64_t>(graph->max_splits) * graph->chunk_tokens >= max_len);
    CHECK((graph->workspace_bytes() == 0) == (graph->max_splits == 1));
    CHECK(heads_allowed(*graph));
  }
}
