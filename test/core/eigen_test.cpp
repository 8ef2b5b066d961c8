// Eigen maps of tensor views: the same memory, products that match a plain loop, and the
// shapes Eigen cannot map.
#include "../support/seed.hpp"

#include <strata/core/eigen/map.hpp>
#include <strata/core/tensor.hpp>

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <vector>

namespace {

template <class T>
std::vector<T> random_values(std::uint64_t seed, std::size_t n) {
  std::vector<T> v(n);
  for (std::size_t i = 0; i < n; ++i)
    v[i] = static_cast<T>(static_cast<double>(strata::test::mix(seed, i) % 2001) / 1000.0 - 1.0);
  return v;
}

} // namespace

TEST_CASE("an Eigen map of a 2-D view shares its memory and multiplies correctly", "[eigen]") {
  std::uint64_t const seed = strata::test::seed();
  std::size_t const m = 5 + strata::test::mix(seed, 0) % 40;
  std::size_t const k = 5 + strata::test::mix(seed, 1) % 40;
  std::size_t const n = 5 + strata::test::mix(seed, 2) % 40;
  auto a = random_values<double>(seed + 1, m * k);
  auto b = random_values<double>(seed + 2, k * n);
  std::vector<double> c(m * n);
  strata::tensor_view<double> av(a.data(), {m, k});
  strata::tensor_view<double const> bv = strata::tensor_view<double>(b.data(), {k, n});
  strata::tensor_view<double> cv(c.data(), {m, n});

  auto am = strata::eigen_map(av);
  CHECK(am.data() == a.data());
  CHECK(am.rows() == static_cast<Eigen::Index>(m));
  CHECK(am(2, 3) == av(2, 3));
  am(2, 3) = 0.125;
  CHECK(a[2 * k + 3] == 0.125);

  strata::eigen_map(cv).noalias() = am * strata::eigen_map(bv);
  for (std::size_t i = 0; i < m; ++i)
    for (std::size_t j = 0; j < n; ++j) {
      double want = 0;
      for (std::size_t l = 0; l < k; ++l)
        want += a[i * k + l] * b[l * n + j];
      REQUIRE(std::fabs(cv(i, j) - want) <= 1e-13 * (1 + std::fabs(want)));
    }
  // A slice of rows maps with the parent's row stride.
  auto rows = strata::eigen_map(av.slice(1, 3));
  CHECK(rows.rows() == 2);
  CHECK(rows(1, 4) == av(2, 4));
  // Every element as one vector.
  auto v = strata::eigen_vector(cv);
  CHECK(v.size() == static_cast<Eigen::Index>(m * n));
  CHECK(v(n + 1) == cv(1, 1));
}

TEST_CASE("views Eigen cannot map throw shape_error", "[eigen]") {
  std::vector<float> data(64, 0.5f);
  strata::tensor_view<float> transposed(data.data(), {8, 8}, {1, 8});
  CHECK_THROWS_MATCHES(
      strata::eigen_map(transposed), strata::shape_error,
      Catch::Matchers::Message("strata: eigen_map needs a rank-2 view with stride 1 in its last "
                               "dimension; this one has shape [8, 8] and strides [1, 8]: make it "
                               "contiguous first, or use eigen_vector for rank 1"));
  CHECK_THROWS_AS(strata::eigen_map(strata::tensor_view<float>(data.data(), {4, 4, 4})),
                  strata::shape_error);
  CHECK_THROWS_AS(strata::eigen_vector(transposed), strata::shape_error);
  strata::tensor_view<float> one_row(data.data(), {1, 8}, {3, 1});
  CHECK(strata::eigen_map(one_row).cols() == 8);
}
