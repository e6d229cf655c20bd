#pragma once
//! The smallest type that models `prefix_index`: instantiate generic code (a scheduler) with it to
//! prove the code asks nothing of a prefix cache beyond the concept.

#include <cstddef>
#include <cstdint>
#include <span>

#include "kvkit/block/types.hpp"
#include "kvkit/concepts/prefix_index.hpp"
#include "kvkit/error.hpp"

namespace kvkit::testing {

//! Models `prefix_index` and nothing more. It caches nothing: every probe and match misses and
//! tracks nothing, so it is fit for compile-time checks and as a "no prefix caching" stand-in.
class prefix_index_archetype {
public:
  explicit prefix_index_archetype(std::int32_t block_size) noexcept : block_size_(block_size) {}
  prefix_index_archetype(const prefix_index_archetype&) = delete;
  prefix_index_archetype& operator=(const prefix_index_archetype&) = delete;

  [[nodiscard]] std::int32_t block_size() const noexcept { return block_size_; }
  [[nodiscard]] prefix_match probe(std::span<const token_id> /*tokens*/,
                                   std::span<const std::byte> /*extra*/) const noexcept {
    return {};
  }
  [[nodiscard]] result<prefix_match> match(seq_id /*s*/, std::span<const token_id> tokens,
                                           std::span<const std::byte> /*extra*/,
                                           std::span<block_id> /*out*/,
                                           const retention& /*r*/) noexcept {
    return tokens.empty() ? result<prefix_match>(errc::bad_argument) : prefix_match{};
  }
  [[nodiscard]] result<std::int32_t> publish(seq_id /*s*/, std::span<const block_id> /*blocks*/,
                                             std::span<const token_id> /*tokens*/) noexcept {
    return 0;
  }
  [[nodiscard]] status fork(seq_id /*parent*/, seq_id /*child*/) noexcept { return {}; }
  [[nodiscard]] status truncate(seq_id /*s*/, std::int32_t /*n*/) noexcept { return {}; }
  [[nodiscard]] status finish(seq_id /*s*/, std::span<const block_id> /*blocks*/,
                              std::span<const token_id> /*tokens*/) noexcept {
    return {};
  }
  [[nodiscard]] status forget(seq_id /*s*/) noexcept { return {}; }

private:
  std::int32_t block_size_;
};

static_assert(prefix_index<prefix_index_archetype>);

} // namespace kvkit::testing
