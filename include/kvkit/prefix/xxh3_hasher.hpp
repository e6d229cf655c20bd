#pragma once
//! xxh3_hasher: kvkit's default block hasher, XXH3-128 from xxHash (header-only, inlined).

#include <cstddef>
#include <cstdint>
#include <span>

#include "kvkit/block/types.hpp"
#include "kvkit/concepts/block_hasher.hpp"
#include "kvkit/config.hpp"

#ifndef XXH_INLINE_ALL
#define XXH_INLINE_ALL
#endif
#include <xxhash.h>

namespace kvkit {

//! Block keys from XXH3-128 in two steps: `XXH3-128(parent | XXH3-128(tokens | extra))`.
//!
//! The inner hash of a block's tokens does not depend on the parent, so when a prompt is walked
//! block by block the processor overlaps it with the previous block's outer hash; only the short
//! 32-byte outer hash is serial. Both steps keep 128 bits. Token ids enter as their in-memory
//! bytes, so keys agree between machines of the same byte order (every platform kvkit targets is
//! little-endian).
struct xxh3_hasher {
  [[nodiscard]] block_key operator()(const block_key& parent, std::span<const token_id> tokens,
                                     std::span<const std::byte> extra) const noexcept {
    XXH128_hash_t content;
    if (extra.empty()) {
      // The usual block sizes get the hash of a fixed length, whose length dispatch folds away.
      switch (tokens.size_bytes()) {
      case 32:
        content = fixed<32>(tokens.data());
        break;
      case 64:
        content = fixed<64>(tokens.data());
        break;
      case 128:
        content = fixed<128>(tokens.data());
        break;
      default:
        content = XXH3_128bits(tokens.data(), tokens.size_bytes());
        break;
      }
    } else {
      XXH3_state_t state;
      XXH3_128bits_reset(&state);
      XXH3_128bits_update(&state, tokens.data(), tokens.size_bytes());
      XXH3_128bits_update(&state, extra.data(), extra.size_bytes());
      content = XXH3_128bits_digest(&state);
    }
    const std::uint64_t words[4] = {parent.lo, parent.hi, content.low64, content.high64};
    const XXH128_hash_t key = fixed<sizeof(words)>(words);
    return block_key{key.low64, key.high64};
  }

private:
  // XXH3-128 of `Bytes` bytes, inlined whole so the compiler sees the constant length.
  template <std::size_t Bytes>
  KVKIT_FLATTEN static XXH128_hash_t fixed(const void* data) noexcept {
    return XXH3_128bits(data, Bytes);
  }
};

static_assert(block_hasher<xxh3_hasher>);

} // namespace kvkit
