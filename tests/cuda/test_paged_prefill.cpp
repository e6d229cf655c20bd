// GPU prefill/extend attention against the float64 CPU reference (kvkit::reference::
// paged_attention): fresh random inputs per case, outputs poisoned before every launch, the
// decode's relative-error bounds per codec; whole prompts, extends of a few queries over long
// caches and single queries in one batch, sequences with no queries, partial last pages, page
// sizes 1 to 128, GQA groups 1 to 16 (and 5), MQA, head dims 64/128/256, every per-token codec,
// window, soft cap and explicit scale, a CUDA graph replay, the LSE output off, and the debug mode
// (bad page ids, sequences with more queries than tokens or than max_queries).

#include <cstring>
#include <random>
#include <span>
#include <vector>

#include <catch2/catch.hpp>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "cuda/no_failures.hpp"
#include "cuda/paged_problem.hpp"
#include "cuda/prefill_device.hpp"
#include "host/test_seed.hpp"
#include "kvkit/layout/page_layout.hpp"
#include "kvkit/quant/codecs.hpp"
#include "kvkit/reference/paged_attention.hpp"

namespace {

using kvkit::kv_order;
using kvkit::paged_layout;
using kvkit_test::bound;
using kvkit_test::compare_rows;
using kvkit_test::from_bits;
using kvkit_test::pages_for;
using kvkit_test::prefill_mode;
using kvkit_test::prefill_outcome;
using kvkit_test::problem;
using kvkit_test::to_bits;
using bf16_nhd = paged_layout<kvkit::bf16_codec>;

// A sequence of a batch: its tokens (the new ones included) and its queries (its last tokens).
struct seq {
  std::int32_t len;
  std::int32_t queries;
};

// A batch over a fresh random cache, its queries, and the reference's outputs.
template <class Layout, class T>
struct prefill_problem {
  problem<Layout> pr;
  std::int32_t q_heads;
  kvkit_test::decode_step table;
  std::vector<std::int32_t> qo{0};
  std::vector<std::uint16_t> q;
  std::vector<float> ref;
  std::vector<float> ref_lse;

  prefill_problem(const Layout& layout, std::int32_t group, const std::vector<seq>& seqs,
                  std::uint64_t seed, const kvkit::attention_options& options)
      : pr(layout, pages_of(layout, seqs) + 7, seed), q_heads(group * layout.num_kv_heads()) {
    table.indptr.push_back(0);
    for (const seq& s : seqs) {
      pr.add_sequence(s.len, table);
      qo.push_back(qo.back() + s.queries);
    }
    std::normal_distribution<float> d(0.0F, 1.0F);
    q.resize(static_cast<std::size_t>(qo.back()) * static_cast<std::size_t>(q_heads) *
             static_cast<std::size_t>(layout.head_dim()));
    std::vector<float> qf(q.size());
    for (std::size_t i = 0; i < q.size(); ++i) {
      q[i] = to_bits<T>(d(pr.rng));
      qf[i] = from_bits<T>(q[i]);
    }
    ref.resize(q.size());
    ref_lse.resize(static_cast<std::size_t>(qo.back()) * static_cast<std::size_t>(q_heads));
    const kvkit::csr_page_table t{table.indptr.data(), table.indices.data(),
                                  table.last_page_len.data(),
                                  static_cast<std::int32_t>(seqs.size()), layout.page_size()};
    REQUIRE(kvkit::reference::paged_attention(
                layout, pr.cache.data(), pr.capacity, t, std::span<const std::int32_t>(qo),
                qf.data(), q_heads, ref.data(), ref_lse.data(),
                pr.scales.empty() ? nullptr : pr.scales.data(), options)
                .ok());
  }

  static std::int32_t pages_of(const Layout& layout, const std::vector<seq>& seqs) {
    std::vector<std::int32_t> lens;
    for (const seq& s : seqs) {
      lens.push_back(s.len);
    }
    return pages_for(layout, lens);
  }

