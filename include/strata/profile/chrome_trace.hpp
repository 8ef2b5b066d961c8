// A profiler's recorded steps as a Chrome trace (the JSON trace event format that Perfetto,
// ui.perfetto.dev, and chrome://tracing open), one file a rank or all ranks merged into one.
// Needs nlohmann_json (link strata::checkpoint, or nlohmann_json::nlohmann_json).
//
// A rank is a process ("rank r (dp a, tp b, pp c)", pid r). Its operations are complete events
// (ph "X", microseconds) on three lanes (threads): compute (forward, loss, backward, the
// optimizer, ...), collectives (a collective's start, waits, ZeRO-3's gathers) and pipeline
// transfers; the operations of a rank run one after another, so each lane's events nest
// (none overlaps another partly). Each event's args: the operation, its index, layer,
// micro-batch, chunk and argument; a communication's call, group (the mesh axis), bytes and
// sequence number in its group; a pipeline group's transfers with each peer's rank and bytes. Each
// recorded step is a "ProfilerStep#N" span on the compute lane around its operations. Flow arrows:
// from each collective's start to the next wait of the same pass on that rank, and from each
// pipeline send to its receive on the peer rank (matched by step, data- and tensor-parallel
// coordinates, the two stages, the micro-batch, the direction and the occurrence). Times are the
// steady clock's, less the rank's offset from rank 0 (profile::process_of), so a merged file lines
// the ranks up.
#pragma once

#include <strata/core/error.hpp>
#include <strata/profile/profiler.hpp>

#include <nlohmann/json.hpp>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace strata::profile {

/// The lane (thread id) an operation is drawn on.
enum class lane : int { compute = 0, collectives = 1, pipeline = 2 };

constexpr lane lane_of(engine::op_code c) noexcept {
  switch (c) {
  case engine::op_code::collective:
  case engine::op_code::wait:
  case engine::op_code::gather:
    return lane::collectives;
  case engine::op_code::send:
  case engine::op_code::recv:
    return lane::pipeline;
  default:
    return lane::compute;
  }
}

namespace detail {

inline std::uint64_t fnv1a(std::string const& s) noexcept {
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 0x100000001b3ull;
  }
  return h >> 11; // within a double's exact integers (the viewers read ids as numbers)
}

inline double micros(std::int64_t ns, std::int64_t offset) noexcept {
  return static_cast<double>(ns - offset) * 1e-3;
}

} // namespace detail

