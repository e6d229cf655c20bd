#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include <catch2/catch.hpp>

#include "host/test_seed.hpp"
#include "kvkit/block/block_pool.hpp"
#include "kvkit/block/block_table.hpp"
#include "kvkit/reference/paged_attention.hpp"

using kvkit::reference::attention_options;

namespace {

constexpr std::int32_t kv_heads = 2;
constexpr std::int32_t q_heads = 8; // GQA group of 4
constexpr std::int32_t dim = 32;
constexpr std::int32_t page = 4;

// A batch of sequences in a paged fp16 cache, with the same K/V kept dense (fp16-exact values).
struct fixture {
  std::vector<std::int32_t> lens;
  std::vector<std::vector<float>> k, v; // per sequence [len][kv_heads][dim]
  kvkit::paged_layout<kvkit::fp16_codec> layout{page, kv_heads, dim};
  kvkit::block_pool pool{64};
  kvkit::block_table<kvkit::block_pool> table{pool, page};
  std::vector<std::byte> cache;
  std::vector<std::int32_t> indptr, indices, last;

  fixture(std::vector<std::int32_t> l, std::uint64_t seed) : lens(std::move(l)) {
    std::mt19937_64 rng(seed);
    std::uniform_int_distribution<int> d(-64, 64);
    cache.assign(static_cast<std::size_t>(pool.capacity() * layout.bytes_per_page()),
                 std::byte{0xEE});
    // Scatter pages: take some blocks first so sequences get non-contiguous ones.
    std::vector<kvkit::block_id> hole(5);
    (void)pool.allocate(hole);
    std::vector<kvkit::seq_id> batch;
    for (std::size_t b = 0; b < lens.size(); ++b) {
      const auto n = static_cast<std::size_t>(lens[b]) * kv_heads * dim;
      k.emplace_back(n);
      v.emplace_back(n);
      for (std::size_t i = 0; i < n; ++i) {
        k[b][i] = static_cast<float>(d(rng)) / 32.0F;
        v[b][i] = static_cast<float>(d(rng)) / 16.0F;
      }
      REQUIRE(table.add_sequence(b).ok());
      std::vector<kvkit::token_slot> slots(static_cast<std::size_t>(lens[b]));
      REQUIRE(table.append_tokens(b, lens[b], slots).ok());
      if (b == 0) {
        for (const auto id : hole) {
          (void)pool.release(id);
        }
      }
      // Write each page of the sequence through the reference quantizer.
      const auto blocks = *table.blocks(b);
      for (std::size_t p = 0; p < blocks.size(); ++p) {
        const auto first = static_cast<std::int32_t>(p) * page;
        const std::int32_t count = std::min(page, lens[b] - first);
        std::byte* dst = cache.data() + static_cast<std::size_t>(blocks[p]) *
                                            static_cast<std::size_t>(layout.bytes_per_page());
        const auto off = static_cast<std::size_t>(first) * kv_heads * dim;
        REQUIRE(kvkit::reference::quantize_page(layout, k[b].data() + off, v[b].data() + off, count,
                                                dst)
                    .ok());
      }
      batch.push_back(b);
    }
    indptr.resize(batch.size() + 1);
    last.resize(batch.size());
    indices.resize(static_cast<std::size_t>(*table.csr_size(batch)));
    REQUIRE(table.export_csr(batch, indptr, indices, last).ok());
  }

  kvkit::csr_page_table view() const {
    return {indptr.data(), indices.data(), last.data(), static_cast<std::int32_t>(lens.size()),
            page};
  }

  // Dense attention of sequence b's query at position pos.
  void dense(std::size_t b, std::int32_t pos, const float* q, const attention_options& o,
             float* out, float* lse) const {
    const double scale = o.scale > 0 ? o.scale : 1.0 / std::sqrt(static_cast<double>(dim));
    const std::int32_t lo = o.window > 0 ? std::max(0, pos - o.window + 1) : 0;
    for (std::int32_t h = 0; h < q_heads; ++h) {
      const std::int32_t kvh = h / (q_heads / kv_heads);
      std::vector<double> w;
      double m = -1e300;
      for (std::int32_t t = lo; t <= pos; ++t) {
        double dot = 0;
        for (std::int32_t c = 0; c < dim; ++c) {
          dot += static_cast<double>(q[h * dim + c]) *
                 k[b][static_cast<std::size_t>((t * kv_heads + kvh) * dim + c)];
        }
        double logit = dot * scale;
        if (o.logits_soft_cap > 0) {
          logit = o.logits_soft_cap * std::tanh(logit / o.logits_soft_cap);
        }
        w.push_back(logit);
        m = std::max(m, logit);
      }
      double z = 0;
      for (auto& x : w) {
        x = std::exp(x - m);
        z += x;
      }
      for (std::int32_t c = 0; c < dim; ++c) {
        double acc = 0;
        for (std::int32_t t = lo; t <= pos; ++t) {
          acc += w[static_cast<std::size_t>(t - lo)] / z *
                 v[b][static_cast<std::size_t>((t * kv_heads + kvh) * dim + c)];
        }
        out[h * dim + c] = static_cast<float>(acc);
      }
      lse[h] = static_cast<float>(m + std::log(z));
    }
  }
};

std::vector<float> queries(std::int32_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d;
  std::vector<float> q(static_cast<std::size_t>(n) * q_heads * dim);
  for (auto& x : q) {
    x = d(rng);
  }
  return q;
}

} // namespace

