// strata_flight: reads the flight recorder's dumps of every rank (strata_flight_rank<r>.json,
// written on a timeout or an abort where STRATA_FLIGHT_RECORDER_DIR points, or on request)
// and says which collective diverged, on which ranks, in which state; or prints the
// communication report (per rank, communicator, op and size bucket: calls, bytes, latency,
// algbw, busbw, straggler time) as CSV or JSON.
//
//   strata_flight analyse <dir-or-dump>... [--json]
//   strata_flight report <dir-or-dump>... [--csv <file>] [--json <file>]
//
// Exit status: 0 the dumps agree (analyse) or the report was written; 3 a divergence or a
// missing rank's dump was found; 1 an error (an unreadable or malformed dump); 2 a wrong
// command line.
#include <strata/comm/comm_report.hpp>
#include <strata/comm/flight_analysis.hpp>
#include <strata/io/flight_recorder.hpp>

#include <cstdio>
#include <exception>
#include <fstream>
#include <string>
#include <vector>

namespace {

int usage() {
  std::fprintf(stderr, "usage: strata_flight analyse <dir-or-dump>... [--json]\n"
                       "       strata_flight report <dir-or-dump>... [--csv <file>] [--json "
                       "<file>]\n");
  return 2;
}

void write_file(std::string const& path, std::string const& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
  if (!out)
    throw strata::config_error("strata_flight: cannot write " + path);
}

} // namespace

int main(int argc, char** argv) {
  if (argc < 3)
    return usage();
  std::string const cmd = argv[1];
  std::vector<std::string> inputs;
  std::string csv, json;
  bool as_json = false;
  for (int i = 2; i < argc; ++i) {
    std::string const a = argv[i];
    if (a == "--json" && cmd == "analyse") {
      as_json = true;
    } else if ((a == "--csv" || a == "--json") && cmd == "report") {
      if (i + 1 >= argc)
        return usage();
      (a == "--csv" ? csv : json) = argv[++i];
    } else if (a.rfind("--", 0) == 0) {
      return usage();
    } else {
      inputs.push_back(a);
    }
  }
  if (inputs.empty() || (cmd != "analyse" && cmd != "report"))
    return usage();
  try {
    std::vector<strata::comm::flight_dump> dumps;
    for (auto const& in : inputs)
      for (auto& d : strata::io::load_flight_dumps(in))
        dumps.push_back(std::move(d));
    if (cmd == "analyse") {
      auto const a = strata::comm::analyse(dumps);
      if (as_json)
        std::printf("%s\n", strata::io::to_json(a).dump(2).c_str());
      else
        std::printf("%s", strata::comm::to_text(a, dumps).c_str());
      return a.consistent() ? 0 : 3;
    }
    auto const rep = strata::comm::make_report(dumps);
    if (!csv.empty())
      write_file(csv, strata::comm::to_csv(rep));
    if (!json.empty())
      write_file(json, strata::io::to_json(rep).dump(2) + "\n");
    if (csv.empty() && json.empty())
      std::printf("%s", strata::comm::to_csv(rep).c_str());
    for (auto const& [rank, n] : rep.dropped)
      if (n)
        std::fprintf(stderr,
                     "strata_flight: rank %d's ring had dropped its %llu oldest calls: its "
                     "totals cover the last ones only (raise STRATA_FLIGHT_RECORDER)\n",
                     rank, static_cast<unsigned long long>(n));
    return 0;
  } catch (std::exception const& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
