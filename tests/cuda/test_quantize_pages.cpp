// GPU page quantization against the CPU reference: whole caches compared byte for byte (scales
// and untouched bytes included), then the decoded values bit for bit, for every codec, both page
// orders and fp32/fp16/bf16 inputs, on fresh random data with outliers and non-finite values.

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <numeric>
#include <random>
#include <vector>

#include <catch2/catch.hpp>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "cuda/no_failures.hpp"
#include "cuda/quantize_device.hpp"
#include "host/test_seed.hpp"
#include "kvkit/layout/page_layout.hpp"
#include "kvkit/quant/codecs.hpp"
#include "kvkit/reference/quantize.hpp"

namespace {

using kvkit::kv_order;
using kvkit::paged_layout;

template <class T>
T from_float(float x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else if constexpr (std::is_same_v<T, __half>) {
    __half_raw r;
    r.x = kvkit::float_to_fp16_bits(x);
    return __half(r);
  } else {
    __nv_bfloat16_raw r;
    r.x = kvkit::float_to_bf16_bits(x);
    return __nv_bfloat16(r);
  }
}

template <class T>
float to_float(T x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    std::uint16_t bits;
    std::memcpy(&bits, &x, 2);
    return std::is_same_v<T, __half> ? kvkit::fp16_bits_to_float(bits)
                                     : kvkit::bf16_bits_to_float(bits);
  }
}

// The index of the first byte where `got` differs from `want` (want.size() where none does).
std::size_t first_difference(const std::vector<std::byte>& got,
                             const std::vector<std::byte>& want) {
  const auto n = std::min(got.size(), want.size());
  return static_cast<std::size_t>(
      std::mismatch(want.begin(), want.begin() + static_cast<std::ptrdiff_t>(n), got.begin())
          .first -
      want.begin());
}

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

// Coarse values: halves in [-2, 2] and signed zeros, so products land on rounding ties, ranges
// start at -0 or +0, and whole groups are constant (every eighth row is one repeated value).
float coarse_value(std::mt19937_64& rng, std::size_t index, std::size_t row) {
  const auto r = std::uniform_int_distribution<int>(0, 9)(rng);
  if ((index / row) % 8 == 5) {
    return 0.5F * static_cast<float>(static_cast<int>((index / row) % 9) - 4);
  }
  return r == 9 ? -0.0F : 0.5F * static_cast<float>(r - 4);
}

// The page kernels' debug mode (page_batch::page_check) in a check: off; on with every page id
// inside the cache; on with two ids outside it (one past the cache and one negative), whose pages
// must be left alone and the flag set.
enum class debug_ids { off, good, bad };

