#include <cstdint>
#include <limits>
#include <set>
#include <vector>

#include <catch2/catch.hpp>

#include "kvkit/layout/kv_memory.hpp"
#include "kvkit/layout/page_layout.hpp"
#include "kvkit/quant/codecs.hpp"

using kvkit::kv_order;

namespace {

template <class Layout>
void check_geometry(const Layout& l) {
  REQUIRE(l.validate().ok());
  CHECK(l.bytes_per_page() % 16 == 0);
  CHECK(l.v_data_offset() % 16 == 0);
  CHECK(l.k_param_offset() % 16 == 0);
  CHECK(l.v_param_offset() % 16 == 0);
  CHECK(l.v_data_offset() >= l.template data_bytes<typename Layout::k_codec>());
  // element_index is a bijection onto 0 .. elements-1.
  std::vector<bool> seen(static_cast<std::size_t>(l.elements()), false);
  for (std::int32_t t = 0; t < l.page_size(); ++t) {
    for (std::int32_t h = 0; h < l.num_kv_heads(); ++h) {
      for (std::int32_t c = 0; c < l.head_dim(); ++c) {
        const auto i = l.element_index(t, h, c);
        REQUIRE(i >= 0);
        REQUIRE(i < l.elements());
        REQUIRE_FALSE(seen[static_cast<std::size_t>(i)]);
        seen[static_cast<std::size_t>(i)] = true;
        using K = typename Layout::k_codec;
        REQUIRE(l.template param_index<K>(t, h, c) <
                std::max<std::int64_t>(1, l.template param_count<K>()));
      }
    }
  }
}

} // namespace

TEST_CASE("page regions are aligned, disjoint and cover every element", "[layout]") {
  check_geometry(kvkit::paged_layout<kvkit::fp16_codec>(16, 8, 128));
  check_geometry(
      kvkit::paged_layout<kvkit::int8_codec, kvkit::int8_codec, kv_order::hnd>(5, 3, 64));
  check_geometry(
      kvkit::paged_layout<kvkit::int4_channel_codec, kvkit::int4_group_codec<32>>(3, 2, 96));
  check_geometry(
      kvkit::paged_layout<kvkit::int4_group_codec<64>, kvkit::int4_group_codec<64>, kv_order::hnd>(
          1, 1, 64));
}

TEST_CASE("page sizes include the scales", "[layout]") {
  const kvkit::paged_layout<kvkit::fp16_codec> fp16(16, 8, 128);
  CHECK(fp16.bytes_per_page() == 2 * 16 * 8 * 128 * 2);
  const kvkit::paged_layout<kvkit::fp8_e4m3_codec> fp8(16, 8, 128);
  CHECK(fp8.bytes_per_page() == 2 * 16 * 8 * 128); // static scales live outside pages
  const kvkit::paged_layout<kvkit::int8_codec> int8(16, 8, 128);
  CHECK(int8.bytes_per_page() == 2 * (16 * 8 * 128 + 16 * 8 * 4));
  const kvkit::paged_layout<kvkit::int4_group_codec<32>> int4(16, 8, 128);
  CHECK(int4.bytes_per_page() == 2 * (16 * 8 * 64 + 16 * 8 * 4 * 4));
  const kvkit::paged_layout<kvkit::int4_channel_codec, kvkit::int4_group_codec<128>> kivi(16, 8,
                                                                                          128);
  CHECK(kivi.k_param_offset() == 2 * 16 * 8 * 64);
  CHECK(kivi.v_param_offset() - kivi.k_param_offset() == 8 * 128 * 4);
  CHECK(kivi.bytes_per_page() == kivi.v_param_offset() + 16 * 8 * 4);
  // Odd sizes round each region up to 16 bytes.
  const kvkit::paged_layout<kvkit::int8_codec> odd(3, 1, 2);
  CHECK(odd.v_data_offset() == 16);
  CHECK(odd.bytes_per_page() == 64);
}

