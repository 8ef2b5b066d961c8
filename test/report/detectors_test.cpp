// The troubleshooting detectors wired into the trainer (docs/troubleshooting.md), on thread-ranks
// of the local backend with a small GPT: data-parallel ranks given the same samples, samplers with
// different seeds, an epoch that restarts, a global batch changed across a checkpoint with the
// learning rate kept, ranks with different trainer seeds (the preflight), and an allocation past
// the memory capacity (the out-of-memory advice). Each fires on its condition, once, and stays
// silent on correct use.
#include "../support/parity.hpp"
#include "../support/seed.hpp"
#include "../support/training.hpp"

#include <strata/comm/local.hpp>
#include <strata/comm/mesh.hpp>
#include <strata/core/warning.hpp>
#include <strata/data/dataset.hpp>
#include <strata/data/loader.hpp>
#include <strata/data/sampler.hpp>
#include <strata/io/trainer_checkpoint.hpp>
#include <strata/models/gpt.hpp>
#include <strata/optim/adamw.hpp>
#include <strata/train/trainer.hpp>

#include <catch2/catch.hpp>

#include <filesystem>
#include <mutex>
#include <string>
#include <unistd.h>
#include <vector>

namespace st = strata;
namespace fs = std::filesystem;

namespace {

using gpt = st::models::gpt_model<float>;
using dp_plan = st::plan<st::data_parallel<>>;

gpt const model{{.vocab = 40, .seq = 8, .features = 16, .heads = 4, .layers = 2}};

// Collects the warnings said while it lives.
struct captured_warnings {
  std::mutex mu;
  std::vector<std::string> said;
  st::warning_handler previous;
  captured_warnings() {
    previous = st::set_warning_handler([this](std::string_view t) {
      std::lock_guard lock(mu);
      said.emplace_back(t);
    });
  }
  ~captured_warnings() { st::set_warning_handler(previous); }
  std::size_t count(std::string const& part) {
    std::lock_guard lock(mu);
    std::size_t n = 0;
    for (auto const& s : said)
      n += s.find(part) != std::string::npos;
    return n;
  }
};

// A token dataset of `samples` windows of 8 ids in [0, 40).
st::data::token_dataset tokens(std::size_t samples, std::uint64_t seed) {
  std::vector<std::int32_t> ids(samples * 8 + 1);
  for (std::size_t i = 0; i < ids.size(); ++i)
    ids[i] = static_cast<std::int32_t>(st::test::mix(seed, i) % 40);
  return st::data::token_dataset(std::move(ids), 8, 40);
}

st::trainer_options options(double lr = 1e-3) {
  return {.lr = st::test::constant_lr(lr), .seed = 5};
}

} // namespace

TEST_CASE("data-parallel ranks given the same samples are named once; shares are silent",
          "[detectors][data]") {
  std::uint64_t const seed = st::test::seed();
  for (bool same : {true, false}) {
    captured_warnings w;
    st::comm::local::run(2, [&](st::comm::local::communicator& world) {
      st::comm::mesh mesh(world, {.dp = 2});
      st::trainer<gpt, dp_plan> t(mesh, model, st::engine::use<st::optim::adamw<float>>({}),
                                  options());
      std::size_t const d = same ? 0 : static_cast<std::size_t>(world.rank());
      for (int k = 0; k < 3; ++k) {
        auto const data = st::test::make_parity_data(model, {.sequences = 8, .seq = 8},
                                                     seed + static_cast<std::uint64_t>(k));
        (void)t.step(data.slice(d * 4, 4, 8, 0));
      }
    });
    INFO("same samples: " << same);
    CHECK(w.count("every data-parallel rank (0, 1) got the same samples") == (same ? 1u : 0u));
    CHECK(w.said.size() == (same ? 1u : 0u));
  }
}

TEST_CASE("samplers with different seeds are named; one seed is silent", "[detectors][data]") {
  auto const ds = tokens(64, st::test::seed());
  for (bool differ : {true, false}) {
    captured_warnings w;
    st::comm::local::run(2, [&](st::comm::local::communicator& world) {
      st::comm::mesh mesh(world, {.dp = 2});
      st::trainer<gpt, dp_plan> t(mesh, model, st::engine::use<st::optim::adamw<float>>({}),
                                  options());
      std::uint64_t const sampler_seed =
          differ ? 100 + static_cast<std::uint64_t>(world.rank()) : 100;
      st::data::loader loader(
          ds, st::data::distributed_sampler(64, 2, world.rank(), {.seed = sampler_seed}),
          {.batch = 4});
      for (int k = 0; k < 3; ++k)
        (void)t.step(loader.next());
    });
    INFO("different seeds: " << differ);
    CHECK(w.count("samplers use different seeds (rank 0: 100, rank 1: 101)") == (differ ? 1u : 0u));
    CHECK(w.said.size() == (differ ? 1u : 0u));
  }
}

TEST_CASE("an epoch that restarts (a loader made anew each epoch) is said once",
          "[detectors][data]") {
  auto const ds = tokens(8, st::test::seed()); // 2 batches of 4 an epoch
  for (bool fresh_each_epoch : {true, false}) {
    captured_warnings w;
    st::trainer<gpt, st::plan<>> t(model, st::engine::use<st::optim::adamw<float>>({}), options());
    auto make = [&] {
      return st::data::loader(ds, st::data::distributed_sampler(8, 1, 0, {.seed = 3}),
                              {.batch = 4});
    };
    auto loader = make();
    for (int epoch = 0; epoch < 3; ++epoch) {
      if (fresh_each_epoch)
        loader = make();
      for (int b = 0; b < 2; ++b)
        (void)t.step(loader.next());
    }
    INFO("a loader each epoch: " << fresh_each_epoch);
    CHECK(w.count("at step 3 the data went back to epoch 0 batch 0 after epoch 0 batch 1") ==
          (fresh_each_epoch ? 1u : 0u));
    CHECK(w.said.size() == (fresh_each_epoch ? 1u : 0u));
  }
}

