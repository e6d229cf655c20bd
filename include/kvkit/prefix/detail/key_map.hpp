#pragma once
// Fixed-capacity open-addressing maps from hash-derived keys to block ids: linear probing with
// backward-shift deletion (no tombstones), sized once so lookups never rehash or allocate.
// Keys come from hashes, so a few of their bits already serve as a uniform slot index.

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "kvkit/block/types.hpp"
#include "kvkit/config.hpp"

namespace kvkit::detail {

// A full block's place in the cache: the tag of what comes before it (its parent block, or the
// root of its extra bytes) and a 64-bit hash of its tokens.
struct child_key {
  std::uint64_t tag = 0;
  std::uint64_t content = 0;
  friend constexpr bool operator==(const child_key&, const child_key&) = default;
};

// The tag of a parent alone (the sibling lists of the partial-block option).
struct tag_key {
  std::uint64_t tag = 0;
  friend constexpr bool operator==(const tag_key&, const tag_key&) = default;
};

[[nodiscard]] constexpr std::uint64_t slot_hash(const tag_key& k) noexcept {
  // A block's tag is (id << 32 | generation): the product's high half mixes both.
  return (k.tag * 0x9E3779B97F4A7C15ULL) >> 32;
}
// A parent tag with its block id in the low half (where a slot index looks) and its generation in
// the high half; a root's tag is uniform either way.
[[nodiscard]] constexpr std::uint64_t parent_bits(std::uint64_t tag) noexcept {
  return std::rotr(tag, 32);
}
[[nodiscard]] constexpr std::uint64_t slot_hash(const child_key& k) noexcept {
  // The content hash is uniform, but the same tokens under many parents (one prompt under many
  // adapters or salts) share it: the parent's id sends each to a slot of its own. The tag as it
  // is would not: its low bits are the parent's generation, 0 for most. A rotation, not the
  // multiply above: the walk's next lookup waits on it.
  return k.content ^ parent_bits(k.tag);
}

struct no_payload {};

// Key -> (block id, Payload). `Payload` rides along with the id so a lookup that needs both
// touches one slot.
template <class Key, class Payload = no_payload>
class basic_key_map {
public:
  struct slot {
    Key key{};
    block_id value = invalid_block_id; // invalid_block_id marks an empty slot
    [[no_unique_address]] Payload payload{};
  };

  // Room for `max_entries` keys at a load factor of at most 1/2.
  explicit basic_key_map(std::size_t max_entries)
      : slots_(std::bit_ceil(std::max<std::size_t>(16, 2 * max_entries))),
        mask_(slots_.size() - 1) {}

  // The slot holding `key`, or null.
  KVKIT_ALWAYS_INLINE const slot* lookup(const Key& key) const noexcept {
    for (std::size_t i = home(key);; i = (i + 1) & mask_) {
      const slot& s = slots_[i];
      if (s.value == invalid_block_id) {
        return nullptr;
      }
      if (s.key == key) {
        return &s;
      }
    }
  }

  [[nodiscard]] block_id find(const Key& key) const noexcept {
    const slot* s = lookup(key);
    return s == nullptr ? invalid_block_id : s->value;
  }

  // Inserts or overwrites. The caller keeps the entry count within max_entries.
  void assign(const Key& key, block_id value, const Payload& payload = {}) noexcept {
    std::size_t i = home(key);
    while (slots_[i].value != invalid_block_id && !(slots_[i].key == key)) {
      i = (i + 1) & mask_;
    }
    size_ += slots_[i].value == invalid_block_id ? 1U : 0U;
    slots_[i] = slot{key, value, payload};
  }

  // Inserts `key` unless it is present; returns the value it had (invalid_block_id if inserted).
  // The caller keeps the entry count within max_entries.
  block_id insert(const Key& key, block_id value, const Payload& payload = {}) noexcept {
    std::size_t i = home(key);
    for (; slots_[i].value != invalid_block_id; i = (i + 1) & mask_) {
      if (slots_[i].key == key) {
        return slots_[i].value;
      }
    }
    ++size_;
    slots_[i] = slot{key, value, payload};
    return invalid_block_id;
  }

  bool erase(const Key& key) noexcept { return erase_if(key, invalid_block_id); }

  // Erases `key` if it maps to `value` (any value when `value` is invalid_block_id).
  bool erase_if(const Key& key, block_id value) noexcept {
    std::size_t i = home(key);
    for (;; i = (i + 1) & mask_) {
      if (slots_[i].value == invalid_block_id) {
        return false;
      }
      if (slots_[i].key == key) {
        if (value != invalid_block_id && slots_[i].value != value) {
          return false;
        }
        break;
      }
    }
    // Shift later members of the probe run back so no lookup stops early at the hole.
    for (std::size_t j = (i + 1) & mask_; slots_[j].value != invalid_block_id;
         j = (j + 1) & mask_) {
      const std::size_t h = home(slots_[j].key);
      const bool stays = i <= j ? (i < h && h <= j) : (i < h || h <= j);
      if (!stays) {
        slots_[i] = slots_[j];
        i = j;
      }
    }
    slots_[i] = slot{};
    --size_;
    return true;
  }

  void clear() noexcept {
    for (slot& s : slots_) {
      s = slot{};
    }
    size_ = 0;
  }

  [[nodiscard]] std::size_t size() const noexcept { return size_; }

private:
  [[nodiscard]] std::size_t home(const Key& key) const noexcept {
    return static_cast<std::size_t>(slot_hash(key)) & mask_;
  }

  std::vector<slot> slots_;
  std::size_t mask_;
  std::size_t size_ = 0;
};

// (parent tag, content hash) of a full block -> the block and its generation.
using child_map = basic_key_map<child_key, std::uint32_t>;
// Parent tag -> the first entry of its sibling list.
using tag_map = basic_key_map<tag_key>;

} // namespace kvkit::detail
