#include <array>
#include <cstddef>
#include <cstring>
#include <map>
#include <random>
#include <set>
#include <span>
#include <type_traits>
#include <vector>

#include <catch2/catch.hpp>

#include "host/test_seed.hpp"
#include "kvkit/prefix/detail/key_map.hpp"
#include "kvkit/prefix/eviction.hpp"
#include "kvkit/prefix/xxh3_hasher.hpp"

using kvkit::block_key;
using kvkit::token_id;

namespace {

// The documented construction: XXH3-128 of the parent key's 16 bytes, the tokens' bytes and the
// extra bytes, concatenated.
block_key concatenated(const block_key& parent, std::span<const token_id> tokens,
                       std::span<const std::byte> extra) {
  std::vector<unsigned char> bytes(sizeof(parent) + tokens.size_bytes() + extra.size_bytes());
  std::memcpy(bytes.data(), &parent.lo, 8);
  std::memcpy(bytes.data() + 8, &parent.hi, 8);
  if (!tokens.empty()) {
    std::memcpy(bytes.data() + 16, tokens.data(), tokens.size_bytes());
  }
  if (!extra.empty()) {
    std::memcpy(bytes.data() + 16 + tokens.size_bytes(), extra.data(), extra.size_bytes());
  }
  const XXH128_hash_t h = XXH3_128bits(bytes.data(), bytes.size());
  return block_key{h.low64, h.high64};
}

} // namespace

TEST_CASE("xxh3_hasher is deterministic and sensitive to every input", "[prefix_cache][hasher]") {
  const kvkit::xxh3_hasher h;
  const std::array<token_id, 4> tokens{1, 2, 3, 4};
  const std::array<std::byte, 3> extra{std::byte{7}, std::byte{8}, std::byte{9}};
  const block_key parent{11, 12};
  const block_key k = h(parent, tokens, {});
  CHECK(k == h(parent, tokens, {}));
  CHECK_FALSE(k == h(block_key{11, 13}, tokens, {}));
  CHECK_FALSE(k == h(parent, tokens, extra));
  auto changed = tokens;
  changed[3] = 5;
  CHECK_FALSE(k == h(parent, changed, {}));
  CHECK_FALSE(k == h(parent, std::span(tokens).first(3), {}));
  // The root key of a request depends on its extra bytes only.
  CHECK(h(block_key{}, {}, extra) == h(block_key{}, {}, extra));
  CHECK_FALSE(h(block_key{}, {}, extra) == h(block_key{}, {}, {}));
  CHECK(k == concatenated(parent, tokens, {}));
  CHECK(h(parent, tokens, extra) == concatenated(parent, tokens, extra));
  CHECK(h(block_key{}, {}, extra) == concatenated(block_key{}, {}, extra));
  CHECK(h(block_key{}, {}, {}) == concatenated(block_key{}, {}, {}));
}

TEST_CASE("xxh3_hasher keys follow the construction at every block size",
          "[prefix_cache][hasher]") {
  // 8-, 16- and 32-token blocks are hashed from registers, other blocks of up to 256 tokens
  // through a buffer, longer ones and any extra bytes through xxHash's streaming state: all must
  // agree.
  const kvkit::xxh3_hasher h;
  std::vector<token_id> tokens(300);
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    tokens[i] = static_cast<token_id>(1000003 * i + 17);
  }
  const std::array<std::byte, 5> extra{std::byte{1}, std::byte{2}, std::byte{3}, std::byte{4},
                                       std::byte{5}};
  const block_key parent{0x0123456789abcdefULL, 0xfedcba9876543210ULL};
  for (std::size_t n = 0; n <= tokens.size(); ++n) {
    CAPTURE(n);
    const auto blk = std::span<const token_id>(tokens).first(n);
    CHECK(h(parent, blk, {}) == concatenated(parent, blk, {}));
    CHECK(h(parent, blk, extra) == concatenated(parent, blk, extra));
  }
}

TEST_CASE("xxh3_hasher's register path is XXH3-128 for any parent and tokens",
          "[prefix_cache][hasher]") {
  // The parent key enters the hash from registers at 8, 16 and 32 tokens a block; random parents
  // and tokens, the all-zero root parent and a parent with every bit set must all give xxHash's
  // key.
  const kvkit::xxh3_hasher h;
  const std::uint64_t seed = kvkit_test::test_seed(5);
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  std::array<token_id, 32> tokens{};
  constexpr std::array<std::size_t, 3> sizes{8, 16, 32};
  int differ = 0;
  for (int round = 0; round < 6000; ++round) {
    for (auto& t : tokens) {
      t = static_cast<token_id>(rng());
    }
    block_key parent{rng(), rng()};
    if (round < 3) {
      parent = block_key{};
    } else if (round < 6) {
      parent = block_key{~std::uint64_t{0}, ~std::uint64_t{0}};
    }
    const auto blk = std::span<const token_id>(tokens).first(sizes[round % sizes.size()]);
    differ += h(parent, blk, {}) == concatenated(parent, blk, {}) ? 0 : 1;
  }
  CHECK(differ == 0);
}

TEST_CASE("eviction policies map hints to levels", "[prefix_cache][eviction]") {
  const kvkit::lru lru;
  CHECK(lru.num_levels() == 1);
  CHECK(lru.level({3, 100}) == 0);
  const kvkit::retention_priority p(4);
  CHECK(p.num_levels() == 4);
  CHECK(p.level({0, 0}) == 0);
  CHECK(p.level({0, 25}) == 0);
  CHECK(p.level({0, 26}) == 1);
  CHECK(p.level({0, 100}) == 3);
  CHECK(p.level({0, 1000}) == 3);
  CHECK(p.level({0, -5}) == 0);
  CHECK(kvkit::retention_priority(1).num_levels() == 2);
  CHECK(kvkit::retention_priority(50).num_levels() == 8);
}

