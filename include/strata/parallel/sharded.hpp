// The sharded data-parallel pass (ZeRO stages 1, 2, 3; stage 3 is FSDP's full shard): what
// data parallelism replicates — optimizer state, gradients, parameters — split over the dp
// axis, each rank holding the r-th slice of every segment of the flat buffers.
//
// sharded_pass (sharded/common.hpp) is the base the stages share; zero1_pass
// (sharded/zero1.hpp), zero2_pass (sharded/zero2.hpp) and zero3_pass (sharded/zero3.hpp) are
// the stages, the last two on staged_sharded_pass (sharded/staged.hpp), the gradient staging
// they share. The plan option below builds the stage the plan names.
#pragma once

#include <strata/core/error.hpp>
#include <strata/engine/option.hpp>
#include <strata/engine/pass.hpp>
#include <strata/parallel/plan.hpp>
#include <strata/parallel/sharded/common.hpp>
#include <strata/parallel/sharded/zero1.hpp>
#include <strata/parallel/sharded/zero2.hpp>
#include <strata/parallel/sharded/zero3.hpp>

#include <memory>
#include <string>
#include <string_view>

namespace strata {

/// sharded<...> as a plan option: ZeRO over the dp axis.
template <class... Os>
struct option_traits<sharded<Os...>> {
  static constexpr std::string_view name = "sharded";
  static constexpr std::string_view axis = "dp";
  static constexpr int fold = folds::data_parallel;
  using options_type = plan_descriptor::sharded_desc;
  static constexpr options_type options() noexcept {
    plan_descriptor d;
    sharded<Os...>::lower(d);
    return d.sharded;
  }
  static void check(options_type const& o, plan_context const&) {
    if (o.stage < 1 || o.stage > 3)
      throw config_error("strata: runtime plan: sharded stage " + std::to_string(o.stage) +
                         ": zero<S> needs S = 1, 2 or 3");
  }
  /// The stage's pass, seen by the engine (and by tests, through dynamic_cast) as
  /// parallel::sharded_pass<T, C, R, D>.
  template <class T, class R, class D, class C>
  static std::unique_ptr<engine::pass<T, D>> make_pass(options_type const& o,
                                                       pass_context<C>& ctx) {
    switch (o.stage) {
    case 1:
      return std::make_unique<parallel::zero1_pass<T, C, R, D>>(ctx.mesh->dp(), o);
    case 2:
      return std::make_unique<parallel::zero2_pass<T, C, R, D>>(ctx.mesh->dp(), o);
    default:
      return std::make_unique<parallel::zero3_pass<T, C, R, D>>(ctx.mesh->dp(), o);
    }
  }
};

} // namespace strata
