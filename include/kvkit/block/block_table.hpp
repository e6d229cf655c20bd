#pragma once
//! block_table: per-sequence page tables (logical block -> physical block) over a block allocator,
//! with copy-on-write appends, truncation, forks and page-table export for kernels.

#include <algorithm>
#include <cassert>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <unordered_map>
#include <vector>

#include "kvkit/block/block_pool.hpp"
#include "kvkit/block/types.hpp"
#include "kvkit/concepts/block_allocator.hpp"
#include "kvkit/concepts/block_mapping.hpp"
#include "kvkit/error.hpp"

namespace kvkit {

//! The page tables of a set of sequences, each a list of blocks from a shared allocator.
//!
//! Each block a sequence lists is one reference in the allocator: `fork` shares blocks by adding
//! references, `truncate` and `free` drop them (tail first, so a cache that reclaims the least
//! recently released block first gives up the end of a chain before its head). Appending into a
//! partly filled block that another sequence also holds, or whose contents a prefix cache published
//! (when the allocator has `is_cached`, as block_pool does), moves this sequence onto a fresh block
//! and reports the `(src, dst)` copy the engine runs before the step writes its new K/V
//! (copy-on-write: the copy moves the whole page, so run after the write it would undo it). The
//! source and the destination each keep a reference until `release_copy_sources()`, so one step's
//! copies never overlap, even where a sequence is freed or truncated after its append in the same
//! step; those references are no holder's, so the last sequence left on a block writes into it
//! in place. Fork between steps: a copy ordered in the step that appended to the parent would move
//! the page without that append's tokens. A sequence freed or truncated during a step gives back
//! its blocks at once (all but the pending copies'), so the step's writes of its dropped tokens
//! must not run: the blocks may be another sequence's by then.
//!
//! The allocator must outlive the table; the table's destructor releases every block it holds.
//! Failed operations return an error code and change nothing. Not thread-safe.
template <block_allocator Allocator = block_pool>
class block_table {
public:
  //! A table over `allocator` with `block_size` tokens per block (must be > 0: checked by assert;
  //! without asserts a smaller one is taken as 1).
  block_table(Allocator& allocator, std::int32_t block_size) noexcept
      : allocator_(&allocator), block_size_(block_size > 0 ? block_size : 1) {
    assert(block_size > 0);
  }

  block_table(const block_table&) = delete;
  block_table& operator=(const block_table&) = delete;
  block_table(block_table&& other) noexcept
      : allocator_(other.allocator_), block_size_(other.block_size_),
        index_(std::move(other.index_)), seqs_(std::move(other.seqs_)),
        spare_(std::move(other.spare_)), copy_sources_(std::move(other.copy_sources_)),
        copy_destinations_(std::move(other.copy_destinations_)) {
    other.index_.clear();
    other.copy_sources_.clear();
    other.copy_destinations_.clear();
  }
  block_table& operator=(block_table&&) = delete;
  ~block_table() {
    for (const auto& [id, slot] : index_) {
      release_tail(seqs_[slot], 0);
    }
    release_copy_sources();
  }

  [[nodiscard]] std::int32_t block_size() const noexcept { return block_size_; }
  [[nodiscard]] Allocator& allocator() const noexcept { return *allocator_; }
  [[nodiscard]] bool contains(seq_id s) const noexcept { return index_.contains(s); }
  [[nodiscard]] std::size_t num_sequences() const noexcept { return index_.size(); }

  [[nodiscard]] result<std::int32_t> num_tokens(seq_id s) const noexcept {
    const sequence* q = find(s);
    if (q == nullptr) {
      return errc::unknown_sequence;
    }
    return q->num_tokens;
  }

  [[nodiscard]] result<std::span<const block_id>> blocks(seq_id s) const noexcept {
    const sequence* q = find(s);
    if (q == nullptr) {
      return errc::unknown_sequence;
    }
    return std::span<const block_id>(q->blocks);
  }

  //! Blocks `append_tokens(s, n, ...)` would allocate now, the copy-on-write block included.
  [[nodiscard]] result<std::int32_t> blocks_needed(seq_id s, std::int32_t n) const noexcept {
    const sequence* q = find(s);
    if (q == nullptr) {
      return errc::unknown_sequence;
    }
    if (n < 0) {
      return errc::bad_argument;
    }
    if (n > std::numeric_limits<std::int32_t>::max() - q->num_tokens) {
      return errc::out_of_range;
    }
    return growth(*q, n).total();
  }

