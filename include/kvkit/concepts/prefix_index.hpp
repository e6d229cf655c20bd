#pragma once
//! The `prefix_index` concept: a cache of published KV blocks looked up by token prefix.

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>

#include "kvkit/block/types.hpp"
#include "kvkit/error.hpp"

namespace kvkit {

//! Tokens whose blocks an engine asks the cache to keep longer (a shared system prompt).
struct retention {
  std::int32_t priority = 0;   //!< 0..100; 0 is the default of every token
  std::int32_t num_tokens = 0; //!< the sequence's first `num_tokens` tokens get `priority`
};

//! The outcome of a prefix lookup.
struct prefix_match {
  std::int32_t num_tokens = 0;    //!< tokens whose K/V the matched blocks already hold
  std::int32_t num_blocks = 0;    //!< blocks matched (the last may be partly used)
  std::int32_t num_evictable = 0; //!< of those, blocks no one held: matching takes them off the
                                  //!< allocator's free count
  bool partial_last = false;      //!< the last block is shared only up to `num_tokens`
};

//! A prefix cache over a block allocator.
//!
//! Required expressions, for `C& c`, `const C& cc`, `seq_id s, t`, `std::int32_t n`,
//! `std::span<const token_id> tokens`, `std::span<const std::byte> extra`,
//! `std::span<block_id> out`, `std::span<const block_id> blocks`, `retention r`:
//!  - `cc.probe(tokens, extra)` -> `prefix_match`: what `match` would find now; changes nothing.
//!  - `c.match(s, tokens, extra, out, r)` -> `result<prefix_match>`: the longest cached prefix of
//!    prompt `tokens`, as blocks written to `out` with one reference each taken for the caller,
//!    and starts tracking sequence `s`. Never covers the last prompt token (its logits must be
//!    computed).
//!  - `c.publish(s, blocks, tokens)` -> `result<std::int32_t>`: makes the full blocks of tracked
//!    sequence `s` (its `blocks`, holding `tokens`) matchable; returns how many were new.
//!  - `c.fork(s, t)`, `c.truncate(s, n)` -> `status`: follow the block table's fork and truncate.
//!  - `c.finish(s, blocks, tokens)` -> `status`: publishes what is left and stops tracking `s`.
//!  - `c.forget(s)` -> `status`: stops tracking `s` without publishing.
//!  - `cc.block_size()` -> `std::int32_t`.
//!
//! Semantics: a matched block holds exactly the K/V of the tokens it was matched for; unreferenced
//! cached blocks stay reusable until the allocator needs them; failures change nothing.
template <class C>
concept prefix_index = requires(C& c, const C& cc, seq_id s, std::int32_t n,
                                std::span<const token_id> tokens, std::span<const std::byte> extra,
                                std::span<block_id> out, std::span<const block_id> blocks,
                                const retention& r) {
  { cc.block_size() } -> std::same_as<std::int32_t>;
  { cc.probe(tokens, extra) } -> std::same_as<prefix_match>;
  { c.match(s, tokens, extra, out, r) } -> std::same_as<result<prefix_match>>;
  { c.publish(s, blocks, tokens) } -> std::same_as<result<std::int32_t>>;
  { c.fork(s, s) } -> std::same_as<status>;
  { c.truncate(s, n) } -> std::same_as<status>;
  { c.finish(s, blocks, tokens) } -> std::same_as<status>;
  { c.forget(s) } -> std::same_as<status>;
};

} // namespace kvkit
