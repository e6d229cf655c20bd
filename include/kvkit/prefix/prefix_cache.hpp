#pragma once
//! prefix_cache: finds the longest already-computed prefix of a prompt among published KV blocks,
//! so a request that shares a prefix with earlier ones skips that part of its prefill.

#include <algorithm>
#include <cassert>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <unordered_map>
#include <utility>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "kvkit/block/block_pool.hpp"
#include "kvkit/block/types.hpp"
#include "kvkit/concepts/block_hasher.hpp"
#include "kvkit/concepts/block_mapping.hpp"
#include "kvkit/concepts/eviction_policy.hpp"
#include "kvkit/concepts/prefix_index.hpp"
#include "kvkit/error.hpp"
#include "kvkit/prefix/detail/key_map.hpp"
#include "kvkit/prefix/eviction.hpp"
#include "kvkit/prefix/xxh3_hasher.hpp"

namespace kvkit {

//! Options of a prefix_cache.
struct prefix_cache_options {
  //! Let a match end inside a block: a prompt that shares only part of a cached block (a system
  //! prompt that is not block-aligned) shares that block up to where the tokens differ, and the
  //! block table copies it on the first write. Finished sequences then also publish their partly
  //! filled last block.
  bool share_partial_blocks = false;
  //! Shortest partial share worth a page copy.
  std::int32_t min_partial_tokens = 1;
  //! Record block stored / removed events for `take_events` (for KV-aware routers). Evictions are
  //! recorded from the pool's `noexcept` eviction callback: should the event buffer need to grow
  //! there and the host be out of memory, `std::bad_alloc` ends the program instead of reaching
  //! the caller (the buffer keeps what it has grown to, so take events often enough).
  bool record_events = false;
};

//! Counters of a prefix_cache since construction.
struct prefix_cache_stats {
  std::int64_t queries = 0;        //!< match calls
  std::int64_t query_tokens = 0;   //!< prompt tokens of those calls
  std::int64_t hit_tokens = 0;     //!< prompt tokens served from cache
  std::int64_t hit_blocks = 0;     //!< blocks matched
  std::int64_t partial_hits = 0;   //!< matches whose last block was shared partly
  std::int64_t stored_blocks = 0;  //!< blocks published
  std::int64_t removed_blocks = 0; //!< published blocks dropped (evicted or cleared)

  //! Share of queried prompt tokens served from cache.
  [[nodiscard]] double hit_rate() const noexcept {
    return query_tokens == 0 ? 0.0
                             : static_cast<double>(hit_tokens) / static_cast<double>(query_tokens);
  }
};

//! What happened to the cache's contents, for engines that mirror it (KV-aware request routing).
struct cache_event {
  enum class kind : std::uint8_t { stored, removed, cleared };
  kind what = kind::stored;
  block_id block = invalid_block_id; //!< the block (invalid for `cleared`)
  block_key key{};                   //!< the block's key
  block_key parent{};                //!< the key of the prefix before it
  std::int32_t num_tokens = 0;       //!< tokens the entry covers (block_size unless partial)
};

namespace detail {
// What prefix_cache::for_each_entry calls: f(block, tokens, key).
template <class F>
concept entry_visitor = requires(F& f, block_id b, std::span<const token_id> tokens,
                                 const block_key& key) {
  f(b, tokens, key);
};
} // namespace detail

//! A request's admission: the prefix served from cache and the blocks added for the rest.
struct admission {
  prefix_match hit;
  append_info append;
};

//! Prefix cache over a block_pool.
//!
//! A full block's key chains its tokens onto the key of everything before it,
//! `key_i = H(key_{i-1}, tokens of block i)`, starting from a root key `H(0, -, extra bytes)`, so
//! equal keys mean equal prefixes under equal extra bytes (LoRA id, salt, multimodal hashes).
//! Blocks become matchable as they fill (`publish`, which computes their keys). Keys name blocks
//! (events); they do not find them: a match walks the prompt block by block, finding each block
//! among the children of the block matched before it (by that block's id and generation, or the
//! request's root key) by an XXH3-64 hash of its tokens, checks the tokens, and takes a reference
//! to each hit. So a hit is always a block with the prompt's tokens after exactly the blocks
//! matched before it, back to the request's root key: a collision of keys or of content hashes can
//! cost hits but cannot serve K/V computed after other tokens (extra bytes count only through the
//! root key, so the hasher must keep roots apart). The cache itself holds no references: a
//! published block whose last holder releases it stays in the pool as evictable, ordered by the
//! eviction policy, until the pool hands it out again and tells the cache to drop it (lazy
//! eviction). A match never covers the last prompt token: its logits must be computed.
//!
//! Sequences are tracked from `match` (or `admit`) to `finish` / `forget`, following the block
//! table's `fork` and `truncate`. The pool must outlive the cache; the cache installs itself as the
//! pool's eviction callback and must not move. One cache per pool: a cache made for a pool that
//! already has one, or another eviction callback, is not attached to it (`attached()` is false)
//! and finds nothing (`match` and
//! `admit` return bad_argument, `probe` an empty match), so it can never hand out a block whose
//! eviction it would not hear of. Not thread-safe. Failures change nothing.
template <block_hasher Hasher = xxh3_hasher, eviction_policy Policy = lru>
class prefix_cache {
public:
  //! A cache for `pool`, whose sequences use `block_size` tokens per block (must be > 0: checked
  //! by assert; without asserts a smaller one is taken as 1). The pool should have
  //! at least `policy.num_levels()` eviction levels (higher levels are clamped to its top level).
  prefix_cache(block_pool& pool, std::int32_t block_size, prefix_cache_options options = {},
               Hasher hasher = {}, Policy policy = {})
      : pool_(&pool), block_size_(std::max(block_size, 1)), options_(options),
        hasher_(std::move(hasher)), policy_(std::move(policy)),
        entries_(static_cast<std::size_t>(pool.capacity())),
        tokens_(static_cast<std::size_t>(pool.capacity()) * static_cast<std::size_t>(block_size_)),
        next_(static_cast<std::size_t>(pool.capacity())),
        children_(options.share_partial_blocks ? static_cast<std::size_t>(pool.capacity()) : 0) {
    assert(block_size > 0);
    // One cache per pool, and the pool's one callback: where another is installed (another
    // cache's, or the engine's own, with or without a context), this one stays detached.
    if (!pool.has_eviction_callback()) {
      pool_->set_eviction_callback(&prefix_cache::on_evict, this);
    }
    if (options_.record_events) {
      events_.reserve(static_cast<std::size_t>(pool.capacity()) * 2);
    }
  }

