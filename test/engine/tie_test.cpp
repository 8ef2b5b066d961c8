// Tied parameters on one rank (engine::model_builder::tie, gpt_config::tie_embeddings): what a
// tie checks when declared, that the members start and stay equal, that each gets the sum of
// both layers' gradients (the gradient of one tensor read twice), and that the norm counts the
// tensor once. The strategies' lines are parity lines (test/parallel).
#include <strata/engine/node.hpp>
#include <strata/engine/op.hpp>
#include <strata/engine/pass.hpp>
#include <strata/models/gpt.hpp>
#include <strata/nn/linear.hpp>
#include <strata/optim/sgd.hpp>
#include <strata/train/trainer.hpp>

#include "../support/parity.hpp"
#include "../support/seed.hpp"
#include "../support/training.hpp"

#include <catch2/catch.hpp>

#include <cmath>
#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace st = strata;
namespace eng = strata::engine;
using Catch::Matchers::Contains;

namespace {

st::models::gpt_model<float> const tied_gpt{
    {.vocab = 24, .seq = 8, .features = 16, .heads = 2, .layers = 2, .tie_embeddings = true}};

// Records the two members' gradients right before the tie operation (each layer's own part).
class before_tie final : public eng::pass<float> {
public:
  std::string_view name() const noexcept override { return "test: before the tie"; }
  void rewrite(eng::program& p, std::uint16_t id) override {
    std::size_t const at = p.find(eng::op_code::tie);
    REQUIRE(at < p.ops.size());
    p.ops.insert(p.ops.begin() + static_cast<std::ptrdiff_t>(at),
                 eng::pass_op(eng::op_code::custom, id));
  }
  void run(eng::op const&, eng::state<float>& s) override {
    for (auto const& e : s.flat().params) {
      auto g = e.p->grads();
      if (e.p->name() == "head.weight")
        head.assign(g.begin(), g.end());
      if (e.p->name() == "embed.wte.weight")
        table.assign(g.begin(), g.end());
    }
  }
  std::vector<float> head, table;
};

} // namespace

TEST_CASE("a tie is checked when it is declared, with both names", "[engine][tie]") {
  eng::model_builder<float> b;
  b.add(st::nn::linear<float>("a", 3, 4));
  b.add(st::nn::linear<float>("b", 4, 3));
  b.add(st::nn::linear<float>("c", 3, 4));
  b.add(st::nn::linear<float>("d", 3, 4));
  CHECK_THROWS_WITH(b.tie("a.weight", "nope.weight"),
                    Contains("no parameter is named \"nope.weight\""));
  CHECK_THROWS_WITH(b.tie("a.weight", "a.bias"), Contains("both are in layer \"a\""));
  CHECK_THROWS_WITH(b.tie("a.weight", "b.weight"),
                    Contains("shapes [4, 3] and [3, 4] differ") && Contains("tie(\"a.weight\""));
  CHECK_THROWS_WITH(b.tie("a.bias", "c.weight"), Contains("shapes [4] and [4, 3] differ"));
  b.tie("a.weight", "c.weight");
  REQUIRE(b.ties().size() == 1);
  CHECK(b.ties()[0].primary == "a.weight");
  CHECK(b.ties()[0].local_size == 12);
  CHECK_THROWS_WITH(b.tie("d.weight", "c.weight"), Contains("is tied already"));
  b.tie("a.weight", "d.weight"); // a second copy of one primary
  CHECK_THROWS_WITH(b.tie("c.weight", "a.weight"), Contains("is tied already"));
}

TEST_CASE("tied embeddings on one rank: equal members, the summed gradient, the norm counting "
          "the tensor once",
          "[engine][tie]") {
  std::uint64_t const seed = st::test::seed();
  st::trainer<st::models::gpt_model<float>> t(
      tied_gpt, eng::use<st::optim::sgd<float>>({}),
      {.lr = st::test::constant_lr(0.05), .grad_norm = true, .seed = seed});
  auto* head = t.find_parameter("head.weight");
  auto* table = t.find_parameter("embed.wte.weight");
  REQUIRE(head != nullptr);
  REQUIRE(table != nullptr);
  CHECK(head->tie_copy());
  CHECK(!table->tie_copy());
  CHECK(head->tie() == "embed.wte.weight");
  CHECK(head->kind() == st::nn::parameter_kind::embedding); // the primary's: one group
  auto equal = [&] {
    for (std::size_t i = 0; i < head->size(); ++i)
      if (head->values()[i] != table->values()[i])
        return false;
    return true;
  };
  CHECK(equal()); // the copy starts from the primary's values
  // The untied model's head starts elsewhere: the tie changed it.
  st::trainer<st::models::gpt_model<float>> untied(
      st::models::gpt_model<float>{[] {
        auto c = tied_gpt.config;
        c.tie_embeddings = false;
        return c;
      }()},
      eng::use<st::optim::sgd<float>>({}), {.lr = st::test::constant_lr(0.05), .seed = seed});
  CHECK(untied.find_parameter("head.weight")->values()[0] != head->values()[0]);
  CHECK(untied.parameter_count() == t.parameter_count());

  auto probe = std::make_unique<before_tie>();
  auto* seen = probe.get();
  t.insert_pass(std::move(probe));
  CHECK_THAT(t.program().table(), Contains("tie"));

  auto const data = st::test::make_parity_data(tied_gpt, {.sequences = 4, .seq = 8}, seed);
  auto const batch = data.view(4, 8);
  auto const r = t.step(batch);
  REQUIRE(seen->head.size() == head->size());
  double sq = 0;
  for (std::size_t i = 0; i < head->size(); ++i) {
    float const sum = seen->head[i] + seen->table[i];
    REQUIRE(head->grads()[i] == sum);
    REQUIRE(table->grads()[i] == sum);
    sq += static_cast<double>(sum) * sum;
  }
  // Both layers' parts are non-zero: the sum is not one of them.
  double part = 0;
  for (float g : seen->head)
    part += std::abs(g);
  CHECK(part > 0);
  // The norm: every parameter once, the tied tensor once.
  t.for_each_parameter([&](auto& p) {
    if (p.name() == "head.weight" || p.name() == "embed.wte.weight")
      return;
    for (float g : p.grads())
      sq += static_cast<double>(g) * g;
  });
  CHECK(r.grad_norm == Approx(std::sqrt(sq)).epsilon(1e-5));
  for (int k = 0; k < 3; ++k)
    t.step(batch);
  CHECK(equal()); // the same gradient and update every step
}
