#pragma once
//! The `block_allocator` concept: what kvkit's block table needs from a pool of KV blocks.

#include <concepts>
#include <cstdint>
#include <span>

#include "kvkit/block/types.hpp"
#include "kvkit/error.hpp"

namespace kvkit {

//! A fixed-capacity pool of reference-counted KV blocks.
//!
//! Required expressions, for `A& a`, `const A& ca`, `block_id id`, `std::span<block_id> out`:
//!  - `a.allocate(out)` -> `status`: hands out `out.size()` blocks, each with reference count 1,
//!    writing their ids into `out`. All or nothing: when fewer than `out.size()` blocks are
//!    allocatable it returns `errc::out_of_blocks` and changes nothing.
//!  - `a.retain(id)` -> `status`: adds one reference to a block in use (`errc::invalid_block` for
//!    an id that is not in use).
//!  - `a.release(id)` -> `status`: drops one reference; at zero the block becomes allocatable
//!    again. `errc::double_release` when the count is already zero, `errc::invalid_block` for an
//!    id outside the pool; nothing changes on error.
//!  - `ca.ref_count(id)` -> `std::int32_t`: the block's reference count (0 when allocatable).
//!  - `ca.num_free()` -> `std::int32_t`: how many blocks `allocate` can hand out now.
//!  - `ca.capacity()` -> `std::int32_t`: the number of blocks, ids `0 .. capacity()-1`.
//!
//! Semantics the compiler cannot check: `num_free() + (blocks with ref_count > 0) == capacity()`
//! at all times; operations are O(1) per block; a model need not be thread-safe (callers
//! serialize access, as an engine's scheduler thread does).
template <class A>
concept block_allocator = requires(A& a, const A& ca, block_id id, std::span<block_id> out) {
  { a.allocate(out) } -> std::same_as<status>;
  { a.retain(id) } -> std::same_as<status>;
  { a.release(id) } -> std::same_as<status>;
  { ca.ref_count(id) } -> std::same_as<std::int32_t>;
  { ca.num_free() } -> std::same_as<std::int32_t>;
  { ca.capacity() } -> std::same_as<std::int32_t>;
};

} // namespace kvkit