  prefix_cache(const prefix_cache&) = delete;
  prefix_cache& operator=(const prefix_cache&) = delete;
  prefix_cache(prefix_cache&&) = delete;
  prefix_cache& operator=(prefix_cache&&) = delete;

  //! Drops every entry (evictable blocks become free) and detaches from the pool.
  ~prefix_cache() {
    clear();
    if (attached()) {
      pool_->set_eviction_callback(nullptr, nullptr);
    }
  }

  //! Whether this cache is its pool's eviction callback (false where the pool had another cache,
  //! or an eviction callback of the engine's, when this one was made, or where something else has
  //! replaced it since): only then does it find and hand out blocks.
  [[nodiscard]] bool attached() const noexcept { return pool_->eviction_context() == this; }

  //! The pool whose blocks it publishes.
  [[nodiscard]] block_pool& pool() const noexcept { return *pool_; }
  [[nodiscard]] std::int32_t block_size() const noexcept { return block_size_; }
  [[nodiscard]] const prefix_cache_options& options() const noexcept { return options_; }
  [[nodiscard]] const prefix_cache_stats& stats() const noexcept { return stats_; }
  //! Published blocks (in use or evictable).
  [[nodiscard]] std::int32_t num_entries() const noexcept { return num_entries_; }
  [[nodiscard]] bool is_published(block_id b) const noexcept {
    return pool_->contains(b) && entries_[static_cast<std::size_t>(b)].len != 0;
  }
  [[nodiscard]] bool tracks(seq_id s) const noexcept { return seqs_.contains(s); }

  //! The most blocks a match of a prompt of `num_tokens` tokens can return: the size `out` needs.
  [[nodiscard]] std::int32_t max_match_blocks(std::int32_t num_tokens) const noexcept {
    return num_tokens <= 1 ? 0 : blocks_for_tokens(num_tokens - 1, block_size_);
  }

  //! What `match` would find for this prompt now, without taking references or counting a query
  //! (nothing where the cache is not attached).
  [[nodiscard]] prefix_match probe(std::span<const token_id> tokens,
                                   std::span<const std::byte> extra = {}) const {
    if (tokens.empty() || tokens.size() > static_cast<std::size_t>(max_tokens) || !attached()) {
      return {};
    }
    return walk<false>(tokens, hasher_(block_key{}, {}, extra), nullptr, nullptr);
  }

  //! Finds the longest cached prefix of prompt `tokens` (never its last token), writes its blocks
  //! to `out` taking one reference to each for the caller, and starts tracking sequence `s` with
  //! retention `r`. Pass the blocks to the block table's `adopt_sequence`. Errors: bad_argument
  //! (empty prompt, retention outside 0..100 or negative, the cache not attached),
  //! duplicate_sequence (s is tracked), buffer_too_small (`out` shorter than max_match_blocks).
  [[nodiscard]] result<prefix_match> match(seq_id s, std::span<const token_id> tokens,
                                           std::span<const std::byte> extra,
                                           std::span<block_id> out, const retention& r = {}) {
    const auto m = match_uncounted(s, tokens, extra, out, r);
    if (m) {
      count_match(static_cast<std::int32_t>(tokens.size()), *m);
    }
    return m;
  }

