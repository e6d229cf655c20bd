#pragma once
// A fixed-capacity open-addressing map from block_key to block_id: linear probing with
// backward-shift deletion (no tombstones), sized once so lookups never rehash or allocate.
// Keys are hash outputs, so their low bits are already uniform and serve as the slot index.

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "kvkit/block/types.hpp"
#include "kvkit/concepts/block_hasher.hpp"

namespace kvkit::detail {

class key_map {
public:
  // Room for `max_entries` keys at a load factor of at most 1/2.
  explicit key_map(std::size_t max_entries)
      : slots_(std::bit_ceil(std::max<std::size_t>(16, 2 * max_entries))),
        mask_(slots_.size() - 1) {}

  [[nodiscard]] block_id find(const block_key& key) const noexcept {
    for (std::size_t i = home(key);; i = (i + 1) & mask_) {
      const slot& s = slots_[i];
      if (s.value == invalid_block_id) {
        return invalid_block_id;
      }
      if (s.key == key) {
        return s.value;
      }
    }
  }

  // Inserts or overwrites. The caller keeps the entry count within max_entries.
  void assign(const block_key& key, block_id value) noexcept {
    std::size_t i = home(key);
    while (slots_[i].value != invalid_block_id && !(slots_[i].key == key)) {
      i = (i + 1) & mask_;
    }
    size_ += slots_[i].value == invalid_block_id ? 1U : 0U;
    slots_[i] = slot{key, value};
  }

  bool erase(const block_key& key) noexcept {
    std::size_t i = home(key);
    for (;; i = (i + 1) & mask_) {
      if (slots_[i].value == invalid_block_id) {
        return false;
      }
      if (slots_[i].key == key) {
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
  struct slot {
    block_key key{};
    block_id value = invalid_block_id; // invalid_block_id marks an empty slot
  };

  [[nodiscard]] std::size_t home(const block_key& key) const noexcept {
    return static_cast<std::size_t>(key.lo) & mask_;
  }

  std::vector<slot> slots_;
  std::size_t mask_;
  std::size_t size_ = 0;
};

} // namespace kvkit::detail