TEST_CASE("paged decode equals dense attention, GQA, windows and soft caps",
          "[reference][attention]") {
  const std::uint64_t seed = kvkit_test::test_seed(12);
  INFO("seed " << seed);
  fixture f({1, 7, 13, 4}, seed);
  const auto q = queries(4, seed + 1);
  for (const attention_options o :
       {attention_options{}, attention_options{0.3F, 0, 0.0F}, attention_options{0.0F, 5, 0.0F},
        attention_options{0.0F, 0, 2.0F}}) {
    std::vector<float> out(q.size(), -1.0F), lse(4 * q_heads, -1.0F);
    REQUIRE(kvkit::reference::paged_decode(f.layout, f.cache.data(), f.pool.capacity(), f.view(),
                                           q.data(), q_heads, out.data(), lse.data(), nullptr, o)
                .ok());
    for (std::size_t b = 0; b < 4; ++b) {
      std::vector<float> want(static_cast<std::size_t>(q_heads * dim)), want_lse(q_heads);
      f.dense(b, f.lens[b] - 1, q.data() + b * q_heads * dim, o, want.data(), want_lse.data());
      for (std::size_t i = 0; i < want.size(); ++i) {
        REQUIRE(out[b * q_heads * dim + i] == Approx(want[i]).margin(1e-6));
      }
      for (std::int32_t h = 0; h < q_heads; ++h) {
        REQUIRE(lse[b * q_heads + static_cast<std::size_t>(h)] ==
                Approx(want_lse[static_cast<std::size_t>(h)]).margin(1e-5));
      }
    }
  }
}

TEST_CASE("paged prefill is causal and its last row is the decode", "[reference][attention]") {
  fixture f({9, 6}, 3);
  const std::vector<std::int32_t> qo{0, 4, 7}; // the last 4 tokens of sequence 0, last 3 of 1
  const auto q = queries(7, 4);
  std::vector<float> out(q.size()), lse(7 * q_heads);
  REQUIRE(kvkit::reference::paged_attention(f.layout, f.cache.data(), f.pool.capacity(), f.view(),
                                            qo, q.data(), q_heads, out.data(), lse.data())
              .ok());
  for (std::int32_t i = 0; i < 7; ++i) {
    const std::size_t b = i < 4 ? 0 : 1;
    const std::int32_t pos = i < 4 ? 5 + i : 3 + (i - 4);
    std::vector<float> want(static_cast<std::size_t>(q_heads * dim)), want_lse(q_heads);
    f.dense(b, pos, q.data() + static_cast<std::size_t>(i) * q_heads * dim, {}, want.data(),
            want_lse.data());
    for (std::size_t j = 0; j < want.size(); ++j) {
      REQUIRE(out[static_cast<std::size_t>(i) * q_heads * dim + j] == Approx(want[j]).margin(1e-6));
    }
  }
}

TEST_CASE("attention reference rejects bad arguments", "[reference][attention]") {
  fixture f({5}, 1);
  const auto q = queries(1, 2);
  std::vector<float> out(q.size());
  CHECK(kvkit::reference::paged_decode(f.layout, f.cache.data(), f.pool.capacity(), f.view(),
                                       q.data(), 3,
                                       out.data())
            .error() == kvkit::errc::bad_argument); // 3 % 2
  CHECK(kvkit::reference::paged_decode(f.layout, f.cache.data(), 1, f.view(), q.data(), q_heads,
                                       out.data())
            .error() == kvkit::errc::invalid_block); // pages beyond
  const std::vector<std::int32_t> too_many{0, 6};
  CHECK(kvkit::reference::paged_attention(f.layout, f.cache.data(), f.pool.capacity(), f.view(),
                                          too_many, q.data(), q_heads, out.data())
            .error() == kvkit::errc::bad_argument);
  const kvkit::paged_layout<kvkit::fp8_e4m3_codec> fp8(page, kv_heads, dim);
  CHECK(kvkit::reference::paged_decode(fp8, f.cache.data(), f.pool.capacity(), f.view(), q.data(),
                                       q_heads,
                                       out.data())
            .error() == kvkit::errc::bad_argument); // no scales
  CHECK(kvkit::reference::paged_decode(f.layout, nullptr, f.pool.capacity(), f.view(), q.data(),
                                       q_heads, out.data())
            .error() == kvkit::errc::bad_argument);
}

