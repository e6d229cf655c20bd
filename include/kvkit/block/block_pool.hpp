#pragma once
//! block_pool: a fixed-capacity pool of reference-counted KV blocks whose cached, unreferenced
//! blocks stay evictable (LRU within eviction levels) and are reclaimed lazily.

#include <algorithm>
#include <array>
#include <cassert>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

#include "kvkit/block/types.hpp"
#include "kvkit/concepts/block_allocator.hpp"
#include "kvkit/error.hpp"

namespace kvkit {

//! A fixed pool of `capacity` KV blocks with ids `0 .. capacity-1`, each with a reference count.
//!
//! A block is in one of three states:
//!  - *free*: reference count 0, holds nothing anyone wants; on the free stack.
//!  - *in use*: reference count > 0.
//!  - *evictable*: reference count 0 but marked cached (a prefix cache published its contents).
//!    It stays on an evictable list with its contents intact, so a later prefix hit can `retain`
//!    it back into use. `allocate` takes free blocks first and reclaims evictable ones only when
//!    none are free, telling the cache through the eviction callback just before the block is
//!    handed out again.
//!
//! Evictable blocks are ordered by eviction level, then by release time: every block of level 0
//! goes before any block of level 1, and within a level the least recently released goes first
//! (LRU). An eviction policy chooses each cached block's level through `set_cached`; with one
//! level (the default) the pool is a plain LRU.
//!
//! Every operation is O(1) per block and allocation-free after construction. Not thread-safe.
//! Failed operations return an error code and leave the pool unchanged.
class block_pool {
public:
  //! Called with a cached block just before `allocate` reclaims it; the cache must drop its key.
  using eviction_callback = void (*)(void* context, block_id id) noexcept;

  //! Most eviction levels a pool supports.
  static constexpr std::int32_t max_eviction_levels = 8;

  //! A pool of `capacity` free blocks (a negative capacity is taken as 0) that orders cached
  //! blocks in `num_eviction_levels` levels (clamped to 1 .. max_eviction_levels).
  explicit block_pool(std::int32_t capacity, std::int32_t num_eviction_levels = 1)
      : meta_(static_cast<std::size_t>(std::max(capacity, 0))),
        free_(static_cast<std::size_t>(std::max(capacity, 0))), free_top_(std::max(capacity, 0)),
        capacity_(std::max(capacity, 0)),
        num_levels_(std::clamp(num_eviction_levels, 1, max_eviction_levels)) {
    // Ids come out in increasing order from a fresh pool: easier to read in logs and tests.
    for (std::int32_t i = 0; i < free_top_; ++i) {
      free_[static_cast<std::size_t>(i)] = free_top_ - 1 - i;
    }
  }

  block_pool(const block_pool&) = delete;
  block_pool& operator=(const block_pool&) = delete;
  //! Not movable either: block tables, prefix caches and schedulers hold the pool's address, and a
  //! cache's eviction callback points back at the cache (hold a pool in a `std::unique_ptr` to
  //! pass it around).
  block_pool(block_pool&&) = delete;
  block_pool& operator=(block_pool&&) = delete;
  ~block_pool() = default;

  //! Hands out `out.size()` blocks with reference count 1, or none (errc::out_of_blocks).
  [[nodiscard]] status allocate(std::span<block_id> out) noexcept {
    if (out.size() > static_cast<std::size_t>(num_free())) {
      return errc::out_of_blocks;
    }
    for (block_id& id : out) {
      id = take_one();
    }
    return {};
  }

  //! Hands out one block with reference count 1.
  [[nodiscard]] result<block_id> allocate() noexcept {
    if (num_free() == 0) {
      return errc::out_of_blocks;
    }
    return take_one();
  }

  //! Adds a reference to a block in use, or brings an evictable block back into use (a prefix-cache
  //! hit). errc::invalid_block for an id outside the pool or a free block; errc::out_of_range when
  //! the count is at its maximum.
  [[nodiscard]] status retain(block_id id) noexcept {
    if (!contains(id)) {
      return errc::invalid_block;
    }
    block_meta& m = meta_[static_cast<std::size_t>(id)];
    if (m.ref > 0) {
      if (m.ref == std::numeric_limits<std::int32_t>::max()) {
        return errc::out_of_range;
      }
      ++m.ref;
      return {};
    }
    if (!m.cached) {
      return errc::invalid_block;
    }
    unlink(id);
    m.ref = 1;
    ++num_revivals_;
    return {};
  }

  //! Drops a reference. At zero a cached block becomes evictable (last in line for reuse within
  //! its level) and any other block becomes free.
  [[nodiscard]] status release(block_id id) noexcept {
    if (!contains(id)) {
      return errc::invalid_block;
    }
    block_meta& m = meta_[static_cast<std::size_t>(id)];
    if (m.ref == 0) {
      return errc::double_release;
    }
    if (--m.ref == 0) {
      if (m.cached) {
        link_back(id);
      } else {
        free_[static_cast<std::size_t>(free_top_++)] = id;
      }
    }
    return {};
  }

