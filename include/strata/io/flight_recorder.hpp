// The flight recorder's files, read back with nlohmann_json: a rank's dump, every dump of a
// directory, and the communication report and the analysis as JSON documents.
#pragma once

#include <strata/comm/comm_report.hpp>
#include <strata/comm/flight_analysis.hpp>
#include <strata/comm/flight_recorder.hpp>
#include <strata/core/error.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

namespace strata::io {

namespace detail {

template <class E, std::size_t N>
E enum_named(std::string_view name, char const* what, std::string const& file) {
  for (std::size_t i = 0; i < N; ++i)
    if (name_of(static_cast<E>(i)) == name) // found by argument-dependent lookup
      return static_cast<E>(i);
  throw config_error("strata: " + file + ": unknown " + what + " '" + std::string(name) + "'");
}

} // namespace detail

/// Parses one dump (the text comm::to_json writes). Raises config_error naming `file` when it
/// is not a flight recorder dump.
inline comm::flight_dump parse_flight_dump(std::string const& text,
                                           std::string const& file = "<dump>") {
  using nlohmann::json;
  json j;
  try {
    j = json::parse(text);
  } catch (json::exception const& e) {
    throw config_error("strata: " + file + " is not JSON: " + e.what());
  }
  if (!j.is_object() || j.value("format", "") != "strata.flight_recorder")
    throw config_error(
        "strata: " + file +
        " is not a flight recorder dump (no \"format\": \"strata.flight_recorder\")");
  comm::flight_dump d;
  try {
    d.rank = j.at("rank").get<int>();
    d.world_size = j.at("world_size").get<int>();
    d.capacity = j.at("capacity").get<std::size_t>();
    d.dropped = j.at("dropped").get<std::uint64_t>();
    d.dumped_at = j.at("dumped_at_ns").get<std::int64_t>();
    d.reason = j.at("reason").get<std::string>();
    for (auto const& c : j.at("communicators"))
      d.comms.push_back(
          {c.at("id").get<std::uint64_t>(), c.at("world_ranks").get<std::vector<int>>()});
    for (auto const& x : j.at("records")) {
      comm::flight_record r;
      r.id = x.at("id").get<std::uint64_t>();
      r.comm = x.at("comm").get<std::uint64_t>();
      r.comm_rank = x.at("comm_rank").get<int>();
      r.comm_size = x.at("comm_size").get<int>();
      r.seq = x.at("seq").get<std::uint64_t>();
      r.p2p = x.at("p2p").get<bool>();
      r.blocking = x.at("blocking").get<bool>();
      r.op = detail::enum_named<comm::op_kind, comm::op_kind_count>(x.at("op").get<std::string>(),
                                                                    "op", file);
      r.count = x.at("count").get<std::uint64_t>();
      r.type = detail::enum_named<dtype, 6>(x.at("dtype").get<std::string>(), "dtype", file);
      r.rop = detail::enum_named<comm::reduce_op, 4>(x.at("reduce_op").get<std::string>(),
                                                     "reduce_op", file);
      r.root = x.at("root").get<int>();
      r.bytes = x.at("bytes").get<std::uint64_t>();
      r.state =
          detail::enum_named<comm::call_state, 3>(x.at("state").get<std::string>(), "state", file);
      r.t_issued = x.at("t_issued_ns").get<std::int64_t>();
      r.t_started = x.at("t_started_ns").get<std::int64_t>();
      r.t_completed = x.at("t_completed_ns").get<std::int64_t>();
      d.records.push_back(r);
    }
  } catch (json::exception const& e) {
    throw config_error("strata: " + file + " is a malformed flight recorder dump: " + e.what());
  }
  return d;
}

/// Reads one dump file.
inline comm::flight_dump load_flight_dump(std::filesystem::path const& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in)
    throw config_error("strata: cannot open flight recorder dump " + path.string());
  std::ostringstream text;
  text << in.rdbuf();
  return parse_flight_dump(text.str(), path.string());
}

