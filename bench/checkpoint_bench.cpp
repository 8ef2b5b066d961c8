// strata_bench_checkpoint: checkpoint throughput (issue 24). io::save and io::load of a one-rank
// GPT's state (weights and AdamW moments in f32, over 1 GiB) against the disk's own sequential
// write (write + fsync) and cold read of a file of the same size, measured in the same run (the
// save once more through io::async_saver, timing its staging on the training thread and its
// write apart; the load once more from the page cache); and the step time of a small trainer
// with an io::async_saver save in flight against without, on 2 compute threads and on 1.
//
//   strata_bench_checkpoint [--ckpt_size=full|tiny] [--ckpt_dir=DIR] [benchmark flags]
//
// full (the default): a GPT of d 768, 12 layers, vocab 8192 (97.7M parameters, 1.09 GiB of
// state); tiny: a small one, for the smoke test. Files go under DIR (default: the system's
// temporary directory) and are removed at the end. Reads are cold: the page cache is dropped
// (/proc/sys/vm/drop_caches, as root) or, failing that, the files' pages are evicted
// (posix_fadvise DONTNEED after fdatasync); the label says which.
#include <strata/io/trainer_checkpoint.hpp>
#include <strata/models/gpt.hpp>
#include <strata/optim/adamw.hpp>
#include <strata/optim/schedule.hpp>
#include <strata/train/trainer.hpp>

#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <fcntl.h>
#include <unistd.h>

namespace {

namespace st = strata;
namespace fs = std::filesystem;
using gpt = st::models::gpt_model<float>;
using clock_type = std::chrono::steady_clock;

bool tiny = false;
fs::path work_dir;

double seconds_since(clock_type::time_point t0) {
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}

[[noreturn]] void fail(std::string const& what, fs::path const& p) {
  throw st::error("strata: checkpoint bench: cannot " + what + " '" + p.string() +
                  "': " + std::strerror(errno) + " (check --ckpt_dir and the free space)");
}

/// The disk's own sequential write: `bytes` of incompressible data to a new file in 8 MiB
/// write(2)s (the store's chunk), then fsync. Returns the seconds.
double disk_write(fs::path const& path, std::uint64_t bytes) {
  static std::vector<std::byte> chunk = [] {
    std::vector<std::byte> c(std::size_t{8} << 20);
    std::mt19937_64 g(42);
    for (std::size_t i = 0; i < c.size(); i += 8) {
      std::uint64_t const v = g();
      std::memcpy(c.data() + i, &v, 8);
    }
    return c;
  }();
  ::sync();
  auto const t0 = clock_type::now();
  int const fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0)
    fail("create", path);
  std::uint64_t left = bytes;
  std::size_t turn = 0;
  while (left > 0) {
    // Each chunk a little different (its first word), so no layer below can deduplicate it.
    std::uint64_t const mark = ++turn;
    std::size_t const n = static_cast<std::size_t>(std::min<std::uint64_t>(left, chunk.size()));
    std::memcpy(chunk.data(), &mark, sizeof mark);
    std::size_t at = 0;
    while (at < n) {
      ssize_t const w = ::write(fd, chunk.data() + at, n - at);
      if (w < 0) {
        if (errno == EINTR)
          continue;
        fail("write", path);
      }
      at += static_cast<std::size_t>(w);
    }
    left -= n;
  }
  if (::fsync(fd) != 0)
    fail("fsync", path);
  ::close(fd);
  return seconds_since(t0);
}

/// Drops the page cache (all of it, as root), else evicts the given files' pages. Returns how.
std::string drop_cache(std::vector<fs::path> const& files) {
  ::sync();
  {
    std::ofstream drop("/proc/sys/vm/drop_caches");
    if (drop && (drop << "1").flush())
      return "drop_caches";
  }
  for (auto const& f : files) {
    int const fd = ::open(f.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0)
      continue;
    ::fdatasync(fd);
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
  }
  return "fadvise DONTNEED";
}

