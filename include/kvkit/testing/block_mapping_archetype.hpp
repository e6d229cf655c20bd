#pragma once
//! The smallest type that models `block_mapping`: instantiate generic code (a scheduler) with it
//! to prove the code asks nothing of a mapping beyond the concept.

#include <cstdint>
#include <span>

#include "kvkit/block/types.hpp"
#include "kvkit/concepts/block_mapping.hpp"
#include "kvkit/error.hpp"

namespace kvkit::testing {

//! Models `block_mapping` and nothing more. It holds no sequences: every lookup fails, so it is
//! fit for compile-time checks only.
class block_mapping_archetype {
public:
  explicit block_mapping_archetype(int /*tag*/) noexcept {}
  block_mapping_archetype(const block_mapping_archetype&) = delete;
  block_mapping_archetype& operator=(const block_mapping_archetype&) = delete;

  [[nodiscard]] std::int32_t block_size() const noexcept { return 1; }
  [[nodiscard]] bool contains(seq_id /*s*/) const noexcept { return false; }
  [[nodiscard]] result<std::int32_t> num_tokens(seq_id /*s*/) const noexcept {
    return errc::unknown_sequence;
  }
  [[nodiscard]] result<std::span<const block_id>> blocks(seq_id /*s*/) const noexcept {
    return errc::unknown_sequence;
  }
  [[nodiscard]] result<std::int32_t> blocks_needed(seq_id /*s*/,
                                                   std::int32_t /*n*/) const noexcept {
    return errc::unknown_sequence;
  }
  [[nodiscard]] status add_sequence(seq_id /*s*/) noexcept { return errc::out_of_blocks; }
  [[nodiscard]] status adopt_sequence(seq_id /*s*/, std::span<const block_id> /*blocks*/,
                                      std::int32_t /*num_tokens*/) noexcept {
    return errc::bad_argument;
  }
  [[nodiscard]] result<append_info> append_tokens(seq_id /*s*/, std::int32_t /*n*/,
                                                  std::span<token_slot> /*slots*/) noexcept {
    return errc::unknown_sequence;
  }
  [[nodiscard]] status truncate(seq_id /*s*/, std::int32_t /*n*/) noexcept {
    return errc::unknown_sequence;
  }
  [[nodiscard]] status fork(seq_id /*parent*/, seq_id /*child*/) noexcept {
    return errc::unknown_sequence;
  }
  [[nodiscard]] status free(seq_id /*s*/) noexcept { return errc::unknown_sequence; }
  void release_copy_sources() noexcept {}
  [[nodiscard]] status export_csr(std::span<const seq_id> /*batch*/,
                                  std::span<std::int32_t> /*indptr*/,
                                  std::span<std::int32_t> /*indices*/,
                                  std::span<std::int32_t> /*last_page_len*/) const noexcept {
    return errc::unknown_sequence;
  }
  [[nodiscard]] status export_block_table(std::span<const seq_id> /*batch*/,
                                          std::int32_t /*max_blocks_per_seq*/,
                                          std::span<std::int32_t> /*table*/,
                                          std::span<std::int32_t> /*seq_lens*/) const noexcept {
    return errc::unknown_sequence;
  }
  [[nodiscard]] status
  export_slot_mapping(std::span<const seq_id> /*batch*/,
                      std::span<const std::int32_t> /*query_lens*/,
                      std::span<std::int64_t> /*slot_mapping*/) const noexcept {
    return errc::unknown_sequence;
  }
};

static_assert(block_mapping<block_mapping_archetype>);

} // namespace kvkit::testing
