#pragma once
//! kvkit's host umbrella header: every host piece (the CPU reference included; not the concept
//! archetypes of kvkit/testing/), no CUDA.

#include "kvkit/attention/decode_plan.hpp"    // IWYU pragma: export
#include "kvkit/attention/options.hpp"        // IWYU pragma: export
#include "kvkit/block/block_pool.hpp"         // IWYU pragma: export
#include "kvkit/block/block_table.hpp"        // IWYU pragma: export
#include "kvkit/block/page_table.hpp"         // IWYU pragma: export
#include "kvkit/block/types.hpp"              // IWYU pragma: export
#include "kvkit/concepts/block_allocator.hpp" // IWYU pragma: export
#include "kvkit/concepts/block_hasher.hpp"    // IWYU pragma: export
#include "kvkit/concepts/block_mapping.hpp"
#include "kvkit/concepts/eviction_policy.hpp"   // IWYU pragma: export
#include "kvkit/concepts/kv_codec.hpp"          // IWYU pragma: export
#include "kvkit/concepts/page_layout.hpp"       // IWYU pragma: export
#include "kvkit/concepts/prefix_index.hpp"      // IWYU pragma: export
#include "kvkit/concepts/scheduling_policy.hpp" // IWYU pragma: export
#include "kvkit/config.hpp"                     // IWYU pragma: export
#include "kvkit/error.hpp"
#include "kvkit/layout/kv_memory.hpp"
#include "kvkit/layout/page_layout.hpp"  // IWYU pragma: export
#include "kvkit/prefix/eviction.hpp"     // IWYU pragma: export
#include "kvkit/prefix/prefix_cache.hpp" // IWYU pragma: export
#include "kvkit/prefix/xxh3_hasher.hpp"
#include "kvkit/quant/codecs.hpp"
#include "kvkit/quant/float_conversions.hpp"
#include "kvkit/quant/kv_format.hpp"           // IWYU pragma: export
#include "kvkit/reference/paged_attention.hpp" // IWYU pragma: export
#include "kvkit/reference/quantize.hpp"        // IWYU pragma: export
#include "kvkit/sched/policies.hpp"            // IWYU pragma: export
#include "kvkit/sched/scheduler.hpp"           // IWYU pragma: export
