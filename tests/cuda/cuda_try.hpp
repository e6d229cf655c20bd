#pragma once
// KVKIT_TRY(expr): in a test wrapper that returns a result struct `out` with an `error` member,
// stores a failed CUDA call's error in it and returns it.

#define KVKIT_TRY(expr)                                                                            \
  do {                                                                                             \
    const cudaError_t e_ = (expr);                                                                 \
    if (e_ != cudaSuccess) {                                                                       \
      out.error = e_;                                                                              \
      return out;                                                                                  \
    }                                                                                              \
  } while (false)
