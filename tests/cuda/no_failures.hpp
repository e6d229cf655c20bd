#pragma once
// The GPU tests' device files return what they found wrong as lines (a case's name, a kernel's
// residency); a test case checks them here, one failed check a line.

#include <string>
#include <vector>

#include <catch2/catch.hpp>

namespace kvkit_test {

// A failed check for each of `lines`, with `what` before it, and a check that there are none.
inline void check_no_failures(const std::vector<std::string>& lines, const char* what) {
  for (const auto& line : lines) {
    INFO(what << line);
    CHECK(false);
  }
  CHECK(lines.empty());
}

} // namespace kvkit_test
