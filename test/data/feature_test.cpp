// Feature rows: datasets from memory and from a mapped file (f32 and f64, class and value
// targets), batches that are the rows in the sampler's order, the conversion to the engine's
// batch_view, a trainer stepping on the loader's batches, and errors.
#include "inputs.hpp"

#include <strata/core/error.hpp>
#include <strata/data/feature_dataset.hpp>
#include <strata/data/loader.hpp>
#include <strata/engine/batch.hpp>
#include <strata/models/mlp.hpp>
#include <strata/optim/sgd.hpp>
#include <strata/train/trainer.hpp>

#include "../support/training.hpp"

#include <catch2/catch.hpp>

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

namespace st = strata;
namespace sd = strata::data;
namespace td = strata::test::data;
using Catch::Matchers::Contains;
using strata::config_error;

namespace {

template <class T>
std::vector<T> uniform(std::uint64_t k, std::size_t n) {
  std::vector<T> v(n);
  for (std::size_t i = 0; i < n; ++i)
    v[i] = static_cast<T>(static_cast<double>(td::draw(k, i, 0, 1 << 20)) / (1 << 19) - 1.0);
  return v;
}

// Rows whose class is the index of the largest of their first `classes` features: learnable.
struct class_rows {
  std::vector<float> x;
  std::vector<std::int32_t> y;
};
class_rows argmax_rows(std::uint64_t k, std::size_t rows, std::size_t width, std::size_t classes) {
  class_rows r{uniform<float>(k, rows * width), std::vector<std::int32_t>(rows)};
  for (std::size_t i = 0; i < rows; ++i) {
    std::size_t best = 0;
    for (std::size_t c = 1; c < classes; ++c)
      if (r.x[i * width + c] > r.x[i * width + best])
        best = c;
    r.y[i] = static_cast<std::int32_t>(best);
  }
  return r;
}

} // namespace

static_assert(
    std::is_same_v<sd::loader<sd::feature_dataset<float>>::batch_type, sd::feature_batch<float>>);
static_assert(std::is_convertible_v<sd::feature_batch<double>, st::engine::batch_view<double>>);
static_assert(!std::is_convertible_v<sd::feature_batch<float>, sd::token_batch>);

TEST_CASE("feature batches are the rows in the sampler's order and convert to batch_view",
          "[data][feature]") {
  std::uint64_t const k = td::key("feature loader");
  std::size_t const rows = td::draw(k, 0, 30, 200);
  std::size_t const width = td::draw(k, 1, 1, 17);
  std::size_t const classes = td::draw(k, 2, 2, 9);
  std::vector<float> const x = uniform<float>(k, rows * width);
  std::vector<std::int32_t> y(rows);
  for (std::size_t i = 0; i < rows; ++i)
    y[i] = static_cast<std::int32_t>(td::draw(k + 1, i, 0, classes - 1));
  auto const ds = sd::feature_dataset<float>::with_classes(x, width, y, classes);
  CHECK(ds.size() == rows);
  CHECK(ds.width() == width);
  CHECK(ds.target() == sd::target_kind::classes);
  CHECK(ds.classes() == classes);
  CHECK(ds.value_width() == 0);

  int const replicas = static_cast<int>(td::draw(k, 3, 1, 4));
  int const rank = static_cast<int>(td::draw(k, 4, 0, static_cast<std::size_t>(replicas) - 1));
  std::size_t const batch = td::draw(k, 5, 1, 6);
  CAPTURE(rows, width, classes, replicas, rank, batch);
  sd::loader l(ds, sd::distributed_sampler(rows, replicas, rank, {.seed = k}),
               {.batch = batch, .drop_last = false});
  sd::distributed_sampler twin(rows, replicas, rank, {.seed = k});
  for (std::size_t n = 0; n < 2 * l.batches_per_epoch(); ++n) {
    sd::feature_batch<float> const b = l.next();
    REQUIRE(b.seq == 1);
    REQUIRE(b.width == width);
    REQUIRE(b.rows() == b.sequences);
    REQUIRE(b.features.size() == b.rows() * width);
    REQUIRE(b.targets.size() == b.rows());
    REQUIRE(b.values.empty());
    REQUIRE(b.tokens.empty());
    for (std::size_t r = 0; r < b.rows(); ++r) {
      std::size_t const i = twin.next();
      REQUIRE(b.targets[r] == y[i]);
      for (std::size_t f = 0; f < width; ++f)
        REQUIRE(b.features[r * width + f] == x[i * width + f]);
    }
    st::engine::batch_view<float> const v = b;
    REQUIRE(v.sequences == b.sequences);
    REQUIRE(v.seq == 1);
    REQUIRE(v.rows() == b.rows());
    REQUIRE(v.features.data() == b.features.data());
    REQUIRE(v.features.size() == b.features.size());
    REQUIRE(v.targets.data() == b.targets.data());
    REQUIRE(v.tokens.empty());
  }
}

