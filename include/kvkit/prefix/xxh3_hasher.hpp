#pragma once
//! xxh3_hasher: kvkit's default block hasher, XXH3-128 from xxHash (header-only, inlined).

#include <cstddef>
#include <cstdint>
#include <span>

#include "kvkit/block/types.hpp"
#include "kvkit/concepts/block_hasher.hpp"

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
      content = XXH3_128bits(tokens.data(), tokens.size_bytes());
    } else {
      XXH3_state_t state;
      XXH3_128bits_reset(&state);
      XXH3_128bits_update(&state, tokens.data(), tokens.size_bytes());
      XXH3_128bits_update(&state, extra.data(), extra.size_bytes());
      content = XXH3_128bits_digest(&state);
    }
    const std::uint64_t words[4] = {parent.lo, parent.hi, content.low64, content.high64};
    const XXH128_hash_t key = XXH3_128bits(words, sizeof(words));
    return block_key{key.low64, key.high64};
  }
};

static_assert(block_hasher<xxh3_hasher>);

} // namespace kvkit
