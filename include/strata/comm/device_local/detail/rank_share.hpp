// What one rank of a device-local communicator shows its peers (its context and the events
// they wait on), the context concept it needs, and the call descriptors of its rendezvous.
#pragma once

#include <strata/comm/detail/call_desc.hpp>
#include <strata/comm/kernels/rank_reduce.hpp>
#include <strata/core/device_context.hpp>

#include <cstdint>
#include <string>

namespace strata::comm::device_local {

/// A device context whose streams can wait on another context's events (`wait_foreign`):
/// emulated_context and cuda_context. The ranks of a device-local communicator each own one.
template <class Ctx>
concept rank_context = device_context<Ctx> &&
    requires(Ctx& c, Ctx const& peer, typename Ctx::stream_type s, typename Ctx::event_type e) {
  c.wait_foreign(s, peer, e);
};

namespace detail {

using comm::detail::call_desc;

/// One rank's events that its peers' streams wait on, published once at construction (the
/// handles are fixed; the host rendezvous of each operation orders a peer's wait after the
/// record, and the next record after every peer's wait):
///   fence  recorded on the compute stream at the start of every operation: the data the
///          operation reads is ready;
///   done   recorded on the communication stream after this rank's share of the operation (its
///          kernel, its receives' copies): what it wrote into and read from the peers' buffers
///          is finished.
template <class Ctx>
struct rank_share {
  Ctx const* ctx = nullptr;
  typename Ctx::event_type fence{};
  typename Ctx::event_type done{};
};

/// The words a rank puts in each collective's rendezvous: its call (compared across ranks) and
/// its buffers.
inline constexpr std::size_t rendezvous_words = 4;

inline std::int64_t pack(call_desc const& d) noexcept {
  return static_cast<std::int64_t>(
      static_cast<std::uint64_t>(d.kind) | static_cast<std::uint64_t>(d.type) << 8 |
      static_cast<std::uint64_t>(d.op) << 16 |
      static_cast<std::uint64_t>(static_cast<std::uint32_t>(d.root)) << 32);
}

inline call_desc unpack(std::int64_t word, std::int64_t count) noexcept {
  auto const w = static_cast<std::uint64_t>(word);
  call_desc d;
  d.kind = static_cast<op_kind>(w & 0xff);
  d.type = static_cast<dtype>((w >> 8) & 0xff);
  d.op = static_cast<reduce_op>((w >> 16) & 0xff);
  d.root = static_cast<int>(static_cast<std::uint32_t>(w >> 32));
  d.count = static_cast<std::size_t>(count);
  return d;
}

inline std::int64_t word_of(void const* p) noexcept {
  return static_cast<std::int64_t>(reinterpret_cast<std::uintptr_t>(p));
}
template <class T>
T* pointer_of(std::int64_t w) noexcept {
  return reinterpret_cast<T*>(static_cast<std::uintptr_t>(w));
}

} // namespace detail
} // namespace strata::comm::device_local