TEMPLATE_TEST_CASE("a feature file maps to the rows written, class or value targets",
                   "[data][feature]", float, double) {
  std::uint64_t const k = td::key("feature file");
  std::size_t const rows = td::draw(k, 0, 5, 300);
  std::size_t const width = td::draw(k, 1, 1, 40);
  std::size_t const value_width = td::draw(k, 2, 1, 3);
  std::vector<TestType> const x = uniform<TestType>(k, rows * width);
  std::vector<TestType> const v = uniform<TestType>(k + 1, rows * value_width);
  std::vector<std::int32_t> y(rows);
  for (std::size_t i = 0; i < rows; ++i)
    y[i] = static_cast<std::int32_t>(td::draw(k + 2, i, 0, 9));
  CAPTURE(rows, width, value_width);

  td::temp_path const classes_file(".rows"), values_file(".rows");
  sd::feature_dataset<TestType>::with_classes(x, width, y, 10).write(classes_file.path());
  sd::feature_dataset<TestType>::with_values(x, width, v, value_width).write(values_file.path());
  std::size_t const header = 64, e = sizeof(TestType);
  CHECK(std::filesystem::file_size(classes_file.path()) == header + rows * (width * e + 4));
  CHECK(std::filesystem::file_size(values_file.path()) ==
        header + rows * (width + value_width) * e);

  sd::feature_dataset<TestType> const c(classes_file.path());
  sd::feature_dataset<TestType> const r(values_file.path());
  REQUIRE(c.size() == rows);
  REQUIRE(c.target() == sd::target_kind::classes);
  REQUIRE(c.classes() == 10);
  REQUIRE(r.target() == sd::target_kind::values);
  REQUIRE(r.value_width() == value_width);
  std::vector<TestType> f(width), values(value_width);
  std::vector<std::int32_t> one(1);
  for (std::size_t i = 0; i < rows; ++i) {
    c.read(i, f, one, {});
    REQUIRE(one[0] == y[i]);
    for (std::size_t j = 0; j < width; ++j)
      REQUIRE(f[j] == x[i * width + j]);
    r.read(i, f, {}, values);
    for (std::size_t j = 0; j < value_width; ++j)
      REQUIRE(values[j] == v[i * value_width + j]);
  }
  // A file of the other element type converts on read.
  using other = std::conditional_t<std::is_same_v<TestType, float>, double, float>;
  sd::feature_dataset<other> const converted(values_file.path());
  std::vector<other> g(width), w(value_width);
  converted.read(rows - 1, g, {}, w);
  CHECK(g[0] == static_cast<other>(x[(rows - 1) * width]));
  CHECK(w[value_width - 1] == static_cast<other>(v[rows * value_width - 1]));

  // Value targets reach the batch in `values`.
  sd::loader l(r, sd::distributed_sampler(rows, 1, 0, {.shuffle = false}),
               {.batch = rows, .drop_last = false});
  sd::feature_batch<TestType> const b = l.next();
  CHECK(b.targets.empty());
  CHECK(b.value_width == value_width);
  REQUIRE(b.values.size() == rows * value_width);
  CHECK(std::equal(b.values.begin(), b.values.end(), v.begin()));
  CHECK(std::equal(b.features.begin(), b.features.end(), x.begin()));

  if (rows >= 2) {
    auto const [head, tail] = c.split(0.5);
    CHECK(head.size() + tail.size() == rows);
    tail.read(0, f, one, {});
    CHECK(one[0] == y[head.size()]);
    td::temp_path const part(".rows");
    tail.write(part.path());
    sd::feature_dataset<TestType> const reread(part.path());
    CHECK(reread.size() == tail.size());
    reread.read(reread.size() - 1, f, one, {});
    CHECK(one[0] == y[rows - 1]);
  }
}

