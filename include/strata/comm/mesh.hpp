// The device mesh: named axes dp, tp, pp over one world communicator.
#pragma once

#include <strata/comm/communicator.hpp>
#include <strata/core/error.hpp>

#include <array>
#include <string>
#include <string_view>

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

/// The ranks of one world arranged as pp x dp x tp, tensor parallel fastest, as Megatron
/// orders them: world rank = tp + tp_size * (dp + dp_size * pp). Tensor-parallel peers are
/// neighbouring ranks (on one machine, sharing its fastest links); pipeline stages are the
/// farthest apart. Each axis has its own communicator, whose rank is the coordinate on that
/// axis. Building a mesh is collective over the world (it splits it three times).
///
/// The mesh keeps a reference to `world`, which must outlive it.
template <communicator C>
class mesh {
public:
  mesh(C& world, mesh_shape shape)
      : world_(&world), shape_(resolve(world.size(), shape)), coords_(coords_of(world.rank())),
        tp_(world.split(coords_.pp * shape_.dp + coords_.dp, coords_.tp)),
        dp_(world.split(coords_.pp * shape_.tp + coords_.tp, coords_.dp)),
        pp_(world.split(coords_.dp * shape_.tp + coords_.tp, coords_.pp)) {}

  mesh_shape shape() const noexcept { return shape_; }
  mesh_coords coords() const noexcept { return coords_; }

  /// The world rank at the given coordinates.
  int rank_at(mesh_coords c) const noexcept { return c.tp + shape_.tp * (c.dp + shape_.dp * c.pp); }
  /// The coordinates of a world rank.
  mesh_coords coords_of(int world_rank) const noexcept {
    return {(world_rank / shape_.tp) % shape_.dp, world_rank % shape_.tp,
            world_rank / (shape_.tp * shape_.dp)};
  }

  C& world() noexcept { return *world_; }
  C& dp() noexcept { return dp_; }
  C& tp() noexcept { return tp_; }
  C& pp() noexcept { return pp_; }

  /// The mesh's axes by name, in Megatron's nesting order (pp outermost, tp fastest).
  static constexpr std::array<std::string_view, 3> axis_names{"pp", "dp", "tp"};
  /// The communicator of a named axis ("dp", "tp", "pp"): what a strategy's option_traits
  /// names as its axis. Throws config_error naming the axes for another name.
  C& axis(std::string_view name) {
    if (name == "dp")
      return dp_;
    if (name == "tp")
      return tp_;
    if (name == "pp")
      return pp_;
    throw config_error("strata: the mesh has no axis \"" + std::string(name) +
                       "\": its axes are pp, dp and tp");
  }
  /// The size of a named axis (as axis()).
  int axis_size(std::string_view name) const {
    if (name == "dp")
      return shape_.dp;
    if (name == "tp")
      return shape_.tp;
    if (name == "pp")
      return shape_.pp;
    throw config_error("strata: the mesh has no axis \"" + std::string(name) +
                       "\": its axes are pp, dp and tp");
  }

private:
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
  mesh_shape shape_;
  mesh_coords coords_;
  C tp_;
  C dp_;
  C pp_;
};

} // namespace strata::comm
