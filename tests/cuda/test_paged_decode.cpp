// GPU decode attention against the float64 CPU reference: fresh random inputs per case, outputs
// poisoned before every launch, relative-error bounds per codec; partial last pages, length 1,
// page sizes 1 to 128, wildly different lengths in one batch, split and unsplit paths, GQA groups
// 1 to 16, head dims 64/128/256, window, soft cap, the graph-safe mode under CUDA graph replay,
// the debug page-id check, and int4 groups out to and beyond fp16's range. fp8, int8 and int4 cases
// at head dim up to 128 run both decode kernels: the two-tile one where the grid has at most one
// block per SM (one split or a few), where the plan chose it (int8 wherever the longest sequence
// has 2048 keys or more; int8 and int4 where two blocks per SM make one wave) or, for fp8, where
// whole sequences of 2048 keys or more make one wave of two blocks per SM and where a plan's splits
// taken two at a time do, the one-tile one elsewhere.

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <utility>
#include <vector>

#include <catch2/catch.hpp>
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include "cuda/decode_device.hpp"
#include "cuda/no_failures.hpp"
#include "cuda/paged_problem.hpp"
#include "host/test_seed.hpp"
#include "kvkit/layout/page_layout.hpp"
#include "kvkit/quant/codecs.hpp"
#include "kvkit/reference/paged_attention.hpp"
#include "kvkit/reference/quantize.hpp"

namespace {

using kvkit::kv_order;
using kvkit::paged_layout;
using bf16_nhd = paged_layout<kvkit::bf16_codec>;

using kvkit_test::bound;
using kvkit_test::compare_rows;
using kvkit_test::errors;
using kvkit_test::from_bits;
using kvkit_test::pages_for;
using kvkit_test::problem;

template <class Layout, class T>
errors compare(const problem<Layout>& pr, const kvkit_test::decode_step& s, std::int32_t q_heads,
               const kvkit::attention_options& options, const std::vector<std::uint16_t>& out,
               const std::vector<float>& lse) {
  const auto batch = static_cast<std::int32_t>(s.last_page_len.size());
  const kvkit::csr_page_table table{s.indptr.data(), s.indices.data(), s.last_page_len.data(),
                                    batch, pr.layout.page_size()};
  std::vector<float> q(s.q.size());
  for (std::size_t i = 0; i < q.size(); ++i) {
    q[i] = from_bits<T>(s.q[i]);
  }
  std::vector<float> ref(q.size());
  std::vector<float> ref_lse(static_cast<std::size_t>(batch * q_heads));
  REQUIRE(kvkit::reference::paged_decode(pr.layout, pr.cache.data(), pr.capacity, table, q.data(),
                                         q_heads, ref.data(), ref_lse.data(),
                                         pr.scales.empty() ? nullptr : pr.scales.data(), options)
              .ok());
  return compare_rows<T>(ref, ref_lse, out, lse, static_cast<std::size_t>(pr.layout.head_dim()));
}

// One step's outputs and log-sum-exps against the reference, within the bound of the cache's codec
// and the query type.
template <class Layout, class T>
void check_step(const problem<Layout>& pr, const kvkit_test::decode_step& s, std::int32_t q_heads,
                const kvkit::attention_options& options, const std::vector<std::uint16_t>& out,
                const std::vector<float>& lse) {
  const errors e = compare<Layout, T>(pr, s, q_heads, options, out, lse);
  INFO("relative error " << e.out_rel << ", lse error " << e.lse_abs << ", worst row "
                         << e.worst_row << " (sequence " << e.worst_row / q_heads << ") "
                         << e.row_rel_max);
  CHECK(e.all_finite);
  CHECK(e.out_rel < bound<Layout, T>());
  // Each row on its own, so that a long sequence's error, whose outputs are small beside a short
  // one's, is not lost in the batch's sum.
  CHECK(e.row_rel_max < 3 * bound<Layout, T>());
  CHECK(e.lse_abs < 2e-2);
}

// Which merge a launch used: through the workspace (written), in thread block clusters (the
// workspace left as it was), or none (one split a sequence).
enum class merged { none, workspace, clusters };

// The merge a launch of `max_splits` splits a sequence should use, on a device with or without
// clusters, where every cluster of the grid fits.
merged expected_merge(std::int32_t max_splits, bool cluster_device) {
  if (max_splits <= 1) {
    return merged::none;
  }
  return cluster_device && max_splits <= kvkit::decode_plan::max_cluster_splits ? merged::clusters
                                                                                : merged::workspace;
}

// The merge a launch took: none (one split), through the workspace (written) or in clusters.
merged merge_taken(const kvkit_test::decode_outcome& got) {
  return got.max_splits <= 1     ? merged::none
         : got.workspace_written ? merged::workspace
                                 : merged::clusters;
}

// Whether a log-sum-exp still holds the poison written before the launch (all bits set).
bool poisoned_lse(float x) {
  std::uint32_t bits = 0;
  std::memcpy(&bits, &x, sizeof bits);
  return bits == 0xFFFFFFFFU;
}

// Returns the merge the launch took.
template <int D, class Layout, class T>
merged check_decode(const Layout& layout, std::int32_t group, const std::vector<std::int32_t>& lens,
                    std::uint64_t seed, const kvkit::attention_options& options = {},
                    std::int32_t sm_count = 132, bool clusters_fit = true,
                    std::int32_t smem_optin = -1, float big_values = 0.0F, float rise = 0.0F) {
  const std::int32_t q_heads = group * layout.num_kv_heads();
  problem<Layout> pr(layout, pages_for(layout, lens) + 7, seed, big_values);
  pr.rise = rise;
  const auto step = pr.template make_step<T>(lens, q_heads);
  const kvkit::decode_shape shape = kvkit::decode_shape_for(
      layout, static_cast<std::int32_t>(lens.size()), q_heads, options.window);
  REQUIRE(shape.head_dim == D);
  kvkit_test::decode_mode mode;
  mode.sm_count = sm_count;
  mode.smem_optin = smem_optin;
  const auto got = kvkit_test::run_decode<D, Layout, T>(layout, pr.cache, pr.capacity, shape,
                                                        {step}, pr.scales, options, mode);
  INFO("seed " << seed << " page " << layout.page_size() << " group " << group << " D " << D
               << " splits " << got.max_splits << " rise " << rise << " error "
               << cudaGetErrorString(got.error));
  REQUIRE(got.error == cudaSuccess);
  check_step<Layout, T>(pr, step, q_heads, options, got.out[0], got.lse[0]);
  CHECK(got.past_workspace_intact);
  // Unless the caller says otherwise (`clusters_fit`), the grid is small enough for every cluster
  // to fit: a plan of up to 8 splits merges in clusters on a device that has them.
  const merged path = merge_taken(got);
  if (clusters_fit) {
    CHECK(path == expected_merge(got.max_splits, got.cluster_device));
  }
  return path;
}

// Each step of a bf16 multi-step run (default options) against the reference.
void check_steps(const problem<bf16_nhd>& pr, const std::vector<kvkit_test::decode_step>& steps,
                 std::int32_t q_heads, const kvkit_test::decode_outcome& got) {
  for (std::size_t i = 0; i < steps.size(); ++i) {
    INFO("step " << i);
    check_step<bf16_nhd, __nv_bfloat16>(pr, steps[i], q_heads, {}, got.out[i], got.lse[i]);
  }
  CHECK(got.past_workspace_intact);
}

} // namespace

TEST_CASE("paged_decode bf16: page sizes 1 to 128, groups 1 to 16, split and unsplit",
          "[cuda][decode][sweep]") {
  const std::uint64_t seed = kvkit_test::test_seed(0xDEC0DE);
  const std::vector<std::int32_t> lens{1, 2, 15, 16, 17, 64, 65, 333, 1000, 4099};
  for (const std::int32_t page : {1, 8, 16, 32, 64, 128}) {
    for (const std::int32_t group : {1, 4, 8, 16}) {
      for (const std::int32_t sms : {1, 132, 4096}) { // few, planned, and many splits
        paged_layout<kvkit::bf16_codec> layout(page, 2, 128);
        check_decode<128, bf16_nhd, __nv_bfloat16>(layout, group, lens,
                                                   seed + page * 100 + group + sms);
      }
    }
  }
}