  //! Admits prompt `tokens` as sequence `s` of `table` (whose allocator must be this cache's pool):
  //! matches the cached prefix, adopts its blocks and appends the rest, writing the slots of the
  //! tokens to compute (`tokens.size() - hit.num_tokens` of them) into `slots` unless it is empty.
  //! All or nothing: errors are those of `match`, plus duplicate_sequence when `table` has `s`,
  //! bad_argument when the block sizes differ or `table` (where it names its allocator) takes its
  //! blocks from another pool, out_of_blocks, buffer_too_small. (A mapping that names no
  //! allocator is not checked against the pool first; where it then refuses the hit or the
  //! appended blocks, the hit blocks rejoin the eviction order as the most recently released.)
  template <block_mapping Mapping>
  [[nodiscard]] result<admission> admit(Mapping& table, seq_id s, std::span<const token_id> tokens,
                                        std::span<const std::byte> extra = {},
                                        const retention& r = {}, std::span<token_slot> slots = {}) {
    if (tokens.empty() || tokens.size() > static_cast<std::size_t>(max_tokens) || !valid(r) ||
        table.block_size() != block_size_ || !attached()) {
      return errc::bad_argument;
    }
    if constexpr (requires { table.allocator(); }) {
      if (static_cast<const void*>(&table.allocator()) != static_cast<const void*>(pool_)) {
        return errc::bad_argument;
      }
    }
    if (seqs_.contains(s) || table.contains(s)) {
      return errc::duplicate_sequence;
    }
    const auto len = static_cast<std::int32_t>(tokens.size());
    const prefix_match p = probe(tokens, extra);
    const std::int32_t rest = len - p.num_tokens;
    if (!slots.empty() && slots.size() < static_cast<std::size_t>(rest)) {
      return errc::buffer_too_small;
    }
    // A partly used last block is copied on the first write: one more block.
    const std::int32_t needed = blocks_for_tokens(len, block_size_) - p.num_blocks +
                                (p.num_tokens % block_size_ != 0 ? 1 : 0);
    if (needed > pool_->num_free() - p.num_evictable) {
      return errc::out_of_blocks;
    }
    scratch_.resize(static_cast<std::size_t>(max_match_blocks(len)));
    const auto m = match_uncounted(s, tokens, extra, scratch_, r);
    if (!m) {
      return m.error();
    }
    const std::span<const block_id> hit(scratch_.data(), static_cast<std::size_t>(m->num_blocks));
    if (const status adopted = table.adopt_sequence(s, hit, m->num_tokens); !adopted) {
      undo_match(s, hit);
      return adopted.error();
    }
    auto appended = table.append_tokens(s, rest, slots);
    if (!appended) {
      (void)table.free(s); // gives back the matched references
      (void)forget(s);
      return appended.error();
    }
    count_match(len, *m); // a query counts once it is admitted
    return admission{*m, *appended};
  }

  //! Makes the full blocks of tracked sequence `s` matchable. `blocks` are its blocks and `tokens`
  //! the tokens they hold, all computed (publish after verification, not while tokens are only
  //! speculative). Only blocks past those already published or matched are hashed. Returns how
  //! many blocks became new entries (a block whose prefix another block already holds is not).
  //! Errors: unknown_sequence, bad_argument (block and token counts disagree, too many tokens, or
  //! the first block ids are not those `s` matched or published: its table was truncated without
  //! `truncate` here, or the id is another sequence's that `forget` or `finish` did not end; a
  //! block handed back at the same place is not caught),
  //! invalid_block (a block not in use).
  [[nodiscard]] result<std::int32_t> publish(seq_id s, std::span<const block_id> blocks,
                                             std::span<const token_id> tokens) {
    const auto it = seqs_.find(s);
    if (it == seqs_.end()) {
      return errc::unknown_sequence;
    }
    if (const status st = check(it->second, blocks, tokens); !st) {
      return st.error();
    }
    return publish_full(it->second, blocks, tokens);
  }

  //! Tracks `child`, a fork of tracked sequence `parent` (after the block table's fork).
  [[nodiscard]] status fork(seq_id parent, seq_id child) {
    const auto it = seqs_.find(parent);
    if (it == seqs_.end()) {
      return errc::unknown_sequence;
    }
    if (seqs_.contains(child)) {
      return errc::duplicate_sequence;
    }
    sequence copy = it->second;
    seqs_.emplace(child, std::move(copy));
    return {};
  }

  //! Follows the block table's truncate of `s` to `num_tokens` tokens: blocks past it are no longer
  //! this sequence's to publish. Published entries stay valid (the table copies a published block
  //! before writing into it).
  [[nodiscard]] status truncate(seq_id s, std::int32_t num_tokens) {
    const auto it = seqs_.find(s);
    if (it == seqs_.end()) {
      return errc::unknown_sequence;
    }
    if (num_tokens < 0) {
      return errc::bad_argument;
    }
    sequence& q = it->second;
    q.chain.resize(std::min(q.chain.size(), static_cast<std::size_t>(num_tokens / block_size_)));
    if (q.stop >= q.chain.size()) {
      q.stop = std::numeric_limits<std::size_t>::max(); // rolled back before it: publish again
    }
    return {};
  }

