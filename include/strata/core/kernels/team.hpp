// Row kernels: the team of lanes that works on one row, its fixed-order reductions, and the
// team the host runs (Thrust's CPP system, the emulated device).
#pragma once

#include <strata/core/hd.hpp>

#include <cstddef>

// A row kernel is a functor with
//
//   template <class Team> STRATA_HD void operator()(Team& team, std::size_t row) const;
//
// run once per row by a team of `lanes` lanes (1 on Thrust's CPP system; 32 (a warp), 256 or
// 1024 (a block) on the GPU; any of these on the emulated device). Its code between the team's
// primitives is *uniform*: every lane computes the same values (on the GPU every thread runs
// the body; on the host the body runs once for the whole team). Work that differs by lane goes
// through the primitives:
//
//   team.template sum<S, T>(f)     T; f(unsigned slot) -> T, the partial of slot s in [0, S)
//   team.template max<S, T>(f)     the same with max
//   team.for_each(n, f)            f(i) for every i in [0, n), split over the lanes; every
//                                  write of f is visible to the team after it returns
//   team.lanes()                   the number of lanes (uniform)
//
// A reduction is defined by S alone, never by the number of lanes: the body computes S
// partials (slot s conventionally sums the elements s, s + S, s + 2S, ... in index order), and
// the team folds them in the fixed tree fold_tree<S> (for half = S/2, ..., 1: p[s] = p[s] op
// p[s + half] for s < half). A lane owns slots lane, lane + lanes, ...; on the GPU the levels
// with half >= lanes fold within a lane, the rest across lanes (shared memory, then
// __shfl_xor_sync, whose butterfly pairs s with s + half). The result is the same bits for any
// number of lanes, which is what lets the host check a GPU row kernel. S is a power of two,
// 1 <= S <= 1024.

namespace strata::kernels {

/// Whether S is a slot count a team reduces (a power of two in [1, 1024]).
template <unsigned S>
inline constexpr bool valid_slots = S >= 1 && S <= 1024 && (S & (S - 1)) == 0;

/// The sum of two partials (a named functor: nvcc and g++ both take it).
struct plus_op {
  template <class T>
  STRATA_HD_INLINE T operator()(T const& a, T const& b) const {
    return a + b;
  }
};
/// The larger of two partials; a NaN operand wins (the reduction does not hide one).
struct max_op {
  template <class T>
  STRATA_HD_INLINE T operator()(T const& a, T const& b) const {
    return (a != a || a > b) ? a : b;
  }
};

/// Folds p[0, S) in the fixed tree order into p[0] and returns it (p is overwritten).
template <unsigned S, class T, class Op>
STRATA_HD_INLINE T fold_tree(T* p, Op const& op) {
  static_assert(valid_slots<S>, "strata: a team reduction takes a power-of-two slot count <= 1024");
  for (unsigned half = S / 2; half >= 1; half /= 2)
    for (unsigned s = 0; s < half; ++s)
      p[s] = op(p[s], p[s + half]);
  return p[0];
}

/// The team of the host: `lanes` lanes run one after the other. Its members are STRATA_HD only
/// so that a .cu file may run the emulated device too (a row kernel's host-device body calls
/// them); it runs on the host alone. for_each goes lane by lane
/// (lane l takes i = l, l + lanes, ...), as the GPU's lanes split the indices; a reduction
/// computes every slot's partial and folds them in fold_tree's order, which is what the GPU's
/// lanes compute whatever their number.
class host_team {
public:
  STRATA_HD explicit host_team(unsigned lanes = 1) noexcept : lanes_(lanes == 0 ? 1 : lanes) {}

  STRATA_HD unsigned lanes() const noexcept { return lanes_; }

  template <unsigned S, class T, class F>
  STRATA_HD T sum(F const& f) const {
    return reduce<S, T>(f, plus_op{});
  }
  template <unsigned S, class T, class F>
  STRATA_HD T max(F const& f) const {
    return reduce<S, T>(f, max_op{});
  }

  template <class F>
  STRATA_HD void for_each(std::size_t n, F const& f) const {
    for (unsigned l = 0; l < lanes_; ++l)
      for (std::size_t i = l; i < n; i += lanes_)
        f(i);
  }

private:
  template <unsigned S, class T, class F, class Op>
  STRATA_HD T reduce(F const& f, Op const& op) const {
    static_assert(valid_slots<S>,
                  "strata: a team reduction takes a power-of-two slot count <= 1024");
    T p[S];
    // Lane by lane over the slots each owns; the slots' partials do not depend on the owner.
    for (unsigned l = 0; l < lanes_ && l < S; ++l)
      for (unsigned s = l; s < S; s += lanes_)
        p[s] = f(s);
    return fold_tree<S>(p, op);
  }

  unsigned lanes_;
};

/// Runs a row kernel over rows [0, rows) on the host with teams of `lanes` lanes.
template <class K>
void run_rows_on_host(K const& k, std::size_t rows, unsigned lanes = 1) {
  host_team team(lanes);
  for (std::size_t r = 0; r < rows; ++r)
    k(team, r);
}

/// Runs an element-wise functor (f(i) for i in [0, n)) on the host.
template <class F>
void run_elements_on_host(F const& f, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i)
    f(i);
}

} // namespace strata::kernels