  //! Adds an empty sequence named `s`.
  [[nodiscard]] status add_sequence(seq_id s) {
    if (contains(s)) {
      return errc::duplicate_sequence;
    }
    index_.emplace(s, take_record());
    return {};
  }

  //! Adds sequence `s` made of `blocks` holding `num_tokens` tokens, taking over one reference
  //! to each block that the caller already holds (a prefix-cache match retains them). The last
  //! block may be partly filled and shared: the first append copies it. Errors (the caller keeps
  //! its references): duplicate_sequence; bad_argument when `num_tokens` < 0, `blocks` is not
  //! exactly the blocks that many tokens fill, or names a block twice (two places of a sequence
  //! are two pages); invalid_block for a block not in use.
  [[nodiscard]] status adopt_sequence(seq_id s, std::span<const block_id> blocks,
                                      std::int32_t num_tokens) {
    if (contains(s)) {
      return errc::duplicate_sequence;
    }
    if (num_tokens < 0 ||
        blocks.size() != static_cast<std::size_t>(blocks_for_tokens(num_tokens, block_size_))) {
      return errc::bad_argument;
    }
    for (const block_id b : blocks) {
      if (allocator_->ref_count(b) <= 0) {
        return errc::invalid_block;
      }
    }
    if (blocks.size() > 1) {
      std::vector<block_id> sorted(blocks.begin(), blocks.end());
      std::ranges::sort(sorted);
      if (std::ranges::adjacent_find(sorted) != sorted.end()) {
        return errc::bad_argument;
      }
    }
    const std::size_t slot = take_record();
    seqs_[slot].blocks.assign(blocks.begin(), blocks.end());
    seqs_[slot].num_tokens = num_tokens;
    index_.emplace(s, slot);
    return {};
  }

  //! Grows sequence `s` by `n` tokens and writes their slots into `slots` unless it is empty
  //! (then it must hold at least `n`). Errors: unknown_sequence, bad_argument (n < 0),
  //! buffer_too_small, out_of_range (length past INT32_MAX), out_of_blocks.
  [[nodiscard]] result<append_info> append_tokens(seq_id s, std::int32_t n,
                                                  std::span<token_slot> slots) {
    sequence* q = find(s);
    if (q == nullptr) {
      return errc::unknown_sequence;
    }
    if (n < 0) {
      return errc::bad_argument;
    }
    if (!slots.empty() && slots.size() < static_cast<std::size_t>(n)) {
      return errc::buffer_too_small;
    }
    if (n > std::numeric_limits<std::int32_t>::max() - q->num_tokens) {
      return errc::out_of_range;
    }
    const plan g = growth(*q, n);
    append_info info;
    info.num_new_blocks = g.total();
    if (g.total() > allocator_->num_free()) {
      return errc::out_of_blocks; // before the block list grows for blocks that cannot come
    }
    if (g.total() > 0) {
      const std::size_t old_size = q->blocks.size();
      q->blocks.resize(old_size + static_cast<std::size_t>(g.total()));
      const status st = allocator_->allocate(
          std::span<block_id>(q->blocks.data() + old_size, static_cast<std::size_t>(g.total())));
      if (!st) {
        q->blocks.resize(old_size);
        return st.error();
      }
      if (g.copy_on_write) {
        // The fresh block taken last replaces the shared last block; the other holders keep it.
        const block_id dst = q->blocks.back();
        q->blocks.pop_back();
        block_id& last = q->blocks[old_size - 1];
        info.copied = true;
        info.copy = block_copy{last, dst};
        // The sequence's reference to the source is kept until the copy has run: released now,
        // the source could be handed out as the destination of another copy of the same step.
        // The destination gets one more for as long, so that freeing or truncating the sequence
        // later in the step cannot hand it out as the destination of another of its copies.
        [[maybe_unused]] const status held = allocator_->retain(dst); // a fresh block: 1 -> 2
        assert(held.ok());
        copy_sources_.push_back(last);
        copy_destinations_.push_back(dst);
        last = dst;
      }
    }
    const std::int32_t first = q->num_tokens;
    q->num_tokens += n;
    if (!slots.empty()) {
      for (std::int32_t i = 0; i < n; ++i) {
        const std::int32_t t = first + i;
        slots[static_cast<std::size_t>(i)] =
            token_slot{q->blocks[static_cast<std::size_t>(t / block_size_)], t % block_size_};
      }
    }
    return info;
  }

