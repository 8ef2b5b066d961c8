// Kernel launches on the emulated device: the functors the CUDA launchers (core/cuda/launch.cuh)
// run, run by host loops on the issuing stream.
#pragma once

#include <strata/core/cuda_emulated/context.hpp>
#include <strata/core/kernels/team.hpp>

#include <cstddef>

namespace strata {

/// f(i) for every i in [0, n), on stream s (an element-wise kernel).
template <class F>
void launch_elements(emulated_context& ctx, emulated_context::stream_type /*s*/, std::size_t n,
                     F const& f) {
  ctx.count_launch();
  kernels::run_elements_on_host(f, n);
}

/// The row kernel k on rows [0, rows), each by a team of `lanes` lanes (1, 32, 256 or 1024 on
/// the GPU; any here), on stream s.
template <class K>
void launch_rows(emulated_context& ctx, emulated_context::stream_type /*s*/, std::size_t rows,
                 unsigned lanes, K const& k) {
  ctx.count_launch();
  kernels::run_rows_on_host(k, rows, lanes);
}

} // namespace strata
