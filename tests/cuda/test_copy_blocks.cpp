// copy_blocks and swap_blocks move whole pages of every layer exactly, and nothing else.

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include <catch2/catch.hpp>

#include "cuda/copy_device.hpp"
#include "cuda/no_failures.hpp"
#include "host/test_seed.hpp"

namespace {

std::vector<std::vector<std::byte>> random_layers(std::size_t layers, std::size_t bytes,
                                                  std::mt19937_64& rng) {
  std::vector<std::vector<std::byte>> out(layers, std::vector<std::byte>(bytes));
  for (auto& l : out) {
    for (auto& b : l) {
      b = static_cast<std::byte>(rng());
    }
  }
  return out;
}

void copy_page(const std::vector<std::byte>& from, std::int32_t f, std::vector<std::byte>& to,
               std::int32_t t, std::int64_t bytes) {
  std::memcpy(to.data() + t * bytes, from.data() + f * bytes, static_cast<std::size_t>(bytes));
}

} // namespace

TEST_CASE("copy_blocks runs a copy-on-write list on every layer", "[cuda][copy]") {
  const std::uint64_t seed = kvkit_test::test_seed(31);
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  for (const std::int64_t bytes :
       {std::int64_t{16}, std::int64_t{4096}, std::int64_t{65536 + 48}}) {
    constexpr std::int32_t pages = 40;
    auto layers = random_layers(3, static_cast<std::size_t>(pages * bytes), rng);
    // Sources and destinations disjoint, as block_table's lists are within a step.
    std::vector<std::int32_t> ids(pages);
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);
    std::vector<kvkit::block_copy> pairs;
    for (int i = 0; i < 12; ++i) {
      pairs.push_back({ids[static_cast<std::size_t>(i)], ids[static_cast<std::size_t>(20 + i)]});
    }
    auto want = layers;
    for (auto& l : want) {
      for (const auto& p : pairs) {
        copy_page(l, p.src, l, p.dst, bytes);
      }
    }
    // One block for every page, and block limits that leave each block several pages (1, 5) or
    // more blocks than pages (1000).
    for (const std::int32_t max_blocks : {0, 1, 5, 1000}) {
      INFO("max_blocks " << max_blocks);
      auto got = layers;
      REQUIRE(kvkit_test::run_copy_blocks(got, bytes, pairs, nullptr, 0, max_blocks) ==
              cudaSuccess);
      CHECK(got == want);
    }
  }
}

TEST_CASE("swap_blocks moves pages out to pinned host memory and back", "[cuda][copy]") {
  const std::uint64_t seed = kvkit_test::test_seed(32);
  INFO("KVKIT_TEST_SEED=" << seed);
  std::mt19937_64 rng(seed);
  constexpr std::int64_t bytes = 8192;
  auto device = random_layers(2, 16 * bytes, rng);
  auto host = random_layers(2, 8 * bytes, rng);
  const std::vector<kvkit::block_copy> out{{3, 0}, {9, 5}, {15, 7}};
  const std::vector<kvkit::block_copy> in{{5, 1}, {0, 2}}; // host 5 (just written) -> device 1
  auto want_device = device;
  auto want_host = host;
  for (std::size_t l = 0; l < 2; ++l) {
    for (const auto& p : out) {
      copy_page(want_device[l], p.src, want_host[l], p.dst, bytes);
    }
    for (const auto& p : in) {
      copy_page(want_host[l], p.src, want_device[l], p.dst, bytes);
    }
  }
  for (const std::int32_t max_blocks : {0, 2}) {
    INFO("max_blocks " << max_blocks);
    auto got_device = device;
    auto got_host = host;
    REQUIRE(kvkit_test::run_swaps(got_device, got_host, bytes, out, in, max_blocks) == cudaSuccess);
    CHECK(got_device == want_device);
    CHECK(got_host == want_host);
  }
}

