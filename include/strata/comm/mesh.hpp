// The device mesh: named axes dp, tp, pp over one world communicator.
#pragma once

#include <strata/comm/communicator.hpp>
#include <strata/core/error.hpp>

#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace strata::comm {

/// Sizes of the mesh axes. A size of 0 for dp means "whatever the world leaves":
/// world / (tp * pp).
struct mesh_shape {
  int dp = 0;
  int tp = 1;
  int pp = 1;
};

/// A rank's place on the mesh.
struct mesh_coords {
  int dp = 0;
  int tp = 0;
  int pp = 0;
  friend bool operator==(mesh_coords const&, mesh_coords const&) = default;
};

/// The color and key of one axis's split of the world (communicator::split(color, key)).
struct split_args {
  int color = 0;
  int key = 0;
  friend bool operator==(split_args const&, split_args const&) = default;
};

/// The splits that make a world rank's tp, dp and pp communicators.
struct mesh_splits {
  split_args tp;
  split_args dp;
  split_args pp;
};

/// The splits of `world_rank` on a mesh of `resolved` shape (dp > 0; any extra axes' blocks of
/// dp * tp * pp ranks follow one another): each axis's color numbers the ranks that share every
/// other coordinate (and the extra block), its key is the coordinate on the axis, so the split
/// communicator's rank is that coordinate. The mesh splits with these; a backend that builds its
/// groups itself (ncclCommSplit) uses the same numbers.
constexpr mesh_splits mesh_split_args(mesh_shape resolved, int world_rank) noexcept {
  int const inner = resolved.dp * resolved.tp * resolved.pp;
  int const e = world_rank / inner;
  int const r = world_rank % inner;
  int const tp = r % resolved.tp;
  int const dp = (r / resolved.tp) % resolved.dp;
  int const pp = r / (resolved.tp * resolved.dp);
  return {{e * resolved.pp * resolved.dp + pp * resolved.dp + dp, tp},
          {e * resolved.pp * resolved.tp + pp * resolved.tp + tp, dp},
          {e * resolved.dp * resolved.tp + dp * resolved.tp + tp, pp}};
}

/// An axis of the mesh beyond dp, tp and pp, named by the strategy that uses it (a user's
/// strategy's option_traits<O>::axis: context or expert parallelism, say).
struct mesh_axis {
  std::string name;
  int size = 1;
};

/// The ranks of one world arranged as pp x dp x tp, tensor parallel fastest, as Megatron
/// orders them: world rank = tp + tp_size * (dp + dp_size * pp). Tensor-parallel peers are
/// neighbouring ranks (on one machine, sharing its fastest links); pipeline stages are the
/// farthest apart. Each axis has its own communicator, whose rank is the coordinate on that
/// axis. Building a mesh is collective over the world (it splits it once per axis).
///
/// Extra named axes (mesh_axis, outermost first) go outside pp: world rank = inner +
/// inner_size * e, where inner is the pp x dp x tp rank above and e the extra coordinates'
/// linear index (the last extra axis fastest); dp = 0 then fills what the extra axes and
/// tp x pp leave. rank_at and coords_of speak of this rank's pp x dp x tp block.
///
/// The mesh keeps a reference to `world`, which must outlive it.
template <communicator C>
class mesh {
public:
  mesh(C& world, mesh_shape shape, std::vector<mesh_axis> extra = {})
      : world_(&world), extra_(checked_extra(std::move(extra))),
        shape_(resolve(inner_world(world.size(), extra_), shape)),
        inner_(shape_.dp * shape_.tp * shape_.pp), e_(world.rank() / inner_),
        coords_(coords_of(world.rank())),
        tp_(split(world, mesh_split_args(shape_, world.rank()).tp)),
        dp_(split(world, mesh_split_args(shape_, world.rank()).dp)),
        pp_(split(world, mesh_split_args(shape_, world.rank()).pp)) {
    // One communicator per extra axis: the ranks that differ only in that coordinate.
    int const inner_rank = world.rank() % inner_;
    for (std::size_t k = 0; k < extra_.size(); ++k) {
      int stride = 1; // of axis k in e (the last axis fastest)
      for (std::size_t j = k + 1; j < extra_.size(); ++j)
        stride *= extra_[j].size;
      int const coord = (e_ / stride) % extra_[k].size;
      int const rest = e_ - coord * stride; // e with coordinate k set to 0
      extra_coords_.push_back(coord);
      extra_groups_.push_back(world.split(inner_rank + inner_ * rest, coord));
    }
  }

  mesh_shape shape() const noexcept { return shape_; }
  mesh_coords coords() const noexcept { return coords_; }

  /// The world rank at the given coordinates (in this rank's pp x dp x tp block).
  int rank_at(mesh_coords c) const noexcept {
    return inner_ * e_ + c.tp + shape_.tp * (c.dp + shape_.dp * c.pp);
  }
  /// The coordinates of a world rank.
  mesh_coords coords_of(int world_rank) const noexcept {
    int const r = world_rank % (shape_.dp * shape_.tp * shape_.pp);
    return {(r / shape_.tp) % shape_.dp, r % shape_.tp, r / (shape_.tp * shape_.dp)};
  }