/// The disk's own sequential read of the file, in 8 MiB read(2)s. Returns the seconds.
double disk_read(fs::path const& path) {
  std::vector<std::byte> buf(std::size_t{8} << 20);
  auto const t0 = clock_type::now();
  int const fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    fail("open", path);
  std::uint64_t sum = 0;
  for (;;) {
    ssize_t const r = ::read(fd, buf.data(), buf.size());
    if (r < 0) {
      if (errno == EINTR)
        continue;
      fail("read", path);
    }
    if (r == 0)
      break;
    sum += static_cast<std::uint64_t>(buf[0]); // touch what was read
  }
  ::close(fd);
  benchmark::DoNotOptimize(sum);
  return seconds_since(t0);
}

std::uint64_t dir_bytes(fs::path const& dir) {
  std::uint64_t n = 0;
  for (auto const& e : fs::directory_iterator(dir))
    if (e.is_regular_file())
      n += e.file_size();
  return n;
}

std::vector<fs::path> files_of(fs::path const& dir) {
  std::vector<fs::path> out;
  for (auto const& e : fs::directory_iterator(dir))
    if (e.is_regular_file())
      out.push_back(e.path());
  return out;
}

double mb_per_s(std::uint64_t bytes, double s) {
  return static_cast<double>(bytes) / s / 1e6;
}

// ---- save and load of a >= 1 GiB state -------------------------------------------------------

/// The one-rank trainer whose state is saved and loaded, built once for both benchmarks.
struct big_state {
  gpt model;
  st::trainer<gpt> t;
  fs::path root, raw;
  std::uint64_t state_bytes = 0; // weights + moments
  bool saved = false;

  static st::models::gpt_config config() {
    if (tiny)
      return {.vocab = 256, .seq = 16, .features = 64, .heads = 4, .layers = 2};
    return {.vocab = 8192, .seq = 64, .features = 768, .heads = 12, .layers = 12};
  }
  big_state()
      : model(config()), t(model, st::engine::use<st::optim::adamw<float>>({}),
                           {.lr = st::optim::constant_schedule(3e-4), .seed = 7}),
        root(work_dir / "strata_bench_ckpt"), raw(work_dir / "strata_bench_ckpt_raw.bin") {
    state_bytes = 3 * t.optimizer().size() * sizeof(float);
  }
  ~big_state() {
    std::error_code ec;
    fs::remove_all(root, ec);
    fs::remove(raw, ec);
  }
  fs::path dir() const { return root / st::io::detail::step_name(t.steps()); }
};

big_state& state_of() {
  static big_state s;
  return s;
}

// Figures kept for the summary printed after the run.
struct figures {
  double disk_write = 0, save = 0, disk_read = 0, load = 0, load_warm = 0; // MB/s
  double staging = 0, writing = 0;                                         // s
  struct step_figures {
    double step = 0, step_saving = 0, save_call = 0, in_flight = 0, ratio = 0; // ms, share
  };
  std::map<std::size_t, step_figures> steps; // by compute threads
  std::uint64_t state = 0, file = 0;
  std::string cold;
} fig;

void save_bench(benchmark::State& state) {
  auto& s = state_of();
  double disk_s = 0, save_s = 0, staging_s = 0, write_s = 0;
  std::uint64_t bytes = 0;
  for (auto _ : state) {
    disk_s += disk_write(s.raw, s.state_bytes);
    std::error_code ec;
    fs::remove_all(s.root, ec);
    ::sync();
    auto const t0 = clock_type::now();
    auto const dir = st::io::save(s.t, s.root);
    double const sec = seconds_since(t0);
    save_s += sec;
    state.SetIterationTime(sec);
    bytes = dir_bytes(dir);
    s.saved = true;
    // The same save split in two: what io::async_saver::save() does on the training thread (the
    // staging copy of the state and its CRC-32C), and the rest (the write, fsync and commit).
    fs::remove_all(s.root, ec);
    ::sync();
    st::io::async_saver saver;
    auto const t1 = clock_type::now();
    saver.save(s.t, s.root);
    staging_s += seconds_since(t1);
    auto const t2 = clock_type::now();
    (void)saver.wait();
    write_s += seconds_since(t2);
  }
  double const n = static_cast<double>(state.iterations());
  fig.state = s.state_bytes;
  fig.file = bytes;
  fig.disk_write = mb_per_s(s.state_bytes, disk_s / n);
  fig.save = mb_per_s(bytes, save_s / n);
  state.counters["state_MiB"] = static_cast<double>(s.state_bytes) / (1 << 20);
  state.counters["disk_write_MB/s"] = fig.disk_write;
  state.counters["save_MB/s"] = fig.save;
  state.counters["save_vs_disk"] = fig.save / fig.disk_write;
  fig.staging = staging_s / n;
  fig.writing = write_s / n;
  state.counters["staging_s"] = fig.staging;
  state.counters["write_commit_s"] = fig.writing;
}

