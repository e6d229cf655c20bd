#pragma once
//! Non-owning views of exported page tables, passed by value to kernels.

#include <cstdint>
#include <type_traits>

#include "kvkit/block/types.hpp"
#include "kvkit/config.hpp"

namespace kvkit {

//! A batch's page table in CSR form (FlashInfer's paged KV layout). Sequence b owns pages
//! `indices[indptr[b] .. indptr[b+1])`; its last page holds `last_page_len[b]` tokens.
struct csr_page_table {
  const std::int32_t* indptr = nullptr;        // [batch_size + 1]
  const std::int32_t* indices = nullptr;       // [indptr[batch_size]]
  const std::int32_t* last_page_len = nullptr; // [batch_size], 1..page_size (0 if empty)
  std::int32_t batch_size = 0;
  std::int32_t page_size = 0;

  [[nodiscard]] KVKIT_HOST_DEVICE std::int32_t num_pages(std::int32_t b) const {
    return indptr[b + 1] - indptr[b];
  }
  [[nodiscard]] KVKIT_HOST_DEVICE std::int32_t num_tokens(std::int32_t b) const {
    const std::int32_t pages = num_pages(b);
    return pages == 0 ? 0 : (pages - 1) * page_size + last_page_len[b];
  }
  [[nodiscard]] KVKIT_HOST_DEVICE block_id page(std::int32_t b, std::int32_t i) const {
    return indices[indptr[b] + i];
  }
  //! The slot of token `t` (0-based) of sequence `b`.
  [[nodiscard]] KVKIT_HOST_DEVICE token_slot slot(std::int32_t b, std::int32_t t) const {
    return token_slot{page(b, t / page_size), t % page_size};
  }
};

//! A batch's page table in padded 2-D form (vLLM's `block_tables` + `seq_lens`). Row b of
//! `block_table` lists sequence b's blocks, then padding up to `max_blocks_per_seq`.
struct padded_page_table {
  const std::int32_t* block_table = nullptr; // [batch_size][max_blocks_per_seq]
  const std::int32_t* seq_lens = nullptr;    // [batch_size]
  std::int32_t batch_size = 0;
  std::int32_t max_blocks_per_seq = 0;
  std::int32_t page_size = 0;

  [[nodiscard]] KVKIT_HOST_DEVICE std::int32_t num_tokens(std::int32_t b) const {
    return seq_lens[b];
  }
  [[nodiscard]] KVKIT_HOST_DEVICE block_id page(std::int32_t b, std::int32_t i) const {
    return block_table[static_cast<std::int64_t>(b) * max_blocks_per_seq + i];
  }
  //! The slot of token `t` (0-based) of sequence `b`.
  [[nodiscard]] KVKIT_HOST_DEVICE token_slot slot(std::int32_t b, std::int32_t t) const {
    return token_slot{page(b, t / page_size), t % page_size};
  }
};

static_assert(std::is_trivially_copyable_v<csr_page_table>);
static_assert(std::is_trivially_copyable_v<padded_page_table>);

} // namespace kvkit
