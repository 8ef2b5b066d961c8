// Prints the time x rank charts of docs/pipeline_schedules.md from the schedule tables:
// strata_schedule_chart (GPipe, 1F1B with p = 4, m = 8; interleaved 1F1B with v = 2), or
// strata_schedule_chart gpipe|1f1b|interleaved P M [V [FORWARD BACKWARD]] for one schedule.
#include <strata/parallel/schedule.hpp>
#include <strata/parallel/schedule_check.hpp>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>

namespace sp = strata::parallel;

int main(int argc, char** argv) try {
  if (argc == 1) {
    std::printf("%s\n", sp::chart(sp::make_schedule(sp::schedule_kind::gpipe, 4, 8)).c_str());
    std::printf("%s\n", sp::chart(sp::make_schedule(sp::schedule_kind::one_f_one_b, 4, 8)).c_str());
    std::printf("%s",
                sp::chart(sp::make_schedule(sp::schedule_kind::interleaved_1f1b, 4, 8, 2)).c_str());
    return 0;
  }
  if (argc != 4 && argc != 5 && argc != 7) {
    std::fprintf(stderr, "usage: %s [gpipe|1f1b|interleaved P M [V [FORWARD BACKWARD]]]\n",
                 argv[0]);
    return 2;
  }
  std::string const name = argv[1];
  sp::schedule_kind kind = sp::schedule_kind::gpipe;
  if (name == "1f1b")
    kind = sp::schedule_kind::one_f_one_b;
  else if (name == "interleaved")
    kind = sp::schedule_kind::interleaved_1f1b;
  else if (name != "gpipe") {
    std::fprintf(stderr, "unknown schedule '%s': use gpipe, 1f1b or interleaved\n", argv[1]);
    return 2;
  }
  int const v = argc >= 5 ? std::atoi(argv[4]) : 1;
  sp::schedule_timing timing;
  if (argc == 7)
    timing = {.forward = std::atoi(argv[5]), .backward = std::atoi(argv[6])};
  std::printf("%s",
              sp::chart(sp::make_schedule(kind, std::atoi(argv[2]), std::atoi(argv[3]), v), timing)
                  .c_str());
  return 0;
} catch (std::exception const& e) {
  std::fprintf(stderr, "%s\n", e.what());
  return 1;
}
