// page_layout: kvkit's layouts and the archetype model it; types that break one rule do not; the
// host reference and the decode plans are generic over it.

#include <climits>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include <catch2/catch.hpp>

#include "kvkit/attention/decode_plan.hpp"
#include "kvkit/block/page_table.hpp"
#include "kvkit/concepts/page_layout.hpp"
#include "kvkit/layout/page_layout.hpp"
#include "kvkit/quant/codecs.hpp"
#include "kvkit/reference/paged_attention.hpp"
#include "kvkit/reference/quantize.hpp"
#include "kvkit/testing/page_layout_archetype.hpp"

using kvkit::page_layout;
using kvkit::paged_layout;
using kvkit::testing::page_layout_archetype;

namespace {

using archetype = page_layout_archetype;

struct float_k_codec : archetype {
  using k_codec = float;
};
struct order_as_int : archetype {
  static constexpr int order = 1;
};
struct static_scales_without_codec : archetype {
  static constexpr bool has_static_scales = true; // the archetype codec stores its parameters
};
struct wide_page_size : archetype {
  [[nodiscard]] std::int64_t page_size() const { return archetype::page_size(); }
};
struct without_validate : archetype {
  [[nodiscard]] kvkit::status validate() const = delete;
};
struct rows_as_pair : archetype {
  [[nodiscard]] std::pair<std::int64_t, std::int64_t> v_rows(std::int32_t) const { return {}; }
};
struct without_param_index : archetype {
  template <class C>
  std::int64_t param_index(std::int32_t, std::int32_t, std::int32_t) const = delete;
};
struct without_default : archetype {
  explicit without_default(std::int32_t page_size) : archetype(page_size, 1, 8) {}
};

} // namespace

TEST_CASE("page_layout models and one-defect types", "[concepts][layout]") {
  STATIC_REQUIRE(page_layout<archetype>);
  STATIC_REQUIRE(page_layout<paged_layout<kvkit::bf16_codec>>);
  STATIC_REQUIRE(
      page_layout<paged_layout<kvkit::fp16_codec, kvkit::fp16_codec, kvkit::kv_order::hnd>>);
  STATIC_REQUIRE(page_layout<paged_layout<kvkit::fp8_e5m2_codec>>);
  STATIC_REQUIRE(page_layout<paged_layout<kvkit::int8_codec, kvkit::int4_group_codec<64>>>);
  STATIC_REQUIRE(page_layout<paged_layout<kvkit::int4_channel_codec, kvkit::int4_group_codec<128>,
                                          kvkit::kv_order::hnd>>);
  STATIC_REQUIRE(page_layout<paged_layout<kvkit::testing::kv_codec_archetype>>);
  STATIC_REQUIRE_FALSE(page_layout<float_k_codec>);
  STATIC_REQUIRE_FALSE(page_layout<order_as_int>);
  STATIC_REQUIRE_FALSE(page_layout<static_scales_without_codec>);
  STATIC_REQUIRE_FALSE(page_layout<wide_page_size>);
  STATIC_REQUIRE_FALSE(page_layout<without_validate>);
  STATIC_REQUIRE_FALSE(page_layout<rows_as_pair>);
  STATIC_REQUIRE_FALSE(page_layout<without_param_index>);
  STATIC_REQUIRE_FALSE(page_layout<without_default>);
  STATIC_REQUIRE_FALSE(page_layout<kvkit::bf16_codec>);
}

