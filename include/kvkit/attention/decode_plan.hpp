#pragma once
//! The host-side plan of the paged decode kernel: how each sequence's keys are split over thread
//! blocks (split-KV), and the workspace that the split path needs. Plain C++: an engine plans on
//! the host, in the same place it builds its page tables, and passes the plan to the launcher.
//!
//! ```
//! auto plan = kvkit::plan_decode(shape, host_seq_lens, sm_count);          // lengths known
//! auto plan = kvkit::plan_decode_graph_safe(shape, max_seq_len, sm_count); // CUDA graph replay
//! std::size_t bytes = plan->workspace_bytes();   // cudaMalloc once; reuse across plans
//! ```

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>

#include "kvkit/concepts/kv_codec.hpp"
#include "kvkit/concepts/page_layout.hpp"
#include "kvkit/config.hpp"
#include "kvkit/error.hpp"
#include "kvkit/layout/page_layout.hpp"

namespace kvkit {

//! The shape of a decode batch: every sequence has one query token.
struct decode_shape {
  std::int32_t batch_size = 0;   //!< sequences (the most a graph-safe plan serves)
  std::int32_t num_q_heads = 0;  //!< query heads, a multiple of num_kv_heads
  std::int32_t num_kv_heads = 0; //!< KV heads; num_q_heads / num_kv_heads is the group, 1..16
  std::int32_t head_dim = 0;     //!< 64, 128 or 256
  std::int32_t window = 0;       //!< sliding window of the attention (0: none); shortens splits
  //! Bits per cached element of the narrower of the K and V codecs: 16 (fp16, bf16), 8 (fp8,
  //! int8) or 4 (int4). A quantized cache keeps more thread blocks resident, so it is split finer.
  std::int32_t kv_bits = 16;
  //! Whether K and V have one width and at least one carries a scale per token: int8, int4
  //! groups, int8 K with fp8 V (not int8 K with bf16 V, nor int4 K with int8 V). Such a cache has
  //! a decode kernel that takes two tiles a warp step, which the plan may choose for it
  //! (decode_plan::two_tiles).
  bool kv_scaled_one_width = false;
  //! Tokens per page of the cache (0: not given). With pages of 16 tokens or more, an 8-bit cache
  //! may keep its sequences whole where it would otherwise be split for four resident blocks
  //! (plan_decode); with smaller pages, or none given, it is split.
  std::int32_t page_size = 0;
  //! Element order of the cache's pages (decode_shape_for fills it in). It only steers the choice
  //! of kernel for int8 and int4 caches: which of two chunks decides decode_plan::two_tiles (an
  //! int4 cache in HND pages keeps the one-tile kernel where NHD pages take the two-tile one with
  //! 2048 keys a block), and whether long blocks of an int4 cache take four KV heads
  //! (decode_plan::heads_per_block, NHD pages only). A plan made for either order decodes a cache
  //! of the other correctly.
  kv_order order = kv_order::nhd;

  [[nodiscard]] constexpr std::int32_t group_size() const {
    return num_kv_heads > 0 ? num_q_heads / num_kv_heads : 0;
  }
  //! The most sequences, and the most KV heads, a decode launch takes (a grid's rows each).
  static constexpr std::int32_t max_rows = static_cast<std::int32_t>(detail::max_grid_rows);

