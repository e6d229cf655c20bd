#pragma once
//! kv_format: the codecs named at run time, and the one place that turns a name into a codec type.

#include <array>
#include <cstdint>
#include <string_view>
#include <utility>

#include "kvkit/error.hpp"
#include "kvkit/quant/codecs.hpp"

namespace kvkit {

//! A K/V storage format chosen at run time (a flag, a config file).
enum class kv_format : std::uint8_t {
  fp16,
  bf16,
  fp8_e4m3,
  fp8_e5m2,
  int8,
  int4_g32,
  int4_g64,
  int4_g128,
  int4_channel,
};

//! Every format, in declaration order.
inline constexpr std::array<kv_format, 9> all_kv_formats{
    kv_format::fp16,     kv_format::bf16,      kv_format::fp8_e4m3,
    kv_format::fp8_e5m2, kv_format::int8,      kv_format::int4_g32,
    kv_format::int4_g64, kv_format::int4_g128, kv_format::int4_channel};

//! Calls `fn(Codec{})` with the codec type of `f`; the single runtime-to-template dispatch point.
//! `f` must be one of the enumerators (a value cast from elsewhere takes int4_channel_codec).
template <class F>
constexpr decltype(auto) visit_codec(kv_format f, F&& fn) {
  switch (f) {
  case kv_format::fp16:
    return std::forward<F>(fn)(fp16_codec{});
  case kv_format::bf16:
    return std::forward<F>(fn)(bf16_codec{});
  case kv_format::fp8_e4m3:
    return std::forward<F>(fn)(fp8_e4m3_codec{});
  case kv_format::fp8_e5m2:
    return std::forward<F>(fn)(fp8_e5m2_codec{});
  case kv_format::int8:
    return std::forward<F>(fn)(int8_codec{});
  case kv_format::int4_g32:
    return std::forward<F>(fn)(int4_group_codec<32>{});
  case kv_format::int4_g64:
    return std::forward<F>(fn)(int4_group_codec<64>{});
  case kv_format::int4_g128:
    return std::forward<F>(fn)(int4_group_codec<128>{});
  case kv_format::int4_channel:
    break;
  }
  return std::forward<F>(fn)(int4_channel_codec{});
}

//! The format's name as `parse_kv_format` reads it; "unknown" for a value that is none of the
//! enumerators.
[[nodiscard]] constexpr std::string_view to_string(kv_format f) noexcept {
  constexpr std::array<std::string_view, 9> names{"fp16",     "bf16",      "fp8_e4m3",
                                                  "fp8_e5m2", "int8",      "int4_g32",
                                                  "int4_g64", "int4_g128", "int4_channel"};
  const auto i = static_cast<std::size_t>(f);
  return i < names.size() ? names[i] : std::string_view("unknown");
}

//! The format named `name` (as `to_string` spells it); bad_argument for anything else.
[[nodiscard]] constexpr result<kv_format> parse_kv_format(std::string_view name) noexcept {
  for (const kv_format f : all_kv_formats) {
    if (to_string(f) == name) {
      return f;
    }
  }
  return errc::bad_argument;
}

} // namespace kvkit