TEST_CASE("paged_decode bf16: head dims 64 and 256, one KV head (MQA)", "[cuda][decode]") {
  const std::uint64_t seed = kvkit_test::test_seed(0xD1A);
  for (const std::int32_t group : {1, 3, 8, 12, 16}) {
    check_decode<64, paged_layout<kvkit::bf16_codec>, __nv_bfloat16>(
        paged_layout<kvkit::bf16_codec>(16, 1, 64), group, {5, 700, 2}, seed + group);
    check_decode<256, paged_layout<kvkit::bf16_codec>, __nv_bfloat16>(
        paged_layout<kvkit::bf16_codec>(16, 1, 256), group, {5, 700, 2, 3000}, seed + 50 + group);
  }
  // Planned for one multiprocessor: whole sequences, so a block of 3000 keys gives each warp 47
  // tiles, around the three-stage ring many times.
  check_decode<256, paged_layout<kvkit::bf16_codec>, __nv_bfloat16>(
      paged_layout<kvkit::bf16_codec>(16, 1, 256), 8, {3000, 5}, seed + 99, {}, 1);
  // As an A100 would run them, which lets a block opt in to 163 KB, less than the three stages'
  // 192 KB: the launcher takes the build of two stages (decode_short_ring_fit), split and whole
  // (47 tiles a warp around its two stages).
  constexpr std::int32_t a100_smem_optin = 163 * 1024;
  for (const std::int32_t group : {1, 8, 16}) {
    check_decode<256, paged_layout<kvkit::bf16_codec>, __nv_bfloat16>(
        paged_layout<kvkit::bf16_codec>(16, 1, 256), group, {5, 700, 2, 3000}, seed + 150 + group,
        {}, 132, true, a100_smem_optin);
  }
  check_decode<256, paged_layout<kvkit::bf16_codec>, __nv_bfloat16>(
      paged_layout<kvkit::bf16_codec>(16, 1, 256), 8, {3000, 5}, seed + 199, {}, 1, true,
      a100_smem_optin);
  // As a device of compute capability 8.6, 8.9 or 12.x would run them, which lets a block opt in
  // to 99 KB (decode_least_smem_optin), less than the two stages' 128 KB: the launcher takes the
  // narrow build (two warps of three stages, 96 KB: decode_narrow_fit), whose cluster mailboxes do
  // not fit 99 KB, so split sequences merge through the workspace: a few splits (planned for 8
  // multiprocessors: 4 splits, which would merge in clusters with room for the mailboxes) and many
  // (planned for 4096: 24). Whole sequences too (planned for one: 94 tiles a warp around its three
  // stages), and a sequence of one key, which leaves the second warp no tile.
  constexpr std::int32_t small_smem_optin = 99 * 1024;
  for (const std::int32_t group : {1, 8, 16}) {
    for (const std::int32_t sms : {1, 8, 4096}) {
      const merged path = check_decode<256, paged_layout<kvkit::bf16_codec>, __nv_bfloat16>(
          paged_layout<kvkit::bf16_codec>(16, 1, 256), group, {5, 700, 2, 3000, 1},
          seed + 250 + group + sms, {}, sms, false, small_smem_optin);
      CHECK(path == (sms == 1 ? merged::none : merged::workspace));
    }
  }
  // With a window, a soft cap and pages of one token, at two KV heads.
  kvkit::attention_options options;
  options.window = 1500;
  options.logits_soft_cap = 30.0F;
  const merged windowed = check_decode<256, paged_layout<kvkit::bf16_codec>, __nv_bfloat16>(
      paged_layout<kvkit::bf16_codec>(1, 2, 256), 4, {2000, 33, 1600}, seed + 299, options, 132,
      false, small_smem_optin);
  CHECK(windowed == merged::workspace);
  // fp16 in HND pages (a head's rows of a page contiguous) with fp16 queries, in each build: this
  // device's own ring, the A100's short ring and the narrow build (two KV heads, 32-token pages).
  using fp16_hnd = paged_layout<kvkit::fp16_codec, kvkit::fp16_codec, kvkit::kv_order::hnd>;
  for (const std::int32_t optin : {-1, a100_smem_optin, small_smem_optin}) {
    for (const std::int32_t group : {4, 16}) {
      const merged path = check_decode<256, fp16_hnd, __half>(
          fp16_hnd(32, 2, 256), group, {1, 257, 1900},
          seed + 400 + static_cast<std::uint64_t>(group) + (optin > 0 ? optin / 1024 : 0), {}, 132,
          optin != small_smem_optin, optin);
      CHECK((optin != small_smem_optin || path == merged::workspace));
    }
  }
}

TEST_CASE("paged_decode: every codec family, both orders", "[cuda][decode]") {
  const std::uint64_t seed = kvkit_test::test_seed(0xC0DEC);
  const std::vector<std::int32_t> lens{1, 31, 200, 3000};
  std::vector<std::int32_t> many_short(48); // 192 (sequence, KV head) pairs of at most 190 keys
  for (std::size_t i = 0; i < many_short.size(); ++i) {
    many_short[i] = 1 + static_cast<std::int32_t>(i * 37 % 190);
  }
  for (const std::int32_t group : {1, 4, 8, 16}) {
    // One split; a few, merged in a thread block cluster; many, merged through the workspace.
    for (const std::int32_t sms : {1, 16, 4096}) {
      const std::uint64_t s = seed + static_cast<std::uint64_t>(group * 10 + sms);
      check_decode<128, paged_layout<kvkit::fp16_codec, kvkit::fp16_codec, kv_order::hnd>, __half>(
          {16, 4, 128}, group, lens, s, {}, sms);
      check_decode<128, paged_layout<kvkit::fp8_e4m3_codec>, __nv_bfloat16>({16, 4, 128}, group,
                                                                            lens, s + 1, {}, sms);
      // fp8 e4m3 and int4 g32 in HND pages too: the order docs/kernels.md advises for them.
      check_decode<128, paged_layout<kvkit::fp8_e4m3_codec, kvkit::fp8_e4m3_codec, kv_order::hnd>,
                   __nv_bfloat16>({16, 4, 128}, group, lens, s + 12, {}, sms);
      check_decode<
          128,
          paged_layout<kvkit::int4_group_codec<32>, kvkit::int4_group_codec<32>, kv_order::hnd>,
          __nv_bfloat16>({16, 4, 128}, group, lens, s + 13, {}, sms);
      check_decode<64, paged_layout<kvkit::fp8_e5m2_codec, kvkit::fp8_e5m2_codec, kv_order::hnd>,
                   __half>({32, 4, 64}, group, lens, s + 2, {}, sms);
      check_decode<128, paged_layout<kvkit::int8_codec>, __nv_bfloat16>({16, 4, 128}, group, lens,
                                                                        s + 3, {}, sms);
      // int8 below decode_plan::two_tiles_min_keys: two tiles where two blocks per SM of 256 keys
      // or more make one wave (16 SMs), or where the grid is small (1 SM: 16 blocks on the device).
      check_decode<128, paged_layout<kvkit::int8_codec>, __nv_bfloat16>(
          {16, 4, 128}, group, {1, 31, 200, 1500}, s + 9, {}, sms);
      // ... and the one-tile kernel, on more blocks than the device has SMs: unsplit blocks of
      // fewer than 256 keys (with 4096 SMs their 192 clusters of 3 splits would not all fit),
      // and five sequences cut into 8 splits for 4096 SMs (20 clusters of 8).
      if (sms != 4096) {
        check_decode<128, paged_layout<kvkit::int8_codec>, __nv_bfloat16>(
            {16, 4, 128}, group, many_short, s + 10, {}, sms);
      }
      check_decode<128, paged_layout<kvkit::int8_codec>, __nv_bfloat16>(
          {16, 4, 128}, group, {1000, 1200, 1400, 1456, 900}, s + 11, {}, sms);
      check_decode<256, paged_layout<kvkit::int4_group_codec<32>>, __half>({16, 2, 256}, group,
                                                                           lens, s + 4, {}, sms);
      check_decode<
          128,
          paged_layout<kvkit::int4_group_codec<128>, kvkit::int4_group_codec<128>, kv_order::hnd>,
          __nv_bfloat16>({8, 4, 128}, group, lens, s + 5, {}, sms);
      check_decode<128, paged_layout<kvkit::int8_codec, kvkit::int4_group_codec<64>>, __half>(
          {16, 4, 128}, group, lens, s + 6, {}, sms);
      check_decode<64, paged_layout<kvkit::int4_group_codec<32>>, __nv_bfloat16>(
          {16, 4, 64}, group, lens, s + 7, {}, sms);
      check_decode<128, bf16_nhd, __half>({16, 4, 128}, group, lens, s + 8, {}, sms); // fp16 q
      // The 8-bit caches at head dims 256 and 64 (the merge path left to the launcher at 256).
      check_decode<256, paged_layout<kvkit::fp8_e4m3_codec>, __nv_bfloat16>(
          {16, 2, 256}, group, lens, s + 14, {}, sms, false);
      check_decode<256, paged_layout<kvkit::int8_codec>, __nv_bfloat16>({16, 2, 256}, group, lens,
                                                                        s + 15, {}, sms, false);
      check_decode<64, paged_layout<kvkit::int8_codec>, __half>({16, 4, 64}, group, lens, s + 16,
                                                                {}, sms);
    }
  }
}

TEST_CASE("paged_decode: int4 on a grid of at most one block per SM runs blocks of eight warps",
          "[cuda][decode]") {
  // One sequence over 8 KV heads, cut for 132 SMs into 8 splits of 256 keys or more: 64 blocks,
  // at most one per SM of the device, two tiles or more for each of the wide kernel's 8 warps
  // (kvkit::cuda::detail::decode_wide_warps): whole splits, a length whose last
  // tile is partial too, and 7 splits of which the last is short.
  const std::uint64_t seed = kvkit_test::test_seed(0x1A7E);
  using int4_hnd =
      paged_layout<kvkit::int4_group_codec<128>, kvkit::int4_group_codec<128>, kv_order::hnd>;
  for (const std::int32_t len : {2048, 2047, 1700}) {
    const int4_hnd layout(16, 8, 128);
    const auto plan = kvkit::plan_decode(kvkit::decode_shape_for(layout, 1, 32, 0),
                                         std::vector<std::int32_t>{len}, 132);
    REQUIRE(plan.ok());
    INFO("length " << len << " chunk " << plan->chunk_tokens << " splits " << plan->max_splits);
    REQUIRE(plan->chunk_tokens >= 2 * 8 * 16);
    REQUIRE(plan->max_splits * 8 <= 132);
    for (const std::int32_t group : {4, 8, 16}) {
      check_decode<128, int4_hnd, __nv_bfloat16>(layout, group, {len},
                                                 seed + static_cast<std::uint64_t>(len + group));
    }
    check_decode<64, paged_layout<kvkit::int4_group_codec<32>>, __nv_bfloat16>(
        paged_layout<kvkit::int4_group_codec<32>>(16, 8, 64), 4, {len}, seed + 7);
  }
}

TEST_CASE("paged_decode: fp8 whole sequences in one wave of two blocks per SM", "[cuda][decode]") {
  // 32 sequences of 2048 keys or more over 8 KV heads, planned for 132 SMs: whole sequences (256
  // blocks) and no two_tiles in the plan, which the launcher runs on the two-tile kernel on a
  // device of 128 to 255 SMs (the H200's 132), and on the one-tile kernel elsewhere. Lengths vary
  // by up to 96 keys, so the last tiles and pages are partial.
  const std::uint64_t seed = kvkit_test::test_seed(0xF8B3);
  const std::vector<std::int32_t> lens = kvkit_test::fp8_whole_wave_lengths();
  using fp8_hnd = paged_layout<kvkit::fp8_e4m3_codec, kvkit::fp8_e4m3_codec, kv_order::hnd>;
  const paged_layout<kvkit::fp8_e4m3_codec> nhd(16, 8, 128);
  const fp8_hnd hnd(16, 8, 128);
  for (const kvkit::decode_shape& shape :
       {kvkit::decode_shape_for(nhd, 32, 16), kvkit::decode_shape_for(hnd, 32, 16)}) {
    const auto plan = kvkit::plan_decode(shape, lens, 132);
    REQUIRE(plan.ok());
    INFO("chunk " << plan->chunk_tokens << " splits " << plan->max_splits);
    REQUIRE(plan->max_splits == 1);
    REQUIRE(plan->chunk_tokens >= kvkit::decode_plan::two_tiles_min_keys);
    REQUIRE(!plan->two_tiles);
  }
  check_decode<128, paged_layout<kvkit::fp8_e4m3_codec>, __nv_bfloat16>(nhd, 2, lens, seed, {},
                                                                        132);
  check_decode<128, fp8_hnd, __nv_bfloat16>(hnd, 2, lens, seed + 1, {}, 132);
}