  C& world() noexcept { return *world_; }
  C& dp() noexcept { return dp_; }
  C& tp() noexcept { return tp_; }
  C& pp() noexcept { return pp_; }

  /// The mesh's extra axes (beyond dp, tp and pp), outermost first.
  std::vector<mesh_axis> const& extra_axes() const noexcept { return extra_; }
  /// Every axis's name: the extra axes, then pp, dp and tp.
  std::vector<std::string_view> axis_names() const {
    std::vector<std::string_view> n;
    for (auto const& a : extra_)
      n.push_back(a.name);
    n.insert(n.end(), {"pp", "dp", "tp"});
    return n;
  }
  /// The communicator of a named axis ("dp", "tp", "pp" or an extra axis): what a strategy's
  /// option_traits names as its axis. Throws config_error naming the axes for another name.
  C& axis(std::string_view name) {
    if (name == "dp")
      return dp_;
    if (name == "tp")
      return tp_;
    if (name == "pp")
      return pp_;
    return extra_groups_[index_of(name)];
  }
  /// The size of a named axis (as axis()).
  int axis_size(std::string_view name) const {
    if (name == "dp")
      return shape_.dp;
    if (name == "tp")
      return shape_.tp;
    if (name == "pp")
      return shape_.pp;
    return extra_[index_of(name)].size;
  }
  /// This rank's coordinate on a named axis (as axis()).
  int axis_coord(std::string_view name) const {
    if (name == "dp")
      return coords_.dp;
    if (name == "tp")
      return coords_.tp;
    if (name == "pp")
      return coords_.pp;
    return extra_coords_[index_of(name)];
  }

private:
  static C split(C& world, split_args a) { return world.split(a.color, a.key); }
  std::size_t index_of(std::string_view name) const {
    for (std::size_t k = 0; k < extra_.size(); ++k)
      if (extra_[k].name == name)
        return k;
    std::string all;
    for (auto n : axis_names())
      all += (all.empty() ? "" : ", ") + std::string(n);
    throw config_error("strata: the mesh has no axis \"" + std::string(name) + "\": its axes are " +
                       all);
  }
  static std::vector<mesh_axis> checked_extra(std::vector<mesh_axis> x) {
    for (std::size_t k = 0; k < x.size(); ++k) {
      if (x[k].size < 1)
        throw config_error("strata: mesh axis \"" + x[k].name + "\" has size " +
                           std::to_string(x[k].size) + ": give it 1 or more");
      if (x[k].name.empty() || x[k].name == "dp" || x[k].name == "tp" || x[k].name == "pp")
        throw config_error("strata: mesh axis \"" + x[k].name +
                           "\": an extra axis needs a name other than dp, tp and pp");
      for (std::size_t j = 0; j < k; ++j)
        if (x[j].name == x[k].name)
          throw config_error("strata: mesh axis \"" + x[k].name + "\" is named twice");
    }
    return x;
  }
  // The ranks of one pp x dp x tp block: the world over the extra axes' product.
  static int inner_world(int world, std::vector<mesh_axis> const& x) {
    int n = 1;
    std::string sizes;
    for (auto const& a : x) {
      n *= a.size;
      sizes += (sizes.empty() ? "" : " x ") + a.name + " " + std::to_string(a.size);
    }
    if (world % n != 0)
      throw config_error("strata: mesh: the extra axes (" + sizes + ") have " + std::to_string(n) +
                         " coordinates, which do not divide the world of " + std::to_string(world) +
                         " ranks");
    return world / n;
  }

  static mesh_shape resolve(int world, mesh_shape s) {
    auto text = [&] {
      return "dp = " + (s.dp ? std::to_string(s.dp) : std::string("auto")) +
             ", tp = " + std::to_string(s.tp) + ", pp = " + std::to_string(s.pp);
    };
    if (s.dp < 0 || s.tp < 1 || s.pp < 1)
      throw config_error("strata: mesh " + text() +
                         ": tp and pp must be >= 1 and dp >= 1 (or 0 to fill the world)");
    if (s.dp == 0) {
      if (world % (s.tp * s.pp) != 0)
        throw config_error("strata: mesh " + text() + " over a world of " + std::to_string(world) +
                           " ranks: tp * pp = " + std::to_string(s.tp * s.pp) +
                           " does not divide " + std::to_string(world) +
                           "; choose tp and pp whose product divides " + "the world size");
      s.dp = world / (s.tp * s.pp);
    }
    if (s.dp * s.tp * s.pp != world)
      throw config_error(
          "strata: mesh " + text() + " has dp * tp * pp = " + std::to_string(s.dp * s.tp * s.pp) +
          " ranks but the world has " + std::to_string(world) +
          "; the product must equal the world size " + "(set dp = 0 to let it fill the world)");
    return s;
  }

  C* world_;
  std::vector<mesh_axis> extra_;
  mesh_shape shape_;
  int inner_ = 1; // ranks of one pp x dp x tp block
  int e_ = 0;     // this rank's block: the extra coordinates' linear index
  mesh_coords coords_;
  C tp_;
  C dp_;
  C pp_;
  std::vector<int> extra_coords_;
  std::vector<C> extra_groups_;
};

} // namespace strata::comm
