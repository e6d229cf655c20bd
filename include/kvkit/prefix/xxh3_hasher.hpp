#pragma once
//! xxh3_hasher: kvkit's default block hasher, XXH3-128 from xxHash (header-only, inlined).

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

#include "kvkit/block/types.hpp"
#include "kvkit/concepts/block_hasher.hpp"
#include "kvkit/config.hpp"

#ifndef XXH_INLINE_ALL
#define XXH_INLINE_ALL
#endif
#include <xxhash.h>

namespace kvkit {

//! Block keys from one XXH3-128 (unseeded) over `parent | tokens | extra`: the parent key's 16
//! bytes (`lo`, then `hi`, little-endian), then the token ids' in-memory bytes, then the extra
//! bytes. Keys agree between machines of the same byte order (every platform kvkit targets is
//! little-endian), so a router can compute them with any XXH3 implementation.
//!
//! A prompt's keys form a chain, each waiting for the one before it. For 8-, 16- and 32-token
//! blocks the hash is evaluated with the parent key in registers: xxHash's multiplications of the
//! tokens do not involve the parent, so most of a key's work overlaps the previous key's, and going
//! through memory would put a store-to-load round trip on the chain. Other block sizes of up to 256
//! tokens copy the parent and tokens into one buffer; extra bytes and longer blocks go through
//! xxHash's streaming state. The tests check every path against `XXH3_128bits` of the
//! concatenated bytes.
struct xxh3_hasher {
  [[nodiscard]] block_key operator()(const block_key& parent, std::span<const token_id> tokens,
                                     std::span<const std::byte> extra) const noexcept {
    const auto* bytes = reinterpret_cast<const std::uint8_t*>(tokens.data());
    const std::size_t size = tokens.size_bytes();
    if (!extra.empty() || size > max_buffered) {
      return streamed(parent, tokens, extra);
    }
    // The usual block sizes get a fixed length, whose length dispatch folds away.
    switch (size) {
    case 32:
      return in_registers<32>(parent, bytes);
    case 64:
      return in_registers<64>(parent, bytes);
    case 128:
      return in_registers_midsize<128>(parent, bytes);
    case 256:
      return buffered<256>(parent, bytes);
    default:
      return buffered<max_buffered>(parent, bytes, size);
    }
  }

private:
  static constexpr std::size_t key_bytes = sizeof(block_key);
  static constexpr std::size_t max_buffered = 1024; // token bytes hashed through a stack buffer

  static block_key to_key(const XXH128_hash_t& h) noexcept { return block_key{h.low64, h.high64}; }

  // XXH3-128 of `parent | Bytes bytes at t` through xxHash's 17-to-128-byte path (unseeded), with
  // the parent in registers. Offsets below count from the start of `parent | tokens`; every round
  // but the last reads tokens only, which holds for 16 token bytes and for 32 to 112.
  template <std::size_t Bytes>
  KVKIT_ALWAYS_INLINE static block_key in_registers(const block_key& parent,
                                                    const std::uint8_t* t) noexcept {
    constexpr std::size_t len = key_bytes + Bytes;
    static_assert(Bytes == 16 || (Bytes >= 32 && len <= 128));
    const std::uint8_t* secret = XXH3_kSecret;
    XXH128_hash_t acc{len * XXH_PRIME64_1, 0};
    if constexpr (len > 32) {
      if constexpr (len > 64) {
        if constexpr (len > 96) {
          acc = XXH128_mix32B(acc, at(t, 48), at(t, len - 64), secret + 96, 0);
        }
        acc = XXH128_mix32B(acc, at(t, 32), at(t, len - 48), secret + 64, 0);
      }
      acc = XXH128_mix32B(acc, at(t, 16), at(t, len - 32), secret + 32, 0);
    }
    return finish(mix_parent(acc, parent, at(t, len - 16)), len);
  }