TEST_CASE("paged_decode: int4 blocks of 2048 keys on the two-tile kernel's shallow build",
          "[cuda][decode]") {
  // Plans for 132 SMs whose blocks take 2048 keys on the two-tile kernel, which the launcher then
  // runs built with four stages (kvkit::cuda::detail::decode_long_ring_fit): 32 sequences of 1985
  // to 2048 keys over 8 KV heads, whole (256 blocks), in HND pages; and 7 sequences of 8105 to
  // 8192 keys in NHD pages, cut into 4 splits of 2048 (224 blocks) that merge in clusters of 4
  // (56 clusters, which fit at two blocks per SM). Lengths vary, so last tiles and pages are
  // partial. (The fp8 case below merges the same build's splits through the workspace.)
  const std::uint64_t seed = kvkit_test::test_seed(0x10A6);
  const std::vector<std::int32_t> whole = kvkit_test::lengths_below(32, 2048, 37, 64);
  const std::vector<std::int32_t> split = kvkit_test::lengths_below(7, 8192, 29, 97);
  using int4_hnd =
      paged_layout<kvkit::int4_group_codec<32>, kvkit::int4_group_codec<32>, kv_order::hnd>;
  using int4_nhd = paged_layout<kvkit::int4_group_codec<32>>;
  const int4_hnd hnd(16, 8, 128);
  const int4_nhd nhd(16, 8, 128);
  for (const auto& [shape, lens] : {std::pair{kvkit::decode_shape_for(hnd, 32, 64), whole},
                                    std::pair{kvkit::decode_shape_for(nhd, 7, 32), split}}) {
    const auto plan = kvkit::plan_decode(shape, lens, 132);
    REQUIRE(plan.ok());
    INFO("chunk " << plan->chunk_tokens << " splits " << plan->max_splits);
    REQUIRE(plan->two_tiles);
    REQUIRE(plan->chunk_tokens == 2048);
  }
  check_decode<128, int4_hnd, __nv_bfloat16>(hnd, 8, whole, seed);
  check_decode<128, int4_nhd, __nv_bfloat16>(nhd, 4, split, seed + 1);
}

TEST_CASE("paged_decode: fp8 split plans paired on the two-tile kernel's shallow build",
          "[cuda][decode]") {
  // Plans for 132 SMs over 8 KV heads of one wave of four blocks per SM of split sequences,
  // which the launcher runs as half the splits of twice the keys, 2048 or more, one wave of two
  // blocks per SM on the two-tile kernel built with four stages
  // (kvkit::cuda::detail::decode_long_ring_fit, decode_paired_block_keys), on a device of 128 to
  // 255 SMs (the H200's 132; the one-tile kernel on the plan's splits elsewhere, with the same
  // results): 8 sequences of 32680 to 32768 keys in NHD pages (8 splits of 4096, run as 4 of 8192
  // that merge in clusters or, where the device does not fit all 64, through the workspace); 24
  // sequences of 8099 to 8192 keys in HND pages (2 splits of 4096, run whole); and 8 sequences of
  // 7933 to 8192 keys in NHD pages (8 splits of 1024, run as 4 of 2048). Lengths vary, so last
  // tiles and pages are partial.
  const std::uint64_t seed = kvkit_test::test_seed(0xF8A4);
  const std::vector<std::int32_t> eight = kvkit_test::lengths_below(8, 32768, 37, 97);
  const std::vector<std::int32_t> many = kvkit_test::lengths_below(24, 8192, 37, 97);
  const std::vector<std::int32_t> mid = kvkit_test::lengths_below(8, 8192, 37, 300);
  using fp8_nhd = paged_layout<kvkit::fp8_e4m3_codec>;
  using fp8_hnd = paged_layout<kvkit::fp8_e4m3_codec, kvkit::fp8_e4m3_codec, kv_order::hnd>;
  const fp8_nhd nhd(16, 8, 128);
  const fp8_hnd hnd(16, 8, 128);
  for (const auto& [shape, lens, chunk, splits] :
       {std::tuple{kvkit::decode_shape_for(nhd, 8, 16), eight, 4096, 8},
        std::tuple{kvkit::decode_shape_for(hnd, 24, 16), many, 4096, 2},
        std::tuple{kvkit::decode_shape_for(nhd, 8, 16), mid, 1024, 8}}) {
    const auto plan = kvkit::plan_decode(shape, lens, 132);
    REQUIRE(plan.ok());
    INFO("chunk " << plan->chunk_tokens << " splits " << plan->max_splits);
    CHECK(!plan->two_tiles);
    CHECK(plan->chunk_tokens == chunk);
    CHECK(plan->max_splits == splits);
  }
  check_decode<128, fp8_nhd, __nv_bfloat16>(nhd, 2, eight, seed, {}, 132, false);
  check_decode<128, fp8_hnd, __nv_bfloat16>(hnd, 2, many, seed + 1, {}, 132, false);
  check_decode<128, fp8_nhd, __nv_bfloat16>(nhd, 4, mid, seed + 2, {}, 132, false);
}

TEST_CASE("paged_decode: int4 in NHD pages on blocks of four KV heads", "[cuda][decode]") {
  // Plans whose grids of the one-tile kernel exceed one block an SM, with chunks of 4 *
  // head_split_min_keys keys or more, which give an int4 cache in NHD pages blocks of four KV
  // heads, a head a warp, over a quarter of the keys (decode_plan::heads_per_block). Planned for
  // few SMs, so that short batches make such chunks: 6 sequences of 16413 to 16500 keys over 8 KV
  // heads for 16 SMs, whole sequences of one head a block that become 4 splits of 4160 keys
  // merging in clusters of 4; one of 50000 keys for 6 SMs, 3 splits that become 12 merging
  // through the workspace; and 12 sequences of 16413 to 16500 keys over 4 KV heads (one block of
  // heads a sequence). Lengths vary, so last tiles and pages are partial. Then a batch of mixed
  // lengths for 8 SMs (16500 down to 1 key: sequences of 4, 3 and 1 of the plan's 4 splits, so
  // that some blocks of a cluster have no keys and some sequences store their outputs unmerged),
  // groups 1 and 8; one sequence of 160000 keys for 20 SMs (32 splits through the
  // workspace, a warp's worth of log-sum-exps a query head); and, on the first batch, a soft cap
  // with an explicit scale, and a window of 9000 keys (whose plan keeps blocks of one head: the
  // same outputs either way).
  const std::uint64_t seed = kvkit_test::test_seed(0x4EAD);
  using int4_nhd = paged_layout<kvkit::int4_group_codec<32>>;
  const int4_nhd layout(16, 8, 128);
  const int4_nhd four(16, 4, 128);
  const std::vector<std::int32_t> batch = kvkit_test::lengths_below(6, 16500, 29, 97);
  const std::vector<std::int32_t> one{50000};
  const std::vector<std::int32_t> twelve = kvkit_test::lengths_below(12, 16500, 29, 97);
  const auto plan_of = [](const auto& l, const std::vector<std::int32_t>& lens, std::int32_t sms) {
    const auto plan = kvkit::plan_decode(
        kvkit::decode_shape_for(l, static_cast<std::int32_t>(lens.size()), 32), lens, sms);
    REQUIRE(plan.ok());
    INFO("chunk " << plan->chunk_tokens << " splits " << plan->max_splits);
    CHECK(plan->heads_per_block == kvkit::decode_plan::head_split_heads);
    return *plan;
  };
  CHECK(plan_of(layout, batch, 16).max_splits == 4);
  CHECK(plan_of(layout, one, 6).max_splits > kvkit::decode_plan::max_cluster_splits);
  CHECK(plan_of(four, twelve, 16).max_splits == 4);
  const std::vector<std::int32_t> mixed{16500, 16413, 9000, 4100, 700, 1};
  const std::vector<std::int32_t> longest{160000};
  CHECK(plan_of(layout, mixed, 8).max_splits == 4);
  CHECK(plan_of(layout, longest, 20).max_splits == 32);
  std::uint64_t s = seed;
  for (const std::int32_t group : {4, 8}) {
    check_decode<128, int4_nhd, __nv_bfloat16>(layout, group, batch, ++s, {}, 16);
    check_decode<128, int4_nhd, __nv_bfloat16>(layout, group, one, ++s, {}, 6);
  }
  check_decode<128, int4_nhd, __nv_bfloat16>(four, 8, twelve, ++s, {}, 16);
  for (const std::int32_t group : {1, 8}) {
    check_decode<128, int4_nhd, __nv_bfloat16>(layout, group, mixed, ++s, {}, 8);
  }
  check_decode<128, int4_nhd, __nv_bfloat16>(layout, 1, longest, ++s, {}, 20);
  for (const kvkit::attention_options o :
       {kvkit::attention_options{0.05F, 0, 2.0F}, kvkit::attention_options{0.0F, 9000, 0.0F}}) {
    check_decode<128, int4_nhd, __nv_bfloat16>(layout, 8, batch, ++s, o, 16);
  }
}

TEST_CASE("paged_decode: sliding window, soft cap and explicit scale", "[cuda][decode]") {
  const std::uint64_t seed = kvkit_test::test_seed(0x0B7);
  const std::vector<std::int32_t> lens{1, 40, 513, 2500};
  const paged_layout<kvkit::bf16_codec> layout(16, 2, 128);
  for (const kvkit::attention_options o :
       {kvkit::attention_options{0.0F, 1, 0.0F}, kvkit::attention_options{0.0F, 100, 0.0F},
        kvkit::attention_options{0.0F, 0, 5.0F}, kvkit::attention_options{0.05F, 257, 2.0F}}) {
    for (const std::int32_t sms : {1, 16, 4096}) {
      check_decode<128, bf16_nhd, __nv_bfloat16>(layout, 4, lens, seed + sms, o, sms);
      // The quantized kernels apply the options in their own loops (an int4 K cache branches
      // around the soft cap where the others predicate it): fp8, int8 and int4 caches too.
      const auto s = seed + 10000 + static_cast<std::uint64_t>(sms);
      check_decode<128, paged_layout<kvkit::fp8_e4m3_codec>, __nv_bfloat16>({16, 2, 128}, 4, lens,
                                                                            s, o, sms);
      check_decode<128, paged_layout<kvkit::int8_codec>, __nv_bfloat16>({16, 2, 128}, 8, lens,
                                                                        s + 1, o, sms);
      check_decode<
          128,
          paged_layout<kvkit::int4_group_codec<128>, kvkit::int4_group_codec<128>, kv_order::hnd>,
          __nv_bfloat16>({16, 2, 128}, 4, lens, s + 2, o, sms);
      check_decode<64, paged_layout<kvkit::int4_group_codec<32>>, __nv_bfloat16>(
          {16, 2, 64}, 1, lens, s + 3, o, sms);
    }
  }
}