TEST_CASE("swap_blocks_copy_engines moves the same pages, merging runs, on every kind of stream",
          "[cuda][copy]") {
  const std::uint64_t seed = kvkit_test::test_seed(58);
  INFO("KVKIT_TEST_SEED=" << seed);
  std::mt19937_64 rng(seed);
  using kvkit_test::swap_stream;
  for (const swap_stream how : {swap_stream::own, swap_stream::legacy, swap_stream::captured}) {
    INFO("stream " << static_cast<int>(how));
    for (const std::int64_t bytes : {std::int64_t{40}, std::int64_t{8192}}) {
      INFO("bytes per page " << bytes);
      constexpr std::int32_t device_pages = 24;
      constexpr std::int32_t host_pages = 16;
      auto device = random_layers(3, static_cast<std::size_t>(device_pages * bytes), rng);
      auto host = random_layers(3, static_cast<std::size_t>(host_pages * bytes), rng);
      // Out: a run of three (device 4-6 -> host 9-11) given out of order, a pair whose source
      // follows on but whose destination does not (7 -> 0), and a lone page at each cache's end.
      const std::vector<kvkit::block_copy> out{
          {6, 11}, {device_pages - 1, host_pages - 1}, {4, 9}, {7, 0}, {5, 10}};
      // In: host 11 (just written) and 12 -> device 20-21 (a run), and host 0 -> device 0.
      const std::vector<kvkit::block_copy> in{{12, 21}, {0, 0}, {11, 20}};
      auto want_device = device;
      auto want_host = host;
      for (std::size_t l = 0; l < 3; ++l) {
        for (const auto& p : out) {
          copy_page(want_device[l], p.src, want_host[l], p.dst, bytes);
        }
        for (const auto& p : in) {
          copy_page(want_host[l], p.src, want_device[l], p.dst, bytes);
        }
      }
      kvkit_test::copy_engine_report got;
      REQUIRE(kvkit_test::run_copy_engine_swaps(device, host, bytes, out, in, how, got) ==
              cudaSuccess);
      CHECK(device == want_device);
      CHECK(host == want_host);
      CHECK(got.runs[0] == 3); // {4-6 -> 9-11}, {7 -> 0}, {23 -> 15}
      CHECK(got.copies[0] == 9);
      CHECK(got.runs[1] == 2); // {0 -> 0}, {11-12 -> 20-21}
      CHECK(got.copies[1] == 6);
      // One batch on a stream of its own (where the runtime has the call: CUDA 12.8 on); the
      // copies one at a time on the legacy stream and under capture.
      const bool batch = how == swap_stream::own && CUDART_VERSION >= 12080;
      CHECK(got.batched[0] == batch);
      CHECK(got.batched[1] == batch);
    }
  }
}

TEST_CASE("swap_blocks_copy_engines matches the swap kernel on random swaps", "[cuda][copy]") {
  const std::uint64_t seed = kvkit_test::test_seed(59);
  INFO("KVKIT_TEST_SEED=" << seed);
  std::mt19937_64 rng(seed);
  constexpr std::int64_t bytes = 4096;
  constexpr std::int32_t pages = 48;
  for (int round = 0; round < 4; ++round) {
    INFO("round " << round);
    auto device = random_layers(2, static_cast<std::size_t>(pages * bytes), rng);
    auto host = random_layers(2, static_cast<std::size_t>(pages * bytes), rng);
    // Swap-out: consecutive device pages to host pages in stretches of four (the stretches in a
    // random order), with pairs left out at random, so that runs form and break. Swap-in: random
    // host pages (some just written) to consecutive device pages, one host page to two of them
    // (a host copy that two requests share).
    std::vector<std::int32_t> stretches(pages / 4);
    std::iota(stretches.begin(), stretches.end(), 0);
    std::shuffle(stretches.begin(), stretches.end(), rng);
    std::vector<std::int32_t> host_pages;
    for (const std::int32_t s : stretches) {
      for (std::int32_t k = 0; k < 4; ++k) {
        host_pages.push_back(4 * s + k);
      }
    }
    std::vector<kvkit::block_copy> out, in;
    const auto n_out = static_cast<std::int32_t>(rng() % 24 + 1);
    for (std::int32_t i = 0; i < n_out; ++i) {
      if (rng() % 5 != 0) {
        out.push_back({i + round, host_pages[static_cast<std::size_t>(i)]});
      }
    }
    std::vector<std::int32_t> ids(pages);
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);
    for (std::size_t i = 0; i < 12; ++i) {
      in.push_back({ids[i], static_cast<std::int32_t>(30 + i)});
    }
    in.push_back({ids[0], 42});
    auto kernel_device = device;
    auto kernel_host = host;
    REQUIRE(kvkit_test::run_swaps(kernel_device, kernel_host, bytes, out, in) == cudaSuccess);
    kvkit_test::copy_engine_report got;
    REQUIRE(kvkit_test::run_copy_engine_swaps(device, host, bytes, out, in,
                                              kvkit_test::swap_stream::own, got) == cudaSuccess);
    CHECK(device == kernel_device);
    CHECK(host == kernel_host);
    CHECK(got.runs[0] == kvkit_test::expected_runs(out));
    CHECK(got.runs[1] == kvkit_test::expected_runs(in));
    CHECK(got.copies[0] == 2 * got.runs[0]);
    CHECK(got.copies[1] == 2 * got.runs[1]);
  }
}