  //! The block's reference count, or -1 when `id` is not a block of this pool.
  [[nodiscard]] std::int32_t ref_count(block_id id) const noexcept {
    return contains(id) ? meta_[static_cast<std::size_t>(id)].ref : -1;
  }

  //! Blocks `allocate` can hand out now: free plus evictable.
  [[nodiscard]] std::int32_t num_free() const noexcept { return free_top_ + num_evictable_; }
  //! Cached blocks with no reference, kept until the space is needed.
  [[nodiscard]] std::int32_t num_evictable() const noexcept { return num_evictable_; }
  //! Blocks with a reference count above zero.
  [[nodiscard]] std::int32_t num_used() const noexcept { return capacity() - num_free(); }
  [[nodiscard]] std::int32_t capacity() const noexcept { return capacity_; }
  [[nodiscard]] bool contains(block_id id) const noexcept {
    return static_cast<std::uint32_t>(id) < static_cast<std::uint32_t>(capacity_);
  }

  //! Marks a block in use as cached (its contents are published) with an eviction `level`, or
  //! clears the mark. Clearing the mark of an evictable block frees it at once. Clearing a mark
  //! calls the eviction callback too, so a cache never keeps an entry for an unmarked block.
  //! Errors: invalid_block for an id outside the pool, for marking a block that is not in use and
  //! for clearing the mark of a free block; bad_argument for a level outside 0 .. levels-1.
  [[nodiscard]] status set_cached(block_id id, bool cached, std::int32_t level = 0) noexcept {
    if (!contains(id)) {
      return errc::invalid_block;
    }
    if (level < 0 || level >= num_levels_) {
      return errc::bad_argument;
    }
    block_meta& m = meta_[static_cast<std::size_t>(id)];
    if (m.ref == 0) {
      if (cached || !m.cached) {
        return errc::invalid_block;
      }
      unlink(id);
      m.cached = false;
      m.level = 0;
      free_[static_cast<std::size_t>(free_top_++)] = id;
      notify_evicted(id);
      return {};
    }
    const bool was_cached = m.cached;
    m.cached = cached;
    m.level = static_cast<std::uint8_t>(cached ? level : 0);
    if (was_cached && !cached) {
      notify_evicted(id);
    }
    return {};
  }

  //! Whether the block carries the cached mark (in use or evictable). False for ids outside.
  [[nodiscard]] bool is_cached(block_id id) const noexcept {
    return contains(id) && meta_[static_cast<std::size_t>(id)].cached;
  }
  //! The eviction level of a cached block (0 for any other block or id).
  [[nodiscard]] std::int32_t eviction_level(block_id id) const noexcept {
    return contains(id) ? meta_[static_cast<std::size_t>(id)].level : 0;
  }
  [[nodiscard]] std::int32_t num_eviction_levels() const noexcept { return num_levels_; }

  //! The evictable block `allocate` would reclaim first, or invalid_block_id when there is none.
  [[nodiscard]] block_id evictable_front() const noexcept { return first_evictable_from(0); }
  //! The evictable block reclaimed after evictable block `id`, or invalid_block_id after the last
  //! (and for an id that is not an evictable block).
  [[nodiscard]] block_id evictable_next(block_id id) const noexcept {
    if (!contains(id)) {
      return invalid_block_id;
    }
    const block_meta& m = meta_[static_cast<std::size_t>(id)];
    if (m.ref != 0 || !m.cached) {
      return invalid_block_id;
    }
    return m.next != invalid_block_id ? m.next : first_evictable_from(m.level + 1);
  }

  //! Installs the callback told about each cached block that loses its mark (reclaimed by
  //! `allocate`, or cleared by `set_cached`); nullptr for none. One prefix cache per pool.
  void set_eviction_callback(eviction_callback callback, void* context) noexcept {
    on_evict_ = callback;
    evict_context_ = context;
  }
  //! The context the installed eviction callback was given (nullptr when none is installed, and
  //! for a callback installed without one).
  [[nodiscard]] void* eviction_context() const noexcept { return evict_context_; }
  //! Whether an eviction callback is installed.
  [[nodiscard]] bool has_eviction_callback() const noexcept { return on_evict_ != nullptr; }

  //! Evictable blocks reclaimed by `allocate` since construction.
  [[nodiscard]] std::int64_t num_evictions() const noexcept { return num_evictions_; }
  //! Evictable blocks brought back into use by `retain` since construction.
  [[nodiscard]] std::int64_t num_revivals() const noexcept { return num_revivals_; }

