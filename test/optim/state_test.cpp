// state_dict, and saving and restoring optimizer state: exact, checked, and by slices.
#include "inputs.hpp"

#include <strata/optim/adamw.hpp>
#include <strata/optim/sgd.hpp>
#include <strata/optim/state.hpp>

#include <catch2/catch.hpp>

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace so = strata::optim;
namespace to = strata::test::optim;
using Catch::Matchers::Contains;
using strata::config_error;

TEST_CASE("state_dict keeps entries in order and gives back the bits it was given",
          "[optim][state]") {
  std::uint64_t const k = to::key("state_dict round trip");
  std::vector<float> const a = to::random_values<float>(37, k, 0.1, 2.0);
  std::vector<double> const b = to::random_values<double>(5, k + 1, 0.1, 2.0);
  std::int64_t const step = static_cast<std::int64_t>(strata::test::mix(k, 3) >> 40) + 1;

  so::state_dict s;
  s.put("b", std::span<double const>(b));
  s.put_scalar("step", step);
  s.put("a", std::span<float const>(a));
  REQUIRE(s.size() == 3);
  std::vector<std::string> names;
  for (auto const& [name, t] : s)
    names.push_back(name);
  CHECK(names == std::vector<std::string>{"b", "step", "a"});
  CHECK(s.at("a").type == strata::dtype::f32);
  CHECK(s.at("a").shape == std::vector<std::int64_t>{37});
  CHECK(s.at("step").shape.empty());
  CHECK(s.at("step").numel() == 1);

  std::vector<float> a2(a.size());
  s.get("a", std::span<float>(a2));
  CHECK(to::same_bits<float>(a2, a));
  CHECK(s.get_scalar<std::int64_t>("step") == step);
  std::vector<double> b_tail(3);
  s.get("b", std::span<double>(b_tail), 2);
  CHECK(to::same_bits<double>(b_tail, std::span<double const>(b).subspan(2)));

  // Replacing keeps the position.
  s.put("b", std::span<double const>(b).first(1));
  names.clear();
  for (auto const& [name, t] : s)
    names.push_back(name);
  CHECK(names == std::vector<std::string>{"b", "step", "a"});
  CHECK(s.at("b").numel() == 1);

  so::state_dict copy = s;
  CHECK(copy == s);
  copy.put_scalar("step", step + 1);
  CHECK(copy != s);
}

TEST_CASE("state_dict names what is wrong when a restore cannot match", "[optim][state]") {
  so::state_dict s;
  std::vector<float> const v(10, 0.25f);
  s.put("exp_avg", std::span<float const>(v));
  s.put_scalar("step", std::int64_t{7});

  std::vector<float> small(4);
  REQUIRE_THROWS_AS(s.get("exp_avg", std::span<float>(small)), config_error);
  REQUIRE_THROWS_WITH(s.get("exp_avg", std::span<float>(small)),
                      Contains("holds 10 elements but 4 are being restored"));
  std::vector<double> wide(10);
  REQUIRE_THROWS_WITH(s.get("exp_avg", std::span<double>(wide)),
                      Contains("saved as f32 but is being restored as f64"));
  REQUIRE_THROWS_WITH(s.get("momentum_buffer", std::span<float>(small)),
                      Contains("no 'momentum_buffer' (it holds: exp_avg, step)"));
  REQUIRE_THROWS_WITH(s.get("exp_avg", std::span<float>(small), 8),
                      Contains("elements [8, 12) of state 'exp_avg', which holds 10"));
  REQUIRE_THROWS_WITH(s.get_scalar<float>("exp_avg"), Contains("holds 10 elements but 1"));
  REQUIRE_THROWS_WITH(s.get_scalar<std::int64_t>("exp_avg"),
                      Contains("as f32 but is being restored as i64"));

  so::state_tensor bad{strata::dtype::f64, {3, 2}, std::vector<std::byte>(40)};
  REQUIRE_THROWS_WITH(s.put("bad", bad), Contains("has 40 bytes but its shape holds 6 f64"));
  CHECK_FALSE(s.contains("bad"));
}

