#pragma once
// The seed of randomized tests: fixed by default, KVKIT_TEST_SEED overrides it to replay or vary.

#include <cstdint>
#include <cstdlib>

namespace kvkit_test {

inline std::uint64_t test_seed(std::uint64_t fallback) {
  const char* env = std::getenv("KVKIT_TEST_SEED");
  return env != nullptr ? std::strtoull(env, nullptr, 10) : fallback;
}

} // namespace kvkit_test