TEST_CASE("paged_decode: logits whose running maximum climbs along the sequence",
          "[cuda][decode]") {
  // A tile whose logits pass no running maximum by more than 2^8 keeps the maxima and skips their
  // shuffles (its probabilities reach 256); one that does moves them and rescales the outputs.
  // Keys that grow along the sequence give both kinds of tile, most of them of the first kind at
  // rise 0.5 and many of the second at rise 6 (K's values up to 53 times their first size at 9000
  // keys), in whole sequences and splits, on the one- and two-tile kernels (1 SM: a small grid)
  // and, for int4 in NHD pages (a batch of the head-split case's mixed lengths for 8 SMs), on
  // blocks of four KV heads. An int4 key's values are dequantized in fp16, which holds values of
  // several hundred (rise 6) only to within an eighth or a quarter where the reference keeps
  // float64: at the default logit scale the first run of this case found the int4 rows'
  // log-sum-exps off by up to 0.047 (rise 0.5) and 0.39 (rise 6), and every bf16, fp8 and int8 row
  // within its bounds; the kernels before the shuffles were skipped failed the same int4 rows (up
  // to 0.52 in the mixed batch). So the int4 logits are scaled to a standard deviation of 2 at
  // 16500 keys, which still climbs past the first tiles' maximum by more than 2^8 in the mixed
  // batch and to about 2^6 at 9000 keys.
  const std::uint64_t seed = kvkit_test::test_seed(0xC11);
  const std::vector<std::int32_t> lens{1, 700, 3000, 9000};
  const std::vector<std::int32_t> mixed{16500, 16413, 9000, 4100, 700, 1};
  using int4_nhd = paged_layout<kvkit::int4_group_codec<32>>;
  using int4_hnd =
      paged_layout<kvkit::int4_group_codec<32>, kvkit::int4_group_codec<32>, kv_order::hnd>;
  for (const float rise : {0.5F, 6.0F}) {
    std::uint64_t s = seed + (rise > 1.0F ? 1000U : 0U);
    // K's growth at 16500 keys, and the int4 options that keep its logits near 2 deviations.
    const float growth = 1.0F + rise * 16500.0F / 1024.0F;
    const auto int4_options = [&](int dim) {
      return kvkit::attention_options{2.0F / (std::sqrt(static_cast<float>(dim)) * growth), 0,
                                      0.0F};
    };
    for (const std::int32_t sms : {1, 16, 132}) {
      check_decode<128, bf16_nhd, __nv_bfloat16>({16, 2, 128}, 4, lens, ++s, {}, sms, true, -1,
                                                 0.0F, rise);
      check_decode<128, paged_layout<kvkit::fp8_e4m3_codec>, __nv_bfloat16>(
          {16, 4, 128}, 8, lens, ++s, {}, sms, true, -1, 0.0F, rise);
      check_decode<128, paged_layout<kvkit::int8_codec>, __nv_bfloat16>(
          {16, 4, 128}, 4, lens, ++s, {}, sms, true, -1, 0.0F, rise);
      check_decode<128, int4_hnd, __nv_bfloat16>({16, 4, 128}, 8, lens, ++s, int4_options(128), sms,
                                                 true, -1, 0.0F, rise);
      check_decode<64, paged_layout<kvkit::int4_group_codec<32>>, __nv_bfloat16>(
          {16, 4, 64}, 4, lens, ++s, int4_options(64), sms, true, -1, 0.0F, rise);
    }
    check_decode<128, int4_nhd, __nv_bfloat16>({16, 8, 128}, 4, mixed, ++s, int4_options(128), 8,
                                               true, -1, 0.0F, rise);
  }
}

TEST_CASE("paged_decode: int4 groups of any range decode as the reference does", "[cuda][decode]") {
  // Every 50th token's K and V are scaled up among tokens of unit size in the same tiles and steps:
  // by 17000 (values to about ±60000: scales near 6000, zero points near -50000, which the loop's
  // fp16 parameters hold only quartered), or by 100000 (beyond fp16: the codec saturates its
  // parameters, scales near 47000, held only divided by 32). The logit scale keeps their logits
  // near 1 to 10. Every int4 loop: the eight-warp kernel (1 SM: a grid of at most one block an
  // SM; and one sequence of 2047 keys over 8 KV heads), the two-tile kernel (16 SMs: one wave of
  // two blocks an SM; and whole sequences of 2048 keys, its four-stage build), the one-tile kernel
  // (132 and 4096 SMs), at head dims 64, 128 (one and two query tiles) and 256, NHD and HND pages,
  // and an int4 V beside an int8 K. Where the outputs are fp16, the values beyond fp16 come in
  // sequences of 200 keys or more with logits near 0, so that the outputs' weighted means fit.
  const std::uint64_t seed = kvkit_test::test_seed(0xB16);
  const std::vector<std::int32_t> lens{1, 4, 200, 3000};
  const std::vector<std::int32_t> long_lens{200, 3000};
  const kvkit::attention_options o{1e-5F, 0, 0.0F};
  const kvkit::attention_options o_beyond{1e-6F, 0, 0.0F};
  const kvkit::attention_options o_flat{1e-8F, 0, 0.0F};
  constexpr float big = 17000.0F;
  constexpr float beyond = 100000.0F;
  using int4_nhd = paged_layout<kvkit::int4_group_codec<32>>;
  using int4_hnd =
      paged_layout<kvkit::int4_group_codec<32>, kvkit::int4_group_codec<32>, kv_order::hnd>;
  using int4_128_hnd =
      paged_layout<kvkit::int4_group_codec<128>, kvkit::int4_group_codec<128>, kv_order::hnd>;
  using int8_k_int4_v = paged_layout<kvkit::int8_codec, kvkit::int4_group_codec<64>>;
  const int4_nhd nhd(16, 4, 128);
  const int4_hnd hnd(16, 4, 128);
  const int4_nhd nhd64(16, 4, 64);
  for (const auto& [shape, name] :
       {std::pair{kvkit::decode_shape_for(nhd, 4, 16), "NHD, group 4"},
        std::pair{kvkit::decode_shape_for(hnd, 4, 32), "HND, group 8"},
        std::pair{kvkit::decode_shape_for(nhd64, 4, 4), "head dim 64"}}) {
    INFO(name);
    const auto plan = kvkit::plan_decode(shape, lens, 16);
    REQUIRE(plan.ok());
    REQUIRE(plan->two_tiles);
  }
  for (const std::int32_t sms : {1, 16, 132, 4096}) {
    const std::uint64_t s = seed + static_cast<std::uint64_t>(sms) * 10;
    for (const float m : {big, beyond}) {
      const auto& opt = m == big ? o : o_beyond;
      for (const std::int32_t group : {4, 16}) {
        check_decode<128, int4_nhd, __nv_bfloat16>(nhd, group, lens, s + group, opt, sms, true, -1,
                                                   m);
      }
      check_decode<128, int4_hnd, __nv_bfloat16>(hnd, 8, lens, s + 1, opt, sms, true, -1, m);
      check_decode<64, int4_nhd, __nv_bfloat16>(nhd64, 1, lens, s + 2, opt, sms, true, -1, m);
    }
    check_decode<256, int4_nhd, __half>({16, 2, 256}, 4, lens, s + 3, o, sms, true, -1, big);
    check_decode<256, int4_nhd, __half>({16, 2, 256}, 4, long_lens, s + 5, o_flat, sms, true, -1,
                                        beyond);
    check_decode<128, int8_k_int4_v, __half>({16, 4, 128}, 4, lens, s + 6, o, sms, true, -1, big);
    check_decode<128, int8_k_int4_v, __half>({16, 4, 128}, 4, long_lens, s + 7, o_flat, sms, true,
                                             -1, beyond);
  }
  check_decode<128, int4_128_hnd, __nv_bfloat16>({16, 8, 128}, 4, {2047}, seed + 1, o, 132, true,
                                                 -1, big);
  check_decode<128, int4_128_hnd, __nv_bfloat16>({16, 8, 128}, 4, {2047}, seed + 2, o_beyond, 132,
                                                 true, -1, beyond);
  // As "int4 blocks of 2048 keys on the two-tile kernel's shallow build" (whose plan takes two
  // tiles of 2048-key blocks for these lengths).
  check_decode<128, int4_hnd, __nv_bfloat16>({16, 8, 128}, 8,
                                             kvkit_test::lengths_below(32, 2048, 37, 64), seed + 3,
                                             o_beyond, 132, true, -1, beyond);
}

TEST_CASE("paged_decode: a cluster merge where some blocks own no outputs or have no keys",
          "[cuda][decode]") {
  // In a cluster merge each block owns ceil(outputs / splits) of the group's float4 outputs
  // (16 at head dim 64, group 1), so a sequence of 5 or 7 splits leaves its last block owning
  // none, and the blocks past a shorter sequence's splits have no keys. With 4096 SMs the plan
  // cuts 128-key chunks: 8, 7, 5, 2 and 1 splits in clusters of 8 (20 clusters: they fit).
  const std::uint64_t seed = kvkit_test::test_seed(0xB0C5);
  const std::vector<std::int32_t> lens{1024, 7 * 128 - 3, 5 * 128 - 7, 129, 1};
  const paged_layout<kvkit::bf16_codec> layout(16, 4, 64);
  const auto plan = kvkit::plan_decode(kvkit::decode_shape_for(layout, 5, 4, 0), lens, 4096);
  REQUIRE(plan.ok());
  REQUIRE(plan->chunk_tokens == 128);
  REQUIRE(plan->max_splits == 8);
  for (const std::int32_t group : {1, 2}) {
    check_decode<64, paged_layout<kvkit::bf16_codec>, __nv_bfloat16>(layout, group, lens,
                                                                     seed + group, {}, 4096);
  }
}