  // The same through xxHash's 129-to-240-byte path, where the parent enters the first round.
  template <std::size_t Bytes>
  KVKIT_ALWAYS_INLINE static block_key in_registers_midsize(const block_key& parent,
                                                            const std::uint8_t* t) noexcept {
    constexpr std::size_t len = key_bytes + Bytes;
    static_assert(len > 128 && len <= XXH3_MIDSIZE_MAX);
    constexpr std::size_t rounds = len / 32;
    const std::uint8_t* secret = XXH3_kSecret;
    XXH128_hash_t acc = mix_parent(XXH128_hash_t{len * XXH_PRIME64_1, 0}, parent, at(t, 16));
    for (std::size_t i = 1; i < 4; ++i) {
      acc = XXH128_mix32B(acc, at(t, 32 * i), at(t, 32 * i + 16), secret + 32 * i, 0);
    }
    acc.low64 = XXH3_avalanche(acc.low64);
    acc.high64 = XXH3_avalanche(acc.high64);
    for (std::size_t i = 4; i < rounds; ++i) {
      acc = XXH128_mix32B(acc, at(t, 32 * i), at(t, 32 * i + 16),
                          secret + XXH3_MIDSIZE_STARTOFFSET + 32 * (i - 4), 0);
    }
    acc = XXH128_mix32B(acc, at(t, len - 16), at(t, len - 32),
                        secret + XXH3_SECRET_SIZE_MIN - XXH3_MIDSIZE_LASTOFFSET - 16, 0);
    return finish(acc, len);
  }

  // Byte `offset` of `parent | tokens` whose tokens start at `t`; only offsets of the tokens.
  KVKIT_ALWAYS_INLINE static const std::uint8_t* at(const std::uint8_t* t,
                                                    std::size_t offset) noexcept {
    return t + (offset - key_bytes);
  }

  // XXH128_mix32B(acc, parent, the 16 bytes at `other`, secret, 0) with the parent in registers:
  // the one round of either path that reads the parent.
  KVKIT_ALWAYS_INLINE static XXH128_hash_t mix_parent(XXH128_hash_t acc, const block_key& parent,
                                                      const std::uint8_t* other) noexcept {
    const std::uint8_t* secret = XXH3_kSecret;
    acc.low64 +=
        XXH3_mul128_fold64(parent.lo ^ XXH_readLE64(secret), parent.hi ^ XXH_readLE64(secret + 8));
    acc.low64 ^= XXH_readLE64(other) + XXH_readLE64(other + 8);
    acc.high64 += XXH3_mix16B(other, secret + 16, 0);
    acc.high64 ^= parent.lo + parent.hi;
    return acc;
  }

  static block_key finish(const XXH128_hash_t& acc, std::uint64_t len) noexcept {
    const std::uint64_t low = acc.low64 + acc.high64;
    const std::uint64_t high =
        acc.low64 * XXH_PRIME64_1 + acc.high64 * XXH_PRIME64_4 + len * XXH_PRIME64_2;
    return block_key{XXH3_avalanche(low), std::uint64_t{0} - XXH3_avalanche(high)};
  }

  // XXH3-128 of `parent | size bytes at t`, copied into one buffer (`size` at most Bytes).
  template <std::size_t Bytes>
  KVKIT_FLATTEN static block_key buffered(const block_key& parent, const std::uint8_t* t,
                                          std::size_t size = Bytes) noexcept {
    std::uint8_t buf[key_bytes + Bytes];
    std::memcpy(buf, &parent.lo, sizeof(parent.lo));
    std::memcpy(buf + sizeof(parent.lo), &parent.hi, sizeof(parent.hi));
    if (size != 0) { // a root key hashes no tokens, and `t` may then be null
      std::memcpy(buf + key_bytes, t, size);
    }
    return to_key(XXH3_128bits(buf, key_bytes + size));
  }

  static block_key streamed(const block_key& parent, std::span<const token_id> tokens,
                            std::span<const std::byte> extra) noexcept {
    const std::uint64_t words[2] = {parent.lo, parent.hi};
    XXH3_state_t state;
    XXH3_128bits_reset(&state);
    XXH3_128bits_update(&state, words, sizeof(words));
    XXH3_128bits_update(&state, tokens.data(), tokens.size_bytes());
    XXH3_128bits_update(&state, extra.data(), extra.size_bytes());
    return to_key(XXH3_128bits_digest(&state));
  }
};

static_assert(block_hasher<xxh3_hasher>);

namespace detail {

// XXH3-64 (unseeded) of `count` token ids' bytes: how prefix_cache finds a block among the
// children of its prefix. `Count` fixes the length at compile time (0: use `count`), so that
// xxHash's length dispatch folds away for the usual block sizes.
template <std::size_t Count = 0>
KVKIT_ALWAYS_INLINE std::uint64_t content_hash(const token_id* tokens,
                                               std::size_t count = Count) noexcept {
  return XXH3_64bits(tokens, (Count != 0 ? Count : count) * sizeof(token_id));
}

} // namespace detail

} // namespace kvkit