  //! Publishes the rest of `s` (with share_partial_blocks, its partly filled last block too),
  //! raises the full blocks of its retained tokens to its retention's level where theirs is lower
  //! (blocks it matched were published at another request's level), and stops tracking it. Call
  //! before the block table frees it, and (as the table's `fork`) not in a step after the
  //! sequence's append: its last block may then be that step's copy-on-write destination, which a
  //! sequence admitted in the same step would copy before the copy into it has run. Errors as for
  //! `publish`.
  [[nodiscard]] status finish(seq_id s, std::span<const block_id> blocks,
                              std::span<const token_id> tokens) {
    const auto it = seqs_.find(s);
    if (it == seqs_.end()) {
      return errc::unknown_sequence;
    }
    if (const status st = check(it->second, blocks, tokens); !st) {
      return st;
    }
    sequence& q = it->second;
    const auto full = static_cast<std::int32_t>(tokens.size()) / block_size_;
    (void)publish_full(q, blocks, tokens);
    raise_kept_levels(q);
    const auto tail = static_cast<std::int32_t>(tokens.size()) % block_size_;
    if (options_.share_partial_blocks && tail != 0 && !collided(q) &&
        q.chain.size() == static_cast<std::size_t>(full)) {
      const block_key parent = full == 0 ? q.root : q.chain.back().key;
      const std::uint64_t tag = full == 0 ? root_tag(q.root) : q.chain.back().tag;
      const auto toks = tokens.subspan(static_cast<std::size_t>(full * block_size_));
      (void)store_partial(blocks.back(), hasher_(parent, toks, {}), parent, tag, toks,
                          level_of(q, full));
    }
    seqs_.erase(it);
    return {};
  }

  //! Stops tracking `s` without publishing anything more (an aborted request).
  [[nodiscard]] status forget(seq_id s) {
    return seqs_.erase(s) == 1 ? status{} : status{errc::unknown_sequence};
  }

  //! Reclaims up to `n` evictable blocks now, in eviction order, so they are free; returns how
  //! many. (The pool also does this by itself when it runs out of free blocks.) A detached cache
  //! reclaims nothing: the pool's evictable blocks are then another cache's.
  std::int32_t evict(std::int32_t n) {
    if (!attached()) {
      return 0;
    }
    std::int32_t done = 0;
    for (; done < n; ++done) {
      const block_id b = pool_->evictable_front();
      if (b == invalid_block_id) {
        break;
      }
      drop(b);
      [[maybe_unused]] const status freed = pool_->set_cached(b, false);
      assert(freed.ok());
    }
    return done;
  }

  //! Drops every entry: evictable blocks become free, blocks in use just stop being matchable.
  //! Tracked sequences with blocks matched or published publish nothing more (the entries they
  //! continue are gone, so what they published next could never be found) until they are
  //! truncated to no blocks.
  void clear() {
    for (auto& [id, q] : seqs_) {
      if (!q.chain.empty()) {
        q.stop = 0; // until it is truncated to no blocks: its root is all that still leads anywhere
      }
    }
    if (num_entries_ == 0) {
      return;
    }
    for (block_id b = 0; b < pool_->capacity(); ++b) {
      if (entries_[static_cast<std::size_t>(b)].len != 0) {
        remove_entry(b);
        [[maybe_unused]] const status unmarked = pool_->set_cached(b, false);
        assert(unmarked.ok());
      }
    }
    if (options_.record_events) {
      events_.push_back(cache_event{cache_event::kind::cleared, invalid_block_id, {}, {}, 0});
    }
  }

  //! Takes the events recorded since the last call (with `record_events` on). The cache keeps its
  //! buffer, and the room it has grown to, for the next events: recording, which evictions do from
  //! the pool's callback, allocates only when more events come between two calls than ever before.
  [[nodiscard]] std::vector<cache_event> take_events() {
    std::vector<cache_event> taken(events_.begin(), events_.end());
    events_.clear();
    return taken;
  }

  //! Calls `f(block, tokens, key)` for every entry: the tokens whose K/V the block must hold.
  template <detail::entry_visitor F>
  void for_each_entry(F&& f) const {
    for (block_id b = 0; b < pool_->capacity(); ++b) {
      const entry& e = entries_[static_cast<std::size_t>(b)];
      if (e.len != 0) {
        f(b, entry_tokens(b).first(static_cast<std::size_t>(e.len)), e.key);
      }
    }
  }

private:
  static constexpr std::int32_t max_tokens = std::numeric_limits<std::int32_t>::max();

  struct entry {
    block_key key{};
    block_key parent{};
    std::uint64_t parent_tag = 0; // tag of the parent it is indexed under
    std::uint64_t content = 0;    // hash of its tokens (full blocks)
    std::int32_t len = 0;         // tokens it covers; 0 when the block is not published
    block_id prev_sibling = invalid_block_id;
    block_id next_sibling = invalid_block_id;
    // Bumped when the entry goes, so its children's tags go stale (until it wraps, after 2^32
    // entries on one block).
    std::uint32_t gen = 0;
  };

