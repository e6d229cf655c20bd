// kv_codec: kvkit's codecs and the archetype model it; types that break one rule do not; the
// layout and the reference are generic over it.

#include <cstddef>
#include <vector>

#include <catch2/catch.hpp>

#include "kvkit/concepts/kv_codec.hpp"
#include "kvkit/quant/codecs.hpp"
#include "kvkit/reference/quantize.hpp"
#include "kvkit/testing/kv_codec_archetype.hpp"

using kvkit::kv_codec;
using kvkit::testing::kv_codec_archetype;

namespace {

struct six_bits : kv_codec_archetype {
  static constexpr std::int32_t bits = 6;
};
struct no_scaling {
  using params = kv_codec_archetype::params;
  static constexpr std::int32_t bits = 8;
  static constexpr std::int32_t group_size = 0;
  static constexpr std::int32_t param_bytes = 1;
  static params fit(const float* x, std::int32_t n) { return kv_codec_archetype::fit(x, n); }
  static std::uint32_t encode(float x, const params& p) { return kv_codec_archetype::encode(x, p); }
  static float decode(std::uint32_t c, const params& p) { return kv_codec_archetype::decode(c, p); }
  static void store(const params& p, std::byte* o) { kv_codec_archetype::store(p, o); }
  static params load(const std::byte* i) { return kv_codec_archetype::load(i); }
};
struct decode_to_double : kv_codec_archetype {
  static double decode(std::uint32_t, const params&) { return 0; }
};
struct encode_to_byte : kv_codec_archetype {
  static std::uint8_t encode(float, const params&) { return 0; }
};
struct without_load : kv_codec_archetype {
  static params load(const std::byte*) = delete;
};

} // namespace

TEST_CASE("kv_codec models and one-defect types", "[concepts][quant]") {
  STATIC_REQUIRE(kv_codec<kv_codec_archetype>);
  STATIC_REQUIRE(kv_codec<kvkit::fp16_codec>);
  STATIC_REQUIRE(kv_codec<kvkit::fp8_e5m2_codec>);
  STATIC_REQUIRE(kv_codec<kvkit::int4_channel_codec>);
  STATIC_REQUIRE_FALSE(kv_codec<six_bits>);
  STATIC_REQUIRE_FALSE(kv_codec<no_scaling>);
  STATIC_REQUIRE_FALSE(kv_codec<decode_to_double>);
  STATIC_REQUIRE_FALSE(kv_codec<encode_to_byte>);
  STATIC_REQUIRE_FALSE(kv_codec<without_load>);
  STATIC_REQUIRE_FALSE(kv_codec<float>);
}

TEST_CASE("layout and reference work for any codec", "[concepts][quant]") {
  const kvkit::paged_layout<kv_codec_archetype> layout(2, 1, 4);
  REQUIRE(layout.validate().ok());
  const std::vector<float> k{1, 2, 3, 4, -1, -2, -3, -4};
  const std::vector<float> v{5, 6, 7, 8, 9, 10, 11, 12};
  std::vector<std::byte> page(static_cast<std::size_t>(layout.bytes_per_page()));
  REQUIRE(kvkit::reference::quantize_page(layout, k.data(), v.data(), 2, page.data()).ok());
  std::vector<float> k2(8), v2(8);
  REQUIRE(kvkit::reference::dequantize_page(layout, page.data(), 2, k2.data(), v2.data()).ok());
  CHECK(k2 == k);
  CHECK(v2 == v);
  // One parameter byte per token and head, holding the group length the codec saw.
  CHECK(page[static_cast<std::size_t>(layout.k_param_offset())] == std::byte{4});
}