/// Reads every strata_flight_rank*.json of `dir` (or the one file `dir` names), by rank.
inline std::vector<comm::flight_dump> load_flight_dumps(std::filesystem::path const& dir) {
  std::vector<comm::flight_dump> out;
  if (std::filesystem::is_regular_file(dir)) {
    out.push_back(load_flight_dump(dir));
    return out;
  }
  if (!std::filesystem::is_directory(dir))
    throw config_error("strata: " + dir.string() +
                       " is neither a flight recorder dump nor a directory of them");
  for (auto const& e : std::filesystem::directory_iterator(dir)) {
    std::string const name = e.path().filename().string();
    if (name.rfind("strata_flight_rank", 0) == 0 && e.path().extension() == ".json")
      out.push_back(load_flight_dump(e.path()));
  }
  if (out.empty())
    throw config_error("strata: no strata_flight_rank*.json in " + dir.string() +
                       " (dumps are written where STRATA_FLIGHT_RECORDER_DIR points)");
  std::sort(out.begin(), out.end(), [](auto const& a, auto const& b) { return a.rank < b.rank; });
  return out;
}

/// The communication report as JSON: {"rows": [...], "dropped": {rank: n}} with the columns
/// of comm::to_csv.
inline nlohmann::json to_json(comm::comm_report const& rep) {
  nlohmann::json rows = nlohmann::json::array();
  for (auto const& r : rep.rows)
    rows.push_back({{"rank", r.rank},
                    {"comm", r.comm},
                    {"comm_size", r.comm_size},
                    {"op", comm::name_of(r.op)},
                    {"bucket_bytes", r.bucket},
                    {"calls", r.calls},
                    {"bytes", r.bytes},
                    {"timed", r.timed},
                    {"total_s", r.total_s},
                    {"mean_s", r.mean_s},
                    {"p50_s", r.p50_s},
                    {"p95_s", r.p95_s},
                    {"algbw_GBps", r.algbw_gbps},
                    {"busbw_GBps", r.busbw_gbps},
                    {"straggler_s", r.straggler_s},
                    {"straggler_calls", r.straggler_calls}});
  nlohmann::json dropped = nlohmann::json::object();
  for (auto const& [rank, n] : rep.dropped)
    dropped[std::to_string(rank)] = n;
  return {{"rows", rows}, {"dropped", dropped}};
}

/// The analysis as JSON: {"consistent", "missing_dumps", "divergences": [{"kind", "comm",
/// "world_ranks", "seq", "issued", "missing", "ranks": [{"rank", "world_rank", "issued",
/// "op", "count", "dtype", "state", "last_seq"}]}]}.
inline nlohmann::json to_json(comm::flight_analysis const& a) {
  nlohmann::json divs = nlohmann::json::array();
  for (auto const& d : a.divergences) {
    nlohmann::json ranks = nlohmann::json::array();
    for (auto const& x : d.ranks) {
      nlohmann::json r = {{"rank", x.rank},
                          {"world_rank", x.world_rank},
                          {"has_dump", x.has_dump},
                          {"issued", x.issued},
                          {"last_seq", x.last_seq}};
      if (x.issued) {
        r["op"] = comm::name_of(x.record.op);
        r["count"] = x.record.count;
        r["dtype"] = name_of(x.record.type);
        r["reduce_op"] = comm::name_of(x.record.rop);
        r["root"] = x.record.root;
        r["state"] = comm::name_of(x.record.state);
      }
      ranks.push_back(r);
    }
    divs.push_back({{"kind", comm::name_of(d.kind)},
                    {"comm", d.comm},
                    {"world_ranks", d.world_ranks},
                    {"seq", d.seq},
                    {"issued", d.issued},
                    {"missing", d.missing},
                    {"ranks", ranks}});
  }
  return {{"consistent", a.consistent()},
          {"world_size", a.world_size},
          {"missing_dumps", a.missing_dumps},
          {"divergences", divs}};
}

} // namespace strata::io
