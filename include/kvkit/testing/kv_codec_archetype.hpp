#pragma once
//! The smallest type that models `kv_codec`.

#include <cstddef>
#include <cstdint>

#include "kvkit/concepts/kv_codec.hpp"
#include "kvkit/config.hpp"

namespace kvkit::testing {

//! Models `kv_codec` and nothing more: 8-bit codes holding the value's integer part, one stored
//! byte of parameters per token and head. Fit for compile-time checks of generic layouts and
//! kernels, and for tests of parameter placement.
struct kv_codec_archetype {
  struct params {
    std::uint8_t tag = 0;
  };
  static constexpr std::int32_t bits = 8;
  static constexpr kv_scaling scaling = kv_scaling::per_token_head;
  static constexpr std::int32_t group_size = 0;
  static constexpr std::int32_t param_bytes = 1;
  KVKIT_HOST_DEVICE static params fit(const float* /*xs*/, std::int32_t n) {
    return {static_cast<std::uint8_t>(n)};
  }
  KVKIT_HOST_DEVICE static std::uint32_t encode(float x, const params& /*p*/) {
    return static_cast<std::uint32_t>(static_cast<std::int32_t>(x)) & 0xFFU;
  }
  KVKIT_HOST_DEVICE static float decode(std::uint32_t code, const params& /*p*/) {
    return static_cast<float>(static_cast<std::int8_t>(static_cast<std::uint8_t>(code)));
  }
  KVKIT_HOST_DEVICE static void store(const params& p, std::byte* out) {
    *out = static_cast<std::byte>(p.tag);
  }
  KVKIT_HOST_DEVICE static params load(const std::byte* in) {
    return {static_cast<std::uint8_t>(*in)};
  }
};

static_assert(kv_codec<kv_codec_archetype>);

} // namespace kvkit::testing
