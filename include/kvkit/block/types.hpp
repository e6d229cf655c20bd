#pragma once
//! Value types shared by the block pieces and the kernels: block ids, sequence ids, token slots
//! and copy-on-write pairs.

#include <cstdint>
#include <type_traits>

#include "kvkit/config.hpp"

namespace kvkit {

//! Index of a physical KV block (page) in a pool: 0 .. capacity-1. One block id names the same
//! page in every layer's cache, so one page table serves all layers.
using block_id = std::int32_t;

//! The id no block has.
inline constexpr block_id invalid_block_id = -1;

//! A caller-chosen sequence (request) id.
using seq_id = std::uint64_t;

//! A token id of the model's vocabulary.
using token_id = std::int32_t;

//! Where one token's K/V lives: a block and the token's offset inside it.
struct token_slot {
  block_id block;
  std::int32_t offset; // 0 .. block_size-1

  //! The flat slot index `block * block_size + offset`, as slot-mapping kernels take it.
  [[nodiscard]] KVKIT_HOST_DEVICE constexpr std::int64_t flat(std::int32_t block_size) const {
    return static_cast<std::int64_t>(block) * block_size + offset;
  }
  friend constexpr bool operator==(const token_slot&, const token_slot&) = default;
};

//! One copy-on-write order: copy the whole page `src` onto page `dst` (in every layer) before the
//! step writes its new K/V (a copy after the write would undo it). An array of these is what the
//! copy kernel consumes: [n][2] int32.
struct block_copy {
  block_id src;
  block_id dst;
  friend constexpr bool operator==(const block_copy&, const block_copy&) = default;
};

static_assert(std::is_trivially_copyable_v<token_slot> && sizeof(token_slot) == 8);
static_assert(std::is_trivially_copyable_v<block_copy> && sizeof(block_copy) == 8);

//! The number of blocks that hold `num_tokens` tokens: ceil(num_tokens / block_size).
[[nodiscard]] KVKIT_HOST_DEVICE constexpr std::int32_t blocks_for_tokens(std::int32_t num_tokens,
                                                                         std::int32_t block_size) {
  return static_cast<std::int32_t>((static_cast<std::int64_t>(num_tokens) + block_size - 1) /
                                   block_size);
}

//! Tokens held by the last block of a sequence of `num_tokens` tokens: 1 .. block_size, or 0 for
//! an empty sequence (FlashInfer's `last_page_len`).
[[nodiscard]] KVKIT_HOST_DEVICE constexpr std::int32_t last_block_len(std::int32_t num_tokens,
                                                                      std::int32_t block_size) {
  return num_tokens == 0 ? 0 : (num_tokens - 1) % block_size + 1;
}

} // namespace kvkit
