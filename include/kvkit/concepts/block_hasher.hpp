#pragma once
//! The `block_hasher` concept and `block_key`, the content key of a full block of a prefix.

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <type_traits>

#include "kvkit/block/types.hpp"

namespace kvkit {

//! A 128-bit key that names the content of a block *and* everything before it: equal keys mean
//! equal token prefixes (up to a 2^-128 collision chance) under equal extra bytes.
struct block_key {
  std::uint64_t lo = 0;
  std::uint64_t hi = 0;
  friend constexpr bool operator==(const block_key&, const block_key&) = default;
};
static_assert(std::is_trivially_copyable_v<block_key> && sizeof(block_key) == 16);

//! Computes chained block keys.
//!
//! Required expression, for `const H& h`, `block_key parent`, `std::span<const token_id> tokens`,
//! `std::span<const std::byte> extra`:
//!  - `h(parent, tokens, extra)` -> `block_key`: the key of a block holding `tokens` whose prefix
//!    has key `parent`, under `extra` bytes (LoRA id, cache salt, multimodal hashes: anything else
//!    that changes the K/V). kvkit's prefix cache calls it with an all-zero parent and no tokens
//!    to make a request's root key from its extra bytes, then with no extra bytes for each block.
//!
//! Semantics: a pure function of its arguments (same inputs, same key, on every run and machine
//! of one build); any change to any input changes the key except with negligible probability.
template <class H>
concept block_hasher = std::copy_constructible<H> &&
    requires(const H& h, const block_key& parent, std::span<const token_id> tokens,
             std::span<const std::byte> extra) {
  { h(parent, tokens, extra) } -> std::same_as<block_key>;
};

} // namespace kvkit