  prefill_outcome run(const kvkit::attention_options& options, const prefill_mode& mode) const {
    return kvkit_test::run_prefill<Layout, T>(pr.layout, pr.cache, pr.capacity, table, qo, q,
                                              q_heads, pr.scales, options, mode);
  }

  // Query rows [first, last) of the outputs (one row: a query's heads), against the reference.
  void check_rows(const prefill_outcome& got, std::int32_t first, std::int32_t last,
                  bool lse = true) const {
    const auto heads = static_cast<std::size_t>(q_heads);
    const auto dim = static_cast<std::size_t>(pr.layout.head_dim());
    const auto rows = [&](const auto& v, std::size_t per) {
      return std::vector(v.begin() + static_cast<std::ptrdiff_t>(first * heads * per),
                         v.begin() + static_cast<std::ptrdiff_t>(last * heads * per));
    };
    const auto want_lse = rows(ref_lse, 1);
    const kvkit_test::errors e = compare_rows<T>(rows(ref, dim), want_lse, rows(got.out, dim),
                                                 lse ? rows(got.lse, 1) : want_lse, dim);
    INFO("rows " << first << ".." << last << ": relative error " << e.out_rel << ", lse error "
                 << e.lse_abs << ", worst (query, head) row " << e.worst_row << " (query "
                 << first + static_cast<std::int32_t>(e.worst_row / heads) << ") "
                 << e.row_rel_max);
    CHECK(e.all_finite);
    CHECK(e.out_rel < bound<Layout, T>());
    CHECK(e.row_rel_max < 3 * bound<Layout, T>());
    CHECK(e.lse_abs < 2e-2);
  }

  // Whether query rows [first, last) still hold the poison written before the launch.
  bool untouched(const prefill_outcome& got, std::int32_t first, std::int32_t last) const {
    const auto heads = static_cast<std::size_t>(q_heads);
    const auto dim = static_cast<std::size_t>(pr.layout.head_dim());
    for (std::size_t i = first * heads * dim; i < last * heads * dim; ++i) {
      if (got.out[i] != 0xFFFFU) {
        return false;
      }
    }
    for (std::size_t i = first * heads; i < last * heads; ++i) {
      std::uint32_t bits = 0;
      std::memcpy(&bits, &got.lse[i], sizeof bits);
      if (bits != 0xFFFFFFFFU) {
        return false;
      }
    }
    return true;
  }
};

template <class Layout, class T>
void check_prefill(const Layout& layout, std::int32_t group, const std::vector<seq>& seqs,
                   std::uint64_t seed, const kvkit::attention_options& options = {},
                   const prefill_mode& mode = {}) {
  const prefill_problem<Layout, T> p(layout, group, seqs, seed, options);
  const prefill_outcome got = p.run(options, mode);
  INFO("seed " << seed << " page " << layout.page_size() << " kv heads " << layout.num_kv_heads()
               << " group " << group << " D " << layout.head_dim() << " error "
               << cudaGetErrorString(got.error));
  REQUIRE(got.error == cudaSuccess);
  CHECK(got.page_check == 0);
  p.check_rows(got, 0, p.qo.back(), mode.lse);
  if (!mode.lse) {
    for (const float x : got.lse) {
      std::uint32_t bits = 0;
      std::memcpy(&bits, &x, sizeof bits);
      CHECK(bits == 0xFFFFFFFFU);
    }
  }
}

// A batch of every kind: a whole prompt, extends over longer caches, single queries, a sequence
// with no queries, partial last pages.
const std::vector<seq> mixed{{1, 1},  {17, 17},   {100, 37}, {333, 1},
                             {64, 0}, {700, 150}, {129, 65}, {40, 3}};

} // namespace

TEST_CASE("paged_prefill bf16: page sizes 1 to 128, groups 1 to 16, prompts and extends",
          "[cuda][prefill][sweep]") {
  const std::uint64_t seed = kvkit_test::test_seed(0xF111);
  for (const std::int32_t page : {1, 16, 128}) {
    for (const std::int32_t group : {1, 5, 8, 16}) {
      check_prefill<bf16_nhd, __nv_bfloat16>(bf16_nhd(page, 2, 128), group, mixed,
                                             seed + page * 100 + group);
    }
  }
}

