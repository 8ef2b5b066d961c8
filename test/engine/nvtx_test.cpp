// NVTX ranges (engine/nvtx.hpp) as a tool sees them: the test runs with NVTX_INJECTION64_PATH
// naming nvtx_tool.cpp's library, which nvtx3 loads as it loads Nsight Systems; the tool
// records every range, and the test checks, for each rank of dp 2 x pp 2 (1F1B) on 4
// in-process ranks, that each step is one "step N" range holding one range per operation the
// trace recorded, named as the trainer names it, in program order, all balanced, all in the
// "strata" domain; evaluate() is an "evaluate" range around its operations.
#include "../support/parity.hpp"
#include "../support/seed.hpp"
#include "../support/training.hpp"

#include <strata/comm/local.hpp>
#include <strata/models/gpt.hpp>
#include <strata/optim/adamw.hpp>
#include <strata/train/trainer.hpp>

#include <catch2/catch.hpp>

#include <dlfcn.h>

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <string>
#include <type_traits>
#include <vector>

namespace st = strata;

namespace {

// The tool's recorder, found in the library nvtx3 loaded.
struct tool {
  int (*initialized)() = nullptr;
  char const* (*domain)() = nullptr;
  int (*thread)() = nullptr;
  std::size_t (*count)() = nullptr;
  char const* (*range)(std::size_t, int*, int*) = nullptr;
  long (*open)() = nullptr;
  std::size_t (*unbalanced)() = nullptr;
  std::size_t (*foreign)() = nullptr;
  std::size_t (*overflow)() = nullptr;

  // Null members when the library is not loaded (no NVTX call yet, or no path set).
  static tool find() {
    tool t;
    char const* path = std::getenv("NVTX_INJECTION64_PATH");
    void* h = path ? ::dlopen(path, RTLD_NOW | RTLD_NOLOAD) : nullptr;
    if (!h)
      return t;
    auto get = [&](auto& f, char const* name) {
      f = reinterpret_cast<std::remove_reference_t<decltype(f)>>(::dlsym(h, name));
    };
    get(t.initialized, "strata_nvtx_tool_initialized");
    get(t.domain, "strata_nvtx_tool_domain");
    get(t.thread, "strata_nvtx_tool_thread");
    get(t.count, "strata_nvtx_tool_count");
    get(t.range, "strata_nvtx_tool_range");
    get(t.open, "strata_nvtx_tool_open");
    get(t.unbalanced, "strata_nvtx_tool_unbalanced");
    get(t.foreign, "strata_nvtx_tool_foreign");
    get(t.overflow, "strata_nvtx_tool_overflow");
    return t;
  }
};

struct recorded {
  int depth = 0;
  std::string name;
};

} // namespace

TEST_CASE("NVTX: a range per step and one per operation the executor runs, named as the trace "
          "names it",
          "[engine][nvtx]") {
  REQUIRE(std::getenv("NVTX_INJECTION64_PATH") != nullptr); // set by CMake (test/engine)
  using plan =
      st::plan<st::data_parallel<>, st::pipeline_parallel<st::one_f_one_b, st::micro_batches<2>>>;
  std::uint64_t const seed = st::test::seed();
  st::models::gpt_model<float> const model{
      {.vocab = 40, .seq = 8, .features = 16, .heads = 4, .layers = 2}};
  constexpr int steps = 3;
  std::mutex mu;
  std::vector<int> thread_of(4, -1);
  std::vector<std::vector<std::string>> expected(4); // each rank's operations, named
  std::vector<std::size_t> traced(4, 0);             // the trace's events per step
  st::comm::local::run(4, [&](st::comm::local::communicator& world) {
    st::comm::mesh mesh(world, {.dp = 2, .pp = 2});
    st::trainer<st::models::gpt_model<float>, plan> t(
        mesh, model, st::engine::use<st::optim::adamw<float>>({}),
        {.lr = st::test::constant_lr(1e-3), .seed = seed});
    auto const r = static_cast<std::size_t>(world.rank());
    auto const slice = static_cast<std::size_t>(mesh.coords().dp) * 4;
    for (int k = 0; k < steps; ++k) {
      auto const data = st::test::make_parity_data(model, {.sequences = 8, .seq = 8},
                                                   seed + static_cast<std::uint64_t>(k));
      (void)t.step(data.slice(slice, 4, 8, 0));
    }
    auto const data = st::test::make_parity_data(model, {.sequences = 8, .seq = 8}, seed);
    (void)t.evaluate(data.slice(slice, 4, 8, 0));
    tool const tl = tool::find(); // loaded at the first NVTX call
    std::lock_guard lock(mu);
    thread_of[r] = tl.thread ? tl.thread() : -1;
    for (auto const& o : t.program().ops)
      expected[r].push_back(t.op_name(o));
    traced[r] = t.trace().events().size();
  });
  tool const tl = tool::find();
  REQUIRE(tl.initialized); // the library is loaded: nvtx3 found it on NVTX_INJECTION64_PATH
  REQUIRE(tl.initialized() == 1);
  CHECK(std::string(tl.domain()) == "strata");
  CHECK(tl.open() == 0);
  CHECK(tl.unbalanced() == 0);
  CHECK(tl.foreign() == 0);
  REQUIRE(tl.overflow() == 0);
  std::vector<std::vector<recorded>> by_thread(8);
  for (std::size_t i = 0; i < tl.count(); ++i) {
    int th = 0, depth = 0;
    char const* name = tl.range(i, &th, &depth);
    REQUIRE(name);
    REQUIRE(th >= 0);
    if (static_cast<std::size_t>(th) >= by_thread.size())
      by_thread.resize(static_cast<std::size_t>(th) + 1);
    by_thread[static_cast<std::size_t>(th)].push_back({depth, name});
  }
  for (std::size_t r = 0; r < 4; ++r) {
    INFO("rank " << r);
    REQUIRE(thread_of[r] >= 0);
    REQUIRE(traced[r] == expected[r].size());
    // the ranges end in order: a run's operations, then the run's own range
    std::vector<std::string> runs;
    std::vector<std::vector<std::string>> ops(1);
    for (auto const& x : by_thread[static_cast<std::size_t>(thread_of[r])]) {
      REQUIRE(x.depth <= 1);
      if (x.depth == 1) {
        ops.back().push_back(x.name);
      } else {
        runs.push_back(x.name);
        ops.emplace_back();
      }
    }
    CHECK(runs == std::vector<std::string>{"step 1", "step 2", "step 3", "evaluate"});
    REQUIRE(ops.size() == runs.size() + 1);
    CHECK(ops.back().empty()); // no operation outside a run
    for (int k = 0; k < steps; ++k) {
      INFO("step " << k + 1);
      CHECK(ops[static_cast<std::size_t>(k)].size() == traced[r]);
      CHECK(ops[static_cast<std::size_t>(k)] == expected[r]);
    }
    auto const& eval = ops[static_cast<std::size_t>(steps)];
    CHECK(std::count(eval.begin(), eval.end(), "forward") > 0);
    CHECK(std::count(eval.begin(), eval.end(), "backward") == 0);
  }
}
