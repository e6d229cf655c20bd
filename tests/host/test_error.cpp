#include <string>

#include <catch2/catch.hpp>

#include "kvkit/config.hpp"
#include "kvkit/error.hpp"

using kvkit::errc;

TEST_CASE("status carries an error code or ok", "[error]") {
  constexpr kvkit::status good;
  static_assert(good.ok() && good.error() == errc::ok);
  const kvkit::status bad = errc::out_of_blocks;
  CHECK_FALSE(bad.ok());
  CHECK_FALSE(static_cast<bool>(bad));
  CHECK(bad.error() == errc::out_of_blocks);
  CHECK(bad == kvkit::status{errc::out_of_blocks});
  CHECK(bad != good);
}

TEST_CASE("result holds a value or an error", "[error]") {
  kvkit::result<std::string> value = std::string("page");
  REQUIRE(value.has_value());
  CHECK(*value == "page");
  CHECK(value->size() == 4);
  CHECK(value.error() == errc::ok);
  CHECK(value.status().ok());

  const kvkit::result<std::string> copy = value;
  CHECK(copy.value() == "page");
  kvkit::result<std::string> moved = std::move(value);
  CHECK(moved.value() == "page");

  const kvkit::result<std::string> failed = errc::unknown_sequence;
  CHECK_FALSE(failed.has_value());
  CHECK_FALSE(static_cast<bool>(failed));
  CHECK(failed.error() == errc::unknown_sequence);
  CHECK(failed.status() == kvkit::status{errc::unknown_sequence});
  CHECK(failed.value_or("none") == "none");
  CHECK(copy.value_or("none") == "page");
}

namespace {
struct not_a_string {};
template <class T, class U>
concept has_value_or = requires(const kvkit::result<T>& r, U u) {
  r.value_or(u);
};
} // namespace

TEST_CASE("value_or takes only fallbacks that make a T", "[error]") {
  STATIC_REQUIRE(has_value_or<std::string, const char*>);
  STATIC_REQUIRE(has_value_or<int, long>);
  STATIC_REQUIRE_FALSE(has_value_or<std::string, not_a_string>);
  STATIC_REQUIRE_FALSE(has_value_or<int, not_a_string>);
}

TEST_CASE("every error code has a distinct name", "[error]") {
  const errc all[] = {errc::ok,
                      errc::out_of_blocks,
                      errc::invalid_block,
                      errc::double_release,
                      errc::unknown_sequence,
                      errc::duplicate_sequence,
                      errc::out_of_range,
                      errc::buffer_too_small,
                      errc::bad_argument};
  for (const errc a : all) {
    CHECK(kvkit::to_string(a) != "unknown_error");
    for (const errc b : all) {
      if (a != b) {
        CHECK(kvkit::to_string(a) != kvkit::to_string(b));
      }
    }
  }
  CHECK(kvkit::to_string(errc::out_of_blocks) == "out_of_blocks");
}

TEST_CASE("version macros agree with kvkit::version", "[error]") {
  CHECK(kvkit::version.major == KVKIT_VERSION_MAJOR);
  CHECK(kvkit::version.minor == KVKIT_VERSION_MINOR);
  CHECK(kvkit::version.patch == KVKIT_VERSION_PATCH);
  CHECK(KVKIT_VERSION ==
        KVKIT_VERSION_MAJOR * 10000 + KVKIT_VERSION_MINOR * 100 + KVKIT_VERSION_PATCH);
}