TEST_CASE("paged_prefill: head dims 64 and 256, MQA", "[cuda][prefill]") {
  const std::uint64_t seed = kvkit_test::test_seed(0xF112);
  check_prefill<bf16_nhd, __nv_bfloat16>(bf16_nhd(16, 1, 64), 8, mixed, seed);
  check_prefill<bf16_nhd, __nv_bfloat16>(bf16_nhd(16, 4, 64), 1, mixed, seed + 1);
  check_prefill<bf16_nhd, __nv_bfloat16>(bf16_nhd(32, 1, 256), 4, mixed, seed + 2);
  check_prefill<bf16_nhd, __nv_bfloat16>(bf16_nhd(8, 2, 256), 2, mixed, seed + 3);
}

TEST_CASE("paged_prefill: every per-token codec, both orders, both query types",
          "[cuda][prefill]") {
  const std::uint64_t seed = kvkit_test::test_seed(0xF113);
  using fp16_hnd = paged_layout<kvkit::fp16_codec, kvkit::fp16_codec, kv_order::hnd>;
  using e4m3_nhd = paged_layout<kvkit::fp8_e4m3_codec>;
  using e5m2_hnd = paged_layout<kvkit::fp8_e5m2_codec, kvkit::fp8_e5m2_codec, kv_order::hnd>;
  using int8_nhd = paged_layout<kvkit::int8_codec>;
  using int4_32 = paged_layout<kvkit::int4_group_codec<32>>;
  using int8_k_int4_v = paged_layout<kvkit::int8_codec, kvkit::int4_group_codec<64>>;
  SECTION("fp16 HND") {
    check_prefill<fp16_hnd, __half>(fp16_hnd(16, 2, 128), 4, mixed, seed);
  }
  SECTION("bf16 cache, fp16 queries") {
    check_prefill<bf16_nhd, __half>(bf16_nhd(16, 2, 128), 4, mixed, seed + 1);
  }
  SECTION("fp8 e4m3") {
    check_prefill<e4m3_nhd, __nv_bfloat16>(e4m3_nhd(16, 2, 128), 4, mixed, seed + 2);
  }
  SECTION("fp8 e5m2 HND, head dim 64") {
    check_prefill<e5m2_hnd, __half>(e5m2_hnd(32, 2, 64), 8, mixed, seed + 3);
  }
  SECTION("int8") {
    check_prefill<int8_nhd, __nv_bfloat16>(int8_nhd(16, 2, 128), 4, mixed, seed + 4);
  }
  SECTION("int4 groups of 32, head dim 256") {
    check_prefill<int4_32, __half>(int4_32(16, 2, 256), 2, mixed, seed + 5);
  }
  SECTION("int8 K, int4 V") {
    check_prefill<int8_k_int4_v, __nv_bfloat16>(int8_k_int4_v(16, 2, 128), 4, mixed, seed + 6);
  }
}

TEST_CASE("paged_prefill: sliding window, soft cap and explicit scale", "[cuda][prefill]") {
  const std::uint64_t seed = kvkit_test::test_seed(0xF114);
  const bf16_nhd layout(16, 2, 128);
  kvkit::attention_options window;
  window.window = 50;
  check_prefill<bf16_nhd, __nv_bfloat16>(layout, 4, mixed, seed, window);
  kvkit::attention_options one;
  one.window = 1; // each query sees its own key only
  check_prefill<bf16_nhd, __nv_bfloat16>(layout, 4, mixed, seed + 1, one);
  kvkit::attention_options capped;
  capped.logits_soft_cap = 5.0F;
  capped.scale = 0.3F;
  check_prefill<bf16_nhd, __nv_bfloat16>(layout, 4, mixed, seed + 2, capped);
}