TEST_CASE("attention reference rejects malformed tables and options before reading",
          "[reference][attention]") {
  fixture f({5}, 1); // two pages of 4: the second holds one token
  const auto q = queries(1, 2);
  std::vector<float> out(q.size(), -7.0F);
  const auto decode = [&](const kvkit::csr_page_table& t, const kvkit::attention_options& o = {}) {
    return kvkit::reference::paged_decode(f.layout, f.cache.data(), f.pool.capacity(), t, q.data(),
                                          q_heads, out.data(), nullptr, nullptr, o)
        .error();
  };
  REQUIRE(decode(f.view()) == kvkit::errc::ok);
  const std::vector<float> good = out;
  std::fill(out.begin(), out.end(), -7.0F);

  // A last page longer than a page would read entries past the sequence's own.
  const std::vector<std::int32_t> long_last{page + 1};
  kvkit::csr_page_table t = f.view();
  t.last_page_len = long_last.data();
  CHECK(decode(t) == kvkit::errc::bad_argument);
  const std::vector<std::int32_t> empty_last{0};
  t.last_page_len = empty_last.data();
  CHECK(decode(t) == kvkit::errc::bad_argument);
  // Null arrays, a negative batch, an indptr that starts below 0 or decreases.
  for (int which = 0; which < 3; ++which) {
    t = f.view();
    (which == 0 ? t.indptr : which == 1 ? t.indices : t.last_page_len) = nullptr;
    CHECK(decode(t) == kvkit::errc::bad_argument);
  }
  t = f.view();
  t.batch_size = -1;
  CHECK(decode(t) == kvkit::errc::bad_argument);
  t.batch_size = -2;
  CHECK(decode(t) == kvkit::errc::bad_argument);
  const std::vector<std::int32_t> shifted{-1, 1};
  t = f.view();
  t.indptr = shifted.data();
  CHECK(decode(t) == kvkit::errc::bad_argument);
  const std::vector<std::int32_t> decreasing{2, 0};
  t.indptr = decreasing.data();
  CHECK(decode(t) == kvkit::errc::bad_argument);
  // Queries that do not start at row 0.
  const std::vector<std::int32_t> offset{1, 2};
  CHECK(kvkit::reference::paged_attention(f.layout, f.cache.data(), f.pool.capacity(), f.view(),
                                          offset, q.data(), q_heads, out.data())
            .error() == kvkit::errc::bad_argument);
  // Options the GPU kernels refuse.
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  for (const float scale : {-1.0F, nan, inf}) {
    CHECK(decode(f.view(), {.scale = scale}) == kvkit::errc::bad_argument);
  }
  for (const float cap : {-1.0F, nan, inf, 1e-42F}) {
    CHECK(decode(f.view(), {.logits_soft_cap = cap}) == kvkit::errc::bad_argument);
  }
  CHECK(decode(f.view(), {.window = -1}) == kvkit::errc::bad_argument);
  // Nothing was written by any refused call.
  CHECK(std::all_of(out.begin(), out.end(), [](float x) { return x == -7.0F; }));
  REQUIRE(decode(f.view()) == kvkit::errc::ok);
  CHECK(out == good);
}

TEST_CASE("attention reference checks every sequence before it writes any output",
          "[reference][attention]") {
  fixture f({5, 3}, 2); // only the second sequence is made bad
  const auto q = queries(2, 3);
  std::vector<float> out(q.size(), -7.0F);
  std::vector<float> lse(2 * q_heads, -7.0F);
  const auto untouched = [&] {
    return std::all_of(out.begin(), out.end(), [](float x) { return x == -7.0F; }) &&
           std::all_of(lse.begin(), lse.end(), [](float x) { return x == -7.0F; });
  };
  // A second sequence whose last page is empty.
  std::vector<std::int32_t> last = f.last;
  last[1] = 0;
  kvkit::csr_page_table t = f.view();
  t.last_page_len = last.data();
  CHECK(kvkit::reference::paged_decode(f.layout, f.cache.data(), f.pool.capacity(), t, q.data(),
                                       q_heads, out.data(), lse.data())
            .error() == kvkit::errc::bad_argument);
  CHECK(untouched());
  // A second sequence with a page past the cache's end.
  std::vector<std::int32_t> indices = f.indices;
  indices[static_cast<std::size_t>(f.indptr[1])] = f.pool.capacity();
  t = f.view();
  t.indices = indices.data();
  CHECK(kvkit::reference::paged_decode(f.layout, f.cache.data(), f.pool.capacity(), t, q.data(),
                                       q_heads, out.data(), lse.data())
            .error() == kvkit::errc::invalid_block);
  CHECK(untouched());
  REQUIRE(kvkit::reference::paged_decode(f.layout, f.cache.data(), f.pool.capacity(), f.view(),
                                         q.data(), q_heads, out.data(), lse.data())
              .ok());
  CHECK_FALSE(untouched());
}