namespace {

template <class Opt>
using value_of = typename Opt::value_type;

// Trains `opt` on params for steps [first, last] with gradients drawn from (k, step).
template <class Opt>
void train(Opt& opt, std::vector<value_of<Opt>>& p, std::uint64_t k, long first, long last,
           std::size_t begin = 0) {
  using T = value_of<Opt>;
  for (long t = first; t <= last; ++t) {
    // The full gradient of the step; a slice optimizer takes its part.
    std::vector<T> const g =
        to::random_values<T>(begin + p.size(), k + static_cast<std::uint64_t>(t), 0.1, 1.0);
    so::step_context const ctx{
        .lr = to::random_in(k, 1000 + static_cast<std::uint64_t>(t), 1e-3, 1e-2),
        .step = t,
        .grad_scale = to::random_in(k, 2000 + static_cast<std::uint64_t>(t), 0.5, 1.0)};
    opt.step(p, std::span<T const>(g).subspan(begin, p.size()), ctx);
  }
}

template <class Opt>
void check_resume(typename Opt::options_type const& options, char const* label) {
  using T = value_of<Opt>;
  constexpr std::size_t n = 1021;
  std::uint64_t const k = to::key(label);
  std::vector<T> const p0 = to::random_values<T>(n, k, 0.5, 1.5);

  std::vector<T> straight = p0;
  Opt uninterrupted(n, options);
  train(uninterrupted, straight, k, 1, 6);

  // Three steps, save; a fresh optimizer restores and runs the other three.
  std::vector<T> at3 = p0;
  so::state_dict saved;
  {
    Opt first(n, options);
    train(first, at3, k, 1, 3);
    saved = first.save();
  }
  std::vector<T> resumed = at3;
  Opt second(n, options);
  second.load(saved);
  CHECK(second.step_count() == 3);
  CHECK(second.save() == saved); // restore is exact
  train(second, resumed, k, second.step_count() + 1, 6);
  CHECK(to::same_bits<T>(resumed, straight));
  CHECK(second.save() == uninterrupted.save());

  // ZeRO later: each rank restores its slice of the full state and continues on its slice.
  std::vector<std::size_t> const cuts = {0, 333, 334, 1000, n};
  for (std::size_t s = 0; s + 1 < cuts.size(); ++s) {
    std::size_t const b = cuts[s], len = cuts[s + 1] - cuts[s];
    std::vector<T> part(at3.begin() + static_cast<std::ptrdiff_t>(b),
                        at3.begin() + static_cast<std::ptrdiff_t>(b + len));
    Opt shard(len, options);
    shard.load(saved, b);
    CHECK(shard.step_count() == 3);
    train(shard, part, k, 4, 6, b);
    CHECK(to::same_bits<T>(part, std::span<T const>(straight).subspan(b, len)));
  }
}

} // namespace

TEMPLATE_TEST_CASE("sgd: save, restore and continue trains bit for bit like uninterrupted "
                   "training, whole or by slices",
                   "[optim][state]", float, double) {
  check_resume<so::sgd<TestType>>({.momentum = 0.9, .weight_decay = 1e-2}, "resume sgd");
  check_resume<so::sgd<TestType>>({.momentum = 0.9, .nesterov = true}, "resume sgd nesterov");
  check_resume<so::sgd<TestType>>({.weight_decay = 1e-2}, "resume sgd plain");
}

TEMPLATE_TEST_CASE("adamw: save, restore and continue trains bit for bit like uninterrupted "
                   "training, whole or by slices",
                   "[optim][state]", float, double) {
  check_resume<so::adamw<TestType>>({}, "resume adamw");
  check_resume<so::adamw<TestType>>({.beta1 = 0.3, .beta2 = 0.95, .weight_decay = 0.1},
                                    "resume adamw low beta1");
}

TEST_CASE("a restore that does not match the optimizer fails and leaves it as it was",
          "[optim][state]") {
  std::uint64_t const k = to::key("restore mismatch");
  std::vector<float> p = to::random_values<float>(100, k, 0.5, 1.5);
  so::adamw<float> big(100, {});
  train(big, p, k, 1, 2);
  so::state_dict const saved = big.save();

  so::adamw<float> small(60, {});
  std::vector<float> q = to::random_values<float>(60, k + 9, 0.5, 1.5);
  train(small, q, k, 1, 1);
  so::state_dict const before = small.save();

  REQUIRE_THROWS_AS(small.load(saved), config_error);
  REQUIRE_THROWS_WITH(small.load(saved), Contains("holds 100 elements but 60"));
  REQUIRE_THROWS_WITH(small.load(saved, 50), Contains("elements [50, 110)"));
  CHECK(small.save() == before);

  so::adamw<double> wide(100, {});
  REQUIRE_THROWS_WITH(wide.load(saved), Contains("saved as f32 but is being restored as f64"));

  so::sgd<float> momentum(100, {.momentum = 0.9});
  REQUIRE_THROWS_WITH(momentum.load(saved),
                      Contains("no 'momentum_buffer' (it holds: step, exp_avg, exp_avg_sq)"));
  so::sgd<float> plain(100, {});
  std::vector<float> r = to::random_values<float>(100, k + 5, 0.5, 1.5);
  train(momentum, r, k, 1, 1);
  REQUIRE_THROWS_WITH(plain.load(momentum.save()),
                      Contains("has a momentum buffer but this sgd has momentum 0"));
  REQUIRE_THROWS_WITH(momentum.load(plain.save()),
                      Contains("no 'momentum_buffer' (it holds: step)"));
  REQUIRE_THROWS_WITH(big.load(momentum.save()), Contains("no 'exp_avg'"));
}