void load_bench(benchmark::State& state) {
  auto& s = state_of();
  if (!s.saved) { // run alone (--benchmark_filter): a checkpoint and the raw file first
    (void)disk_write(s.raw, s.state_bytes);
    (void)st::io::save(s.t, s.root);
    s.saved = true;
  }
  if (!fs::exists(s.raw))
    (void)disk_write(s.raw, s.state_bytes);
  auto const dir = s.dir();
  std::uint64_t const bytes = dir_bytes(dir);
  double disk_s = 0, load_s = 0, warm_s = 0;
  std::string how;
  for (auto _ : state) {
    how = drop_cache({s.raw});
    disk_s += disk_read(s.raw);
    how = drop_cache(files_of(dir));
    auto const t0 = clock_type::now();
    (void)st::io::load(s.t, dir);
    double const sec = seconds_since(t0);
    load_s += sec;
    state.SetIterationTime(sec);
    // Again with the files in the page cache: the load's own work, without the disk.
    auto const t1 = clock_type::now();
    (void)st::io::load(s.t, dir);
    warm_s += seconds_since(t1);
  }
  double const n = static_cast<double>(state.iterations());
  fig.cold = how;
  fig.disk_read = mb_per_s(fs::file_size(s.raw), disk_s / n);
  fig.load = mb_per_s(bytes, load_s / n);
  state.SetLabel("cold reads: " + how);
  state.counters["state_MiB"] = static_cast<double>(s.state_bytes) / (1 << 20);
  state.counters["disk_read_MB/s"] = fig.disk_read;
  state.counters["load_MB/s"] = fig.load;
  state.counters["load_vs_disk"] = fig.load / fig.disk_read;
  fig.load_warm = mb_per_s(bytes, warm_s / n);
  state.counters["load_warm_MB/s"] = fig.load_warm;
}

// ---- a step with a save in flight ------------------------------------------------------------

double median(std::vector<double> v) {
  std::nth_element(v.begin(), v.begin() + static_cast<long>(v.size() / 2), v.end());
  return v[v.size() / 2];
}

void async_step_bench(benchmark::State& state) {
  st::models::gpt_config const c =
      tiny ? st::models::gpt_config{.vocab = 64, .seq = 16, .features = 32, .heads = 4, .layers = 2}
           : st::models::gpt_config{
                 .vocab = 256, .seq = 64, .features = 128, .heads = 4, .layers = 8};
  std::size_t const sequences = 8, rows = sequences * c.seq;
  gpt const model{c};
  std::size_t const threads = static_cast<std::size_t>(state.range(0));
  st::trainer<gpt> t(model, st::engine::use<st::optim::adamw<float>>({}),
                     {.lr = st::optim::constant_schedule(3e-4), .seed = 11, .threads = threads});
  std::vector<std::int32_t> tokens(rows), targets(rows);
  std::mt19937 g(4321);
  std::uniform_int_distribution<std::int32_t> u(0, static_cast<std::int32_t>(c.vocab) - 1);
  for (std::size_t i = 0; i < rows; ++i) {
    tokens[i] = u(g);
    targets[i] = u(g);
  }
  st::engine::batch_view<float> const batch{sequences, c.seq, tokens, {}, targets};
  auto const root = work_dir / "strata_bench_ckpt_async";
  st::io::async_saver saver;
  for (int i = 0; i < 2; ++i)
    t.step(batch);
  auto timed_step = [&] {
    auto const t0 = clock_type::now();
    benchmark::DoNotOptimize(t.step(batch));
    return seconds_since(t0);
  };
  // Steps in pairs, one plain and one with the save of the step before in flight, so that both
  // see the same machine; the median of the pairs.
  std::vector<double> plain, saving, call, ratios;
  std::size_t in_flight = 0, pairs = 0;
  for (auto _ : state) {
    for (int p = 0; p < 9; ++p) {
      plain.push_back(timed_step());
      auto const t0 = clock_type::now();
      saver.save(t, root, {.keep_last = 1, .loader = {}});
      call.push_back(seconds_since(t0));
      in_flight += saver.busy() ? 1 : 0;
      saving.push_back(timed_step());
      state.SetIterationTime(saving.back());
      (void)saver.wait();
      ratios.push_back(saving.back() / plain.back());
      ++pairs;
    }
  }
  std::error_code ec;
  fs::remove_all(root, ec);
  auto& f = fig.steps[threads];
  f.step = median(plain) * 1e3;
  f.step_saving = median(saving) * 1e3;
  f.save_call = median(call) * 1e3;
  f.in_flight = static_cast<double>(in_flight) / static_cast<double>(pairs);
  f.ratio = median(ratios);
  state.counters["state_MiB"] =
      static_cast<double>(3 * t.optimizer().size() * sizeof(float)) / (1 << 20);
  state.counters["step_ms"] = f.step;
  state.counters["step_saving_ms"] = f.step_saving;
  state.counters["save_call_ms"] = f.save_call;
  state.counters["in_flight"] = f.in_flight;
  state.counters["saving_vs_plain"] = f.ratio;
}

} // namespace