  //! Shortens sequence `s` to `new_len` tokens and releases the blocks past the end, last first.
  //! Errors: unknown_sequence, bad_argument (new_len < 0), out_of_range (new_len > length).
  [[nodiscard]] status truncate(seq_id s, std::int32_t new_len) noexcept {
    sequence* q = find(s);
    if (q == nullptr) {
      return errc::unknown_sequence;
    }
    if (new_len < 0) {
      return errc::bad_argument;
    }
    if (new_len > q->num_tokens) {
      return errc::out_of_range;
    }
    release_tail(*q, blocks_for_tokens(new_len, block_size_));
    q->num_tokens = new_len;
    return {};
  }

  //! Makes `child` a new sequence that shares every block of `parent` (one more reference each,
  //! no data copied). Errors: unknown_sequence (parent), duplicate_sequence (child exists),
  //! out_of_range (a block's reference count is at its maximum).
  [[nodiscard]] status fork(seq_id parent, seq_id child) {
    if (!contains(parent)) {
      return errc::unknown_sequence;
    }
    if (contains(child)) {
      return errc::duplicate_sequence;
    }
    const std::size_t slot = take_record();
    // take_record may grow seqs_, so look the parent up afterwards.
    const sequence& p = seqs_[index_.find(parent)->second];
    sequence& c = seqs_[slot];
    for (std::size_t i = 0; i < p.blocks.size(); ++i) {
      const status st = allocator_->retain(p.blocks[i]);
      if (!st) {
        for (std::size_t j = i; j-- > 0;) {
          [[maybe_unused]] const status undone = allocator_->release(p.blocks[j]);
        }
        spare_.push_back(slot);
        return st;
      }
    }
    c.blocks.assign(p.blocks.begin(), p.blocks.end());
    c.num_tokens = p.num_tokens;
    index_.emplace(child, slot);
    return {};
  }

  //! Releases every block of sequence `s` (last first) and forgets `s`.
  [[nodiscard]] status free(seq_id s) noexcept {
    const auto it = index_.find(s);
    if (it == index_.end()) {
      return errc::unknown_sequence;
    }
    const std::size_t slot = it->second;
    release_tail(seqs_[slot], 0);
    seqs_[slot].num_tokens = 0;
    index_.erase(it);
    spare_.push_back(slot);
    return {};
  }

  //! Releases the sources and destinations of the copy-on-write orders returned since the last
  //! call (the name, the block_mapping concept's, is older than the destinations' references).
  //! Call it once the engine has run those copies, or queued them on the stream where every
  //! later write of those blocks is queued too (once per step, after the copy kernel); until then
  //! each source and each destination keeps one reference, so no block is both read and written,
  //! or written twice, by one step's copies.
  void release_copy_sources() noexcept {
    for (const std::vector<block_id>* pending : {&copy_sources_, &copy_destinations_}) {
      for (const block_id b : *pending) {
        [[maybe_unused]] const status released = allocator_->release(b);
        assert(released.ok());
      }
    }
    copy_sources_.clear();
    copy_destinations_.clear();
  }
  //! Copy-on-write sources still waiting for `release_copy_sources`.
  [[nodiscard]] std::span<const block_id> pending_copy_sources() const noexcept {
    return copy_sources_;
  }
  //! Copy-on-write destinations still waiting for `release_copy_sources` (in the order of
  //! pending_copy_sources: the i-th copy moved source i to destination i).
  [[nodiscard]] std::span<const block_id> pending_copy_destinations() const noexcept {
    return copy_destinations_;
  }