  //! bad_argument unless the batch is positive, batch and KV heads are at most max_rows, the
  //! group size is 1..16 and divides evenly, head_dim is 64, 128 or 256, kv_bits is 4, 8 or 16,
  //! kv_scaled_one_width is false where kv_bits is 16, and page_size is not negative.
  [[nodiscard]] constexpr status validate() const noexcept {
    if (batch_size <= 0 || num_kv_heads <= 0 || num_q_heads <= 0 || batch_size > max_rows ||
        num_kv_heads > max_rows || num_q_heads % num_kv_heads != 0 || group_size() > 16 ||
        window < 0 || page_size < 0 || (head_dim != 64 && head_dim != 128 && head_dim != 256) ||
        (kv_bits != 4 && kv_bits != 8 && kv_bits != 16) || (kv_bits == 16 && kv_scaled_one_width)) {
      return errc::bad_argument;
    }
    return {};
  }
};

//! decode_shape::kv_bits of a cache of this layout: the narrower of its K and V codecs' bits.
template <page_layout Layout>
inline constexpr std::int32_t decode_kv_bits =
    Layout::k_codec::bits < Layout::v_codec::bits ? Layout::k_codec::bits : Layout::v_codec::bits;

//! decode_shape::kv_scaled_one_width of a cache of this layout: K and V of one width, at least one
//! scaled per token.
template <page_layout Layout>
inline constexpr bool
    decode_kv_scaled_one_width = Layout::k_codec::bits == Layout::v_codec::bits &&
                                 (Layout::k_codec::scaling == kv_scaling::per_token_head ||
                                  Layout::k_codec::scaling == kv_scaling::per_token_group ||
                                  Layout::v_codec::scaling == kv_scaling::per_token_head ||
                                  Layout::v_codec::scaling == kv_scaling::per_token_group);

//! The decode_shape of a batch of `batch_size` sequences with `num_q_heads` query heads over a
//! cache of `layout` (its KV heads, head dim, kv_bits, kv_scaled_one_width, page size and element
//! order), attending within `window` (0: no window).
template <page_layout Layout>
[[nodiscard]] constexpr decode_shape decode_shape_for(const Layout& layout, std::int32_t batch_size,
                                                      std::int32_t num_q_heads,
                                                      std::int32_t window = 0) {
  decode_shape shape{batch_size,
                     num_q_heads,
                     layout.num_kv_heads(),
                     layout.head_dim(),
                     window,
                     decode_kv_bits<Layout>,
                     decode_kv_scaled_one_width<Layout>,
                     layout.page_size()};
  shape.order = Layout::order;
  return shape;
}

//! Thread blocks of the decode kernel resident on one multiprocessor for a cache of `kv_bits`
//! bits, `head_dim` channels and query groups of `group` heads. Four for a quantized cache with
//! head_dim up to 128 and groups up to 8: its tiles are bound by the latency of their
//! dequantization more than by bandwidth, so it runs twice the warps, each with a shallower copy
//! pipeline (measured on the H200: fp8 at B=128, L=32768 2.32 ms with two blocks, 2.03 ms with
//! four). One for a 16-bit cache at head_dim 256, whose two pipeline stages of 16 KB a warp would
//! take 128 KB a block (more than half of a multiprocessor's shared memory; the one block keeps
//! three). Two otherwise.
[[nodiscard]] constexpr std::int32_t
decode_blocks_per_sm(std::int32_t kv_bits, std::int32_t head_dim, std::int32_t group) {
  if (kv_bits == 16 && head_dim > 128) {
    return 1;
  }
  return kv_bits < 16 && head_dim <= 128 && group <= 8 ? 4 : 2;
}

//! How a decode launch splits its keys: thread block (split s, KV head h, sequence b) covers keys
//! [s * chunk_tokens, (s + 1) * chunk_tokens) of the sequence's attended range (for KV heads h to
//! h + 3 where heads_per_block says so). With more than one split per sequence, the splits'
//! partial results are merged by log-sum-exp in the same launch: inside a thread block cluster of
//! the splits (through distributed shared memory) where the device and the grid allow it,
//! otherwise through the workspace, where the last block of each (sequence, KV head, or KV heads
//! of a block) to finish merges them.
struct decode_plan {
  decode_shape shape;
  std::int32_t chunk_tokens = 0; //!< keys per split; a multiple of tile_tokens
  std::int32_t max_splits = 0;   //!< splits per sequence the grid has room for
  bool graph_safe = false;       //!< planned from a length bound, not from the batch's lengths
  //! The launch runs the kernel that takes two tiles a warp step, two blocks per multiprocessor,
  //! on every grid, at head dim up to 128 and groups up to 8: an 8-bit cache with per-token
  //! scales (int8) whose longest sequence attends two_tiles_min_keys keys or more, and an int8 or
  //! int4 cache whose blocks of 256 to 2048 keys fill one wave of two blocks per multiprocessor
  //! (more blocks than multiprocessors, at most twice as many). The launcher also runs that
  //! kernel, for fp8 and int8, on a grid of at most one block per multiprocessor, and on a grid of
  //! whole sequences of two_tiles_min_keys keys or more that makes one wave of two blocks per
  //! multiprocessor (fp8 at B=32), whatever this says.
  bool two_tiles = false;
  //! KV heads a thread block takes: 1, its warps sharing each split's keys, or
  //! head_split_heads, each warp taking one head over all of the split's keys. An int4 cache in
  //! NHD pages at head dim 128 with groups up to 8 and KV heads a multiple of four takes
  //! head_split_heads where its grid of the one-tile kernel is larger than one block per
  //! multiprocessor and a quarter of its chunk is head_split_min_keys or more: four times the
  //! splits of a quarter of the keys (the same blocks, each warp as many keys). A key's rows of
  //! four neighbouring heads, 256 contiguous bytes, are then read by one block at once instead of
  //! by four blocks that drift apart (see choose_splits). The launcher runs any other cache's plan
  //! that says so (one made by hand, or one made for NHD pages and run on HND pages) on blocks of
  //! one head, with the same results; kvkit::cuda::validate takes head_split_heads only with KV
  //! heads a multiple of it and at most head_split_max_splits splits, whatever the cache.
  std::int32_t heads_per_block = 1;