  // A full block of a sequence's chain: its key and the tag of the entry that holds its place
  // (its own block's, or that of another block with the same prefix; 0 after a collision).
  struct link {
    block_key key{};
    std::uint64_t tag = 0;
    block_id block = invalid_block_id; // the sequence's block at this place
  };

  struct sequence {
    block_key root;
    std::vector<link> chain; // its first chain.size() (full) blocks
    retention keep;
    // The place in its chain from which it publishes nothing: the first block that found no
    // place in the index (another entry holds it: other tokens with the same content hash, another
    // root with the same root tag, or the block itself published elsewhere), or 0 after `clear`
    // (the entries its chain follows are gone). A truncation back before that place lifts it.
    std::size_t stop = std::numeric_limits<std::size_t>::max();
  };
  [[nodiscard]] static bool collided(const sequence& q) noexcept {
    return q.stop != std::numeric_limits<std::size_t>::max();
  }

  // Tags name what a block follows: a published block and its generation (top bit set), or the
  // root key of a request's extra bytes (top bit clear; a first block is also checked against
  // the whole root key). Unlike keys, a block's tag cannot be shared by another prefix.
  static constexpr std::uint64_t block_bit = std::uint64_t{1} << 63;
  static std::uint64_t root_tag(const block_key& root) noexcept { return root.lo & ~block_bit; }
  static std::uint64_t block_tag(block_id b, std::uint32_t gen) noexcept {
    return block_bit | (static_cast<std::uint64_t>(static_cast<std::uint32_t>(b)) << 32) | gen;
  }
  // The block a block tag names.
  static block_id tag_block(std::uint64_t tag) noexcept {
    return static_cast<block_id>((tag & ~block_bit) >> 32);
  }
  [[nodiscard]] std::uint64_t tag_of(block_id b) const noexcept {
    return block_tag(b, entries_[static_cast<std::size_t>(b)].gen);
  }

  static bool valid(const retention& r) noexcept {
    return r.priority >= 0 && r.priority <= 100 && r.num_tokens >= 0;
  }

  // The blocks and tokens `publish` and `finish` take for sequence `q`: as many blocks as the
  // tokens fill, each in use, and first the block ids it matched or published before (a table
  // truncated without the cache told, or a sequence freed and its id used again without
  // `forget`, would otherwise publish blocks under a prefix their K/V does not follow; a block
  // freed and handed back at the same place still passes).
  [[nodiscard]] status check(const sequence& q, std::span<const block_id> blocks,
                             std::span<const token_id> tokens) const {
    if (tokens.size() > static_cast<std::size_t>(max_tokens) ||
        blocks.size() != static_cast<std::size_t>(blocks_for_tokens(
                             static_cast<std::int32_t>(tokens.size()), block_size_))) {
      return errc::bad_argument;
    }
    const std::size_t known = std::min(q.chain.size(), blocks.size());
    for (std::size_t i = 0; i < known; ++i) {
      if (q.chain[i].block != blocks[i]) {
        return errc::bad_argument;
      }
    }
    for (const block_id b : blocks) {
      if (pool_->ref_count(b) <= 0) {
        return errc::invalid_block;
      }
    }
    return {};
  }

  [[nodiscard]] std::span<const token_id> entry_tokens(block_id b) const noexcept {
    return {tokens_.data() + static_cast<std::size_t>(b) * static_cast<std::size_t>(block_size_),
            static_cast<std::size_t>(block_size_)};
  }

  [[nodiscard]] std::int32_t level_of(const sequence& q, std::int32_t block_index) const {
    const bool kept = static_cast<std::int64_t>(block_index) * block_size_ < q.keep.num_tokens;
    const std::int32_t level =
        policy_.level(eviction_hint{block_index, kept ? q.keep.priority : 0});
    return std::clamp(level, 0, pool_->num_eviction_levels() - 1);
  }

  // Raises the eviction level of the entries that hold q's first q.keep.num_tokens tokens in full
  // blocks (those it matched, those it published, and those another sequence published first at
  // its places) to the level of q's retention where that is higher, while some sequence holds
  // them: q holds those it matched and published until the table frees it; an entry another
  // sequence published first and has since released keeps its level. Levels are never lowered.
  void raise_kept_levels(const sequence& q) {
    const auto kept =
        std::min(q.chain.size(),
                 static_cast<std::size_t>(blocks_for_tokens(q.keep.num_tokens, block_size_)));
    for (std::size_t i = 0; i < kept; ++i) {
      const std::uint64_t tag = q.chain[i].tag;
      if (tag == 0) {
        break; // a collided chain: no entry holds these places
      }
      const block_id b = tag_block(tag);
      const std::int32_t level = level_of(q, static_cast<std::int32_t>(i));
      if (tag_of(b) == tag && pool_->ref_count(b) > 0 && level > pool_->eviction_level(b)) {
        [[maybe_unused]] const status raised = pool_->set_cached(b, true, level);
        assert(raised.ok());
      }
    }
  }

  // A reference to published block `b` for a match's caller.
  void take(block_id b) const noexcept {
    [[maybe_unused]] const status held = pool_->retain(b);
    assert(held.ok()); // published blocks are in use or evictable
  }

