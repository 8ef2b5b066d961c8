// Parameter groups (issue 19): the rules, the default (no decay on biases and norms), the
// report, and the first AdamW step of every parameter against torch.optim.AdamW's formula with
// its group's weight decay and learning rate.
#include <strata/models/gpt.hpp>
#include <strata/optim/adamw.hpp>
#include <strata/train/trainer.hpp>

#include "../support/parity.hpp"
#include "../support/seed.hpp"
#include "../support/training.hpp"

#include <catch2/catch.hpp>

#include <cmath>
#include <map>
#include <string>
#include <vector>

namespace st = strata;
using Catch::Matchers::Contains;

namespace {

st::models::gpt_model<float> const gpt{
    {.vocab = 24, .seq = 8, .features = 16, .heads = 2, .layers = 2}};

st::param_groups custom() {
  return st::test::mixed_groups();
}

} // namespace

TEST_CASE("the default groups leave biases and normalisation parameters undecayed", "[groups]") {
  st::trainer_options o{.lr = st::test::constant_lr(1e-2), .seed = 1};
  st::trainer<decltype(gpt)> t(gpt, st::engine::use<st::optim::adamw<float>>({}), o);
  auto const groups = t.parameter_groups();
  REQUIRE(groups.size() == 2);
  CHECK(groups[0].name == "no_decay");
  CHECK(groups[0].weight_decay_mult == 0);
  CHECK(groups[1].name == "decay");
  CHECK(groups[1].weight_decay_mult == 1);
  std::size_t total = 0;
  t.for_each_parameter([&](st::nn::parameter<float>& p) {
    auto const& in =
        p.kind() == st::nn::parameter_kind::bias || p.kind() == st::nn::parameter_kind::norm
            ? groups[0]
            : groups[1];
    INFO(p.name());
    CHECK(std::count(in.parameters.begin(), in.parameters.end(), p.name()) == 1);
    // Every 1-D parameter (gains and biases: nanoGPT's dim < 2) and every bias.
    bool const bias_or_norm = p.name().ends_with(".bias") || p.shape().size() == 1;
    CHECK(bias_or_norm == (&in == &groups[0]));
    total += p.size();
  });
  CHECK(groups[0].elements + groups[1].elements == total);
  auto const text = t.describe_parameter_groups();
  CHECK_THAT(text, Contains("no_decay"));
  CHECK_THAT(text, Contains("blocks.0.ln1.weight"));
  CHECK_THAT(text, Contains("weight_decay x 0"));
}

TEST_CASE("parameter group rules: the first match wins, and bad groups are refused", "[groups]") {
  auto const g = custom();
  std::vector<std::size_t> shape{16};
  CHECK(g.group_of({"blocks.0.attn.qkv.bias", st::nn::parameter_kind::bias, shape, 1}) == 1);
  CHECK(g.group_of({"blocks.0.attn.qkv.weight", st::nn::parameter_kind::weight, shape, 1}) == 2);
  CHECK(g.group_of({"head.weight", st::nn::parameter_kind::weight, shape, 3}) == 3);
  CHECK(g.group(3).name == "decay");
  auto refused = [](auto f, char const* text) {
    try {
      f();
      FAIL("accepted");
    } catch (st::config_error const& e) {
      CHECK_THAT(std::string(e.what()), Contains(text));
    }
  };
  refused(
      [] {
        st::param_groups{}.add({"x", st::match::name_contains("a"), -1.0, 1.0});
      },
      "weight_decay_mult = -1");
  refused([] { st::param_groups{}.add({"x", nullptr, 1.0, 1.0}); }, "has no rule");
  refused(
      [] {
        custom().add({"attention", st::match::name_contains("a"), 1.0, 1.0});
      },
      "two groups are called \"attention\"");
  refused([] { st::param_groups{}.set_fallback("rest", 1.0, std::nan("")); }, "lr_mult = nan");
}

namespace {

// One AdamW step of Plan's trainer (f32, or bf16 with f32 master weights) on one rank, each
// parameter against torch.optim.AdamW's first step with its group's multipliers, from the f32
// initial values: p1 = p0 (1 - lr wd) - lr g / (|g| + eps) (step 1: m_hat = g, v_hat = g^2),
// rounded to the parameter's type. The decay is large (wd = 5) so that bf16 shows it.
template <class Plan>
void check_first_step(double tolerance) {
  double const lr = 1e-2, wd = 5, eps = 1e-8;
  std::uint64_t const seed = st::test::seed();
  st::trainer_options o{.lr = st::test::constant_lr(lr), .seed = seed};
  o.groups = custom();
  auto adamw = st::engine::use<st::optim::adamw<float>>({.eps = eps, .weight_decay = wd});
  std::map<std::string, std::vector<float>> before; // the f32 model's initial values
  {
    st::trainer<decltype(gpt)> f32(gpt, adamw, o);
    f32.for_each_parameter([&](st::nn::parameter<float>& p) {
      before[p.name()].assign(p.values().begin(), p.values().end());
    });
  }
  st::trainer<decltype(gpt), Plan> t(gpt, adamw, o);
  using T = typename decltype(t)::value_type;
  auto const data = st::test::make_parity_data(gpt, {.sequences = 4, .seq = 8}, seed);
  t.step(data.view(4, 8));
  auto const groups = t.parameter_groups();
  std::map<std::string, std::size_t> group_of;
  for (std::size_t i = 0; i < groups.size(); ++i)
    for (auto const& n : groups[i].parameters)
      group_of[n] = i;
  std::vector<std::size_t> per_group(groups.size(), 0);
  t.for_each_parameter([&](st::nn::parameter<T>& p) {
    std::size_t const gi = group_of.at(p.name());
    auto const& g = groups[gi];
    ++per_group[gi];
    double const l = lr * g.lr_mult;
    auto const& p0 = before.at(p.name());
    auto v = p.values();
    auto gr = p.grads();
    double worst = 0;
    for (std::size_t i = 0; i < v.size(); ++i) {
      double const d = static_cast<double>(st::element_traits<T>::to_compute(gr[i]));
      double const want = p0[i] * (1 - l * wd * g.weight_decay_mult) - l * d / (std::fabs(d) + eps);
      double const got = static_cast<double>(st::element_traits<T>::to_compute(v[i]));
      worst = std::max(worst, std::fabs(got - want) / (1e-7 + tolerance * std::fabs(want)));
    }
    INFO(p.name() << " in group " << g.name << ": worst error " << worst << " of tolerance");
    CHECK(worst <= 1);
  });
  for (std::size_t i = 0; i < groups.size(); ++i) // every group holds parameters
    CHECK(per_group[i] > 0);
}

} // namespace

TEST_CASE("one AdamW step updates each parameter with its group's decay and learning rate, "
          "as torch.optim.AdamW's param_groups",
          "[groups]") {
  SECTION("f32") {
    check_first_step<st::plan<>>(1e-6);
  }
  // bf16 parameters round the f32 master weights: one rounding, 2^-8 relative.
  SECTION("bf16") {
    check_first_step<st::plan<st::precision::bf16>>(0x1p-8);
  }
}