int main(int argc, char** argv) {
  // This benchmark's own flags, taken out before Google Benchmark reads the rest.
  work_dir = fs::temp_directory_path();
  std::vector<char*> rest;
  for (int i = 0; i < argc; ++i) {
    std::string const a = argv[i];
    if (a == "--ckpt_size=tiny" || a == "--ckpt_size=full") {
      tiny = a == "--ckpt_size=tiny";
    } else if (a.rfind("--ckpt_dir=", 0) == 0) {
      work_dir = a.substr(11);
    } else if (a.rfind("--ckpt_", 0) == 0) {
      std::fprintf(stderr,
                   "strata_bench_checkpoint: unknown flag '%s' (--ckpt_size=full|tiny, "
                   "--ckpt_dir=DIR)\n",
                   a.c_str());
      return 2;
    } else {
      rest.push_back(argv[i]);
    }
  }
  int n = static_cast<int>(rest.size());
  benchmark::Initialize(&n, rest.data());
  if (benchmark::ReportUnrecognizedArguments(n, rest.data()))
    return 1;
  benchmark::RegisterBenchmark("checkpoint/save", save_bench)
      ->Iterations(1)
      ->UseManualTime()
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("checkpoint/load", load_bench)
      ->Iterations(1)
      ->UseManualTime()
      ->Unit(benchmark::kMillisecond);
  // Two compute threads fill this machine's two cores; one leaves a core to the save's thread.
  benchmark::RegisterBenchmark("checkpoint/step_with_async_save", async_step_bench)
      ->ArgName("threads")
      ->Arg(2)
      ->Arg(1)
      ->Iterations(1)
      ->UseManualTime()
      ->Unit(benchmark::kMillisecond);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  if (fig.save > 0)
    std::printf("\nstate %.1f MiB (file %.1f MiB): disk write %.0f MB/s, io::save %.0f MB/s "
                "(%.0f%%); the same save by async_saver: %.2f s staging, %.2f s write and "
                "commit\n",
                static_cast<double>(fig.state) / (1 << 20),
                static_cast<double>(fig.file) / (1 << 20), fig.disk_write, fig.save,
                100 * fig.save / fig.disk_write, fig.staging, fig.writing);
  if (fig.load > 0)
    std::printf("cold reads by %s: disk read %.0f MB/s, io::load %.0f MB/s (%.0f%%); io::load "
                "from the page cache %.0f MB/s\n",
                fig.cold.c_str(), fig.disk_read, fig.load, 100 * fig.load / fig.disk_read,
                fig.load_warm);
  for (auto const& [threads, f] : fig.steps)
    std::printf("threads %zu: step %.1f ms, with an async save in flight %.1f ms (x%.2f, median "
                "of 9 pairs; in flight at %.0f%% of those steps); save() on the training thread "
                "%.1f ms\n",
                threads, f.step, f.step_saving, f.ratio, 100 * f.in_flight, f.save_call);
  return 0;
}