template <class Layout, class T>
void check(const Layout& layout, std::int32_t num_pages, std::uint64_t seed, bool coarse = false,
           debug_ids debug = debug_ids::off) {
  INFO("seed " << seed << ", page_size " << layout.page_size() << ", heads "
               << layout.num_kv_heads() << ", head_dim " << layout.head_dim() << ", coarse "
               << coarse << ", debug " << static_cast<int>(debug));
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0F, 1.0F);
  std::uniform_int_distribution<int> pct(0, 999);
  const auto n = static_cast<std::size_t>(num_pages * layout.elements());
  std::vector<T> k(n), v(n);
  for (std::size_t i = 0; i < n; ++i) {
    const auto channel = static_cast<std::int32_t>(i % static_cast<std::size_t>(layout.head_dim()));
    float a = normal(rng) * (channel % 17 == 3 ? 20.0F : 1.0F); // K channel outliers
    float b = normal(rng);
    const int roll = pct(rng);
    if (roll == 0) {
      a = std::numeric_limits<float>::infinity();
    } else if (roll == 1) {
      b = -std::numeric_limits<float>::infinity();
    } else if (roll == 2) {
      a = std::numeric_limits<float>::quiet_NaN();
    } else if (roll == 3) {
      a = 1e6F; // finite, but past fp16: int4 parameters saturate
    }
    if (coarse) {
      const auto row = static_cast<std::size_t>(layout.head_dim());
      a = coarse_value(rng, i, row);
      b = coarse_value(rng, i, row);
    }
    k[i] = from_float<T>(a);
    v[i] = from_float<T>(b);
  }
  // Scattered pages out of a larger cache.
  const std::int32_t capacity = num_pages * 3;
  std::vector<std::int32_t> ids(static_cast<std::size_t>(capacity));
  for (std::int32_t i = 0; i < capacity; ++i) {
    ids[static_cast<std::size_t>(i)] = i;
  }
  std::shuffle(ids.begin(), ids.end(), rng);
  ids.resize(static_cast<std::size_t>(num_pages));
  if (debug == debug_ids::bad) {
    REQUIRE(num_pages >= 3);
    ids[0] = capacity; // the first guard page after the cache
    ids[2] = -1;       // the last guard page before it
  }
  const auto outside = [&](std::int32_t id) {
    return id < 0 || id >= capacity;
  };
  std::vector<float> scales(static_cast<std::size_t>(2 * layout.num_kv_heads()));
  for (auto& s : scales) {
    s = (1.0F + static_cast<float>(pct(rng)) / 100.0F) / 448.0F;
  }

  // The reference: the same inputs as floats, page by page.
  const auto page_bytes = static_cast<std::size_t>(layout.bytes_per_page());
  std::vector<std::byte> want_cache(page_bytes * static_cast<std::size_t>(capacity),
                                    std::byte{0xA5});
  std::vector<T> want_k(n), want_v(n);
  const auto per_page = static_cast<std::size_t>(layout.elements());
  for (std::int32_t p = 0; p < num_pages; ++p) {
    if (outside(ids[static_cast<std::size_t>(p)])) {
      // Left alone: not written to the cache, and its rows keep dequantize's poison.
      std::memset(static_cast<void*>(want_k.data() + static_cast<std::size_t>(p) * per_page), 0x5A,
                  per_page * sizeof(T));
      std::memset(static_cast<void*>(want_v.data() + static_cast<std::size_t>(p) * per_page), 0x5A,
                  per_page * sizeof(T));
      continue;
    }
    std::vector<float> fk(per_page), fv(per_page), dk(per_page), dv(per_page);
    for (std::size_t i = 0; i < per_page; ++i) {
      fk[i] = to_float(k[static_cast<std::size_t>(p) * per_page + i]);
      fv[i] = to_float(v[static_cast<std::size_t>(p) * per_page + i]);
    }
    std::byte* page =
        want_cache.data() + static_cast<std::size_t>(ids[static_cast<std::size_t>(p)]) * page_bytes;
    REQUIRE(kvkit::reference::quantize_page(layout, fk.data(), fv.data(), layout.page_size(), page,
                                            scales.data())
                .ok());
    REQUIRE(kvkit::reference::dequantize_page(layout, page, layout.page_size(), dk.data(),
                                              dv.data(), scales.data())
                .ok());
    for (std::size_t i = 0; i < per_page; ++i) {
      want_k[static_cast<std::size_t>(p) * per_page + i] = from_float<T>(dk[i]);
      want_v[static_cast<std::size_t>(p) * per_page + i] = from_float<T>(dv[i]);
    }
  }

  const auto got =
      kvkit_test::run_on_device(layout, k, v, ids, capacity, scales, debug != debug_ids::off);
  REQUIRE(got.error == cudaSuccess);
  const std::int32_t want_flag = debug == debug_ids::off ? -1 : (debug == debug_ids::bad ? 1 : 0);
  CHECK(got.flag_written == want_flag);
  CHECK(got.flag_read == want_flag);
  const std::size_t first_diff = first_difference(got.cache, want_cache);
  INFO("first differing cache byte " << first_diff << " (page " << first_diff / page_bytes
                                     << ", offset " << first_diff % page_bytes << ")");
  CHECK(first_diff == want_cache.size());
  CHECK(got.guards_intact);
  CHECK(same_bits(got.k, want_k));
  CHECK(same_bits(got.v, want_v));
}

} // namespace