TEST_CASE("paged_decode: a few splits merge through the workspace when their clusters do not fit",
          "[cuda][decode]") {
  // 64 sequences x 4 KV heads, each cut into at most 8 splits: 256 clusters, more than an H200
  // holds at once, so the launch merges through the workspace.
  const std::uint64_t seed = kvkit_test::test_seed(0xF17);
  problem<bf16_nhd> pr(bf16_nhd(16, 4, 128), 64 * 45 + 8, seed);
  std::vector<std::int32_t> lens;
  for (std::int32_t b = 0; b < 64; ++b) {
    lens.push_back(300 + (b * 37) % 400);
  }
  const std::int32_t q_heads = 16;
  const std::vector<kvkit_test::decode_step> steps{pr.make_step<__nv_bfloat16>(lens, q_heads)};
  kvkit_test::decode_mode mode;
  mode.sm_count = 4096;
  const auto got = kvkit_test::run_decode<128, bf16_nhd, __nv_bfloat16>(
      pr.layout, pr.cache, pr.capacity, {64, q_heads, 4, 128, 0}, steps, pr.scales, {}, mode);
  INFO("seed " << seed << " splits " << got.max_splits << " error "
               << cudaGetErrorString(got.error));
  REQUIRE(got.error == cudaSuccess);
  CHECK(got.max_splits >= 2);
  CHECK(got.max_splits <= kvkit::decode_plan::max_cluster_splits);
  CHECK(got.workspace_written);
  check_steps(pr, steps, q_heads, got);
}

TEST_CASE("paged_decode: split rows that are not a multiple of four stay inside the workspace",
          "[cuda][decode]") {
  // One sequence of one query head (one KV head, group 1) in 17 splits: 17 partial rows, whose
  // log-sum-exps the launcher rounds up to 20 floats so that the partial outputs after them are
  // 16-byte aligned. A workspace of exactly plan.workspace_bytes() must hold the last split's
  // outputs (run_decode allocates that many bytes and checks a poisoned guard after them); and
  // with 3 and 5 sequences (51 and 85 rows) likewise.
  const std::uint64_t seed = kvkit_test::test_seed(0x17);
  const paged_layout<kvkit::bf16_codec> layout(16, 1, 128);
  for (const std::int32_t batch : {1, 3, 5}) {
    std::vector<std::int32_t> lens(static_cast<std::size_t>(batch), 2077);
    const auto plan = kvkit::plan_decode(kvkit::decode_shape_for(layout, batch, 1, 0), lens, 132);
    REQUIRE(plan.ok());
    INFO("batch " << batch << " rows " << plan->partial_rows());
    REQUIRE(plan->max_splits > kvkit::decode_plan::max_cluster_splits); // merged in the workspace
    REQUIRE(plan->partial_rows() % 4 != 0);
    check_decode<128, bf16_nhd, __nv_bfloat16>(layout, 1, lens, seed + batch);
  }
}

TEST_CASE("paged_decode: one workspace serves plans of different batches in turn",
          "[cuda][decode]") {
  // An engine keeps one workspace while its batch grows and shrinks: each step's plan lays out
  // the workspace differently, so no step may depend on what an earlier one left there. The last
  // step's 40 sequences (80 counters, 512 bytes) keep counters where the step before it (2
  // sequences, 256 bytes of counters) left its partial log-sum-exps. Its sequences of 2500 keys
  // are cut in 20 splits (one of 2000 keys would be cut in 8 at most, merged in clusters).
  const std::uint64_t seed = kvkit_test::test_seed(0x5EED);
  problem<bf16_nhd> pr(bf16_nhd(16, 2, 128), 8192, seed);
  const std::int32_t q_heads = 8;
  const std::vector<std::int32_t> last_lens(40, 2500);
  std::vector<kvkit_test::decode_step> steps;
  for (const auto& lens : std::vector<std::vector<std::int32_t>>{
           {3000, 2000, 1500, 900, 700, 5000}, {4000}, {2500, 3500, 100}, {1, 6000}, last_lens}) {
    steps.push_back(pr.make_step<__nv_bfloat16>(lens, q_heads));
  }
  const auto last = kvkit::plan_decode({40, q_heads, 2, 128, 0}, last_lens, 4096);
  REQUIRE(last.ok());
  REQUIRE(last->max_splits > kvkit::decode_plan::max_cluster_splits);
  // Back to back, with no host synchronization between launches: each zeroes its arrival
  // counters on the stream after the launch before it has counted in the same words; or, with
  // counters the caller zeroed once, each leaves them zero for the next.
  for (const bool zeroed : {false, true}) {
    kvkit_test::decode_mode mode;
    mode.sm_count = 4096; // many splits (over 8), so every step merges through the workspace
    mode.repeats = 3;
    mode.zeroed_counters = zeroed;
    const auto got = kvkit_test::run_decode<128, bf16_nhd, __nv_bfloat16>(
        pr.layout, pr.cache, pr.capacity, {40, q_heads, 2, 128, 0}, steps, pr.scales, {}, mode);
    INFO("seed " << seed << " zeroed " << zeroed << " error " << cudaGetErrorString(got.error));
    REQUIRE(got.error == cudaSuccess);
    CHECK(got.workspace_written);
    CHECK(got.counters_zero);
    check_steps(pr, steps, q_heads, got);
  }
}

TEST_CASE("paged_decode: without the LSE output, the same outputs on every merge path",
          "[cuda][decode]") {
  // decode_args::lse is optional: with it null, one split a sequence (1 multiprocessor), a few
  // splits merged in clusters where the device has them (16) and many through the workspace
  // (4096) must write the outputs bit for bit as with it.
  const std::uint64_t seed = kvkit_test::test_seed(0x15E);
  const paged_layout<kvkit::bf16_codec> layout(16, 2, 128);
  const std::int32_t q_heads = 8;
  problem<bf16_nhd> pr(layout, 480, seed);
  const std::vector<kvkit_test::decode_step> steps{
      pr.make_step<__nv_bfloat16>({1, 300, 2100, 5000}, q_heads)};
  for (const std::int32_t sms : {1, 16, 4096}) {
    kvkit_test::decode_mode mode;
    mode.sm_count = sms;
    const auto with = kvkit_test::run_decode<128, bf16_nhd, __nv_bfloat16>(
        layout, pr.cache, pr.capacity, {4, q_heads, 2, 128, 0}, steps, pr.scales, {}, mode);
    mode.lse = false;
    const auto without = kvkit_test::run_decode<128, bf16_nhd, __nv_bfloat16>(
        layout, pr.cache, pr.capacity, {4, q_heads, 2, 128, 0}, steps, pr.scales, {}, mode);
    INFO("seed " << seed << " sms " << sms << " splits " << with.max_splits << " errors "
                 << cudaGetErrorString(with.error) << ", " << cudaGetErrorString(without.error));
    REQUIRE(with.error == cudaSuccess);
    REQUIRE(without.error == cudaSuccess);
    check_steps(pr, steps, q_heads, with);
    CHECK((sms == 1) == (with.max_splits == 1));
    CHECK((sms == 4096) == (with.max_splits > kvkit::decode_plan::max_cluster_splits));
    CHECK(merge_taken(with) == expected_merge(with.max_splits, with.cluster_device));
    CHECK(without.out == with.out);
  }
}

// The cases tagged [first_launch] also run each in a process of its own (ctest's
// cuda.first_launch, scripts/gpu_check.sh), where their first launch of each kernel is the one
// captured: the launcher's once-per-device set-up then runs inside the capture, and must still
// choose the cluster merge where the device has clusters.
TEST_CASE("paged_decode: graph-safe plan captured once, replayed as lengths change",
          "[cuda][decode][first_launch]") {
  const std::uint64_t seed = kvkit_test::test_seed(0x6A4);
  const paged_layout<kvkit::bf16_codec> layout(16, 2, 128);
  const std::int32_t q_heads = 8;
  problem<bf16_nhd> pr(layout, 2048, seed);
  std::vector<kvkit_test::decode_step> steps;
  // Same batch size every step; lengths grow, shrink, and one exceeds the plan's bound.
  for (const auto& lens : std::vector<std::vector<std::int32_t>>{
           {1, 100, 1000}, {2, 101, 1001}, {3000, 7, 64}, {5000, 1, 1}}) {
    steps.push_back(pr.make_step<__nv_bfloat16>(lens, q_heads));
  }
  const kvkit::decode_shape shape{3, q_heads, 2, 128, 0};
  kvkit_test::decode_mode mode;
  mode.graph = true;
  mode.max_seq_len = 1024;
  mode.repeats = 2;             // the graph replayed back to back
  mode.page_table_ready = true; // the table is uploaded before the graph runs
  const auto got = kvkit_test::run_decode<128, bf16_nhd, __nv_bfloat16>(
      layout, pr.cache, pr.capacity, shape, steps, pr.scales, {}, mode);
  INFO("seed " << seed << " splits " << got.max_splits << " cluster device " << got.cluster_device
               << " error " << cudaGetErrorString(got.error));
  REQUIRE(got.error == cudaSuccess);
  // Planned for 132 multiprocessors: 8 splits of 128 keys, which merge in clusters.
  CHECK(got.max_splits > 1);
  CHECK(got.max_splits <= kvkit::decode_plan::max_cluster_splits);
  CHECK(merge_taken(got) == expected_merge(got.max_splits, got.cluster_device));
  check_steps(pr, steps, q_heads, got);
}

