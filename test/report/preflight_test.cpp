// The trainer's preflight (strata/train/preflight.hpp): ranks comparing their builds of strata.
// Three thread-ranks of the local backend, one of them faking another version, other options or
// another compiler: every rank raises the same config_error naming the rank that differs and
// what differs; equal builds pass; a trainer's construction runs it (one all_gather on the
// world).
#include <strata/comm/local.hpp>
#include <strata/comm/mesh.hpp>
#include <strata/core/build_info.hpp>
#include <strata/models/mlp.hpp>
#include <strata/optim/sgd.hpp>
#include <strata/train/preflight.hpp>
#include <strata/train/trainer.hpp>

#include "../support/training.hpp"

#include <catch2/catch.hpp>

#include <functional>
#include <mutex>
#include <string>
#include <vector>

namespace st = strata;

namespace {

// Runs the preflight on n thread-ranks, rank `faked`'s facts changed by `fake`; returns each
// rank's error message ("" when it did not throw).
std::vector<std::string> preflight_messages(int n, int faked,
                                            std::function<void(st::build_facts&)> const& fake) {
  std::vector<std::string> messages(static_cast<std::size_t>(n));
  st::comm::local::run(n, [&](st::comm::local::communicator& world) {
    auto facts = st::build_facts::of_this_build();
    if (world.rank() == faked) {
      fake(facts);
      facts.hash = facts.compute_hash();
    }
    try {
      st::preflight(world, facts);
    } catch (st::config_error const& e) {
      messages[static_cast<std::size_t>(world.rank())] = e.what();
    }
  });
  return messages;
}

} // namespace

TEST_CASE("the preflight passes when every rank runs the same build", "[preflight]") {
  for (int n : {1, 2, 3}) {
    auto const m = preflight_messages(n, -1, [](st::build_facts&) {});
    for (auto const& s : m)
      CHECK(s.empty());
  }
}

TEST_CASE("the preflight names the rank that runs another version", "[preflight]") {
  auto const m = preflight_messages(3, 1, [](st::build_facts& f) { f.version = 0x000200; });
  for (auto const& s : m) {
    INFO(s);
    CHECK(s.find("2 of 3 ranks (rank 0 among them) run strata " + st::version_string()) !=
          std::string::npos);
    CHECK(s.find("rank 1 differs: version 0.2.0 instead of " + st::version_string()) !=
          std::string::npos);
    CHECK(s.find("rank 0 differs") == std::string::npos);
    CHECK(s.find("rank 2 differs") == std::string::npos);
    CHECK(s == m[0]); // the same message on every rank
  }
}

TEST_CASE("the preflight names the options and the compiler that differ", "[preflight]") {
  auto m = preflight_messages(3, 0, [](st::build_facts& f) {
    f.options ^= st::build_fast_math;
    f.options ^= st::build_openblas;
  });
  INFO(m[2]);
  CHECK(m[2].find("(rank 1 among them)") != std::string::npos); // the majority's lowest rank
  auto const has_fm = (st::build_facts::of_this_build().options & st::build_fast_math) != 0;
  CHECK(m[2].find("rank 0 differs: build options") != std::string::npos);
  CHECK(m[2].find(has_fm ? "without fast_math" : "with fast_math") != std::string::npos);
  CHECK(m[2].find("openblas") != std::string::npos);

  m = preflight_messages(3, 2, [](st::build_facts& f) {
    f.compiler = static_cast<std::int64_t>((2ull << 48) | (17ull << 32) | (1ull << 16));
    f.layout ^= 1;
  });
  INFO(m[0]);
  CHECK(m[0].find("rank 2 differs: compiled by Clang 17.1.0 instead of ") != std::string::npos);
  CHECK(m[0].find("other type sizes or alignments") != std::string::npos);
}

TEST_CASE("with two ranks the preflight names rank 1 against rank 0", "[preflight]") {
  auto const m = preflight_messages(2, 1, [](st::build_facts& f) { f.magic = 42; });
  INFO(m[0]);
  CHECK(m[0].find("1 of 2 ranks (rank 0 among them)") != std::string::npos);
  CHECK(m[0].find("rank 1 differs: not a strata build record") != std::string::npos);
  CHECK(m[1] == m[0]);
}

TEST_CASE("a trainer's construction runs the preflight on the world", "[preflight]") {
  st::models::mlp_model<float> m{8, 16, 2, 4};
  st::comm::local::run(3, [&](st::comm::local::communicator& world) {
    st::comm::mesh mesh(world, {.dp = 3});
    auto const before = world.counters().calls(st::comm::op_kind::all_gather);
    st::trainer<decltype(m), st::plan<st::data_parallel<>>> t(
        mesh, m, st::engine::use<st::optim::sgd<float>>(),
        {.lr = st::test::constant_lr(0.1), .seed = 1});
    CHECK(world.counters().calls(st::comm::op_kind::all_gather) - before == 1);
  });
}
