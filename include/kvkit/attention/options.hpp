#pragma once
//! Options that the attention kernels and their CPU reference share.

#include <cmath>
#include <cstdint>

#include "kvkit/error.hpp"

namespace kvkit {

//! Options of paged attention (the CPU reference and the decode kernel).
struct attention_options {
  float scale = 0.0F;           //!< logit scale; 0 means 1 / sqrt(head_dim)
  std::int32_t window = 0;      //!< sliding window: keys at most window-1 positions back; 0: all
  float logits_soft_cap = 0.0F; //!< cap * tanh(logit / cap) when > 0

  //! bad_argument for a negative or non-finite scale, a negative window, or a soft cap that is not
  //! 0 (none) or a positive normal float (the kernels divide by it once, and the reciprocal of a
  //! subnormal cap is infinite: a logit of 0 would become NaN).
  [[nodiscard]] status validate() const noexcept {
    if (!(scale >= 0.0F) || !std::isfinite(scale) || window < 0 ||
        !(logits_soft_cap == 0.0F || (logits_soft_cap > 0.0F && std::isnormal(logits_soft_cap)))) {
      return errc::bad_argument;
    }
    return {};
  }
};

} // namespace kvkit