TEST_CASE("the reference and the plans work for any page layout", "[concepts][layout]") {
  // The archetype's geometry is paged_layout's for the archetype codec in NHD pages: the same
  // offsets and rows for every head, the same page bytes, the same attention.
  const archetype wide(3, 2, 4);
  const paged_layout<kvkit::testing::kv_codec_archetype> wide_peer(3, 2, 4);
  REQUIRE(wide.validate().ok());
  CHECK_FALSE(archetype(0, 1, 4).validate().ok());
  CHECK_FALSE(archetype(INT32_MAX, INT32_MAX, 2).validate().ok());
  CHECK_FALSE(archetype(1, 1, INT32_MAX).validate().ok());
  CHECK(wide.bytes_per_page() == wide_peer.bytes_per_page());
  CHECK(wide.v_data_offset() == wide_peer.v_data_offset());
  CHECK(wide.k_param_offset() == wide_peer.k_param_offset());
  CHECK(wide.v_param_offset() == wide_peer.v_param_offset());
  using codec = kvkit::testing::kv_codec_archetype;
  for (std::int32_t h = 0; h < 2; ++h) {
    INFO("head " << h);
    const auto same = [](auto a, auto b) {
      return a.first == b.first && a.step == b.step;
    };
    CHECK(same(wide.k_rows(h), wide_peer.k_rows(h)));
    CHECK(same(wide.v_rows(h), wide_peer.v_rows(h)));
    CHECK(same(wide.k_param_rows(h), wide_peer.k_param_rows(h)));
    CHECK(same(wide.v_param_rows(h), wide_peer.v_param_rows(h)));
    for (std::int32_t t = 0; t < 3; ++t) {
      for (std::int32_t c = 0; c < 4; ++c) {
        CHECK(wide.element_index(t, h, c) == wide_peer.element_index(t, h, c));
        CHECK(wide.param_index<codec>(t, h, c) == wide_peer.param_index<codec>(t, h, c));
      }
    }
  }
  CHECK(wide.token_stride() == wide_peer.token_stride());
  CHECK(wide.param_token_stride<codec>() == wide_peer.param_token_stride<codec>());

  const archetype layout(2, 1, 4);
  const paged_layout<kvkit::testing::kv_codec_archetype> peer(2, 1, 4);
  REQUIRE(layout.validate().ok());
  // Two pages of two tokens: integer values, which the archetype codec keeps exactly.
  const auto bytes = static_cast<std::size_t>(layout.bytes_per_page());
  std::vector<std::byte> cache(2 * bytes), peer_cache(2 * bytes);
  const std::vector<std::vector<float>> k{{1, 2, 3, 4, -1, -2, -3, -4}, {2, 0, 1, 3, 0, 0, 1, 1}};
  const std::vector<std::vector<float>> v{{5, 6, 7, 8, 9, 10, 11, 12}, {-5, 4, 3, 2, 1, 0, -1, 7}};
  for (std::size_t p = 0; p < 2; ++p) {
    REQUIRE(kvkit::reference::quantize_page(layout, k[p].data(), v[p].data(), 2,
                                            cache.data() + p * bytes)
                .ok());
    REQUIRE(kvkit::reference::quantize_page(peer, k[p].data(), v[p].data(), 2,
                                            peer_cache.data() + p * bytes)
                .ok());
  }
  CHECK(cache == peer_cache);
  std::vector<float> k2(8), v2(8);
  REQUIRE(kvkit::reference::dequantize_page(layout, cache.data() + bytes, 2, k2.data(), v2.data())
              .ok());
  CHECK(k2 == k[1]);
  CHECK(v2 == v[1]);

  // One sequence of three tokens: page 1 whole, then the first token of page 0.
  const std::vector<std::int32_t> indptr{0, 2}, indices{1, 0}, last{1};
  const kvkit::csr_page_table table{indptr.data(), indices.data(), last.data(), 1, 2};
  const std::vector<float> q{0.5F, -0.25F, 0.125F, 1.0F, -1.0F, 0.0F, 0.5F, 0.25F};
  std::vector<float> out(8), peer_out(8), lse(2), peer_lse(2);
  REQUIRE(kvkit::reference::paged_decode(layout, cache.data(), 2, table, q.data(), 2, out.data(),
                                         lse.data())
              .ok());
  REQUIRE(kvkit::reference::paged_decode(peer, peer_cache.data(), 2, table, q.data(), 2,
                                         peer_out.data(), peer_lse.data())
              .ok());
  CHECK(out == peer_out);
  CHECK(lse == peer_lse);

  const kvkit::decode_shape shape = kvkit::decode_shape_for(layout, 1, 2);
  const kvkit::decode_shape peer_shape = kvkit::decode_shape_for(peer, 1, 2);
  CHECK(shape.num_kv_heads == 1);
  CHECK(shape.head_dim == 4);
  CHECK(shape.kv_bits == peer_shape.kv_bits);
  CHECK(shape.kv_scaled_one_width == peer_shape.kv_scaled_one_width);
  CHECK(shape.page_size == 2);
  CHECK(shape.order == kvkit::kv_order::nhd);
}