TEST_CASE("a trainer steps on the loader's feature batches and learns", "[data][feature]") {
  std::uint64_t const k = td::key("feature training");
  std::size_t const width = 8, classes = 4;
  class_rows const data = argmax_rows(k, 512, width, classes);
  auto const ds = sd::feature_dataset<float>::with_classes(data.x, width, data.y, classes);
  st::models::mlp_model<float> const m{width, 32, 2, classes};
  st::trainer<st::models::mlp_model<float>> t(
      m, st::engine::use<st::optim::sgd<float>>({.momentum = 0.9}),
      {.lr = st::test::constant_lr(0.1), .seed = k});
  sd::loader l(ds, sd::distributed_sampler(ds.size(), 1, 0, {.seed = k}), {.batch = 32});
  double first = 0, last = 0;
  for (std::size_t s = 0; s < 4 * l.batches_per_epoch(); ++s) {
    double const loss = t.step(l.next()).loss; // feature_batch -> batch_view
    if (s == 0)
      first = loss;
    last = loss;
  }
  CAPTURE(first, last);
  CHECK(last < first - 0.3);
}

TEST_CASE("feature rows that do not fit fail with the numbers", "[data][feature][errors]") {
  using fd = sd::feature_dataset<float>;
  CHECK_THROWS_WITH(fd::with_classes(std::vector<float>(10), 3, {0, 1, 2}, 3),
                    Contains("10 feature values are not a whole number of rows of 3"));
  CHECK_THROWS_WITH(fd::with_classes(std::vector<float>(9), 3, {0, 1}, 3),
                    Contains("3 rows of 3 features come with 2 class ids; give 1 per row (3)"));
  CHECK_THROWS_WITH(fd::with_classes(std::vector<float>(6), 3, {0, 5}, 3),
                    Contains("row 1 of the feature rows in memory has class 5, outside [0, 3)"));
  CHECK_THROWS_WITH(fd::with_values(std::vector<float>(6), 3, std::vector<float>(3), 2),
                    Contains("come with 3 target values; give 2 per row (4)"));
  CHECK_THROWS_WITH(fd::with_values(std::vector<float>(6), 0, {}, 1), Contains("width >= 1"));
  auto const ds = fd::with_classes(std::vector<float>(6), 3, {0, 1}, 2);
  std::vector<float> f(2);
  std::vector<std::int32_t> c(1);
  CHECK_THROWS_WITH(ds.read(0, f, c, {}), Contains("a row of 3 features, 1 class ids and 0 values "
                                                   "was given spans of 2, 1 and 0"));
  CHECK_THROWS_WITH(ds.read(2, f, c, {}), Contains("row 2 is out of range: the dataset has 2"));

  td::temp_path const file(".rows");
  ds.write(file.path());
  std::string bytes = td::read_bytes(file.path());
  td::write_bytes(file.path(), bytes.substr(0, bytes.size() - 3));
  CHECK_THROWS_WITH(fd(file.path()), Contains("holds 93 bytes, but its header's 2 rows of 3 "
                                              "features take 96"));
  td::write_bytes(file.path(), "not a feature file at all, not at all, no, not at all, no...!");
  CHECK_THROWS_WITH(fd(file.path()),
                    Contains("is not a strata feature file") && Contains("STRATAFR"));
  CHECK_THROWS_WITH(fd("/nonexistent/rows"), Contains("cannot open feature file"));
}

TEST_CASE("a loader of feature rows refuses mask_input_id", "[data][feature][errors]") {
  std::vector<float> x(4 * 2, 0.5f);
  std::vector<std::int32_t> y{0, 1, 0, 1};
  auto const ds = sd::feature_dataset<float>::with_classes(x, 2, y, 2);
  CHECK_THROWS_WITH(
      sd::loader(ds, sd::distributed_sampler(ds.size(), 1, 0), {.batch = 2, .mask_input_id = 3}),
      Contains("mask_input_id") && Contains("no token ids"));
}
