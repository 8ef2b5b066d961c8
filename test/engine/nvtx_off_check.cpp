// Built without NVTX (whatever the build found), the executor's ranges are an empty member:
// the executor stays an empty class, and its calls compile to nothing. Compiled, not run.
#undef STRATA_HAVE_NVTX
#include <strata/engine/executor.hpp>
#include <strata/engine/nvtx.hpp>

#include <type_traits>

static_assert(std::is_empty_v<strata::engine::nvtx_ranges<float, strata::host>>,
              "without NVTX the ranges must hold nothing");
static_assert(std::is_empty_v<strata::engine::executor<float>>,
              "without NVTX the executor must hold nothing");
