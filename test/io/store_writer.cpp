// A checkpoint writer for the store's fault test: commits step <step> under <root> with three
// files of known bytes (a function of the step), and stops the process (_exit(9), no cleanup, as
// a killed writer) before the write that would pass <kill_bytes> bytes, or at the named stage
// "(rename)" or "(latest)"; -1 and no stage: it finishes.
//
//   strata_store_writer <root> <step> <kill_bytes> [stage]
#include <strata/io/store.hpp>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <unistd.h>

#include "store_files.hpp"

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: strata_store_writer <root> <step> <kill_bytes> [stage]\n");
    return 2;
  }
  std::int64_t const step = std::atoll(argv[2]);
  long long const kill = std::atoll(argv[3]);
  std::string const stage = argc > 4 ? argv[4] : "";
  strata::io::store s(argv[1]);
  s.set_write_hook(
      [&](std::string const& file, std::uint64_t written) {
        if ((kill >= 0 && written >= static_cast<std::uint64_t>(kill)) ||
            (!stage.empty() && file == stage))
          ::_exit(9);
      },
      4096);
  s.begin(step);
  std::map<std::string, strata::io::file_record> files;
  for (auto const& f : strata::test::store_files(step))
    files[f.name] = s.write(step, f.name, f.bytes);
  s.commit(step, files);
  return 0;
}