namespace {

// The sequences of `s` that have keys, as a step of their own, and their rows of `out` and `lse`
// (`q_heads` rows of `dim` each a sequence); the empty ones' rows must still hold the poison (all
// bits set) written before the launch. False where one does not.
bool drop_empty(const kvkit_test::decode_step& s, std::int32_t q_heads, std::int32_t dim,
                const std::vector<std::uint16_t>& out, const std::vector<float>& lse,
                kvkit_test::decode_step& kept, std::vector<std::uint16_t>& kept_out,
                std::vector<float>& kept_lse) {
  const auto rows = static_cast<std::size_t>(q_heads);
  const auto row_elems = rows * static_cast<std::size_t>(dim);
  kept = {};
  kept.indptr.push_back(0);
  kept_out.clear();
  kept_lse.clear();
  bool poisoned = true;
  for (std::size_t b = 0; b + 1 < s.indptr.size(); ++b) {
    const auto first_out = out.begin() + static_cast<std::ptrdiff_t>(b * row_elems);
    const auto first_lse = lse.begin() + static_cast<std::ptrdiff_t>(b * rows);
    if (s.indptr[b + 1] == s.indptr[b]) {
      poisoned =
          poisoned &&
          std::all_of(first_out, first_out + static_cast<std::ptrdiff_t>(row_elems),
                      [](std::uint16_t x) { return x == 0xFFFFU; }) &&
          std::all_of(first_lse, first_lse + static_cast<std::ptrdiff_t>(rows), poisoned_lse);
      continue;
    }
    kept.indices.insert(kept.indices.end(), s.indices.begin() + s.indptr[b],
                        s.indices.begin() + s.indptr[b + 1]);
    kept.indptr.push_back(static_cast<std::int32_t>(kept.indices.size()));
    kept.last_page_len.push_back(s.last_page_len[b]);
    kept.q.insert(kept.q.end(), s.q.begin() + static_cast<std::ptrdiff_t>(b * row_elems),
                  s.q.begin() + static_cast<std::ptrdiff_t>((b + 1) * row_elems));
    kept_out.insert(kept_out.end(), first_out, first_out + static_cast<std::ptrdiff_t>(row_elems));
    kept_lse.insert(kept_lse.end(), first_lse, first_lse + static_cast<std::ptrdiff_t>(rows));
  }
  return poisoned;
}

// The batches a graph-safe plan is replayed for (four sequences each, some empty), the bound it is
// planned for, the multiprocessors it is planned for, and whether its splits merge through the
// workspace (more than decode_plan::max_cluster_splits). The default plans many splits, so that
// they do and the counters count.
struct padded_graph {
  std::vector<std::vector<std::int32_t>> steps{
      {100, 0, 3000, 0}, {0, 0, 0, 1}, {4000, 17, 0, 2500}};
  std::int32_t max_seq_len = 4096;
  std::int32_t sm_count = 4096;
  bool workspace = true;
};

// A graph-safe plan over a cache of `Layout` (head dim 128, bf16 queries), captured once and
// replayed for steps of one batch size padded with empty sequences, with the caller's zeroed
// counters or without, within `window` (0: none): the padding's outputs and log-sum-exps stay as
// they were, the others match the reference.
template <class Layout>
void check_padded_graph(const Layout& layout, std::int32_t window, bool zeroed, std::uint64_t seed,
                        const padded_graph& g = {}) {
  const std::int32_t q_heads = 4 * layout.num_kv_heads();
  std::int32_t pages = 7;
  for (const auto& lens : g.steps) {
    pages += pages_for(layout, lens);
  }
  problem<Layout> pr(layout, pages, seed);
  std::vector<kvkit_test::decode_step> steps;
  for (const auto& lens : g.steps) {
    steps.push_back(pr.template make_step<__nv_bfloat16>(lens, q_heads));
  }
  kvkit::attention_options options;
  options.window = window;
  const kvkit::decode_shape shape = kvkit::decode_shape_for(layout, 4, q_heads, window);
  kvkit_test::decode_mode mode;
  mode.graph = true;
  mode.max_seq_len = g.max_seq_len;
  mode.sm_count = g.sm_count;
  mode.repeats = 2;
  mode.zeroed_counters = zeroed;
  const auto got = kvkit_test::run_decode<128, Layout, __nv_bfloat16>(
      layout, pr.cache, pr.capacity, shape, steps, pr.scales, options, mode);
  INFO("seed " << seed << " window " << window << " zeroed " << zeroed << " splits "
               << got.max_splits << " error " << cudaGetErrorString(got.error));
  REQUIRE(got.error == cudaSuccess);
  CHECK((got.max_splits > kvkit::decode_plan::max_cluster_splits) == g.workspace);
  CHECK(merge_taken(got) == expected_merge(got.max_splits, got.cluster_device));
  if (zeroed || g.workspace) {
    // The workspace's own counters are zeroed (and used) only where the splits merge through it.
    CHECK(got.counters_zero);
  }
  CHECK(got.past_workspace_intact);
  for (std::size_t i = 0; i < steps.size(); ++i) {
    INFO("step " << i);
    kvkit_test::decode_step kept;
    std::vector<std::uint16_t> out;
    std::vector<float> lse;
    CHECK(drop_empty(steps[i], q_heads, 128, got.out[i], got.lse[i], kept, out, lse));
    check_step<Layout, __nv_bfloat16>(pr, kept, q_heads, options, out, lse);
  }
}

} // namespace

TEST_CASE("paged_decode: a graph-safe batch padded with empty sequences",
          "[cuda][decode][first_launch]") {
  const std::uint64_t seed = kvkit_test::test_seed(0x9AD);
  check_padded_graph(bf16_nhd(16, 2, 128), 0, false, seed);
  check_padded_graph(bf16_nhd(16, 2, 128), 2500, true, seed + 1);
  check_padded_graph(paged_layout<kvkit::int8_codec>(16, 2, 128), 0, true, seed + 2);
  check_padded_graph(paged_layout<kvkit::int4_group_codec<32>>(16, 2, 128), 3000, false, seed + 3);
}

TEST_CASE("paged_decode: a graph-safe int4 plan on blocks of four KV heads, replayed as lengths "
          "change",
          "[cuda][decode][first_launch]") {
  // Four sequences of at most 16500 keys over 8 KV heads, planned for 8 SMs: whole sequences of
  // one head a block become 4 splits of 4160 keys on blocks of four heads, merging in clusters of
  // 4. Replayed for batches padded with empty sequences, one of a single key, and ones past the
  // bound (their blocks take longer chunks), with the caller's zeroed counters and without.
  const std::uint64_t seed = kvkit_test::test_seed(0x6A5);
  using int4_nhd = paged_layout<kvkit::int4_group_codec<32>>;
  const int4_nhd layout(16, 8, 128);
  padded_graph g;
  g.steps = {{16500, 0, 12000, 1}, {0, 30000, 0, 0}, {16499, 20001, 4100, 16500}};
  g.max_seq_len = 16500;
  g.sm_count = 8;
  g.workspace = false;
  const auto plan = kvkit::plan_decode_graph_safe(
      kvkit::decode_shape_for(layout, 4, 4 * layout.num_kv_heads()), g.max_seq_len, g.sm_count);
  REQUIRE(plan.ok());
  INFO("chunk " << plan->chunk_tokens << " splits " << plan->max_splits);
  CHECK(plan->heads_per_block == kvkit::decode_plan::head_split_heads);
  CHECK(plan->max_splits == 4);
  check_padded_graph(layout, 0, false, seed, g);
  check_padded_graph(layout, 0, true, seed + 1, g);
}

TEST_CASE("paged_decode: a dependent launch waits for the kernel before it", "[cuda][decode]") {
  // The queries are written by a kernel that lets its dependents start at once and copies about
  // 20 us later; a decode launched as its programmatic dependent must still read the copied
  // queries (one split, splits merged in clusters, and through the workspace), also when it reads
  // the page table (uploaded before) ahead of its wait, and when it copies the cache's pages but
  // each sequence's last ahead of its wait too while the same kernel writes the last pages late;
  // an ordinary launch gives the same results.
  const std::uint64_t seed = kvkit_test::test_seed(0x9D1);
  const paged_layout<kvkit::bf16_codec> layout(16, 2, 128);
  const std::int32_t q_heads = 8;
  problem<bf16_nhd> pr(layout, 480, seed);
  const std::vector<kvkit_test::decode_step> steps{
      pr.make_step<__nv_bfloat16>({1, 300, 2100, 5000}, q_heads)};
  // Plans for 1, 16, 48 and 4096 multiprocessors: one split a sequence, splits merged in
  // clusters, 27 splits of 192 keys through the workspace (216 blocks: more than a multiprocessor
  // each on a device of up to 215, all resident at once on one of 108 or more, so a 16-bit cache
  // signals its dependents early and reads ahead of its wait there), and 40 splits.
  for (const std::int32_t sms : {1, 16, 48, 4096}) {
    // Dependent; dependent, table read early; ordinary; dependent, table and cache but the last
    // pages read early.
    for (const int variant : {0, 1, 2, 3}) {
      kvkit_test::decode_mode mode;
      mode.sm_count = sms;
      mode.late_queries = true;
      mode.dependent_launch = variant != 2;
      mode.page_table_ready = variant == 1 || variant == 3;
      mode.late_last_pages = variant == 3;
      // A dependent launch gets counters kept at zero by the caller: the launcher's memset of
      // the workspace's counters would come between the late kernel and the decode, which would
      // then follow a memset that itself waited for that kernel. The ordinary launch keeps it.
      mode.zeroed_counters = mode.dependent_launch;
      const auto got = kvkit_test::run_decode<128, bf16_nhd, __nv_bfloat16>(
          layout, pr.cache, pr.capacity, {4, q_heads, 2, 128, 0}, steps, pr.scales, {}, mode);
      INFO("seed " << seed << " sms " << sms << " variant " << variant << " splits "
                   << got.max_splits << " error " << cudaGetErrorString(got.error));
      REQUIRE(got.error == cudaSuccess);
      if (sms == 48) {
        REQUIRE(got.max_splits == 27);
      }
      check_steps(pr, steps, q_heads, got);
      if (mode.zeroed_counters && got.max_splits > kvkit::decode_plan::max_cluster_splits) {
        CHECK(got.counters_zero); // the caller's counters, used and back at zero
      }
    }
  }
}

TEST_CASE("paged_decode: a batch of empty sequences alone ends after the kernel before it",
          "[cuda][decode]") {
  // Padding only (a graph-safe plan), launched as a programmatic dependent, reading the page table
  // before or after its wait, right after a kernel that lets its dependents start at once and
  // writes the queries late: no block has keys to read, yet a copy of the queries made on the
  // stream after the decode finds them written, and the outputs stay as they were.
  const std::uint64_t seed = kvkit_test::test_seed(0x9E0);
  const bf16_nhd layout(16, 2, 128);
  const std::int32_t q_heads = 8;
  problem<bf16_nhd> pr(layout, 8, seed);
  const std::vector<kvkit_test::decode_step> steps{
      pr.make_step<__nv_bfloat16>({0, 0, 0, 0}, q_heads)};
  for (const bool ready : {false, true}) {
    kvkit_test::decode_mode mode;
    mode.graph_safe_plan = true;
    mode.max_seq_len = 4096;
    mode.late_queries = true;
    mode.page_table_ready = ready;
    // Counters kept at zero by the caller: no memset between the late kernel and the decode,
    // which would make the decode follow a memset that itself waited for that kernel.
    mode.zeroed_counters = true;
    const auto got = kvkit_test::run_decode<128, bf16_nhd, __nv_bfloat16>(
        layout, pr.cache, pr.capacity, {4, q_heads, 2, 128, 0}, steps, pr.scales, {}, mode);
    INFO("seed " << seed << " page_table_ready " << ready << " splits " << got.max_splits
                 << " error " << cudaGetErrorString(got.error));
    REQUIRE(got.error == cudaSuccess);
    CHECK(got.queries_after == steps[0].q);
    CHECK(std::all_of(got.out[0].begin(), got.out[0].end(),
                      [](std::uint16_t x) { return x == 0xFFFF; }));
  }
}

