#pragma once
//! Options that the attention kernels and their CPU reference share.

#include <cstdint>

namespace kvkit {

//! Options of paged attention (the CPU reference and the decode kernel).
struct attention_options {
  float scale = 0.0F;           //!< logit scale; 0 means 1 / sqrt(head_dim)
  std::int32_t window = 0;      //!< sliding window: keys at most window-1 positions back; 0: all
  float logits_soft_cap = 0.0F; //!< cap * tanh(logit / cap) when > 0
};

} // namespace kvkit
