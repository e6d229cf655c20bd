#include <array>
#include <cstddef>
#include <map>
#include <random>
#include <vector>

#include <catch2/catch.hpp>

#include "host/test_seed.hpp"
#include "kvkit/prefix/detail/key_map.hpp"
#include "kvkit/prefix/eviction.hpp"
#include "kvkit/prefix/xxh3_hasher.hpp"

using kvkit::block_key;
using kvkit::token_id;

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
  // The documented construction: XXH3-128(parent | XXH3-128(tokens)).
  const XXH128_hash_t content = XXH3_128bits(tokens.data(), sizeof(tokens));
  const std::uint64_t words[4] = {parent.lo, parent.hi, content.low64, content.high64};
  const XXH128_hash_t want = XXH3_128bits(words, sizeof(words));
  CHECK(k == block_key{want.low64, want.high64});
}

TEST_CASE("xxh3_hasher keys follow the construction at every block size",
          "[prefix_cache][hasher]") {
  // The usual block sizes take fixed-length paths; each must give the generic construction.
  const kvkit::xxh3_hasher h;
  std::vector<token_id> tokens(80);
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    tokens[i] = static_cast<token_id>(1000003 * i + 17);
  }
  const block_key parent{0x0123456789abcdefULL, 0xfedcba9876543210ULL};
  for (std::size_t n = 1; n <= tokens.size(); ++n) {
    CAPTURE(n);
    const XXH128_hash_t content = XXH3_128bits(tokens.data(), n * sizeof(token_id));
    const std::uint64_t words[4] = {parent.lo, parent.hi, content.low64, content.high64};
    const XXH128_hash_t want = XXH3_128bits(words, sizeof(words));
    CHECK(h(parent, std::span(tokens).first(n), {}) == block_key{want.low64, want.high64});
  }
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

TEST_CASE("key_map agrees with std::map under random inserts and erases",
          "[prefix_cache][key_map]") {
  const std::uint64_t seed = kvkit_test::test_seed(99);
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  constexpr std::size_t max_entries = 300;
  kvkit::detail::key_map map(max_entries);
  std::map<std::pair<std::uint64_t, std::uint64_t>, kvkit::block_id> model;
  // Few distinct low bits force long probe runs and wrap-around, the hard cases of shifting.
  const auto key_of = [](std::uint64_t r) {
    return block_key{(r % 4096) * 0x9E37u, r / 4096};
  };
  for (int step = 0; step < 200000; ++step) {
    const block_key k = key_of(rng() % 20000);
    const auto mk = std::make_pair(k.lo, k.hi);
    const auto op = rng() % 3;
    if (op == 0 && model.size() < max_entries) {
      const auto v = static_cast<kvkit::block_id>(rng() % 1000);
      map.assign(k, v);
      model[mk] = v;
    } else if (op == 1) {
      CHECK(map.erase(k) == (model.erase(mk) == 1));
    } else {
      const auto it = model.find(mk);
      const kvkit::block_id want = it == model.end() ? kvkit::invalid_block_id : it->second;
      if (map.find(k) != want) {
        FAIL("lookup mismatch at step " << step);
      }
    }
    if (map.size() != model.size()) {
      FAIL("size mismatch at step " << step);
    }
  }
  for (const auto& [mk, v] : model) {
    CHECK(map.find(block_key{mk.first, mk.second}) == v);
  }
  map.clear();
  CHECK(map.size() == 0);
}