TEST_CASE("invalid geometries are rejected", "[layout]") {
  CHECK(kvkit::paged_layout<kvkit::fp16_codec>(0, 8, 128).validate().error() ==
        kvkit::errc::bad_argument);
  CHECK_FALSE(kvkit::paged_layout<kvkit::fp16_codec>(16, -1, 128).validate().ok());
  CHECK_FALSE(kvkit::paged_layout<kvkit::int4_group_codec<32>>(16, 8, 48).validate().ok());
  CHECK_FALSE(kvkit::paged_layout<kvkit::int4_channel_codec>(16, 8, 127).validate().ok());
  CHECK_FALSE(kvkit::paged_layout<kvkit::fp16_codec>(1 << 20, 64, 256).validate().ok());
  CHECK(kvkit::paged_layout<kvkit::int8_codec>(16, 8, 127).validate().ok());
  // Dimensions whose product overflows 64 bits once scaled to bytes (it wrapped to a negative
  // page size, or to 0, and passed) are refused as any other page over 1 GiB.
  CHECK_FALSE(kvkit::paged_layout<kvkit::fp16_codec>(1, INT32_MAX, 3 << 29).validate().ok());
  CHECK_FALSE(kvkit::paged_layout<kvkit::fp16_codec>(4, 1 << 30, 1 << 30).validate().ok());
  CHECK_FALSE(
      kvkit::paged_layout<kvkit::fp16_codec>(INT32_MAX, INT32_MAX, INT32_MAX).validate().ok());
  CHECK_FALSE(kvkit::paged_layout<kvkit::fp16_codec>(1 << 28, 1, 2).validate().ok());
  CHECK(kvkit::paged_layout<kvkit::fp16_codec>(1 << 20, 2, 128).validate().ok());
  CHECK(kvkit::paged_layout<kvkit::fp16_codec>(1 << 20, 2, 128).bytes_per_page() == (1LL << 30));
  // A page stays under 2 GiB with its parameters too: per-channel scales of a one-token page of
  // 2^28 channels take 1 GiB each for K and V, over the data's 128 MiB each.
  using per_channel = kvkit::paged_layout<kvkit::int4_channel_codec>;
  CHECK(per_channel(1, 1 << 21, 128).bytes_per_page() > INT32_MAX);
  CHECK(per_channel(1, 1 << 21, 128).validate().error() == kvkit::errc::bad_argument);
  CHECK(per_channel(1, 1 << 20, 128).bytes_per_page() <= INT32_MAX);
  CHECK(per_channel(1, 1 << 20, 128).validate().ok());
}

TEST_CASE("NHD and HND orders", "[layout]") {
  const kvkit::paged_layout<kvkit::fp16_codec, kvkit::fp16_codec, kv_order::nhd> nhd(4, 2, 8);
  const kvkit::paged_layout<kvkit::fp16_codec, kvkit::fp16_codec, kv_order::hnd> hnd(4, 2, 8);
  CHECK(nhd.element_index(1, 0, 0) == 16); // next token skips all heads
  CHECK(hnd.element_index(1, 0, 0) == 8);  // next token of the same head is adjacent
  CHECK(hnd.element_index(0, 1, 0) == 32);
}

namespace {

// Every token's row of every head starts where k_rows/v_rows/k_param_rows/v_param_rows say, and
// element_index and param_index step by token_stride and param_token_stride.
template <class Layout>
void check_head_rows(const Layout& l) {
  using K = typename Layout::k_codec;
  using V = typename Layout::v_codec;
  REQUIRE(l.validate().ok());
  for (std::int32_t h = 0; h < l.num_kv_heads(); ++h) {
    for (std::int32_t t = 0; t < l.page_size(); ++t) {
      INFO("head " << h << ", token " << t);
      for (std::int32_t c = 0; c < l.head_dim(); ++c) {
        REQUIRE(l.element_index(t, h, c) == l.element_index(0, h, c) + t * l.token_stride());
        REQUIRE(l.template param_index<K>(t, h, c) ==
                l.template param_index<K>(0, h, c) + t * l.template param_token_stride<K>());
        REQUIRE(l.template param_index<V>(t, h, c) ==
                l.template param_index<V>(0, h, c) + t * l.template param_token_stride<V>());
      }
      const auto k = l.k_rows(h);
      const auto v = l.v_rows(h);
      CHECK(k.first + t * k.step == l.k_data_offset() + l.element_index(t, h, 0) * K::bits / 8);
      CHECK(v.first + t * v.step == l.v_data_offset() + l.element_index(t, h, 0) * V::bits / 8);
      const auto kp = l.k_param_rows(h);
      const auto vp = l.v_param_rows(h);
      CHECK(kp.first + t * kp.step ==
            l.k_param_offset() + l.template param_index<K>(t, h, 0) * K::param_bytes);
      CHECK(vp.first + t * vp.step ==
            l.v_param_offset() + l.template param_index<V>(t, h, 0) * V::param_bytes);
    }
  }
}

} // namespace