/// The profiler's held steps (a cycle, in on_trace_ready) as trace events of this rank.
inline nlohmann::json chrome_events(profiler const& p) {
  using nlohmann::json;
  auto const& pi = p.process();
  int const pid = pi.pid >= 0 ? pi.pid : pi.rank;
  std::int64_t const off = pi.clock_offset_ns;
  json ev = json::array();
  char name[96];
  std::snprintf(name, sizeof name, "rank %d (dp %d, tp %d, pp %d)", pi.rank, pi.coords.dp,
                pi.coords.tp, pi.coords.pp);
  std::string const process = pi.label.empty() ? std::string(name) : pi.label + " " + name;
  ev.push_back(
      {{"ph", "M"}, {"name", "process_name"}, {"pid", pid}, {"args", {{"name", process}}}});
  ev.push_back(
      {{"ph", "M"}, {"name", "process_sort_index"}, {"pid", pid}, {"args", {{"sort_index", pid}}}});
  for (auto [l, n] :
       {std::pair{lane::compute, "compute"}, std::pair{lane::collectives, "collectives"},
        std::pair{lane::pipeline, "pipeline transfers"}})
    ev.push_back({{"ph", "M"},
                  {"name", "thread_name"},
                  {"pid", pid},
                  {"tid", static_cast<int>(l)},
                  {"args", {{"name", n}}}});
  auto const ops = p.program_ops();
  for (auto const& s : p.steps()) {
    ev.push_back({{"ph", "X"},
                  {"name", "ProfilerStep#" + std::to_string(s.number)},
                  {"cat", "step"},
                  {"pid", pid},
                  {"tid", static_cast<int>(lane::compute)},
                  {"ts", detail::micros(s.begin_ns, off)},
                  {"dur", static_cast<double>(s.end_ns - s.begin_ns) * 1e-3},
                  {"args", {{"step", s.number}}}});
    // collectives started, waiting for their pass's next wait: owner -> (flow id, start)
    std::map<std::uint16_t, std::vector<std::pair<std::uint64_t, double>>> open;
    std::map<std::string, int> occurrence; // pipeline transfers of one key so far this step
    for (std::size_t i = s.first; i < s.first + s.count; ++i) {
      auto const& r = p.ops()[i];
      auto const& o = ops[r.index];
      lane const l = lane_of(o.code);
      double const ts = detail::micros(r.begin_ns, off);
      json args = {{"operation", std::string(engine::name_of(o.code))},
                   {"index", r.index},
                   {"layer", o.layer},
                   {"micro_batch", o.micro_batch},
                   {"chunk", o.chunk},
                   {"arg", o.arg}};
      if (o.owner != engine::engine_owner)
        args["pass"] = p.name_of(r.index);
      if (auto const& c = p.communication_of(r.index); c.seq >= 0) {
        args["call"] = std::string(c.call);
        args["group"] = std::string(c.group);
        args["bytes"] = c.bytes;
        args["seq"] = c.seq;
      }
      if (auto const tr = p.transfers_of(r.index); !tr.empty()) {
        json list = json::array();
        for (auto const& t : tr) // the peer as a stage of this rank's pipeline, and its rank
          list.push_back({{"direction", t.send ? "send" : "recv"},
                          {"peer_stage", t.peer},
                          {"peer", pi.rank + (t.peer - pi.coords.pp) * pi.shape.dp * pi.shape.tp},
                          {"what", t.grad ? "gradient" : "activation"},
                          {"micro_batch", t.micro_batch},
                          {"chunk", t.chunk},
                          {"bytes", t.bytes}});
        args["transfers"] = std::move(list);
      }
      ev.push_back({{"ph", "X"},
                    {"name", p.name_of(r.index)},
                    {"cat", std::string(engine::name_of(engine::category_of(o.code)))},
                    {"pid", pid},
                    {"tid", static_cast<int>(l)},
                    {"ts", ts},
                    {"dur", static_cast<double>(r.end_ns - r.begin_ns) * 1e-3},
                    {"args", args}});
      if (o.code == engine::op_code::collective && o.owner != engine::engine_owner) {
        open[o.owner].push_back({detail::fnv1a("c/" + std::to_string(pid) + "/" +
                                               std::to_string(s.number) + "/" + std::to_string(i)),
                                 ts});
      } else if (o.code == engine::op_code::wait) {
        // the pass's collectives started since its last wait end here (a collective that
        // blocks, with no wait after it, draws no arrow)
        auto it = open.find(o.owner);
        if (it != open.end()) {
          for (auto const& [id, start] : it->second) {
            ev.push_back({{"ph", "s"},
                          {"name", "collective"},
                          {"cat", "collective"},
                          {"id", id},
                          {"pid", pid},
                          {"tid", static_cast<int>(l)},
                          {"ts", start}});
            ev.push_back({{"ph", "f"},
                          {"bp", "e"},
                          {"name", "collective"},
                          {"cat", "collective"},
                          {"id", id},
                          {"pid", pid},
                          {"tid", static_cast<int>(l)},
                          {"ts", ts}});
          }
          open.erase(it);
        }
      }
      for (auto const& t : p.transfers_of(r.index)) {
        int const from = t.send ? pi.coords.pp : t.peer, to = t.send ? t.peer : pi.coords.pp;
        std::string key = std::to_string(s.number) + "/" + std::to_string(pi.coords.dp) + "." +
                          std::to_string(pi.coords.tp) + "/" + std::to_string(from) + ">" +
                          std::to_string(to) + "/mb" + std::to_string(t.micro_batch) +
                          (t.grad ? "/g" : "/a");
        key += "/" + std::to_string(occurrence[key]++);
        ev.push_back({{"ph", t.send ? "s" : "f"},
                      {"name", t.grad ? "gradient" : "activation"},
                      {"cat", "pipeline"},
                      {"id", detail::fnv1a("p/" + key)},
                      {"pid", pid},
                      {"tid", static_cast<int>(l)},
                      {"ts", ts}});
        if (!t.send)
          ev.back()["bp"] = "e";
      }
    }
  }
  return ev;
}

/// Writes the profiler's held steps as a Chrome trace file ({"traceEvents": [...]}).
inline void write_chrome_trace(profiler const& p, std::filesystem::path const& path) {
  nlohmann::json doc = {{"traceEvents", chrome_events(p)}, {"displayTimeUnit", "ms"}};
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out)
    throw config_error("strata: cannot write the trace '" + path.string() +
                       "': check that its directory exists and is writable");
  out << doc.dump();
  if (!out.flush())
    throw config_error("strata: writing the trace '" + path.string() + "' failed (disk full?)");
}

/// One file of several ranks' traces (each written by write_chrome_trace, with its clock
/// offset already applied): their events in one traceEvents array.
inline void merge_chrome_traces(std::vector<std::filesystem::path> const& in,
                                std::filesystem::path const& out_path) {
  nlohmann::json all = nlohmann::json::array();
  for (auto const& f : in) {
    std::ifstream is(f, std::ios::binary);
    if (!is)
      throw config_error("strata: cannot read the trace '" + f.string() + "'");
    nlohmann::json doc;
    try {
      doc = nlohmann::json::parse(is);
    } catch (nlohmann::json::exception const& e) {
      throw config_error("strata: the trace '" + f.string() + "' is not JSON: " + e.what());
    }
    if (!doc.contains("traceEvents") || !doc["traceEvents"].is_array())
      throw config_error("strata: the trace '" + f.string() + "' has no traceEvents array");
    for (auto& e : doc["traceEvents"])
      all.push_back(std::move(e));
  }
  nlohmann::json doc = {{"traceEvents", std::move(all)}, {"displayTimeUnit", "ms"}};
  std::ofstream out(out_path, std::ios::binary | std::ios::trunc);
  if (!out)
    throw config_error("strata: cannot write the trace '" + out_path.string() + "'");
  out << doc.dump();
}

} // namespace strata::profile