  //! O(capacity) self-check of every internal invariant, for tests and debug builds: each block
  //! is in exactly one state, the free stack and evictable lists hold exactly the free and
  //! evictable blocks, and the counts agree.
  [[nodiscard]] bool check_consistency() const {
    const auto n = meta_.size();
    std::vector<std::uint8_t> seen(n, 0);
    for (std::int32_t i = 0; i < free_top_; ++i) {
      const block_id id = free_[static_cast<std::size_t>(i)];
      if (!contains(id) || seen[static_cast<std::size_t>(id)] != 0) {
        return false;
      }
      const block_meta& m = meta_[static_cast<std::size_t>(id)];
      if (m.ref != 0 || m.cached) {
        return false;
      }
      seen[static_cast<std::size_t>(id)] = 1;
    }
    std::int32_t count = 0;
    for (std::int32_t level = 0; level < max_eviction_levels; ++level) {
      const list& l = lists_[static_cast<std::size_t>(level)];
      block_id prev = invalid_block_id;
      for (block_id id = l.head; id != invalid_block_id;
           id = meta_[static_cast<std::size_t>(id)].next) {
        if (!contains(id) || seen[static_cast<std::size_t>(id)] != 0 || ++count > num_evictable_) {
          return false;
        }
        const block_meta& m = meta_[static_cast<std::size_t>(id)];
        if (m.ref != 0 || !m.cached || m.prev != prev || m.level != level) {
          return false;
        }
        seen[static_cast<std::size_t>(id)] = 2;
        prev = id;
      }
      if (prev != l.tail || (level >= num_levels_ && l.head != invalid_block_id)) {
        return false;
      }
    }
    if (count != num_evictable_) {
      return false;
    }
    for (std::size_t i = 0; i < n; ++i) {
      if (seen[i] == 0 && meta_[i].ref <= 0) {
        return false; // neither free, evictable nor in use
      }
    }
    return true;
  }

private:
  struct block_meta {
    std::int32_t ref = 0;
    block_id prev = invalid_block_id; // evictable list links, valid while evictable
    block_id next = invalid_block_id;
    bool cached = false;
    std::uint8_t level = 0; // eviction level while cached
  };

  struct list {
    block_id head = invalid_block_id; // next to reclaim
    block_id tail = invalid_block_id; // most recently released
  };

  [[nodiscard]] block_id first_evictable_from(std::int32_t level) const noexcept {
    for (; level < num_levels_; ++level) {
      const block_id head = lists_[static_cast<std::size_t>(level)].head;
      if (head != invalid_block_id) {
        return head;
      }
    }
    return invalid_block_id;
  }

  block_id take_one() noexcept {
    block_id id;
    if (free_top_ > 0) {
      id = free_[static_cast<std::size_t>(--free_top_)];
    } else {
      id = first_evictable_from(0);
      assert(id != invalid_block_id);
      unlink(id);
      block_meta& m = meta_[static_cast<std::size_t>(id)];
      m.cached = false;
      m.level = 0;
      ++num_evictions_;
      notify_evicted(id);
    }
    meta_[static_cast<std::size_t>(id)].ref = 1;
    return id;
  }

  void notify_evicted(block_id id) const noexcept {
    if (on_evict_ != nullptr) {
      on_evict_(evict_context_, id);
    }
  }

  void link_back(block_id id) noexcept {
    block_meta& m = meta_[static_cast<std::size_t>(id)];
    list& l = lists_[m.level];
    m.prev = l.tail;
    m.next = invalid_block_id;
    if (l.tail != invalid_block_id) {
      meta_[static_cast<std::size_t>(l.tail)].next = id;
    } else {
      l.head = id;
    }
    l.tail = id;
    ++num_evictable_;
  }

  void unlink(block_id id) noexcept {
    block_meta& m = meta_[static_cast<std::size_t>(id)];
    list& l = lists_[m.level];
    if (m.prev != invalid_block_id) {
      meta_[static_cast<std::size_t>(m.prev)].next = m.next;
    } else {
      l.head = m.next;
    }
    if (m.next != invalid_block_id) {
      meta_[static_cast<std::size_t>(m.next)].prev = m.prev;
    } else {
      l.tail = m.prev;
    }
    m.prev = invalid_block_id;
    m.next = invalid_block_id;
    --num_evictable_;
  }

  std::vector<block_meta> meta_; // [capacity]
  std::vector<block_id> free_;   // [capacity], free stack in [0, free_top_)
  std::int32_t free_top_ = 0;
  std::int32_t capacity_ = 0; // meta_.size(), kept apart so that a bounds check is one compare
  std::array<list, max_eviction_levels> lists_{}; // evictable blocks, one LRU list per level
  std::int32_t num_levels_ = 1;
  std::int32_t num_evictable_ = 0;
  std::int64_t num_evictions_ = 0;
  std::int64_t num_revivals_ = 0;
  eviction_callback on_evict_ = nullptr;
  void* evict_context_ = nullptr;
};

static_assert(block_allocator<block_pool>);

} // namespace kvkit