TEST_CASE("content hashes are XXH3-64 of the token bytes, fixed or runtime length",
          "[prefix_cache]") {
  const std::uint64_t seed = kvkit_test::test_seed(96);
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  std::vector<token_id> t(64);
  for (int trial = 0; trial < 2000; ++trial) {
    for (auto& x : t) {
      x = static_cast<token_id>(rng());
    }
    const auto want = [&](std::size_t n) {
      return XXH3_64bits(t.data(), n * sizeof(token_id));
    };
    CHECK(kvkit::detail::content_hash<8>(t.data()) == want(8));   // 32 bytes
    CHECK(kvkit::detail::content_hash<16>(t.data()) == want(16)); // 64 bytes
    CHECK(kvkit::detail::content_hash<32>(t.data()) == want(32)); // 128 bytes
    CHECK(kvkit::detail::content_hash<5>(t.data()) == want(5));   // 20 bytes
    CHECK(kvkit::detail::content_hash<64>(t.data()) == want(64)); // 256 bytes
    const std::size_t n = 1 + rng() % 64;
    CHECK(kvkit::detail::content_hash(t.data(), n) == want(n));
  }
}

namespace {

// Random assigns, inserts, erases and lookups on `Map` against std::map; `make` turns a number into
// a key whose slot index has few distinct values (long probe runs and wrap-around, the hard cases
// of backward shifting), and each value carries a payload made from it.
template <class Map, class Make>
void check_against_std_map(std::uint64_t seed, Make make) {
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  constexpr std::size_t max_entries = 300;
  Map map(max_entries);
  std::map<std::uint64_t, kvkit::block_id> model;
  const auto payload_of = [](kvkit::block_id v) {
    if constexpr (std::is_same_v<Map, kvkit::detail::child_map>) {
      return static_cast<std::uint32_t>(v) * 3 + 1;
    } else {
      return kvkit::detail::no_payload{};
    }
  };
  for (int step = 0; step < 200000; ++step) {
    const std::uint64_t r = rng() % 20000;
    const auto k = make(r);
    const auto op = rng() % 5;
    const auto it = model.find(r);
    const kvkit::block_id had = it == model.end() ? kvkit::invalid_block_id : it->second;
    if (op <= 1 && model.size() < max_entries) {
      const auto v = static_cast<kvkit::block_id>(rng() % 1000);
      if (op == 0) {
        map.assign(k, v, payload_of(v));
        model[r] = v;
      } else {
        if (map.insert(k, v, payload_of(v)) != had) {
          FAIL("insert mismatch at step " << step);
        }
        model.emplace(r, v);
      }
    } else if (op == 2) {
      CHECK(map.erase(k) == (model.erase(r) == 1));
    } else if (op == 3) {
      // Erase only if the key maps to this value (usually a guess, sometimes the value).
      const auto v = rng() % 2 == 0 && had != kvkit::invalid_block_id
                         ? had
                         : static_cast<kvkit::block_id>(rng() % 1000);
      const bool erases = had != kvkit::invalid_block_id && had == v;
      CHECK(map.erase_if(k, v) == erases);
      if (erases) {
        model.erase(r);
      }
    } else {
      const kvkit::block_id want = had;
      const auto* s = map.lookup(k);
      if ((s == nullptr ? kvkit::invalid_block_id : s->value) != want || map.find(k) != want) {
        FAIL("lookup mismatch at step " << step);
      }
      if constexpr (std::is_same_v<Map, kvkit::detail::child_map>) {
        if (s != nullptr && !(s->payload == payload_of(want))) {
          FAIL("payload mismatch at step " << step);
        }
      }
    }
    if (map.size() != model.size()) {
      FAIL("size mismatch at step " << step);
    }
  }
  for (const auto& [r, v] : model) {
    CHECK(map.find(make(r)) == v);
  }
  map.clear();
  CHECK(map.size() == 0);
}

} // namespace

TEST_CASE("child_map agrees with std::map and keeps each payload", "[prefix_cache][key_map]") {
  // Keys differ in the tag, the content or both; the contents are made so that a content under
  // every tag has the same slot.
  check_against_std_map<kvkit::detail::child_map>(kvkit_test::test_seed(98), [](std::uint64_t r) {
    const std::uint64_t tag = (r % 7) * 0x100;
    return kvkit::detail::child_key{tag, (r / 7) * 0x9E37U ^ kvkit::detail::parent_bits(tag)};
  });
}

TEST_CASE("child_map places one block's tokens under many parents in many slots",
          "[prefix_cache][key_map]") {
  // The same content hash under 1000 parent blocks of generation 0 (one prompt under as many
  // adapters): their home slots among 2048 are at least as many as random places would give
  // (about 790), not one, which would make each lookup probe past the others.
  std::set<std::uint64_t> homes;
  for (std::uint64_t id = 0; id < 1000; ++id) {
    const std::uint64_t tag = (std::uint64_t{1} << 63) | (id << 32);
    homes.insert(kvkit::detail::slot_hash(kvkit::detail::child_key{tag, 0x1234'5678'9ABC'DEF0U}) &
                 2047U);
  }
  CHECK(homes.size() > 700);
}

TEST_CASE("tag_map agrees with std::map on block-like tags", "[prefix_cache][key_map]") {
  // Tags of blocks: a set top bit, the block id, a small generation.
  check_against_std_map<kvkit::detail::tag_map>(kvkit_test::test_seed(97), [](std::uint64_t r) {
    return kvkit::detail::tag_key{(std::uint64_t{1} << 63) | ((r % 500) << 32) | (r / 500)};
  });
}