TEST_CASE("GPU page quantization matches the CPU reference bit for bit", "[cuda][quant]") {
  const std::uint64_t seed = kvkit_test::test_seed(2026);
  check<paged_layout<kvkit::fp16_codec>, __nv_bfloat16>({16, 8, 128}, 37, seed);
  check<paged_layout<kvkit::bf16_codec, kvkit::bf16_codec, kv_order::hnd>, float>({8, 4, 64}, 21,
                                                                                  seed + 1);
  check<paged_layout<kvkit::fp8_e4m3_codec>, __nv_bfloat16>({16, 8, 128}, 29, seed + 2);
  check<paged_layout<kvkit::fp8_e5m2_codec, kvkit::fp8_e5m2_codec, kv_order::hnd>, __half>(
      {32, 2, 256}, 11, seed + 3);
  check<paged_layout<kvkit::int8_codec>, __nv_bfloat16>({16, 8, 128}, 33, seed + 4);
  check<paged_layout<kvkit::int8_codec, kvkit::int8_codec, kv_order::hnd>, float>({1, 4, 64}, 70,
                                                                                  seed + 5);
  check<paged_layout<kvkit::int4_group_codec<32>>, __nv_bfloat16>({16, 8, 128}, 25, seed + 6);
  check<paged_layout<kvkit::int4_group_codec<64>, kvkit::int4_group_codec<64>, kv_order::hnd>,
        __half>({64, 2, 128}, 9, seed + 7);
  check<paged_layout<kvkit::int4_group_codec<128>>, __nv_bfloat16>({16, 4, 256}, 17, seed + 8);
  check<paged_layout<kvkit::int4_channel_codec, kvkit::int4_group_codec<128>>, __nv_bfloat16>(
      {16, 8, 128}, 23, seed + 9);
  check<paged_layout<kvkit::int4_channel_codec, kvkit::int8_codec, kv_order::hnd>, float>(
      {128, 2, 64}, 5, seed + 10);
}

TEST_CASE("GPU page quantization matches the reference on ties, signed zeros and constant groups",
          "[cuda][quant]") {
  const std::uint64_t seed = kvkit_test::test_seed(77);
  check<paged_layout<kvkit::int8_codec>, __nv_bfloat16>({16, 8, 128}, 19, seed, true);
  check<paged_layout<kvkit::int8_codec, kvkit::int8_codec, kv_order::hnd>, float>({4, 2, 256}, 9,
                                                                                  seed + 1, true);
  check<paged_layout<kvkit::int4_group_codec<32>>, __nv_bfloat16>({16, 8, 128}, 15, seed + 2, true);
  check<paged_layout<kvkit::int4_group_codec<128>>, __half>({8, 4, 128}, 11, seed + 3, true);
  check<paged_layout<kvkit::fp8_e4m3_codec>, __nv_bfloat16>({16, 8, 128}, 7, seed + 4, true);
  check<paged_layout<kvkit::bf16_codec>, __nv_bfloat16>({16, 8, 128}, 7, seed + 5, true);
  check<paged_layout<kvkit::int4_channel_codec, kvkit::int4_group_codec<128>>, __nv_bfloat16>(
      {16, 8, 128}, 9, seed + 6, true);
}

TEST_CASE("per-channel quantization of rows wider than one CTA of its kernel", "[cuda][quant]") {
  // 32 heads of 128 channels: 1024 threads of four channels, more than a CTA of the per-channel
  // quantizer (72 registers a thread) can hold, so the launch splits them over the grid's y.
  const std::uint64_t seed = kvkit_test::test_seed(1024);
  check<paged_layout<kvkit::int4_channel_codec, kvkit::int4_group_codec<128>>, __nv_bfloat16>(
      {16, 32, 128}, 3, seed);
}

TEST_CASE("pages smaller than a warp's chunks quantize correctly", "[cuda][quant]") {
  // One token of one 64-channel head is 8 chunks: most lanes of the warp have no work but still
  // take part in the group shuffles.
  const std::uint64_t seed = kvkit_test::test_seed(99);
  check<paged_layout<kvkit::int8_codec>, __nv_bfloat16>({1, 1, 64}, 13, seed);
  check<paged_layout<kvkit::int4_group_codec<32>, kvkit::int4_group_codec<32>, kv_order::hnd>,
        float>({1, 1, 64}, 7, seed + 1);
  check<paged_layout<kvkit::int4_channel_codec, kvkit::int4_group_codec<128>>, __nv_bfloat16>(
      {3, 1, 128}, 5, seed + 2);
}

