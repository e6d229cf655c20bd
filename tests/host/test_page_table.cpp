#include <array>
#include <vector>

#include <catch2/catch.hpp>

#include "kvkit/block/block_pool.hpp"
#include "kvkit/block/block_table.hpp"
#include "kvkit/block/page_table.hpp"

using kvkit::seq_id;
using kvkit::token_slot;

TEST_CASE("token helpers", "[page_table]") {
  static_assert(kvkit::blocks_for_tokens(0, 16) == 0);
  static_assert(kvkit::blocks_for_tokens(1, 16) == 1);
  static_assert(kvkit::blocks_for_tokens(16, 16) == 1);
  static_assert(kvkit::blocks_for_tokens(17, 16) == 2);
  static_assert(kvkit::blocks_for_tokens(2'147'483'647, 1) == 2'147'483'647);
  static_assert(kvkit::last_block_len(0, 16) == 0);
  static_assert(kvkit::last_block_len(16, 16) == 16);
  static_assert(kvkit::last_block_len(17, 16) == 1);
  static_assert(token_slot{3, 5}.flat(16) == 53);
  static_assert(token_slot{2'000'000'000, 1}.flat(64) == 128'000'000'001LL);
  CHECK(kvkit::blocks_for_tokens(33, 32) == 2);
}

TEST_CASE("kernel views over exported tables resolve every token's slot", "[page_table]") {
  kvkit::block_pool pool(64);
  kvkit::block_table table(pool, 8);
  const std::array<std::int32_t, 5> lens{1, 8, 9, 30, 0};
  std::vector<std::vector<token_slot>> slots(lens.size());
  std::vector<seq_id> batch;
  for (std::size_t b = 0; b < lens.size(); ++b) {
    const seq_id s = 100 + b;
    batch.push_back(s);
    REQUIRE(table.add_sequence(s).ok());
    slots[b].resize(static_cast<std::size_t>(lens[b]));
    REQUIRE(table.append_tokens(s, lens[b], slots[b]).ok());
  }
  const auto nnz = static_cast<std::size_t>(*table.csr_size(batch));
  std::vector<std::int32_t> indptr(batch.size() + 1);
  std::vector<std::int32_t> indices(nnz);
  std::vector<std::int32_t> last(batch.size());
  REQUIRE(table.export_csr(batch, indptr, indices, last).ok());
  const kvkit::csr_page_table csr{indptr.data(), indices.data(), last.data(),
                                  static_cast<std::int32_t>(batch.size()), 8};

  constexpr std::int32_t width = 4;
  std::vector<std::int32_t> rows(batch.size() * width);
  std::vector<std::int32_t> seq_lens(batch.size());
  REQUIRE(table.export_block_table(batch, width, rows, seq_lens).ok());
  const kvkit::padded_page_table padded{rows.data(), seq_lens.data(),
                                        static_cast<std::int32_t>(batch.size()), width, 8};

  for (std::int32_t b = 0; b < csr.batch_size; ++b) {
    const auto bi = static_cast<std::size_t>(b);
    CHECK(csr.num_tokens(b) == lens[bi]);
    CHECK(padded.num_tokens(b) == lens[bi]);
    CHECK(csr.num_pages(b) == kvkit::blocks_for_tokens(lens[bi], 8));
    for (std::int32_t t = 0; t < lens[bi]; ++t) {
      CHECK(csr.slot(b, t) == slots[bi][static_cast<std::size_t>(t)]);
      CHECK(padded.slot(b, t) == slots[bi][static_cast<std::size_t>(t)]);
    }
  }
}