  //! Number of page ids `export_csr` writes for `batch` (the size `indices` needs).
  [[nodiscard]] result<std::int32_t> csr_size(std::span<const seq_id> batch) const noexcept {
    std::int64_t total = 0;
    for (const seq_id s : batch) {
      const sequence* q = find(s);
      if (q == nullptr) {
        return errc::unknown_sequence;
      }
      total += static_cast<std::int64_t>(q->blocks.size());
    }
    if (total > std::numeric_limits<std::int32_t>::max()) {
      return errc::out_of_range;
    }
    return static_cast<std::int32_t>(total);
  }

  //! Writes the batch's page table in CSR form: `indptr[batch.size()+1]`, `indices[csr_size]`,
  //! `last_page_len[batch.size()]` (0 for an empty sequence). No allocation. Errors:
  //! unknown_sequence, buffer_too_small, out_of_range (more than INT32_MAX pages).
  [[nodiscard]] status export_csr(std::span<const seq_id> batch, std::span<std::int32_t> indptr,
                                  std::span<std::int32_t> indices,
                                  std::span<std::int32_t> last_page_len) const noexcept {
    if (indptr.size() < batch.size() + 1 || last_page_len.size() < batch.size()) {
      return errc::buffer_too_small;
    }
    std::size_t offset = 0;
    indptr[0] = 0;
    for (std::size_t b = 0; b < batch.size(); ++b) {
      const sequence* q = find(batch[b]);
      if (q == nullptr) {
        return errc::unknown_sequence;
      }
      const std::size_t n = q->blocks.size();
      if (n > indices.size() - offset) {
        return errc::buffer_too_small;
      }
      if (offset + n > static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max())) {
        return errc::out_of_range;
      }
      copy_ids(q->blocks, indices.data() + offset);
      offset += n;
      indptr[b + 1] = static_cast<std::int32_t>(offset);
      last_page_len[b] = last_block_len(q->num_tokens, block_size_);
    }
    return {};
  }

  //! Writes the batch's page table in padded 2-D form: row b of `table` (row length
  //! `max_blocks_per_seq`) lists sequence b's blocks, then `pad`; `seq_lens[b]` its length.
  //! Errors: unknown_sequence, bad_argument (max_blocks_per_seq < 0), buffer_too_small (a
  //! buffer, or a sequence with more than max_blocks_per_seq blocks).
  [[nodiscard]] status export_block_table(std::span<const seq_id> batch,
                                          std::int32_t max_blocks_per_seq,
                                          std::span<std::int32_t> table,
                                          std::span<std::int32_t> seq_lens,
                                          std::int32_t pad = 0) const noexcept {
    if (max_blocks_per_seq < 0) {
      return errc::bad_argument;
    }
    const auto row = static_cast<std::size_t>(max_blocks_per_seq);
    if ((row != 0 && table.size() / row < batch.size()) || seq_lens.size() < batch.size()) {
      return errc::buffer_too_small;
    }
    for (std::size_t b = 0; b < batch.size(); ++b) {
      const sequence* q = find(batch[b]);
      if (q == nullptr) {
        return errc::unknown_sequence;
      }
      const std::size_t n = q->blocks.size();
      if (n > row) {
        return errc::buffer_too_small;
      }
      std::int32_t* out = table.data() + b * row;
      copy_ids(q->blocks, out);
      for (std::size_t i = n; i < row; ++i) {
        out[i] = pad;
      }
      seq_lens[b] = q->num_tokens;
    }
    return {};
  }

  //! Writes, for each sequence b of the batch, the flat slots (`block * block_size + offset`) of
  //! its last `query_lens[b]` tokens, concatenated (vLLM's `slot_mapping`). Errors:
  //! unknown_sequence, bad_argument (negative length or query_lens shorter than the batch),
  //! out_of_range (more than the sequence holds), buffer_too_small.
  [[nodiscard]] status export_slot_mapping(std::span<const seq_id> batch,
                                           std::span<const std::int32_t> query_lens,
                                           std::span<std::int64_t> slot_mapping) const noexcept {
    if (query_lens.size() < batch.size()) {
      return errc::bad_argument;
    }
    std::size_t offset = 0;
    for (std::size_t b = 0; b < batch.size(); ++b) {
      const sequence* q = find(batch[b]);
      if (q == nullptr) {
        return errc::unknown_sequence;
      }
      const std::int32_t count = query_lens[b];
      if (count < 0) {
        return errc::bad_argument;
      }
      if (count > q->num_tokens) {
        return errc::out_of_range;
      }
      if (static_cast<std::size_t>(count) > slot_mapping.size() - offset) {
        return errc::buffer_too_small;
      }
      for (std::int32_t t = q->num_tokens - count; t < q->num_tokens; ++t) {
        const block_id blk = q->blocks[static_cast<std::size_t>(t / block_size_)];
        slot_mapping[offset++] = token_slot{blk, t % block_size_}.flat(block_size_);
      }
    }
    return {};
  }

private:
  struct sequence {
    std::vector<block_id> blocks;
    std::int32_t num_tokens = 0;
  };