TEST_CASE("copy_blocks leaves pairs outside the caches alone in its debug mode, and flags them",
          "[cuda][copy]") {
  const std::uint64_t seed = kvkit_test::test_seed(47);
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  constexpr std::int64_t bytes = 4096;
  constexpr std::int32_t pages = 24;
  const auto layers = random_layers(2, static_cast<std::size_t>(pages * bytes), rng);
  const std::vector<kvkit::block_copy> good{{0, 5}, {3, 9}, {7, 23}};
  auto want = layers;
  for (auto& l : want) {
    for (const auto& p : good) {
      copy_page(l, p.src, l, p.dst, bytes);
    }
  }
  // Every pair inside: the same copies, and the flag stays 0.
  auto got = layers;
  std::int32_t flag = -1;
  REQUIRE(kvkit_test::run_copy_blocks(got, bytes, good, &flag) == cudaSuccess);
  CHECK(flag == 0);
  CHECK(got == want);
  // Pairs whose source or destination lies outside (past the end, negative) among them: those are
  // not copied, the others are, and the flag is set.
  auto mixed = good;
  mixed.insert(mixed.begin() + 1, {{pages, 2}, {4, pages + 100}, {-1, 6}, {8, -7}});
  got = layers;
  flag = -1;
  REQUIRE(kvkit_test::run_copy_blocks(got, bytes, mixed, &flag) == cudaSuccess);
  CHECK(flag == 1);
  CHECK(got == want);
  // The same with two blocks taking the pages in turn: a rejected pair skips to the next page.
  got = layers;
  flag = -1;
  REQUIRE(kvkit_test::run_copy_blocks(got, bytes, mixed, &flag, 0, 2) == cudaSuccess);
  CHECK(flag == 1);
  CHECK(got == want);
  // Each bound for its own side: with destinations held to the first pages - 4, a source past
  // them is copied, a destination past them is not.
  const std::vector<kvkit::block_copy> bounds{{pages - 2, 1}, {2, pages - 2}};
  want = layers;
  for (auto& l : want) {
    copy_page(l, pages - 2, l, 1, bytes);
  }
  got = layers;
  flag = -1;
  REQUIRE(kvkit_test::run_copy_blocks(got, bytes, bounds, &flag, pages - 4) == cudaSuccess);
  CHECK(flag == 1);
  CHECK(got == want);
}

TEST_CASE("write_kv, quantize_pages and copy_blocks return an error left pending before them, "
          "having launched nothing",
          "[cuda][copy][pending_error]") {
  kvkit_test::check_no_failures(kvkit_test::pending_error_failures(), "");
}

TEST_CASE("page movement validates its arguments", "[cuda][copy][host]") {
  kvkit_test::check_no_failures(kvkit_test::copy_validation_failures(),
                                "decided otherwise than expected: ");
}

TEST_CASE("swap_blocks_copy_engines validates its arguments and every page id",
          "[cuda][copy][host]") {
  kvkit_test::check_no_failures(kvkit_test::copy_engine_validation_failures(),
                                "decided otherwise than expected: ");
}

TEST_CASE("the launchers run the checked kernels exactly when the debug flag is set",
          "[cuda][copy][host]") {
  kvkit_test::check_no_failures(kvkit_test::page_check_dispatch_failures(), "");
}
