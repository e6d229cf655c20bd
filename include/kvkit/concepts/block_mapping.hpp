#pragma once
//! The `block_mapping` concept: per-sequence page tables over a block allocator.

#include <concepts>
#include <cstdint>
#include <span>

#include "kvkit/block/types.hpp"
#include "kvkit/error.hpp"

namespace kvkit {

//! What one `append_tokens` call did besides writing the new tokens' slots.
struct append_info {
  std::int32_t num_new_blocks = 0; //!< blocks allocated, the copy-on-write target included
  bool copied = false;             //!< whether the partly filled last block was copied on write
  block_copy copy{invalid_block_id, invalid_block_id}; //!< valid when `copied`: run it first
};

//! Per-sequence logical-to-physical block tables (page tables) over a block allocator.
//!
//! Required expressions, for `M& m`, `const M& cm`, `seq_id s, t`, `std::int32_t n`,
//! `std::span<token_slot> slots`, `std::span<const seq_id> batch`, `std::span<std::int32_t> i32`,
//! `std::span<const std::int32_t> ci32`, `std::span<std::int64_t> i64`:
//!  - `cm.block_size()` -> `std::int32_t`: tokens per block.
//!  - `cm.contains(s)` -> `bool`.
//!  - `cm.num_tokens(s)` -> `result<std::int32_t>`; `cm.blocks(s)` ->
//!    `result<std::span<const block_id>>`: the sequence's blocks in logical order.
//!  - `cm.blocks_needed(s, n)` -> `result<std::int32_t>`: blocks `append_tokens(s, n, ...)` would
//!    allocate now, the copy-on-write block included.
//!  - `m.add_sequence(s)` -> `status`: a new empty sequence (`errc::duplicate_sequence`).
//!  - `m.adopt_sequence(s, cblocks, n)` -> `status`: a new sequence of `n` tokens made of
//!    `cblocks` (a `std::span<const block_id>`), taking over one reference to each that the caller
//!    holds (a prefix-cache match).
//!  - `m.append_tokens(s, n, slots)` -> `result<append_info>`: grows `s` by `n` tokens, allocating
//!    blocks as needed, and writes each new token's slot into `slots` (when it is not empty). A
//!    write into a block shared with another sequence first moves the sequence onto a fresh copy
//!    and reports the `(src, dst)` pair to execute before the step writes its new K/V. All or
//!    nothing.
//!  - `m.release_copy_sources()`: the copies reported so far have run (or are queued before any
//!    later write of their blocks, on one stream); their sources and destinations may be handed
//!    out again (until then neither may be, so that one step's copies never overlap).
//!  - `m.truncate(s, n)` -> `status`: shortens `s` to `n` tokens, releasing blocks past the end.
//!  - `m.fork(s, t)` -> `status`: new sequence `t` shares every block of `s` (no data copied).
//!  - `m.free(s)` -> `status`: releases every block of `s` and forgets it.
//!  - `cm.export_csr(batch, indptr, indices, last_page_len)` -> `status`: the batch's page table
//!    in CSR form, `indptr[B+1]`, `indices[indptr[B]]`, `last_page_len[B]`.
//!  - `cm.export_block_table(batch, n, table, seq_lens)` -> `status`: the padded 2-D form,
//!    `table[B][n]` (row b holds sequence b's blocks, then padding) and `seq_lens[B]`.
//!  - `cm.export_slot_mapping(batch, ci32, i64)` -> `status`: for each sequence b, the flat slots
//!    (`block * block_size + offset`) of its last `ci32[b]` tokens, concatenated.
//!
//! Semantics: failures return an error code and change nothing (output buffers of a failed
//! export hold unspecified values). Each block a mapping holds is one reference in its allocator.
template <class M>
concept block_mapping = requires(M& m, const M& cm, seq_id s, std::int32_t n,
                                 std::span<token_slot> slots, std::span<const seq_id> batch,
                                 std::span<std::int32_t> i32, std::span<const std::int32_t> ci32,
                                 std::span<std::int64_t> i64, std::span<const block_id> cblocks) {
  { cm.block_size() } -> std::same_as<std::int32_t>;
  { cm.contains(s) } -> std::same_as<bool>;
  { cm.num_tokens(s) } -> std::same_as<result<std::int32_t>>;
  { cm.blocks(s) } -> std::same_as<result<std::span<const block_id>>>;
  { cm.blocks_needed(s, n) } -> std::same_as<result<std::int32_t>>;
  { m.add_sequence(s) } -> std::same_as<status>;
  { m.adopt_sequence(s, cblocks, n) } -> std::same_as<status>;
  { m.append_tokens(s, n, slots) } -> std::same_as<result<append_info>>;
  { m.truncate(s, n) } -> std::same_as<status>;
  { m.fork(s, s) } -> std::same_as<status>;
  { m.free(s) } -> std::same_as<status>;
  m.release_copy_sources();
  { cm.export_csr(batch, i32, i32, i32) } -> std::same_as<status>;
  { cm.export_block_table(batch, n, i32, i32) } -> std::same_as<status>;
  { cm.export_slot_mapping(batch, ci32, i64) } -> std::same_as<status>;
};

} // namespace kvkit