  // How an append of some tokens grows a sequence.
  struct plan {
    std::int32_t new_blocks = 0;
    bool copy_on_write = false;
    [[nodiscard]] std::int32_t total() const noexcept {
      return new_blocks + (copy_on_write ? 1 : 0);
    }
  };

  [[nodiscard]] plan growth(const sequence& q, std::int32_t n) const noexcept {
    plan g;
    g.new_blocks = blocks_for_tokens(q.num_tokens + n, block_size_) -
                   static_cast<std::int32_t>(q.blocks.size());
    // Only the partly filled last block is ever written into. It is copied first when another
    // sequence holds it too, or when a prefix cache published its contents (which must stay).
    g.copy_on_write = n > 0 && q.num_tokens % block_size_ != 0 && !writable(q.blocks.back());
    return g;
  }

  // A block takes writes in place when the appending sequence is its only holder. The references
  // this table keeps for the step's pending copies are not holders: the sources' sequences have
  // moved off them, and the copies run before the step's writes, so the last sequence left on a
  // forked block writes into it instead of copying it again; a destination's extra reference only
  // keeps it from being handed out again before its copy has run.
  [[nodiscard]] bool writable(block_id b) const noexcept {
    if constexpr (requires(const Allocator& a) {
                    { a.is_cached(b) } -> std::convertible_to<bool>;
                  }) {
      if (allocator_->is_cached(b)) {
        return false;
      }
    }
    const std::int32_t refs = allocator_->ref_count(b);
    if (refs == 1) {
      return true;
    }
    const auto pending = std::count(copy_sources_.begin(), copy_sources_.end(), b) +
                         std::count(copy_destinations_.begin(), copy_destinations_.end(), b);
    return refs - static_cast<std::int32_t>(pending) == 1;
  }

  [[nodiscard]] const sequence* find(seq_id s) const noexcept {
    const auto it = index_.find(s);
    return it == index_.end() ? nullptr : &seqs_[it->second];
  }
  [[nodiscard]] sequence* find(seq_id s) noexcept {
    const auto it = index_.find(s);
    return it == index_.end() ? nullptr : &seqs_[it->second];
  }

  // A cleared record, reusing a freed one (and its block vector's capacity) when there is one.
  [[nodiscard]] std::size_t take_record() {
    if (!spare_.empty()) {
      const std::size_t slot = spare_.back();
      spare_.pop_back();
      return slot;
    }
    seqs_.emplace_back();
    return seqs_.size() - 1;
  }

  void release_tail(sequence& q, std::int32_t keep) noexcept {
    while (static_cast<std::int32_t>(q.blocks.size()) > keep) {
      [[maybe_unused]] const status st = allocator_->release(q.blocks.back());
      assert(st.ok());
      q.blocks.pop_back();
    }
  }

  static void copy_ids(const std::vector<block_id>& ids, std::int32_t* out) noexcept {
    static_assert(sizeof(block_id) == sizeof(std::int32_t));
    if (!ids.empty()) {
      std::memcpy(out, ids.data(), ids.size() * sizeof(block_id));
    }
  }

  Allocator* allocator_;
  std::int32_t block_size_;
  std::unordered_map<seq_id, std::size_t> index_; // sequence id -> record in seqs_
  std::vector<sequence> seqs_;                    // records, reused through spare_
  std::vector<std::size_t> spare_;                // free records
  std::vector<block_id> copy_sources_;            // copy-on-write sources not yet released
  std::vector<block_id> copy_destinations_;       // and their destinations, in the same order
};

static_assert(block_mapping<block_table<block_pool>>);

} // namespace kvkit