TEST_CASE("int4 parameters on the device match the host bit for bit", "[cuda][quant]") {
  const std::uint64_t seed = kvkit_test::test_seed(15);
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> unit(-1.0F, 1.0F);
  std::vector<float> lo;
  std::vector<float> hi;
  // Edges first: signed zeros (a channel of -0 only), fp16 subnormals, the limits and past them.
  const std::vector<float> edges{0.0F,      -0.0F,    1e-30F,    -1e-30F, 5.96e-8F, -2.98e-8F,
                                 1.0F,      -1.0F,    15.0F,     -15.0F,  7.5F,     65504.0F,
                                 -65504.0F, 65519.0F, -65520.0F, 1e9F,    -1e9F,    0.1F};
  for (const float a : edges) {
    for (const float b : edges) {
      if (a <= b) {
        lo.push_back(a);
        hi.push_back(b);
      }
    }
  }
  for (int i = 0; i < 4'000'000; ++i) {
    float a;
    float b;
    if (i % 2 == 0) { // a channel at some magnitude, fp16 subnormals to past fp16's range
      const float scale = std::ldexp(1.0F, static_cast<int>(rng() % 44) - 26);
      a = unit(rng) * scale;
      b = unit(rng) * scale;
    } else { // an fp16 value or midpoint, and a range a few float steps to a few units wide
      const auto h = static_cast<std::uint16_t>((rng() % 0x7C00U) | (rng() & 0x8000U)); // finite
      a = kvkit::fp16_bits_to_float(h);
      if ((rng() & 1) != 0 && (h & 0x7FFFU) < 0x7BFFU) {
        a = (a + kvkit::fp16_bits_to_float(static_cast<std::uint16_t>(h + 1))) / 2;
      }
      b = (rng() & 1) != 0
              ? std::nextafter(a, 1e30F)
              : a + std::fabs(unit(rng)) * std::ldexp(1.0F, static_cast<int>(rng() % 16) - 8);
    }
    lo.push_back(std::min(a, b));
    hi.push_back(std::max(a, b));
  }
  const auto got = kvkit_test::device_int4_params(lo, hi);
  REQUIRE(got.size() == lo.size());
  std::int64_t mismatches = 0;
  for (std::size_t i = 0; i < lo.size(); ++i) {
    const auto want = kvkit::detail::min_max_params({lo[i], hi[i], true});
    const bool same = std::memcmp(&got[i].scale, &want.scale, 4) == 0 &&
                      std::memcmp(&got[i].zero, &want.zero, 4) == 0 &&
                      std::memcmp(&got[i].inv, &want.inv, 4) == 0;
    if (!same && mismatches < 5) {
      UNSCOPED_INFO("lo " << lo[i] << " hi " << hi[i]);
    }
    mismatches += same ? 0 : 1;
  }
  CHECK(mismatches == 0);
  CHECK(kvkit_test::device_div15_mismatches() == 0);
}

TEST_CASE("conversions on the device match the device's own instructions",
          "[cuda][quant][conversions]") {
  const std::uint64_t seed = kvkit_test::test_seed(7);
  INFO("seed " << seed);
  CHECK(kvkit_test::device_conversion_mismatches(seed, 64'000'000) == 0);
}