  // The lookup shared by probe and match: full blocks by parent and content, then (option) the
  // best partial share.
  // With `Take` (match), the blocks found go to `out`, each with a reference taken for the caller,
  // and their keys to `keys`; without it (probe) both are null. The usual block sizes get a walk of
  // their own, in which the content hash's length dispatch and the token comparison fold to
  // fixed lengths.
  template <bool Take>
  prefix_match walk(std::span<const token_id> tokens, const block_key& root, block_id* out,
                    std::vector<link>* keys) const {
    switch (block_size_) {
    case 8:
      return walk_blocks<8, Take>(tokens, root, out, keys);
    case 16:
      return walk_blocks<16, Take>(tokens, root, out, keys);
    case 32:
      return walk_blocks<32, Take>(tokens, root, out, keys);
    case 64:
      return walk_blocks<64, Take>(tokens, root, out, keys);
    default:
      return walk_blocks<0, Take>(tokens, root, out, keys);
    }
  }

  // walk for blocks of `BlockSize` tokens, or of block_size_ when it is 0.
  template <std::size_t BlockSize, bool Take>
  prefix_match walk_blocks(std::span<const token_id> tokens, const block_key& root, block_id* out,
                           std::vector<link>* keys) const {
    prefix_match m;
    // A match counts the evictable blocks it took back by the pool's revivals, not block by block.
    [[maybe_unused]] const std::int64_t revived = pool_->num_revivals();
    const std::size_t bs = BlockSize != 0 ? BlockSize : static_cast<std::size_t>(block_size_);
    const auto limit = static_cast<std::int32_t>(tokens.size()) - 1; // keep the last token
    const std::int32_t max_full = limit / block_size_;
    // A block is found among the children of the block before it (by that block's tag) by the
    // hash of its tokens: the walk computes no chained key. A block's hash does not wait for
    // the lookup before it, so the processor overlaps the two.
    std::uint64_t tag = root_tag(root);
    std::int32_t i = 0;
    for (; i < max_full; ++i) {
      const token_id* blk = tokens.data() + static_cast<std::size_t>(i) * bs;
      const auto* s =
          next_.lookup(detail::child_key{tag, detail::content_hash<BlockSize>(blk, bs)});
      if (s == nullptr || !same_tokens<BlockSize>(s->value, blk, bs) ||
          (i == 0 && !follows_root(s->value, root))) {
        break;
      }
      tag = block_tag(s->value, s->payload);
      if constexpr (Take) {
        out[i] = s->value;
        take(s->value);
        keys->push_back(link{entries_[static_cast<std::size_t>(s->value)].key, tag, s->value});
      } else {
        m.num_evictable += pool_->ref_count(s->value) == 0 ? 1 : 0;
      }
    }
    m.num_blocks = i;
    m.num_tokens = i * block_size_;
    if (options_.share_partial_blocks && m.num_tokens < limit) {
      const std::int32_t room = std::min(block_size_, limit - m.num_tokens);
      const auto rest = tokens.subspan(static_cast<std::size_t>(m.num_tokens));
      block_id best = invalid_block_id;
      std::int32_t best_len = 0;
      const block_key& parent =
          i == 0 ? root : entries_[static_cast<std::size_t>(tag_block(tag))].key;
      for (block_id c = children_.find(detail::tag_key{tag}); c != invalid_block_id;
           c = entries_[static_cast<std::size_t>(c)].next_sibling) {
        if (!(entries_[static_cast<std::size_t>(c)].parent == parent)) {
          continue; // a root tag shared by two roots' lower 63 bits
        }
        const std::int32_t n = common_prefix(c, rest, room);
        if (n > best_len) {
          best_len = n;
          best = c;
        }
      }
      if (best != invalid_block_id && best_len >= options_.min_partial_tokens) {
        if constexpr (Take) {
          out[i] = best;
          take(best);
        } else {
          m.num_evictable += pool_->ref_count(best) == 0 ? 1 : 0;
        }
        ++m.num_blocks;
        m.num_tokens += best_len;
        m.partial_last = true;
      }
    }
    if constexpr (Take) {
      m.num_evictable = static_cast<std::int32_t>(pool_->num_revivals() - revived);
    }
    return m;
  }

  // Whether entry `b`, indexed under a root tag, follows this very root (not another root whose
  // tag is the same).
  [[nodiscard]] bool follows_root(block_id b, const block_key& root) const noexcept {
    return entries_[static_cast<std::size_t>(b)].parent == root;
  }

  // Whether entry `b` holds exactly the block of tokens at `blk`. `bs` is block_size_, passed in
  // (and `BlockSize`, when it is not 0) so that a walk for a fixed block size compares a fixed
  // length.
  template <std::size_t BlockSize = 0>
  [[nodiscard]] bool same_tokens(block_id b, const token_id* blk, std::size_t bs) const noexcept {
    const token_id* held = tokens_.data() + static_cast<std::size_t>(b) * bs;
#if defined(__SSE2__)
    if constexpr (BlockSize != 0 && BlockSize % 4 == 0) {
      // Four tokens a compare, one branch for the block (memcmp's inline form tests every 16
      // bytes).
      __m128i all = _mm_set1_epi32(-1);
      for (std::size_t i = 0; i < BlockSize; i += 4) {
        const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(held + i));
        const __m128i y = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + i));
        all = _mm_and_si128(all, _mm_cmpeq_epi32(x, y));
      }
      return _mm_movemask_epi8(all) == 0xFFFF;
    }