TEST_CASE("a head's rows are linear in the token", "[layout]") {
  check_head_rows(kvkit::paged_layout<kvkit::fp16_codec>(4, 3, 8));
  check_head_rows(
      kvkit::paged_layout<kvkit::fp8_e4m3_codec, kvkit::fp8_e4m3_codec, kv_order::hnd>(5, 2, 16));
  check_head_rows(kvkit::paged_layout<kvkit::int8_codec>(3, 2, 12));
  check_head_rows(
      kvkit::paged_layout<kvkit::int4_group_codec<32>, kvkit::int4_group_codec<32>, kv_order::hnd>(
          4, 3, 64));
  check_head_rows(
      kvkit::paged_layout<kvkit::int4_channel_codec, kvkit::int4_group_codec<32>>(3, 2, 64));
  // The steps, spelled out: NHD skips every head, HND the head's own channels; a per-token-group
  // codec has head_dim / group sets a token, a per-page-channel codec one row for every token.
  const kvkit::paged_layout<kvkit::int4_channel_codec, kvkit::int4_group_codec<32>> kivi(16, 8,
                                                                                         128);
  CHECK(kivi.k_rows(2).first == 2 * 64);
  CHECK(kivi.k_rows(2).step == 8 * 64);
  CHECK(kivi.v_rows(0).first == kivi.v_data_offset());
  CHECK(kivi.k_param_rows(1).first == kivi.k_param_offset() + 128 * 4);
  CHECK(kivi.k_param_rows(1).step == 0);
  CHECK(kivi.v_param_rows(1).first == kivi.v_param_offset() + 16 * 4 * 4);
  CHECK(kivi.v_param_rows(1).step == 4 * 4);
  const kvkit::paged_layout<kvkit::int8_codec, kvkit::int8_codec, kv_order::hnd> int8(16, 8, 128);
  CHECK(int8.k_rows(3).first == 3 * 16 * 128);
  CHECK(int8.k_rows(3).step == 128);
  CHECK(int8.k_param_rows(3).step == 4);
}