  //! KV heads a thread block of the head-split kernel takes (one a warp).
  static constexpr std::int32_t head_split_heads = 4;
  //! The most splits a sequence is cut into for blocks of head_split_heads heads (the block that
  //! merges them keeps every split's weight for all its query heads in shared memory).
  static constexpr std::int32_t head_split_max_splits = 64;
  //! The fewest keys a block of head_split_heads heads is planned for (each of its warps takes
  //! them all). Shorter ones lost to the blocks of one head that they replace (H100, int4 at 8 KV
  //! heads: whole sequences of 512 and 2048 keys at B=64 and 128 as 4 splits of 128 and 512,
  //! 10-79% slower; B=8, L=32768 as 32 splits of 1024, 26-39% slower with groups of 8 heads;
  //! blocks of 1024 and 2048 keys from 7% faster to 6% slower).
  static constexpr std::int32_t head_split_min_keys = 4096;
  //! Keys a thread block of four warps processes per step (each warp takes 16); chunks are whole
  //! multiples of it, whatever the warps of the block that runs them.
  static constexpr std::int32_t tile_tokens = 64;
  //! The most splits a sequence is cut into (the last block of a sequence merges every split's
  //! partial result, so more splits lengthen that chain); longer sequences get longer chunks.
  static constexpr std::int32_t max_splits_limit = 256;
  //! Up to this many splits per sequence, a device of compute capability 9 or later merges them
  //! inside a thread block cluster (through distributed shared memory: the workspace then goes
  //! unused); more are merged through the workspace.
  static constexpr std::int32_t max_cluster_splits = 8;
  //! The shortest longest sequence (keys attended) from which an int8 cache is planned for the
  //! two-tile kernel on every grid (H200: int8 8-16% faster from L=2048); below it, only where
  //! two blocks per multiprocessor make one wave (see two_tiles).
  static constexpr std::int32_t two_tiles_min_keys = 2048;
  //! The shortest chunk with which a grid of a quantized cache whose sequences are split, where
  //! all its blocks are resident at once, lets the launch after it start early and reads its page
  //! table ahead of its wait (kvkit::cuda::decode_args::page_table_ready; a 16-bit cache's grid
  //! does at any chunk). H200: fp8, int8 and int4 at B=8, L=8192 2.5-5.3% faster; splits of 128
  //! keys were up to 15% slower.
  static constexpr std::int32_t early_read_min_chunk = 1024;