#endif
    return std::memcmp(held, blk, bs * sizeof(token_id)) == 0;
  }

  // Tokens at the start of `tokens` (at most `room`) that entry `b` holds too.
  [[nodiscard]] std::int32_t common_prefix(block_id b, std::span<const token_id> tokens,
                                           std::int32_t room) const noexcept {
    const auto held = entry_tokens(b);
    const std::int32_t n = std::min(room, entries_[static_cast<std::size_t>(b)].len);
    std::int32_t i = 0;
    while (i < n && held[static_cast<std::size_t>(i)] == tokens[static_cast<std::size_t>(i)]) {
      ++i;
    }
    return i;
  }

  std::int32_t publish_full(sequence& q, std::span<const block_id> blocks,
                            std::span<const token_id> tokens) {
    const auto bs = static_cast<std::size_t>(block_size_);
    const auto full = tokens.size() / bs;
    std::int32_t stored = 0;
    for (std::size_t i = q.chain.size(); i < full; ++i) {
      const block_key parent = i == 0 ? q.root : q.chain[i - 1].key;
      const std::uint64_t parent_tag = i == 0 ? root_tag(q.root) : q.chain[i - 1].tag;
      const auto blk = tokens.subspan(i * bs, bs);
      link l{hasher_(parent, blk, {}), 0, blocks[i]};
      if (!collided(q)) {
        const auto [at, added] = store_full(blocks[i], l.key, parent, parent_tag, blk,
                                            level_of(q, static_cast<std::int32_t>(i)),
                                            detail::content_hash(blk.data(), bs));
        // No entry holds this place (another block's tokens have the same content hash under
        // the same parent): later blocks have no tag to be found under.
        if (at == invalid_block_id) {
          q.stop = i;
        }
        l.tag = at == invalid_block_id ? 0 : tag_of(at);
        stored += added ? 1 : 0;
      }
      q.chain.push_back(l);
    }
    return stored;
  }

  struct placed {
    block_id at = invalid_block_id; // the entry that holds the place (invalid: none can)
    bool added = false;             // a new entry
  };

  // Publishes full block `b` (tokens `toks`, hash `content`) after the entry or root tagged
  // `parent_tag`, unless an entry holds that place already: the same tokens computed twice (that
  // entry serves) or, rarely, other tokens with the same content hash (none can).
  placed store_full(block_id b, const block_key& key, const block_key& parent,
                    std::uint64_t parent_tag, std::span<const token_id> toks, std::int32_t level,
                    std::uint64_t content) {
    const entry& e = entries_[static_cast<std::size_t>(b)];
    if (e.len != 0) {
      // Published already (a block is never written once published), normally at this place.
      const bool here = e.len == block_size_ && e.parent_tag == parent_tag &&
                        e.content == content && e.parent == parent;
      return {here ? b : invalid_block_id, false};
    }
    const block_id existing = next_.insert(detail::child_key{parent_tag, content}, b, e.gen);
    if (existing != invalid_block_id) {
      // The same prefix only if the parent keys agree too: two roots can share a root tag.
      const bool same = entries_[static_cast<std::size_t>(existing)].parent == parent &&
                        same_tokens(existing, toks.data(), toks.size());
      return {same ? existing : invalid_block_id, false};
    }
    record(b, key, parent, parent_tag, content, toks, level);
    return {b, true};
  }

  // Publishes the partly filled block `b` after the entry or root tagged `parent_tag`, unless it
  // is published already or an entry there already covers its tokens.
  bool store_partial(block_id b, const block_key& key, const block_key& parent,
                     std::uint64_t parent_tag, std::span<const token_id> toks, std::int32_t level) {
    const auto len = static_cast<std::int32_t>(toks.size());
    if (entries_[static_cast<std::size_t>(b)].len != 0) {
      return false; // a truncated sequence's head, which its full entry already covers
    }
    for (block_id c = children_.find(detail::tag_key{parent_tag}); c != invalid_block_id;
         c = entries_[static_cast<std::size_t>(c)].next_sibling) {
      if (entries_[static_cast<std::size_t>(c)].parent == parent &&
          common_prefix(c, toks, len) == len) {
        return false; // an entry already covers these tokens
      }
    }
    record(b, key, parent, parent_tag, 0, toks, level);
    return true;
  }

  // Makes `b` an entry (its full-block index slot, if any, is the caller's).
  void record(block_id b, const block_key& key, const block_key& parent, std::uint64_t parent_tag,
              std::uint64_t content, std::span<const token_id> toks, std::int32_t level) {
    entry& e = entries_[static_cast<std::size_t>(b)];
    const auto len = static_cast<std::int32_t>(toks.size());
    [[maybe_unused]] const status marked = pool_->set_cached(b, true, level);
    assert(marked.ok());
    e.key = key;
    e.parent = parent;
    e.parent_tag = parent_tag;
    e.content = content;
    e.len = len;
    std::copy(toks.begin(), toks.end(),
              tokens_.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(b) *
                                                            static_cast<std::size_t>(block_size_)));
    if (options_.share_partial_blocks) {
      const detail::tag_key siblings{parent_tag};
      const block_id head = children_.find(siblings);
      e.prev_sibling = invalid_block_id;
      e.next_sibling = head;
      if (head != invalid_block_id) {
        entries_[static_cast<std::size_t>(head)].prev_sibling = b;
      }
      children_.assign(siblings, b);
    }
    ++num_entries_;
    ++stats_.stored_blocks;
    if (options_.record_events) {
      events_.push_back(cache_event{cache_event::kind::stored, b, key, parent, len});
    }
  }

  // Removes block `b`'s entry from the indexes; the pool mark is the caller's business.
  void remove_entry(block_id b) {
    entry& e = entries_[static_cast<std::size_t>(b)];
    if (e.len == block_size_) {
      next_.erase_if(detail::child_key{e.parent_tag, e.content}, b);
    }
    if (options_.share_partial_blocks) {
      const detail::tag_key siblings{e.parent_tag};
      if (e.prev_sibling != invalid_block_id) {
        entries_[static_cast<std::size_t>(e.prev_sibling)].next_sibling = e.next_sibling;
      } else if (e.next_sibling != invalid_block_id) {
        children_.assign(siblings, e.next_sibling);
      } else {
        children_.erase(siblings);
      }
      if (e.next_sibling != invalid_block_id) {
        entries_[static_cast<std::size_t>(e.next_sibling)].prev_sibling = e.prev_sibling;
      }
    }
    e = entry{.gen = e.gen + 1};
    --num_entries_;
    ++stats_.removed_blocks;
  }

  void drop(block_id b) {
    const entry e = entries_[static_cast<std::size_t>(b)];
    if (e.len == 0) {
      return;
    }
    remove_entry(b);
    if (options_.record_events) {
      events_.push_back(cache_event{cache_event::kind::removed, b, e.key, e.parent, e.len});
    }
  }

  // `match` without counting the query in the statistics (admit counts it once admitted).
  [[nodiscard]] result<prefix_match> match_uncounted(seq_id s, std::span<const token_id> tokens,
                                                     std::span<const std::byte> extra,
                                                     std::span<block_id> out, const retention& r) {
    if (tokens.empty() || tokens.size() > static_cast<std::size_t>(max_tokens) || !valid(r) ||
        !attached()) {
      return errc::bad_argument;
    }
    if (seqs_.contains(s)) {
      return errc::duplicate_sequence;
    }
    const auto len = static_cast<std::int32_t>(tokens.size());
    if (out.size() < static_cast<std::size_t>(max_match_blocks(len))) {
      return errc::buffer_too_small;
    }
    sequence st{hasher_(block_key{}, {}, extra), {}, r};
    // The sequence will key every full block of its prompt when it publishes: room for all now.
    st.chain.reserve(static_cast<std::size_t>(len / block_size_));
    const prefix_match m = walk<true>(tokens, st.root, out.data(), &st.chain);
    seqs_.emplace(s, std::move(st));
    return m;
  }

  // Counts a query of `len` tokens that matched `m` in the statistics.
  void count_match(std::int32_t len, const prefix_match& m) noexcept {
    ++stats_.queries;
    stats_.query_tokens += len;
    stats_.hit_tokens += m.num_tokens;
    stats_.hit_blocks += m.num_blocks;
    stats_.partial_hits += m.partial_last ? 1 : 0;
  }

  // Gives back the references a match took and stops tracking (admission that failed late).
  void undo_match(seq_id s, std::span<const block_id> blocks) {
    for (auto it = blocks.rbegin(); it != blocks.rend(); ++it) {
      [[maybe_unused]] const status released = pool_->release(*it);
    }
    seqs_.erase(s);
  }

  static void on_evict(void* self, block_id b) noexcept {
    static_cast<prefix_cache*>(self)->drop(b);
  }

  block_pool* pool_;
  std::int32_t block_size_;
  prefix_cache_options options_;
  Hasher hasher_;
  Policy policy_;
  std::vector<entry> entries_;   // [capacity], by block id
  std::vector<token_id> tokens_; // [capacity][block_size], the tokens each entry covers
  detail::child_map next_;       // (parent tag, content hash) of a full block -> block, its gen
  detail::tag_map children_;     // parent tag -> first entry of its sibling list (partial option)
  std::unordered_map<seq_id, sequence> seqs_;
  std::vector<block_id> scratch_; // admit's match buffer
  std::vector<cache_event> events_;
  prefix_cache_stats stats_;
  std::int32_t num_entries_ = 0;
};

static_assert(prefix_index<prefix_cache<>>);

} // namespace kvkit