namespace {

// Tokens of several pages, each page filled from offset 0 to a random length, fed in shuffled
// order with a few skipped (-1) slots; the cache must equal the reference quantizing each page's
// tokens.
// `debug`: in the debug mode (kv_write::page_check), first with every slot inside the cache (the
// flag stays 0), then with two more tokens whose slots lie past it (not written, the flag set).
template <class Layout, class T>
void check_write_kv(const Layout& layout, std::uint64_t seed, bool expect_rejection = false,
                    bool debug = false) {
  INFO("seed " << seed << ", debug " << debug);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0F, 1.5F);
  const std::int32_t capacity = 24;
  const std::int32_t ps = layout.page_size();
  const auto row = static_cast<std::size_t>(layout.num_kv_heads() * layout.head_dim());
  std::vector<std::int32_t> pages(static_cast<std::size_t>(capacity));
  std::iota(pages.begin(), pages.end(), 0);
  std::shuffle(pages.begin(), pages.end(), rng);
  pages.resize(9);
  struct token {
    std::int64_t slot;
    std::vector<float> k, v;
  };
  std::vector<token> toks;
  std::map<std::int32_t, std::int32_t> fill;
  for (const std::int32_t p : pages) {
    const std::int32_t n = std::uniform_int_distribution<std::int32_t>(1, ps)(rng);
    fill[p] = n;
    for (std::int32_t o = 0; o < n; ++o) {
      token t{static_cast<std::int64_t>(p) * ps + o, std::vector<float>(row),
              std::vector<float>(row)};
      for (std::size_t i = 0; i < row; ++i) {
        t.k[i] = to_float(from_float<T>(normal(rng)));
        t.v[i] = to_float(from_float<T>(normal(rng)));
      }
      toks.push_back(std::move(t));
    }
  }
  for (int i = 0; i < 3; ++i) {
    toks.push_back({-1, std::vector<float>(row, 7.0F), std::vector<float>(row, 7.0F)});
  }
  std::shuffle(toks.begin(), toks.end(), rng);
  std::vector<T> k, v;
  std::vector<std::int64_t> slots;
  for (const auto& t : toks) {
    slots.push_back(t.slot);
    for (std::size_t i = 0; i < row; ++i) {
      k.push_back(from_float<T>(t.k[i]));
      v.push_back(from_float<T>(t.v[i]));
    }
  }
  std::vector<float> scales(static_cast<std::size_t>(2 * layout.num_kv_heads()), 3.0F / 448.0F);
  const auto got = kvkit_test::run_write_kv(layout, k, v, slots, capacity, scales, debug);
  if (expect_rejection) {
    CHECK(got.error == cudaErrorInvalidValue);
    return;
  }
  const auto bytes = static_cast<std::size_t>(layout.bytes_per_page());
  std::vector<std::byte> want(bytes * capacity, std::byte{0xA5});
  for (const auto& [p, n] : fill) {
    std::vector<float> pk(row * static_cast<std::size_t>(n)), pv(pk.size());
    for (const auto& t : toks) {
      if (t.slot >= 0 && t.slot / ps == p) {
        const auto o = static_cast<std::size_t>(t.slot % ps);
        std::copy(t.k.begin(), t.k.end(), pk.begin() + static_cast<std::ptrdiff_t>(o * row));
        std::copy(t.v.begin(), t.v.end(), pv.begin() + static_cast<std::ptrdiff_t>(o * row));
      }
    }
    REQUIRE(kvkit::reference::quantize_page(layout, pk.data(), pv.data(), n,
                                            want.data() + static_cast<std::size_t>(p) * bytes,
                                            scales.data())
                .ok());
  }
  const auto compare = [&](const kvkit_test::device_round_trip<T>& result, std::int32_t want_flag) {
    REQUIRE(result.error == cudaSuccess);
    CHECK(result.flag_written == want_flag);
    const std::size_t first_diff = first_difference(result.cache, want);
    INFO("first differing byte " << first_diff);
    CHECK(first_diff == want.size());
    CHECK(result.guards_intact);
  };
  compare(got, debug ? 0 : -1);
  if (debug) {
    // Two tokens more, whose slots lie past the cache (the first slot after it, and one in a page
    // further out), among the others: the cache must be what it was without them, and the guard
    // pages after it, where the two slots lie, untouched.
    static_assert(kvkit_test::guard_pages >= 8);
    auto bad_slots = slots;
    auto bad_k = k;
    auto bad_v = v;
    const std::int64_t past[] = {static_cast<std::int64_t>(capacity) * ps,
                                 static_cast<std::int64_t>(capacity + 7) * ps + ps - 1};
    for (std::size_t j = 0; j < 2; ++j) {
      const std::size_t at = j == 0 ? 1 : bad_slots.size() / 2;
      bad_slots.insert(bad_slots.begin() + static_cast<std::ptrdiff_t>(at), past[j]);
      bad_k.insert(bad_k.begin() + static_cast<std::ptrdiff_t>(at * row), row, from_float<T>(9.0F));
      bad_v.insert(bad_v.begin() + static_cast<std::ptrdiff_t>(at * row), row, from_float<T>(9.0F));
    }
    compare(kvkit_test::run_write_kv(layout, bad_k, bad_v, bad_slots, capacity, scales, true), 1);
  }
}

} // namespace

TEST_CASE("write_kv writes each token into its slot as the reference would", "[cuda][quant]") {
  const std::uint64_t seed = kvkit_test::test_seed(404);
  check_write_kv<paged_layout<kvkit::fp16_codec>, __nv_bfloat16>({16, 8, 128}, seed);
  check_write_kv<paged_layout<kvkit::int8_codec, kvkit::int8_codec, kv_order::hnd>, float>(
      {16, 4, 64}, seed + 1);
  check_write_kv<paged_layout<kvkit::int4_group_codec<32>>, __nv_bfloat16>({8, 8, 128}, seed + 2);
  check_write_kv<paged_layout<kvkit::int8_codec>, __nv_bfloat16>({16, 8, 128}, seed + 5);
  check_write_kv<paged_layout<kvkit::int4_group_codec<128>, kvkit::int4_group_codec<64>>, __half>(
      {16, 2, 256}, seed + 6);
  // K and V through different quantizers (8-channel rows, 32-channel runs) in one launch.
  check_write_kv<paged_layout<kvkit::fp8_e4m3_codec, kvkit::int4_group_codec<32>>, __nv_bfloat16>(
      {16, 8, 128}, seed + 7);
  check_write_kv<paged_layout<kvkit::fp8_e5m2_codec, kvkit::fp8_e5m2_codec, kv_order::hnd>, __half>(
      {32, 2, 256}, seed + 3);
  // Per-channel K needs whole pages: rejected before launch.
  check_write_kv<paged_layout<kvkit::int4_channel_codec, kvkit::int4_group_codec<128>>,
                 __nv_bfloat16>({16, 8, 128}, seed + 4, true);
}