namespace {

// Two sequences of a bf16 cache (2 KV heads at head dim 128, 16-token pages, 8 query heads) in
// one step, for the launcher's cases below, each of which decodes them under a mode of its own.
struct two_sequences {
  two_sequences(std::uint64_t seed_tag, const std::vector<std::int32_t>& lens)
      : seed(kvkit_test::test_seed(seed_tag)),
        pr(layout, 64, seed), steps{pr.make_step<__nv_bfloat16>(lens, q_heads)} {}

  [[nodiscard]] kvkit_test::decode_outcome decode(const kvkit_test::decode_mode& mode) const {
    return kvkit_test::run_decode<128, bf16_nhd, __nv_bfloat16>(
        layout, pr.cache, pr.capacity, {2, q_heads, 2, 128, 0}, steps, pr.scales, {}, mode);
  }
  void check(const kvkit_test::decode_outcome& got) const { check_steps(pr, steps, q_heads, got); }

  static constexpr std::int32_t q_heads = 8;
  std::uint64_t seed;
  bf16_nhd layout{16, 2, 128};
  problem<bf16_nhd> pr;
  std::vector<kvkit_test::decode_step> steps;
};

} // namespace

TEST_CASE("paged_decode: an error left pending before it is returned, and nothing launched",
          "[cuda][decode][pending_error]") {
  const two_sequences c(0x9E1, {300, 17});
  kvkit_test::decode_mode mode;
  mode.pending_error_first = true;
  const auto got = c.decode(mode);
  INFO("seed " << c.seed << " error " << cudaGetErrorString(got.error) << " first call "
               << cudaGetErrorString(got.pending_error_returned));
  REQUIRE(got.error == cudaSuccess);
  REQUIRE(got.pending_error_left != cudaSuccess);
  CHECK(got.pending_error_returned == got.pending_error_left);
  CHECK(got.pending_error_taken);
  CHECK(got.untouched_after_error);
  c.check(got);
}

TEST_CASE("paged_decode: an error of its own launch is returned and taken, and the next call runs",
          "[cuda][decode][pending_error]") {
  // A long sequence, split on any device, and a short one.
  const two_sequences c(0x9E2, {900, 17});
  kvkit_test::decode_mode mode;
  mode.own_error_on_repeat = true;
  mode.repeats = 2;
  const auto got = c.decode(mode);
  INFO("seed " << c.seed << " error " << cudaGetErrorString(got.error) << " failing call "
               << cudaGetErrorString(got.own_error_returned));
  REQUIRE(got.error == cudaSuccess);
  CHECK(got.own_error_returned != cudaSuccess);
  CHECK(got.own_error_taken);
  CHECK(got.untouched_after_error);
  c.check(got);
}

// The launcher raises a kernel's shared-memory limit once per device and keeps that it did for the
// life of the process. The limit holds across cudaDeviceReset (observed with the CUDA 13 runtime
// and driver 580 on an H100), so a decode after a reset runs as before it: a bf16 sequence split
// over a cluster, whose kernel takes more than the default 48 KB (decode_device.cu asserts it).
// Every case after this one runs in the new context.
TEST_CASE("paged_decode: a decode after cudaDeviceReset runs as before it", "[cuda][decode]") {
  const two_sequences c(0x9E3, {900, 17});
  INFO("seed " << c.seed);
  const auto before = c.decode({});
  INFO("before the reset: " << cudaGetErrorString(before.error));
  REQUIRE(before.error == cudaSuccess);
  c.check(before);
  REQUIRE(cudaDeviceReset() == cudaSuccess);
  const auto after = c.decode({});
  INFO("after the reset: " << cudaGetErrorString(after.error));
  REQUIRE(after.error == cudaSuccess);
  CHECK(after.max_splits > 1);
  c.check(after);
}

// Driver API contexts (CUDA 12.5 and later: cuCtxCreate's parameters, green contexts, and the
// runtime's entry-point query by version).
#if CUDART_VERSION >= 12050
namespace {

// The driver's entry point `name` in the form of CUDA version `version` (that of its PFN type),
// found at run time (the tests link the runtime alone); null where the driver lacks it.
template <class Fn>
Fn driver_entry(const char* name, unsigned version) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found{};
  if (cudaGetDriverEntryPointByVersion(name, &fn, version, cudaEnableDefault, &found) !=
          cudaSuccess ||
      found != cudaDriverEntryPointSuccess) {
    (void)cudaGetLastError();
    return nullptr;
  }
  return reinterpret_cast<Fn>(fn);
}

// Calls `f` when it goes out of scope (a context destroyed, though a check failed on the way).
template <class F>
class at_exit {
public:
  explicit at_exit(F f) : f_(std::move(f)) {}
  at_exit(const at_exit&) = delete;
  at_exit& operator=(const at_exit&) = delete;
  ~at_exit() { f_(); }

private:
  F f_;
};

// Pushes `ctx` current on this thread for its life, and pops it after.
class pushed_context {
public:
  explicit pushed_context(CUcontext ctx)
      : pop_(driver_entry<PFN_cuCtxPopCurrent_v4000>("cuCtxPopCurrent", 4000)) {
    const auto push = driver_entry<PFN_cuCtxPushCurrent_v4000>("cuCtxPushCurrent", 4000);
    pushed_ = push != nullptr && pop_ != nullptr && push(ctx) == CUDA_SUCCESS;
  }
  pushed_context(const pushed_context&) = delete;
  pushed_context& operator=(const pushed_context&) = delete;
  ~pushed_context() {
    if (pushed_) {
      CUcontext popped = nullptr;
      (void)pop_(&popped);
    }
  }
  [[nodiscard]] bool ok() const { return pushed_; }

private:
  PFN_cuCtxPopCurrent_v4000 pop_;
  bool pushed_ = false;
};

// Decodes `c` with the runtime's calls going to `ctx`, planned for `sm_count` multiprocessors,
// checks it against the reference and returns the plan's splits.
std::int32_t check_in_context(const two_sequences& c, CUcontext ctx, std::int32_t sm_count) {
  const pushed_context current(ctx);
  REQUIRE(current.ok());
  kvkit_test::decode_mode mode;
  mode.sm_count = sm_count;
  const auto got = c.decode(mode);
  INFO("planned for " << sm_count << " SMs: error " << cudaGetErrorString(got.error) << ", splits "
                      << got.max_splits);
  REQUIRE(got.error == cudaSuccess);
  CHECK(got.max_splits > 1);
  c.check(got);
  return got.max_splits;
}

} // namespace

// The launcher keeps per device, not per context, what it asked and set (the device's
// attributes, each kernel's raised shared-memory limit). A context of the driver API's own and a
// green context holding part of the device's SMs each decode a sequence split over a cluster,
// whose kernel takes more than the default 48 KB, as the reference does; the primary context has
// launched that kernel first.
TEST_CASE("paged_decode: a decode in a second context and in a green context of the device",
          "[cuda][decode]") {
  const two_sequences c(0x9E4, {900, 17});
  INFO("seed " << c.seed);
  int ordinal = 0;
  std::int32_t sms = 0;
  REQUIRE(cudaGetDevice(&ordinal) == cudaSuccess);
  REQUIRE(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, ordinal) == cudaSuccess);
  kvkit_test::decode_mode whole;
  whole.sm_count = sms;
  const auto primary = c.decode(whole);
  REQUIRE(primary.error == cudaSuccess);
  c.check(primary);
  const auto device_get = driver_entry<PFN_cuDeviceGet_v2000>("cuDeviceGet", 2000);
  REQUIRE(device_get != nullptr);
  CUdevice device = 0;
  REQUIRE(device_get(&device, ordinal) == CUDA_SUCCESS);

  SECTION("a context of its own (cuCtxCreate)") {
    const auto create = driver_entry<PFN_cuCtxCreate_v12050>("cuCtxCreate", 12050);
    const auto pop = driver_entry<PFN_cuCtxPopCurrent_v4000>("cuCtxPopCurrent", 4000);
    const auto destroy = driver_entry<PFN_cuCtxDestroy_v4000>("cuCtxDestroy", 4000);
    REQUIRE(create != nullptr);
    REQUIRE(pop != nullptr);
    REQUIRE(destroy != nullptr);
    CUctxCreateParams params{};
    CUcontext ctx = nullptr;
    const CUresult made = create(&ctx, &params, 0, device);
    INFO("cuCtxCreate returned " << made);
    REQUIRE(made == CUDA_SUCCESS);
    // Destroyed whatever happens below (current or not).
    const at_exit destroyed([&] { (void)destroy(ctx); });
    // cuCtxCreate leaves the new context current: pop it, so that only the case's push holds it.
    CUcontext popped = nullptr;
    REQUIRE(pop(&popped) == CUDA_SUCCESS);
    REQUIRE(popped == ctx);
    check_in_context(c, ctx, sms);
  }

  SECTION("a green context of the fewest SMs the device splits off") {
    const auto get_resource =
        driver_entry<PFN_cuDeviceGetDevResource_v12040>("cuDeviceGetDevResource", 12040);
    const auto split =
        driver_entry<PFN_cuDevSmResourceSplitByCount_v12040>("cuDevSmResourceSplitByCount", 12040);
    const auto describe =
        driver_entry<PFN_cuDevResourceGenerateDesc_v12040>("cuDevResourceGenerateDesc", 12040);
    const auto create = driver_entry<PFN_cuGreenCtxCreate_v12040>("cuGreenCtxCreate", 12040);
    const auto as_context = driver_entry<PFN_cuCtxFromGreenCtx_v12040>("cuCtxFromGreenCtx", 12040);
    const auto destroy = driver_entry<PFN_cuGreenCtxDestroy_v12040>("cuGreenCtxDestroy", 12040);
    REQUIRE(get_resource != nullptr);
    REQUIRE(split != nullptr);
    REQUIRE(describe != nullptr);
    REQUIRE(create != nullptr);
    REQUIRE(as_context != nullptr);
    REQUIRE(destroy != nullptr);
    CUdevResource all{};
    REQUIRE(get_resource(device, &all, CU_DEV_RESOURCE_TYPE_SM) == CUDA_SUCCESS);
    CUdevResource part{};
    unsigned groups = 1;
    const CUresult cut = split(&part, &groups, &all, nullptr, 0, all.sm.minSmPartitionSize);
    INFO("device SMs " << all.sm.smCount << ", smallest partition " << all.sm.minSmPartitionSize
                       << "; split returned " << cut << ", " << groups << " group(s) of "
                       << part.sm.smCount << " SMs");
    REQUIRE(cut == CUDA_SUCCESS);
    REQUIRE(groups == 1);
    REQUIRE(part.sm.smCount < all.sm.smCount);
    CUdevResourceDesc desc = nullptr;
    REQUIRE(describe(&desc, &part, 1) == CUDA_SUCCESS);
    CUgreenCtx green = nullptr;
    REQUIRE(create(&green, desc, device, CU_GREEN_CTX_DEFAULT_STREAM) == CUDA_SUCCESS);
    const at_exit destroyed([&] { (void)destroy(green); });
    CUcontext ctx = nullptr;
    REQUIRE(as_context(&ctx, green) == CUDA_SUCCESS);
    // Planned for the partition's SMs, as an engine that knows its share plans; then for the
    // whole device, as one that does not: the primary context's plan, whose clusters (8 blocks on
    // an H100 or H200) may be as large as the partition.
    check_in_context(c, ctx, static_cast<std::int32_t>(part.sm.smCount));
    CHECK(check_in_context(c, ctx, sms) == primary.max_splits);
  }
}
#else
TEST_CASE("paged_decode: a decode in a second context and in a green context of the device",
          "[cuda][decode]") {
  WARN("not built: driver API contexts need CUDA 12.5 or later (CUDART_VERSION " << CUDART_VERSION
                                                                                 << ")");
}
#endif