TEST_CASE("KV memory: the formula, its worked numbers and its inverse", "[layout][kv_memory]") {
  using kvkit::kv_format;
  namespace m = kvkit::models;
  // 2 x 80 x 8192 x 8 x 128 x 2 B x 32 = 85.9 GB
  CHECK(kvkit::kv_bytes(m::llama3_70b, 8192, 32, 2.0) == 85'899'345'920.0);
  // 2 x 32 x 4096 x 8 x 128 x 2 B x 8 = 4 GiB
  CHECK(kvkit::kv_bytes(m::llama3_8b, 4096, 8, 2.0) == 4.0 * (1LL << 30));
  // Paged fp16 with whole pages equals the formula.
  CHECK(*kvkit::kv_bytes_paged(m::llama3_8b, kv_format::fp16, kv_format::fp16, 4096, 8, 16) ==
        4LL << 30);
  // One token past a page boundary costs a whole page in every layer.
  const auto page = *kvkit::page_bytes(m::llama3_8b, kv_format::fp16, kv_format::fp16, 16);
  CHECK(*kvkit::kv_bytes_paged(m::llama3_8b, kv_format::fp16, kv_format::fp16, 4097, 1, 16) ==
        (4096 / 16 + 1) * page * 32);
  // GQA: Llama-2-7B (MHA, 32 KV heads) needs 4x Llama-3-8B's cache.
  CHECK(kvkit::kv_bytes(m::llama2_7b, 1000, 1, 2.0) ==
        4 * kvkit::kv_bytes(m::llama3_8b, 1000, 1, 2.0));
  // Scales add to the page: int8 is a little over half of fp16.
  const auto fp16 =
      *kvkit::kv_bytes_paged(m::qwen2_5_7b, kv_format::fp16, kv_format::fp16, 8192, 1, 16);
  const auto int8 =
      *kvkit::kv_bytes_paged(m::qwen2_5_7b, kv_format::int8, kv_format::int8, 8192, 1, 16);
  CHECK(int8 > fp16 / 2);
  CHECK(int8 < fp16 * 53 / 100);
  // The inverse: tokens that fit, in whole pages, and they do fit.
  const std::int64_t budget = 10LL << 30;
  const auto fit =
      *kvkit::tokens_that_fit(m::mistral_7b, kv_format::int4_g32, kv_format::int4_g32, budget, 16);
  CHECK(fit % 16 == 0);
  CHECK(*kvkit::kv_bytes_paged(m::mistral_7b, kv_format::int4_g32, kv_format::int4_g32, fit, 1,
                               16) <= budget);
  CHECK(*kvkit::kv_bytes_paged(m::mistral_7b, kv_format::int4_g32, kv_format::int4_g32, fit + 16, 1,
                               16) > budget);
  // Errors.
  CHECK(kvkit::kv_bytes_paged(m::llama3_8b, kv_format::fp16, kv_format::fp16, -1, 1, 16).error() ==
        kvkit::errc::bad_argument);
  // Sizes past int64: 2^21 pages of 2^16 bytes in 32 layers for 2^21 sequences are 2^63 bytes,
  // one sequence fewer is exact, and a token count at int64's top rounds up without wrapping.
  REQUIRE(page == 1 << 16);
  CHECK(kvkit::kv_bytes_paged(m::llama3_8b, kv_format::fp16, kv_format::fp16, 1LL << 25, 1LL << 21,
                              16)
            .error() == kvkit::errc::out_of_range);
  CHECK(*kvkit::kv_bytes_paged(m::llama3_8b, kv_format::fp16, kv_format::fp16, 1LL << 25,
                               (1LL << 21) - 1,
                               16) == std::numeric_limits<std::int64_t>::max() - (1LL << 42) + 1);
  CHECK(kvkit::kv_bytes_paged(m::llama3_8b, kv_format::fp16, kv_format::fp16,
                              std::numeric_limits<std::int64_t>::max(), 1, 16)
            .error() == kvkit::errc::out_of_range);
  CHECK(kvkit::page_bytes(m::llama3_8b, kv_format::fp16, kv_format::fp16, 0).error() ==
        kvkit::errc::bad_argument);
  CHECK(kvkit::tokens_that_fit(m::llama3_8b, kv_format::fp16, kv_format::fp16, -5, 16).error() ==
        kvkit::errc::bad_argument);
  const kvkit::model_config odd{"odd", 2, 2, 2, 96};
  CHECK(kvkit::page_bytes(odd, kv_format::int4_g64, kv_format::int4_g64, 16).error() ==
        kvkit::errc::bad_argument);
  // A format value that is no format (cast from a configuration's integer) sizes nothing.
  const auto bogus = static_cast<kv_format>(kvkit::all_kv_formats.size());
  CHECK(kvkit::page_bytes(m::llama3_8b, bogus, kv_format::fp16, 16).error() ==
        kvkit::errc::bad_argument);
  CHECK(kvkit::kv_bytes_paged(m::llama3_8b, kv_format::fp16, bogus, 16, 1, 16).error() ==
        kvkit::errc::bad_argument);
  CHECK(kvkit::tokens_that_fit(m::llama3_8b, bogus, bogus, 1LL << 30, 16).error() ==
        kvkit::errc::bad_argument);
}

static_assert(kvkit::paged_layout<kvkit::fp8_e4m3_codec, kvkit::int8_codec>::has_static_scales);
static_assert(kvkit::paged_layout<kvkit::int8_codec, kvkit::fp8_e5m2_codec>::has_static_scales);
static_assert(
    !kvkit::paged_layout<kvkit::bf16_codec, kvkit::int4_group_codec<32>>::has_static_scales);