TEST_CASE("rows of 1024 threads: 64 KV heads of 128 channels, 32 of 256", "[cuda][quant]") {
  // A token's row of 8192 channels is 1024 chunks of eight, so the rows, runs and dequantize
  // kernels and write_kv launch CTAs of 1024 threads (detail::threads_for), which fit only while
  // each kernel keeps to 64 registers a thread; the per-channel dequantizer too, its quantizer
  // capped at 896 threads. A compiler that gave one of them more would fail its launch here.
  const std::uint64_t seed = kvkit_test::test_seed(8192);
  check<paged_layout<kvkit::fp16_codec>, __nv_bfloat16>({4, 64, 128}, 5, seed);
  check<paged_layout<kvkit::bf16_codec, kvkit::bf16_codec, kv_order::hnd>, float>({4, 64, 128}, 5,
                                                                                  seed + 1);
  check<paged_layout<kvkit::fp8_e4m3_codec>, __nv_bfloat16>({4, 64, 128}, 5, seed + 2);
  check<paged_layout<kvkit::fp8_e5m2_codec, kvkit::fp8_e5m2_codec, kv_order::hnd>, __half>(
      {4, 32, 256}, 5, seed + 3);
  check<paged_layout<kvkit::int8_codec>, __nv_bfloat16>({4, 64, 128}, 5, seed + 4);
  check<paged_layout<kvkit::int8_codec, kvkit::int8_codec, kv_order::hnd>, float>({4, 64, 128}, 5,
                                                                                  seed + 5);
  check<paged_layout<kvkit::int4_group_codec<32>>, __nv_bfloat16>({4, 64, 128}, 5, seed + 6);
  check<paged_layout<kvkit::int4_group_codec<128>>, __nv_bfloat16>({4, 32, 256}, 5, seed + 7);
  check<paged_layout<kvkit::int4_channel_codec, kvkit::int8_codec, kv_order::hnd>, float>(
      {4, 64, 128}, 5, seed + 8);
  check_write_kv<paged_layout<kvkit::fp16_codec>, __nv_bfloat16>({16, 64, 128}, seed + 9);
  check_write_kv<paged_layout<kvkit::int8_codec, kvkit::int8_codec, kv_order::hnd>, float>(
      {16, 64, 128}, seed + 10);
  check_write_kv<paged_layout<kvkit::fp8_e4m3_codec, kvkit::int4_group_codec<32>>, __nv_bfloat16>(
      {16, 64, 128}, seed + 11);
}

TEST_CASE("write_kv, quantize_pages and dequantize_pages leave pages outside the cache alone in "
          "their debug mode, and flag them",
          "[cuda][quant]") {
  const std::uint64_t seed = kvkit_test::test_seed(31);
  // Every kind of page kernel: rows (fp8 with static scales; dequantize rows for all but int4
  // per channel), runs (int4 groups), columns (int4 per channel, quantize and dequantize).
  for (const auto debug : {debug_ids::good, debug_ids::bad}) {
    check<paged_layout<kvkit::fp8_e4m3_codec>, __nv_bfloat16>({16, 8, 128}, 9, seed, false, debug);
    check<paged_layout<kvkit::int4_group_codec<32>>, __nv_bfloat16>({16, 8, 128}, 7, seed + 1,
                                                                    false, debug);
    check<paged_layout<kvkit::int4_channel_codec, kvkit::int8_codec, kv_order::hnd>, float>(
        {128, 2, 64}, 5, seed + 2, false, debug);
  }
  // write_kv through both quantizers (8-channel rows and 32-channel runs) in one launch.
  check_write_kv<paged_layout<kvkit::fp8_e4m3_codec, kvkit::int4_group_codec<32>>, __nv_bfloat16>(
      {16, 8, 128}, seed + 3, false, true);
  check_write_kv<paged_layout<kvkit::fp16_codec>, __nv_bfloat16>({16, 8, 128}, seed + 4, false,
                                                                 true);
}

TEST_CASE("write_kv, quantize_pages and dequantize_pages reject bad arguments before launch",
          "[cuda][quant][host]") {
  kvkit_test::check_no_failures(kvkit_test::page_validation_failures(),
                                "decided otherwise than expected: ");
}