// A quantized cache's one-wave grid of split sequences, launched as a programmatic dependent with
// the page table and the cache but each sequence's last page read ahead of its wait, while the
// kernel before it writes the queries and the last pages late; two launches back to back, so
// that the second follows a decode that signalled it early.
template <class Layout>
void check_early_split_grid(const Layout& layout, std::int32_t sm_count, std::uint64_t seed) {
  std::vector<std::int32_t> lens(24);
  for (std::size_t i = 0; i < lens.size(); ++i) {
    lens[i] = 1100 + static_cast<std::int32_t>(i * 389 % 1001);
  }
  const std::int32_t q_heads = 2 * layout.num_kv_heads();
  const kvkit::decode_shape shape =
      kvkit::decode_shape_for(layout, static_cast<std::int32_t>(lens.size()), q_heads);
  const auto plan = kvkit::plan_decode(shape, lens, sm_count);
  REQUIRE(plan.ok());
  std::int64_t blocks = 0;
  for (const std::int32_t len : lens) {
    blocks += (len + plan->chunk_tokens - 1) / plan->chunk_tokens * layout.num_kv_heads();
  }
  INFO("seed " << seed << " chunk " << plan->chunk_tokens << " splits " << plan->max_splits
               << " blocks " << blocks);
  REQUIRE(plan->max_splits > 1);
  REQUIRE(plan->chunk_tokens >= kvkit::decode_plan::early_read_min_chunk);
  REQUIRE(blocks > 132);
  REQUIRE(blocks <= 2 * 132);
  problem<Layout> pr(layout, pages_for(layout, lens) + 7, seed);
  const std::vector<kvkit_test::decode_step> steps{
      pr.template make_step<__nv_bfloat16>(lens, q_heads)};
  kvkit_test::decode_mode mode;
  mode.sm_count = sm_count;
  mode.repeats = 2;
  mode.late_queries = true;
  mode.page_table_ready = true;
  mode.late_last_pages = true;
  // Counters kept at zero by the caller, so that no memset of the launcher's comes between the
  // late kernel and the decode (see the dependent launch case above).
  mode.zeroed_counters = true;
  const auto got = kvkit_test::run_decode<128, Layout, __nv_bfloat16>(
      layout, pr.cache, pr.capacity, shape, steps, pr.scales, {}, mode);
  INFO("error " << cudaGetErrorString(got.error));
  REQUIRE(got.error == cudaSuccess);
  check_step<Layout, __nv_bfloat16>(pr, steps[0], q_heads, {}, got.out[0], got.lse[0]);
  CHECK(got.past_workspace_intact);
  CHECK(got.counters_zero);
}

TEST_CASE("paged_decode: quantized one-wave grids of split sequences read ahead of their wait",
          "[cuda][decode]") {
  // 24 sequences of 1100 to 2100 keys over 4 KV heads, 8-token pages, planned so that every
  // sequence takes 2 splits of at least decode_plan::early_read_min_chunk keys: 184 blocks, one
  // wave and more than one block per SM on the H200's 132 SMs, where such a grid signals its
  // dependents early and reads ahead of its wait (elsewhere it runs the ordinary way; the results
  // are the same). fp8 on the one-tile kernel, int8 on the two-tile one, int4 in HND pages.
  const std::uint64_t seed = kvkit_test::test_seed(0xEA51);
  check_early_split_grid(paged_layout<kvkit::fp8_e4m3_codec>(8, 4, 128), 48, seed);
  check_early_split_grid(paged_layout<kvkit::int8_codec>(8, 4, 128), 96, seed + 1);
  using int4_hnd =
      paged_layout<kvkit::int4_group_codec<32>, kvkit::int4_group_codec<32>, kv_order::hnd>;
  check_early_split_grid(int4_hnd(8, 4, 128), 48, seed + 2);
}

namespace {

// The debug page check over a cache of `Layout` (head dim 128, bf16 queries): clean page ids
// leave the flag at zero; ids one past the cache, negative and far outside set it, and their
// keys read as zeros (K and V, parameters included: a page of zero bytes, as the reference reads
// it), while the other keys and a clean sequence are read as ever.
template <class Layout>
void check_page_flags(const Layout& layout, std::int32_t longest, std::uint64_t seed) {
  const std::vector<std::int32_t> lens{longest, 300, 40};
  const std::int32_t q_heads = 4 * layout.num_kv_heads();
  problem<Layout> pr(layout, pages_for(layout, lens) + 8, seed);
  const std::int32_t zero_page = pr.free_pages.back();
  pr.free_pages.pop_back();
  const auto page_bytes = static_cast<std::size_t>(layout.bytes_per_page());
  std::fill_n(pr.cache.begin() + static_cast<std::ptrdiff_t>(zero_page * page_bytes), page_bytes,
              std::byte{0});
  const auto good = pr.template make_step<__nv_bfloat16>(lens, q_heads);
  const kvkit::decode_shape shape = kvkit::decode_shape_for(layout, 3, q_heads);
  kvkit_test::decode_mode mode;
  mode.check_pages = true;
  INFO("seed " << seed << " longest " << longest);
  const auto clean = kvkit_test::run_decode<128, Layout, __nv_bfloat16>(
      layout, pr.cache, pr.capacity, shape, {good}, pr.scales, {}, mode);
  REQUIRE(clean.error == cudaSuccess);
  CHECK(clean.page_check == 0);
  check_step<Layout, __nv_bfloat16>(pr, good, q_heads, {}, clean.out[0], clean.lse[0]);
  // Pages inside each sequence (not its last): one past the cache in the first, a negative id and
  // one far outside in the second; the third stays clean.
  auto bad = good;
  auto seen = good; // what the kernel should read: the zero page for each bad id
  for (const auto& [page, id] :
       {std::pair{good.indptr[0] + 1, pr.capacity}, std::pair{good.indptr[1], -3},
        std::pair{good.indptr[1] + 2, 1 << 20}}) {
    REQUIRE(page + 1 < good.indptr[page < good.indptr[1] ? 1 : 2]);
    bad.indices[static_cast<std::size_t>(page)] = id;
    seen.indices[static_cast<std::size_t>(page)] = zero_page;
  }
  const auto flagged = kvkit_test::run_decode<128, Layout, __nv_bfloat16>(
      layout, pr.cache, pr.capacity, shape, {bad}, pr.scales, {}, mode);
  REQUIRE(flagged.error == cudaSuccess);
  CHECK(flagged.page_check == 1);
  check_step<Layout, __nv_bfloat16>(pr, seen, q_heads, {}, flagged.out[0], flagged.lse[0]);
}

} // namespace

TEST_CASE("paged_decode: the debug page check flags bad page ids and reads nothing outside",
          "[cuda][decode]") {
  // Each form of the check: bf16's and int4's predicated one, and the branch of the 8-bit
  // kernels, one-tile (fp8 over 8 KV heads: 192 blocks of 8 splits, more than the device's SMs,
  // so neither the small grid's two-tile kernel nor fp8's paired one) and two-tile (int8 over
  // 2048 keys).
  const std::uint64_t seed = kvkit_test::test_seed(0xBAD);
  check_page_flags(bf16_nhd(16, 2, 128), 1000, seed);
  check_page_flags(paged_layout<kvkit::int4_group_codec<32>>(16, 2, 128), 1000, seed + 1);
  check_page_flags(paged_layout<kvkit::fp8_e4m3_codec>(16, 8, 128), 1000, seed + 2);
  check_page_flags(paged_layout<kvkit::int8_codec>(16, 2, 128), 2100, seed + 3);
}

TEST_CASE("paged_decode: the launcher chooses the builds the cases above are named after",
          "[cuda][decode][host]") {
  kvkit_test::check_no_failures(kvkit_test::decode_choice_failures(), "");
}

TEST_CASE("paged_decode: validate rejects bad arguments before launch", "[cuda][decode][host]") {
  kvkit_test::check_no_failures(kvkit_test::decode_validation_failures(),
                                "not rejected (or a good case rejected): ");
}

TEST_CASE("paged_decode: every kernel resides as many blocks per SM as its grids are cut for",
          "[cuda][decode]") {
  kvkit_test::check_no_failures(kvkit_test::decode_residency_failures(), "");
}