TEST_CASE("a checkpoint loaded at another global batch with the learning rate kept warns with "
          "the factors",
          "[detectors][lr]") {
  fs::path const root =
      fs::temp_directory_path() / ("strata_detectors_" + std::to_string(::getpid()));
  fs::remove_all(root);
  std::uint64_t const seed = st::test::seed();
  fs::path saved;
  // Saved at dp 2, 4 samples a rank: a global batch of 8 at lr 1e-3.
  st::comm::local::run(2, [&](st::comm::local::communicator& world) {
    st::comm::mesh mesh(world, {.dp = 2});
    st::trainer<gpt, dp_plan> t(mesh, model, st::engine::use<st::optim::adamw<float>>({}),
                                options(1e-3));
    auto const d = static_cast<std::size_t>(world.rank());
    for (int k = 0; k < 2; ++k) {
      auto const data = st::test::make_parity_data(model, {.sequences = 8, .seq = 8},
                                                   seed + static_cast<std::uint64_t>(k));
      (void)t.step(data.slice(d * 4, 4, 8, 0));
    }
    auto const p = st::io::save(t, mesh, root);
    if (world.rank() == 0)
      saved = p;
  });
  REQUIRE(!saved.empty());
  struct resume {
    double lr;
    std::size_t per_rank;
    std::size_t warnings;
  };
  // dp 4: 4 a rank (16, the rate kept: warned), 4 a rank at 2e-3 (scaled: silent), 2 a rank
  // (the global batch kept: silent).
  for (auto const r : {resume{1e-3, 4, 1}, resume{2e-3, 4, 0}, resume{1e-3, 2, 0}}) {
    captured_warnings w;
    st::comm::local::run(4, [&](st::comm::local::communicator& world) {
      st::comm::mesh mesh(world, {.dp = 4});
      st::trainer<gpt, dp_plan> t(mesh, model, st::engine::use<st::optim::adamw<float>>({}),
                                  options(r.lr));
      st::io::load(t, mesh, saved);
      auto const d = static_cast<std::size_t>(world.rank());
      for (int k = 0; k < 2; ++k) {
        auto const data = st::test::make_parity_data(model, {.sequences = 16, .seq = 8},
                                                     seed + 10 + static_cast<std::uint64_t>(k));
        (void)t.step(data.slice(d * r.per_rank, r.per_rank, 8, 0));
      }
    });
    INFO("lr " << r.lr << ", " << r.per_rank << " a rank");
    CHECK(w.said.size() == r.warnings);
    if (r.warnings) {
      CHECK(w.count("the global batch is 16 (dp 4) but the learning rate 0.001 was set for 8 "
                    "(dp 2, step 2)") == 1);
      CHECK(w.count("linear rule, x2 -> 0.002") == 1);
      CHECK(w.count("square-root rule, x1.41421 -> 0.00141421") == 1);
      CHECK(w.count("keep the global batch: 2 samples per rank") == 1);
    }
  }
  fs::remove_all(root);
}

TEST_CASE("ranks with different trainer seeds are refused at construction, naming the seeds",
          "[detectors][seed]") {
  for (bool differ : {true, false}) {
    std::vector<std::string> errors(3);
    st::comm::local::run(3, [&](st::comm::local::communicator& world) {
      st::comm::mesh mesh(world, {.dp = 3});
      auto o = options();
      o.seed = differ && world.rank() == 2 ? 9 : 5;
      try {
        st::trainer<gpt, dp_plan> t(mesh, model, st::engine::use<st::optim::adamw<float>>({}), o);
      } catch (st::config_error const& e) {
        errors[static_cast<std::size_t>(world.rank())] = e.what();
      }
    });
    for (auto const& e : errors) {
      INFO(e);
      if (differ)
        CHECK(e.find("trainer_options::seed differ (rank 0: 5, rank 1: 5, rank 2: 9)") !=
              std::string::npos);
      else
        CHECK(e.empty());
    }
  }
}

TEST_CASE("past the memory capacity the trainer's allocation_error carries the advice",
          "[detectors][oom]") {
  std::size_t held = 0;
  {
    st::trainer<gpt, st::plan<>> t(model, st::engine::use<st::optim::adamw<float>>({}), options());
    held = t.ledger().current();
  }
  REQUIRE(held > 0);
  // Silent at the capacity it needs.
  auto fits = options();
  fits.memory_capacity = held;
  st::trainer<gpt, st::plan<>> ok(model, st::engine::use<st::optim::adamw<float>>({}), fits);
  CHECK(ok.ledger().current() == held);
  // Past it: the advice, once, in the error.
  auto tight = options();
  tight.memory_capacity = held - 1;
  try {
    st::trainer<gpt, st::plan<>> t(model, st::engine::use<st::optim::adamw<float>>({}), tight);
    FAIL("a trainer past its memory capacity was built");
  } catch (st::allocation_error const& e) {
    std::string const what = e.what();
    INFO(what);
    CHECK(what.find("out of memory on \"rank 0\"") != std::string::npos);
    CHECK(what.find("dominate") != std::string::npos);
    CHECK(what.find("with dp = 1 it saves nothing") != std::string::npos);
    CHECK(what.find("fix: ") != std::string::npos);
    CHECK(what.find("out of memory on") == what.rfind("out of memory on")); // said once
  }
}
