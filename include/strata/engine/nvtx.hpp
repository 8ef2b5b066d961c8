// nvtx: NVTX ranges around the operations and steps the executor runs, for Nsight Systems;
// compiled in where STRATA_HAVE_NVTX is 1 (CMake's STRATA_ENABLE_NVTX with nvtx3's header
// found), to an empty type otherwise.
#pragma once

#include <strata/core/device.hpp>
#include <strata/engine/op.hpp>
#include <strata/engine/pass.hpp>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#if STRATA_HAVE_NVTX
#include <nvtx3/nvToolsExt.h>

#include <cstdio>
#endif

namespace strata::engine {

/// An operation's name in tables and traces: its code, or for one a pass inserted, the pass
/// and the pass's kind ("sharded:reduce").
template <class T, class Device>
std::string op_name(op const& o, std::vector<std::unique_ptr<pass<T, Device>>> const& passes) {
  if (o.owner == engine_owner)
    return std::string(name_of(o.code));
  auto const& p = *passes[o.owner];
  std::string n(p.name());
  if (auto k = p.kind_name(o.kind); !k.empty())
    n += ":" + std::string(k);
  return n;
}

#if STRATA_HAVE_NVTX

/// The ranges, in the "strata" NVTX domain: "step N" (a training step, N from 1) or
/// "evaluate" around a run of a program, and around each operation a range named as
/// op_name() names it. The passes' names are made once, when the passes change; a step
/// allocates nothing. Without a tool attached every call returns at once (nvtx3's stubs).
template <class T, class Device>
class nvtx_ranges {
public:
  /// Makes the names of the passes' operations, when the passes are not those it last saw.
  void sync(std::vector<std::unique_ptr<pass<T, Device>>> const& passes) {
    if (!created_) { // (null without a tool: every call below is then a stub's return)
      // Once a process, under the static's guard: nvtx3's lazy initialisation writes its
      // globals unsynchronised, so ranks (threads) that create the domain at once race there.
      static nvtxDomainHandle_t const domain = nvtxDomainCreateA("strata");
      domain_ = domain;
      created_ = true;
    }
    bool same = seen_.size() == passes.size();
    for (std::size_t i = 0; same && i < passes.size(); ++i)
      same = seen_[i] == passes[i].get();
    if (same)
      return;
    seen_.clear();
    names_.clear();
    for (auto const& p : passes) {
      seen_.push_back(p.get());
      names_.emplace_back();
      auto& n = names_.back();
      n.base = std::string(p->name());
      for (unsigned k = 0; k < 256; ++k)
        if (auto kn = p->kind_name(static_cast<std::uint8_t>(k)); !kn.empty()) {
          n.kinds.resize(k + 1);
          n.kinds[k] = n.base + ":" + std::string(kn);
        }
    }
  }
  void push_step(bool training, std::int64_t step) noexcept {
    char name[48];
    if (training)
      std::snprintf(name, sizeof name, "step %lld", static_cast<long long>(step));
    else
      std::snprintf(name, sizeof name, "evaluate");
    push(name);
  }
  void push(op const& o) noexcept { push(name(o)); }
  void pop() noexcept {
    if (depth_ > 0) {
      --depth_;
      nvtxDomainRangePop(domain_);
    }
  }
  /// Ends every range still open (an operation threw).
  void pop_all() noexcept {
    while (depth_ > 0)
      pop();
  }

private:
  struct pass_names {
    std::string base;
    std::vector<std::string> kinds; // by op::kind; empty: the pass's name alone
  };

  char const* name(op const& o) const noexcept {
    if (o.owner == engine_owner)
      return name_of(o.code).data(); // a string literal's view: NUL-terminated
    auto const& n = names_[o.owner];
    return o.kind < n.kinds.size() && !n.kinds[o.kind].empty() ? n.kinds[o.kind].c_str()
                                                               : n.base.c_str();
  }
  void push(char const* message) noexcept {
    nvtxEventAttributes_t a{};
    a.version = NVTX_VERSION;
    a.size = NVTX_EVENT_ATTRIB_STRUCT_SIZE;
    a.messageType = NVTX_MESSAGE_TYPE_ASCII;
    a.message.ascii = message;
    nvtxDomainRangePushEx(domain_, &a);
    ++depth_;
  }

  nvtxDomainHandle_t domain_ = nullptr;
  bool created_ = false;
  int depth_ = 0;
  std::vector<pass<T, Device> const*> seen_;
  std::vector<pass_names> names_;
};

#else

/// Without NVTX: nothing, at no cost (an empty member, calls that compile to nothing).
template <class T, class Device>
class nvtx_ranges {
public:
  void sync(std::vector<std::unique_ptr<pass<T, Device>>> const&) noexcept {}
  void push_step(bool, std::int64_t) noexcept {}
  void push(op const&) noexcept {}
  void pop() noexcept {}
  void pop_all() noexcept {}
};

#endif

} // namespace strata::engine