  //! Bytes of workspace: partial outputs and log-sum-exps (fp32) of every split, and one arrival
  //! counter per (sequence, KV head). Zero when no sequence is split. The launcher zeroes the
  //! counters itself, so a workspace needs no initialization and can serve any plan that fits (a
  //! caller can instead keep counters of its own at zero and let the launcher skip that:
  //! zeroed_counters of the launcher's arguments, kvkit::cuda::decode_args).
  [[nodiscard]] constexpr std::size_t workspace_bytes() const {
    if (max_splits <= 1) {
      return 0;
    }
    return partial_outputs_offset() +
           partial_rows() * static_cast<std::size_t>(shape.head_dim) * sizeof(float);
  }
  //! Partial results in the workspace: one per sequence, query head and split.
  [[nodiscard]] constexpr std::size_t partial_rows() const {
    return static_cast<std::size_t>(shape.batch_size) *
           static_cast<std::size_t>(shape.num_q_heads) * static_cast<std::size_t>(max_splits);
  }
  //! Where the partial outputs start in the workspace: after the arrival counters
  //! (counter_bytes) and the partial log-sum-exps, one float a row, their count rounded up to a
  //! multiple of four so that the outputs are 16-byte aligned for the kernel's 16-byte stores.
  [[nodiscard]] constexpr std::size_t partial_outputs_offset() const {
    return counter_bytes() + (partial_rows() + 3) / 4 * 4 * sizeof(float);
  }
  //! Arrival counters of a launch with this plan: one per (sequence, KV head); a block of
  //! head_split_heads heads counts on its first head's.
  [[nodiscard]] constexpr std::size_t counter_count() const {
    return static_cast<std::size_t>(shape.batch_size) *
           static_cast<std::size_t>(shape.num_kv_heads);
  }
  //! Bytes of the arrival counters, at the start of the workspace. They grow with the plan's
  //! batch, so a plan's partial log-sum-exps lie where a plan for a larger batch keeps counters.
  [[nodiscard]] constexpr std::size_t counter_bytes() const {
    return (counter_count() * sizeof(std::uint32_t) + 255) / 256 * 256;
  }
};

namespace detail {

// Whether the two-tile kernel serves a cache of `shape` that the plan may choose it for: K and V
// of one width, 8 or 4 bits, scaled per token (int8, int4), at head dim up to 128 with groups up
// to 8 (kvkit::cuda::detail::decode_two_tiles_fit on the device side).
[[nodiscard]] constexpr bool two_tiles_cache(const decode_shape& shape) {
  return shape.kv_scaled_one_width && (shape.kv_bits == 4 || shape.kv_bits == 8) &&
         shape.head_dim <= 128 && shape.group_size() <= 8;
}

// Whether the plan may give a cache of `shape` blocks of decode_plan::head_split_heads KV heads:
// int4 K and V in NHD pages at head dim 128, groups up to 8, KV heads a multiple of four
// (kvkit::cuda::detail::decode_head_split_fit on the device side).
[[nodiscard]] constexpr bool head_split_cache(const decode_shape& shape) {
  return shape.kv_scaled_one_width && shape.kv_bits == 4 && shape.order == kv_order::nhd &&
         shape.head_dim == 128 && shape.group_size() <= 8 &&
         shape.num_kv_heads % decode_plan::head_split_heads == 0;
}

// Keys a sequence of `len` tokens attends to under `window`.
[[nodiscard]] constexpr std::int64_t attended(std::int64_t len, std::int32_t window) {
  return window > 0 ? std::min<std::int64_t>(len, window) : len;
}

// The longest sequence a plan serves, sliding window or not: the kernel locates keys in 32 bits,
// and a sequence's length plus a chunk (at most the longest attended length, rounded up to
// tiles) stays below 2^31, so the end of every split does, however the launch cuts the chunk.
inline constexpr std::int64_t max_decode_keys = std::int64_t{1} << 30;

// `keys` rounded up to whole tiles, at least one.
[[nodiscard]] constexpr std::int64_t whole_tiles(std::int64_t keys) {
  constexpr std::int64_t tile = decode_plan::tile_tokens;
  return std::max<std::int64_t>((keys + tile - 1) / tile * tile, tile);
}

// Thread blocks of a grid cut in splits of `chunk` keys: every sequence's splits, for every KV
// head.
template <class Lengths>
[[nodiscard]] constexpr std::int64_t block_count(const decode_shape& shape, Lengths& lengths,
                                                 std::int64_t chunk) {
  std::int64_t splits = 0;
  lengths([&](std::int64_t len) { splits += (len + chunk - 1) / chunk; });
  return splits * shape.num_kv_heads;
}

// The smallest chunk (a multiple of the tile) whose thread blocks (over all sequences and KV
// heads) number at most `target`, or the longest sequence's length when even one split per
// sequence exceeds it; a chunk below two tiles costs more to merge than it saves.
template <class Lengths>
[[nodiscard]] constexpr std::int64_t smallest_chunk(const decode_shape& shape, Lengths& lengths,
                                                    std::int64_t max_len, std::int64_t target) {
  constexpr std::int64_t tile = decode_plan::tile_tokens;
  const std::int64_t longest = whole_tiles(max_len);
  std::int64_t chunk = std::min<std::int64_t>(2 * tile, longest);
  while (chunk < longest) {
    if (block_count(shape, lengths, chunk) <= target &&
        (max_len + chunk - 1) / chunk <= decode_plan::max_splits_limit) {
      break;
    }
    chunk += std::max<std::int64_t>(tile, chunk / 8 / tile * tile);
  }
  return std::min(chunk, longest);
}

// Keys the busiest multiprocessor streams when the blocks of `chunk` keys are dealt out evenly.
template <class Lengths>
[[nodiscard]] constexpr std::int64_t busiest_sm_keys(const decode_shape& shape, Lengths& lengths,
                                                     std::int64_t chunk, std::int64_t sms) {
  const std::int64_t blocks = block_count(shape, lengths, chunk);
  return (blocks + sms - 1) / sms * chunk;
}

// The chunk for one wave of two blocks per multiprocessor (of one where the kernel keeps only one
// resident, `resident` 1: a 16-bit cache at head dim 256). Where the kernel keeps four resident
// (`resident`), it splits for four only if each block still gets at least 16 tiles: shorter ones
// pay their start and their merge for too little work (H200, fp8: B=8, L=8192 50.3 to 46.5 us with
// 8 splits of 1024 keys, but B=1, L=8192 19.1 to 22.7 us with 64 of 128, and B=32, L=512 19.2 to
// 21.5 us with 2 of 256). Nor does an 8-bit cache where the plan for two leaves every sequence
// whole and loads the busiest multiprocessor with no more keys than the finer plan: two blocks
// an SM stream its bytes as fast as four, and the whole sequences need no merge (H200, fp8 at
// B=32, 256 blocks of one split against 512 of two: L=2048 5-6% faster, L=8192 4%, L=32768 3%;
// at B=24, whose 192 blocks put two on only some SMs, one split was 12-20% slower than two). Not
// with pages under 16 tokens, whose scattered rows want the warps of four blocks (fp8 B=32,
// L=2048 with 1-token pages: 4-5% slower whole), nor for int4, whose loop is bound by
// instructions (two blocks an SM at B=32: L=2048 5% slower, L=8192 21%).
template <class Lengths>
[[nodiscard]] constexpr std::int64_t chunk_for(const decode_shape& shape, Lengths& lengths,
                                               std::int64_t max_len, std::int64_t sms,
                                               std::int32_t resident) {
  // One wave of two blocks per multiprocessor, or of one where no more fit (`resident` 1).
  const std::int64_t wave = std::min<std::int64_t>(resident, 2) * sms;
  std::int64_t chunk = smallest_chunk(shape, lengths, max_len, wave);
  if (resident > 2) {
    const std::int64_t finer = smallest_chunk(shape, lengths, max_len, resident * sms);
    if (finer >= 16 * decode_plan::tile_tokens) {
      // A chunk of max_len keys or more leaves every sequence whole.
      const bool keep_whole = shape.kv_bits == 8 && shape.page_size >= 16 && chunk >= max_len &&
                              busiest_sm_keys(shape, lengths, chunk, sms) <=
                                  busiest_sm_keys(shape, lengths, finer, sms);
      if (!keep_whole) {
        chunk = std::min(chunk, finer);
      }
    }
  }
  // Up to max_cluster_splits splits a sequence merge inside a thread block cluster, far faster
  // than through the workspace. Where the plan cuts finer, it takes that many splits instead if
  // their chunks are at most twice as long; where it leaves room for twice its blocks, it cuts
  // down to one tile a warp (H200, bf16 B=1: L=2048 12.5 us with 16 splits of 128 keys, 10.4 with
  // 8 of 256; L=8192 19.9 with 32 of 256, 22.9 with 8 of 1024; L=512 7.9 with 4 of 128, 7.45
  // with 8 of 64). With one block per multiprocessor (`resident` 1) half the blocks leave half the
  // SMs idle, so the longer chunks are taken only up to four tiles (H200, bf16 at head dim 256,
  // B=1, 8 KV heads: L=2048 in 8 splits of 256 keys 2-18% less time than in 16 of 128, but
  // L=8192 in 16 splits of 512 keys 16-22% less than in 8 of 1024, L=32768 in 16 of 2048 34-36%
  // less than in 8 of 4096). The plan does not know the device: on one without clusters, or where
  // the clusters do not all fit, the same splits merge through the workspace.
  const std::int64_t cluster_chunk = whole_tiles((max_len + decode_plan::max_cluster_splits - 1) /
                                                 decode_plan::max_cluster_splits);
  if (cluster_chunk > chunk) {
    if ((max_len + chunk - 1) / chunk > decode_plan::max_cluster_splits &&
        cluster_chunk <= 2 * chunk &&
        (resident >= 2 || cluster_chunk <= 4 * decode_plan::tile_tokens)) {
      chunk = cluster_chunk;
    }
  } else if (cluster_chunk < chunk) {
    if (2 * block_count(shape, lengths, cluster_chunk) <= wave) {
      chunk = cluster_chunk;
    }
  }
  return chunk;
}

// `chunk` shortened to the fewest whole tiles that still cut the longest sequence into as many
// splits, where no sequence then takes more blocks: the steps by which smallest_chunk grows can
// pass over the even cut (8192 keys in 4 splits: 2112, 2112, 2112 and 1856 keys, where 2048 each
// would do), and a grid of one wave ends with its longest block (H200, B=8, L=8192 in 4 splits
// of 2048 keys instead of 2112: int8 3.2-3.3% faster, bf16 0-0.8%).
template <class Lengths>
[[nodiscard]] constexpr std::int64_t even_chunk(const decode_shape& shape, Lengths& lengths,
                                                std::int64_t max_len, std::int64_t chunk) {
  const std::int64_t splits = (max_len + chunk - 1) / chunk;
  const std::int64_t even = whole_tiles((max_len + splits - 1) / splits);
  return even < chunk && block_count(shape, lengths, even) <= block_count(shape, lengths, chunk)
             ? even
             : chunk;
}

// Whether a grid of `blocks` thread blocks makes one wave of two blocks per multiprocessor on a
// device of `sms`: more blocks than multiprocessors, at most twice as many. The plan's choice of
// the two-tile kernel (choose_splits) and the launcher's (kvkit::cuda::paged_decode) both ask it.
[[nodiscard]] constexpr bool one_wave_of_two(std::int64_t blocks, std::int64_t sms) {
  return blocks > sms && blocks <= 2 * sms;
}

// The splits, and the kernel they are cut for: the two-tile kernel at two blocks per SM
// (decode_plan::two_tiles) or the one-tile kernel at decode_blocks_per_sm. An int8 cache takes
// the two-tile kernel whenever its longest sequence attends two_tiles_min_keys keys or more (its
// one-tile kernel, held to 128 registers at four blocks, spills; the two-tile one holds both
// tiles in 208: H200, int8 8-16% faster at every shape from L=2048). An int8 or int4 cache takes
// it too where its plan for two blocks is one wave of more blocks than SMs, of 256 to 2048 keys
// each (int4: B=8, L=2048 14-18% faster, B=32, L=512 13%, B=32, L=2048 5-10%; int8 at B=32,
// L=512 11%); more blocks, or longer ones, run faster as four blocks of one-tile warps (int4:
// B=64, L=2048 13% and B=32, L=8192 2-4% slower with two tiles), and fewer gain nothing (int4
// B=1, L=2048 0-6% slower). The block length is the evenly cut chunk in NHD pages (int4 at B=8,
// L=8192, 4 splits of 2048 keys: 3.6-8.4% faster than the one-tile kernel's 8 splits of 1024),
// and the chunk as grown in HND pages, where int4's one-tile kernel (without the L2 prefetch its
// NHD form then had) read 1.3-3.1% faster than the two-tile one at that shape (2112 keys, over
// the bound). A cache whose K and V differ in width (no two-tile form) keeps the one-tile
// kernel's plan.
template <class Lengths>
[[nodiscard]] constexpr decode_plan choose_splits(const decode_shape& shape, Lengths&& lengths,
                                                  std::int64_t max_len, std::int32_t sm_count) {
  const std::int64_t sms = std::max(sm_count, 1);
  bool two_tiles = false;
  std::int64_t chunk = 0;
  if (two_tiles_cache(shape)) {
    const std::int64_t grown = chunk_for(shape, lengths, max_len, sms, 2);
    chunk = even_chunk(shape, lengths, max_len, grown);
    // NHD pages decide on the evenly cut chunk, HND pages on the chunk as grown (see above).
    const std::int64_t decided = shape.order == kv_order::hnd ? grown : chunk;
    const std::int64_t blocks = block_count(shape, lengths, decided);
    two_tiles = (shape.kv_bits == 8 && max_len >= decode_plan::two_tiles_min_keys) ||
                (decided >= 4 * decode_plan::tile_tokens &&
                 decided <= 32 * decode_plan::tile_tokens && one_wave_of_two(blocks, sms));
  }
  std::int32_t heads_per_block = 1;
  if (!two_tiles) {
    chunk = even_chunk(
        shape, lengths, max_len,
        chunk_for(shape, lengths, max_len, sms,
                  decode_blocks_per_sm(shape.kv_bits, shape.head_dim, shape.group_size())));
    // An int4 cache in NHD pages, on a grid of more blocks than multiprocessors: the same blocks
    // as four heads each, with a quarter of the keys (decode_plan::heads_per_block), where that
    // is at least head_split_min_keys. In NHD pages a block of one head reads 64 of each key's
    // 512 bytes (8 KV heads); the 256-byte L2 fetches it makes (the kernel's `l2_wide`) serve
    // the blocks of its three neighbours only if they read the same keys soon after, and over long
    // blocks they drift apart: H100, int4 g32 at B=32, L=32768 g8 (2 splits of 16384 keys) read
    // 1.74 GB from DRAM for 1.34 GB of cache and took 650 us, where HND pages read 1.34 GB in 465.
    // As blocks of four heads (8 splits of 4096 keys), against blocks of one, in one call: B=32,
    // L=32768 24-30% less time, B=64 and 128, L=32768 7-15% less (int4 groups of 32, 64, 128).
    if (head_split_cache(shape) && block_count(shape, lengths, chunk) > sms) {
      constexpr std::int64_t heads = decode_plan::head_split_heads;
      const std::int64_t quarter = whole_tiles((chunk + heads - 1) / heads);
      if (quarter >= decode_plan::head_split_min_keys &&
          (max_len + quarter - 1) / quarter <= decode_plan::head_split_max_splits) {
        chunk = quarter;
        heads_per_block = decode_plan::head_split_heads;
      }
    }
  }
  decode_plan plan;
  plan.shape = shape;
  plan.chunk_tokens = static_cast<std::int32_t>(chunk);
  plan.two_tiles = two_tiles;
  plan.heads_per_block = heads_per_block;
  plan.max_splits =
      static_cast<std::int32_t>((std::max<std::int64_t>(max_len, 1) + chunk - 1) / chunk);
  return plan;
}

} // namespace detail

//! A plan for the batch whose sequence lengths (cached tokens, the new one included) are
//! `seq_lens` (host memory, shape.batch_size entries), for a GPU of `sm_count` multiprocessors
//! (cudaDevAttrMultiProcessorCount). bad_argument on a bad shape, a length count that is not the
//! batch size, or a length below 1 or above 2^30 (with or without a sliding window: the kernel
//! locates keys in 32 bits).
[[nodiscard]] inline result<decode_plan> plan_decode(const decode_shape& shape,
                                                     std::span<const std::int32_t> seq_lens,
                                                     std::int32_t sm_count) {
  if (!shape.validate().ok() || seq_lens.size() != static_cast<std::size_t>(shape.batch_size) ||
      sm_count <= 0) {
    return errc::bad_argument;
  }
  std::int64_t max_len = 0;
  for (const std::int32_t len : seq_lens) {
    if (len < 1 || len > detail::max_decode_keys) {
      return errc::bad_argument;
    }
    max_len = std::max(max_len, detail::attended(len, shape.window));
  }
  return detail::choose_splits(
      shape,
      [&](auto&& f) {
        for (const std::int32_t len : seq_lens) {
          f(detail::attended(len, shape.window));
        }
      },
      max_len, sm_count);
}

//! A plan that stays valid for any batch of at most shape.batch_size sequences, so launches with
//! it can be captured in a CUDA graph and replayed while the lengths change. It splits as if every
//! sequence had `max_seq_len` tokens; a longer sequence still decodes correctly (its blocks take
//! longer chunks), up to 2^30 keys. bad_argument on a bad shape, a bound below 1 or above 2^30
//! (with or without a sliding window; INT32_MAX for "no bound" is one: pass the longest length
//! the engine serves).
[[nodiscard]] inline result<decode_plan>
plan_decode_graph_safe(const decode_shape& shape, std::int32_t max_seq_len, std::int32_t sm_count) {
  if (!shape.validate().ok() || max_seq_len < 1 || max_seq_len > detail::max_decode_keys ||
      sm_count <= 0) {
    return errc::bad_argument;
  }
  const std::int64_t len = detail::attended(max_seq_len, shape.window);
  decode_plan plan = detail::choose_splits(
      shape,
      [&](auto&& f) {
        for (std::int32_t b = 0; b < shape.batch_size; ++b) {
          f(len);
        }
      },
      len, sm_count);
  plan.graph_safe = true;
  return plan;
}

} // namespace kvkit