TEST_CASE("paged_prefill: a long prompt in many tiles, and a batch of speculative verifies",
          "[cuda][prefill]") {
  const std::uint64_t seed = kvkit_test::test_seed(0xF115);
  check_prefill<bf16_nhd, __nv_bfloat16>(bf16_nhd(16, 2, 128), 4, {{2100, 600}, {5, 5}}, seed);
  std::vector<seq> verify;
  for (std::int32_t i = 0; i < 48; ++i) {
    verify.push_back({1500 + 11 * i, 4});
  }
  check_prefill<bf16_nhd, __nv_bfloat16>(bf16_nhd(16, 2, 128), 8, verify, seed + 1);
}

TEST_CASE("paged_prefill: captured in a CUDA graph and replayed", "[cuda][prefill]") {
  prefill_mode mode;
  mode.graph = true;
  check_prefill<bf16_nhd, __nv_bfloat16>(bf16_nhd(16, 2, 128), 4, mixed,
                                         kvkit_test::test_seed(0xF116), {}, mode);
}

TEST_CASE("paged_prefill: without the LSE output, the same outputs and the LSE buffer untouched",
          "[cuda][prefill]") {
  prefill_mode mode;
  mode.lse = false;
  check_prefill<bf16_nhd, __nv_bfloat16>(bf16_nhd(16, 2, 128), 4, mixed,
                                         kvkit_test::test_seed(0xF117), {}, mode);
}

TEST_CASE("paged_prefill: sequences it cannot run are skipped, and flagged in the debug mode",
          "[cuda][prefill]") {
  const std::uint64_t seed = kvkit_test::test_seed(0xF118);
  const bf16_nhd layout(16, 2, 128);
  for (const bool debug : {false, true}) {
    INFO("debug mode " << debug);
    prefill_mode mode;
    mode.check_pages = debug;
    {
      INFO("a sequence with more queries than tokens");
      prefill_problem<bf16_nhd, __nv_bfloat16> p(layout, 4, {{30, 10}, {20, 20}, {50, 5}}, seed,
                                                 {});
      // The second sequence loses its last page (4 tokens), not its queries: 20 over 16 keys.
      p.table.indptr[2] -= 1;
      p.table.indices.erase(p.table.indices.begin() + p.table.indptr[2]);
      p.table.indptr[3] -= 1;
      p.table.last_page_len[1] = 16;
      const prefill_outcome got = p.run({}, mode);
      REQUIRE(got.error == cudaSuccess);
      CHECK(got.page_check == (debug ? 1 : 0));
      p.check_rows(got, 0, 10);
      CHECK(p.untouched(got, 10, 30));
      p.check_rows(got, 30, 35);
    }
    {
      INFO("a sequence with more queries than max_queries");
      prefill_problem<bf16_nhd, __nv_bfloat16> p(layout, 4, {{30, 10}, {300, 40}, {50, 5}}, seed,
                                                 {});
      mode.extra_max_queries = -1; // 39, one fewer than the second sequence's 40
      const prefill_outcome got = p.run({}, mode);
      REQUIRE(got.error == cudaSuccess);
      CHECK(got.page_check == (debug ? 1 : 0));
      p.check_rows(got, 0, 10);
      CHECK(p.untouched(got, 10, 50));
      p.check_rows(got, 50, 55);
    }
  }
}

TEST_CASE("paged_prefill: the debug mode flags bad page ids and reads nothing outside the cache",
          "[cuda][prefill]") {
  prefill_problem<bf16_nhd, __nv_bfloat16> p(bf16_nhd(16, 2, 128), 4, {{40, 8}, {90, 30}},
                                             kvkit_test::test_seed(0xF119), {});
  p.table.indices.back() = p.pr.capacity + 1000; // the second sequence's last page
  prefill_mode mode;
  mode.check_pages = true;
  const prefill_outcome got = p.run({}, mode);
  REQUIRE(got.error == cudaSuccess);
  CHECK(got.page_check == 1);
  p.check_rows(got, 0, 8); // the first sequence is as the reference has it
}

TEST_CASE("paged_prefill: validate rejects bad arguments before launch", "[cuda][prefill][host]") {
  kvkit_test::check_no_failures(kvkit_test::prefill_validation_failures(), "not rejected: ");
}
