// The environment report (strata_report, DeepSpeed's ds_report): checks of the build, the
// machine, the libraries and the launch environment, each OK, WARNING or FAIL with a reason
// and a fix. Every check is a pure function of `readings` (what the tool read from the
// machine), so a test drives each one to every outcome with readings of its own.
#pragma once

#include <strata/core/build_info.hpp>

#include <algorithm>
#include <charconv>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

namespace strata::profile {

/// A check's outcome. Only fail makes strata_report exit nonzero.
enum class level { ok, warning, fail };

/// "OK", "WARNING" or "FAIL".
constexpr char const* level_name(level l) noexcept {
  return l == level::ok ? "OK" : l == level::warning ? "WARNING" : "FAIL";
}

/// One check's result: what was read, the outcome, why, and what to do (empty when OK).
struct check {
  std::string name;
  level status = level::ok;
  std::string value;
  std::string reason;
  std::string fix;
};

/// A network interface as getifaddrs lists it.
struct interface_info {
  std::string name;
  std::vector<std::string> ipv4;
  bool up = false;
  bool loopback = false;
};

/// A CUDA device: its name, memory and compute capability.
struct gpu_info {
  std::string name;
  std::uint64_t total_bytes = 0;
  std::uint64_t free_bytes = 0;
  int major = 0;
  int minor = 0;
};

/// /dev/shm as statvfs and access(W_OK) see it.
struct shm_info {
  bool present = false;
  bool writable = false;
  std::uint64_t total_bytes = 0;
  std::uint64_t free_bytes = 0;
};

/// The optional dependencies the build found (CMake's STRATA_HAVE_*).
struct dependencies {
  bool mpi = false;
  bool cuda = false;
  bool nccl = false;
  bool openblas = false;
  bool eigen = false;
  bool json = false;
};

/// Everything the checks read. The tool fills it from the machine; a test fills it by hand.
struct readings {
  std::uint32_t version = version_code; // the headers' version
  std::string project_version;          // CMake's project(VERSION); empty: unknown
  std::uint32_t options = 0;            // build_option bits
  std::int64_t build_hash = 0;
  dependencies found;
  std::uint64_t compiler = 0; // compiler_code
  std::string compiler_text;  // __VERSION__
  std::string cpuinfo;        // /proc/cpuinfo
  unsigned hardware_threads = 0;
  std::string meminfo;                    // /proc/meminfo
  std::map<std::string, std::string> env; // the process's environment
  std::string mpi_header;  // the MPI compiled against ("Open MPI 4.1.4"); empty: not built with MPI
  std::string mpi_library; // MPI_Get_library_version's text
  int cuda_runtime = 0;    // cudaRuntimeGetVersion (13000 is 13.0); 0: unknown
  int cuda_driver = 0;     // cudaDriverGetVersion; 0: no driver
  int gpu_count = 0;
  std::string gpu_error; // why cudaGetDeviceCount found none
  std::vector<gpu_info> gpus;
  int nccl_header = 0;  // NCCL_VERSION_CODE compiled against (22809 is 2.28.9)
  int nccl_library = 0; // ncclGetVersion; 0: unknown
  shm_info shm;
  std::vector<interface_info> interfaces;
};

namespace detail {

inline std::optional<long long> parse_integer(std::string_view s) {
  long long v = 0;
  auto const [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (s.empty() || ec != std::errc() || end != s.data() + s.size())
    return std::nullopt;
  return v;
}

inline std::optional<double> parse_number(std::string_view s) {
  double v = 0;
  auto const [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (s.empty() || ec != std::errc() || end != s.data() + s.size())
    return std::nullopt;
  return v;
}

inline std::string const* find(readings const& r, std::string const& name) {
  auto it = r.env.find(name);
  return it == r.env.end() ? nullptr : &it->second;
}

/// "12.3 GiB" (binary units, one decimal).
inline std::string bytes_text(std::uint64_t b) {
  char buf[32];
  if (b >= (1ull << 30))
    std::snprintf(buf, sizeof buf, "%.1f GiB", static_cast<double>(b) / (1ull << 30));
  else
    std::snprintf(buf, sizeof buf, "%.1f MiB", static_cast<double>(b) / (1ull << 20));
  return buf;
}

/// The value of "key: value" lines (/proc/cpuinfo, /proc/meminfo): the first such line's.
inline std::optional<std::string> field(std::string const& text, std::string_view key) {
  std::size_t pos = 0;
  while (pos < text.size()) {
    std::size_t const eol = std::min(text.find('\n', pos), text.size());
    std::string_view line(text.data() + pos, eol - pos);
    if (line.size() > key.size() && line.substr(0, key.size()) == key) {
      auto rest = line.substr(key.size());
      auto const colon = rest.find(':');
      if (colon != std::string_view::npos &&
          rest.substr(0, colon).find_first_not_of(" \t") == std::string_view::npos) {
        rest = rest.substr(colon + 1);
        auto const b = rest.find_first_not_of(" \t");
        auto const e = rest.find_last_not_of(" \t\r");
        return b == std::string_view::npos ? std::string() : std::string(rest.substr(b, e - b + 1));
      }
    }
    pos = eol + 1;
  }
  return std::nullopt;
}

/// A /proc/meminfo entry in bytes ("MemTotal:  24576000 kB").
inline std::optional<std::uint64_t> meminfo_bytes(std::string const& text, std::string_view key) {
  auto v = field(text, key);
  if (!v)
    return std::nullopt;
  auto const sp = v->find(' ');
  auto n = parse_integer(std::string_view(*v).substr(0, sp));
  if (!n || *n < 0)
    return std::nullopt;
  return static_cast<std::uint64_t>(*n) * 1024;
}

inline bool has_word(std::string const& words, std::string_view w) {
  std::size_t pos = 0;
  while ((pos = words.find(w, pos)) != std::string::npos) {
    bool const start = pos == 0 || words[pos - 1] == ' ';
    bool const end = pos + w.size() == words.size() || words[pos + w.size()] == ' ';
    if (start && end)
      return true;
    pos += w.size();
  }
  return false;
}

inline std::vector<std::string> split(std::string_view s, char sep) {
  std::vector<std::string> out;
  std::size_t pos = 0;
  while (pos <= s.size()) {
    auto const e = std::min(s.find(sep, pos), s.size());
    if (e > pos)
      out.emplace_back(s.substr(pos, e - pos));
    pos = e + 1;
  }
  return out;
}

/// "13.0" of a CUDA version number (13000).
inline std::string cuda_version_text(int v) {
  return std::to_string(v / 1000) + "." + std::to_string((v % 1000) / 10);
}

/// "2.28.9" of an NCCL version code (22809; codes before 2.9 are 1000 * major + 100 * minor).
inline std::string nccl_version_text(int v) {
  if (v >= 20900)
    return std::to_string(v / 10000) + "." + std::to_string((v % 10000) / 100) + "." +
           std::to_string(v % 100);
  return std::to_string(v / 1000) + "." + std::to_string((v % 1000) / 100) + "." +
         std::to_string(v % 100);
}

/// The MPI implementation a version text names, and its major version (-1: not found).
struct mpi_identity {
  std::string implementation;
  int major = -1;
};
inline mpi_identity identify_mpi(std::string const& text) {
  mpi_identity id;
  std::size_t at = std::string::npos;
  for (char const* name : {"Open MPI", "MVAPICH", "Intel(R) MPI", "MPICH"})
    if (auto const p = text.find(name); p != std::string::npos) {
      id.implementation = name;
      at = p + std::string_view(name).size();
      break;
    }
  if (at == std::string::npos)
    return id;
  auto const d = text.find_first_of("0123456789", at);
  if (d != std::string::npos && d < at + 24)
    id.major = std::atoi(text.c_str() + d);
  return id;
}

// Does an interface selection (NCCL_SOCKET_IFNAME's syntax: comma-separated name prefixes,
// "=" for exact names, a leading "^" to exclude) leave any interface that is up?
inline bool selects_any(std::string_view spec, std::vector<interface_info> const& ifs) {
  bool exclude = false;
  if (!spec.empty() && spec.front() == '^') {
    exclude = true;
    spec.remove_prefix(1);
  }
  bool exact = false;
  if (!spec.empty() && spec.front() == '=') {
    exact = true;
    spec.remove_prefix(1);
  }
  auto const names = split(spec, ',');
  auto matches = [&](std::string const& ifname) {
    for (auto const& n : names)
      if (exact ? ifname == n : ifname.compare(0, n.size(), n) == 0)
        return true;
    return false;
  };
  for (auto const& i : ifs)
    if (i.up && matches(i.name) != exclude)
      return true;
  return false;
}

inline std::string interface_names(std::vector<interface_info> const& ifs) {
  std::string s;
  for (auto const& i : ifs)
    if (i.up)
      s += (s.empty() ? "" : ", ") + i.name;
  return s.empty() ? "none" : s;
}

inline check make(std::string name, std::string value) {
  check c;
  c.name = std::move(name);
  c.value = std::move(value);
  return c;
}

inline void set(check& c, level l, std::string reason, std::string fix) {
  if (l < c.status)
    return;
  if (l > c.status) {
    c.reason.clear();
    c.fix.clear();
  }
  c.status = l;
  c.reason += (c.reason.empty() ? "" : "; ") + reason;
  if (!fix.empty())
    c.fix += (c.fix.empty() ? "" : "; ") + fix;
}

inline void ok(check& c, std::string reason) {
  if (c.status == level::ok && c.reason.empty())
    c.reason = std::move(reason);
}

} // namespace detail

/// The headers' version against CMake's project(VERSION): FAIL when they differ (the headers
/// and the build files come from different versions), WARNING when the project's is unknown.
inline check check_version(readings const& r) {
  auto c = detail::make("version", "strata " + version_string(r.version));
  if (r.project_version.empty())
    detail::set(c, level::warning, "CMake's project version is unknown to this program",
                "build strata_report from strata's own CMake project");
  else if (r.project_version != version_string(r.version))
    detail::set(c, level::fail,
                "the headers say " + version_string(r.version) +
                    ", CMake's project(VERSION) says " + r.project_version,
                "headers and build files come from different versions of strata: install one "
                "version, or make STRATA_VERSION_* in core/build_info.hpp and CMakeLists.txt's "
                "project(VERSION) agree");
  detail::ok(c, "the headers and CMake's project agree");
  return c;
}

/// Build options and the dependencies found. FAIL: -ffast-math (no inf or NaN: the fp16 loss
/// scaler's overflow check cannot see an overflow). WARNING: assertions on (a debug build),
/// no OpenBLAS, or compiled without AVX2 where the CPU has it.
inline check check_build(readings const& r) {
  auto const& f = r.found;
  std::string found;
  auto add = [&](bool b, char const* n) {
    if (b)
      found += (found.empty() ? "" : ", ") + std::string(n);
  };
  add(f.mpi, "MPI");
  add(f.cuda, "CUDA");
  add(f.nccl, "NCCL");
  add(f.openblas, "OpenBLAS");
  add(f.eigen, "Eigen");
  add(f.json, "nlohmann_json");
  char hash[24];
  std::snprintf(hash, sizeof hash, "%016llx", static_cast<unsigned long long>(r.build_hash));
  auto c = detail::make("build", "options: " + build_options_string(r.options) + "; found: " +
                                     (found.empty() ? "none" : found) + "; build hash " + hash);
  if (r.options & build_fast_math)
    detail::set(c, level::fail, "compiled with -ffast-math: the compiler may assume no inf or NaN",
                "the fp16 loss scaler and the gradient checks must see inf and NaN: drop "
                "-ffast-math (and -ffinite-math-only)");
  if (r.options & build_assertions)
    detail::set(c, level::warning, "a debug build (NDEBUG not defined): assertions on, slower",
                "configure with -DCMAKE_BUILD_TYPE=Release or RelWithDebInfo");
  if (!f.openblas)
    detail::set(c, level::warning, "no OpenBLAS: the host GEMM runs strata's own kernel",
                "apt-get install libopenblas-dev and configure again (STRATA_BLAS=AUTO)");
  auto const flags = detail::field(r.cpuinfo, "flags");
  if (flags && detail::has_word(*flags, "avx2") && !(r.options & build_avx2))
    detail::set(c, level::warning,
                "compiled without AVX2 on a CPU that has it: strata's kernels dispatch at run "
                "time, Eigen and the compiler's own code run SSE2 (about 6x slower GEMM)",
                "compile with -march=native (or -march=x86-64-v3)");
  detail::ok(c, "a release build; OpenBLAS found");
  return c;
}

/// The compiler of this program. OK: GCC 12 or later, Clang 15 or later (what strata is tested
/// with or newer); WARNING: another compiler or an older version with C++20; FAIL: GCC
/// before 10 or Clang before 10 (no concepts).
inline check check_compiler(readings const& r) {
  auto const name = compiler_string(r.compiler);
  bool const said = r.compiler_text.empty() || name.find(r.compiler_text) != std::string::npos;
  auto c = detail::make("compiler", name + (said ? "" : " (" + r.compiler_text + ")"));
  auto const id = r.compiler >> 48;
  int const major = static_cast<int>((r.compiler >> 32) & 0xffff);
  if (id == 0)
    detail::set(c, level::warning, "an unknown compiler: strata is tested with GCC 12",
                "use GCC 12 or later, or Clang 15 or later");
  else if (major < 10)
    detail::set(c, level::fail, name + " has no C++20 concepts",
                "use GCC 12 or later, or Clang 15 or later");
  else if ((id == 1 && major < 12) || (id == 2 && major < 15))
    detail::set(c, level::warning, name + " is older than what strata is tested with",
                "use GCC 12 or later, or Clang 15 or later");
  detail::ok(c, "GCC 12 or later, or Clang 15 or later");
  return c;
}

/// The CPU: model, hardware threads and the vector instructions strata's kernels use. FAIL:
/// this program was compiled for an instruction set the CPU lacks; WARNING: no AVX2 or FMA
/// (the baseline kernels), or /proc/cpuinfo has no flags.
inline check check_cpu(readings const& r) {
  auto const model = detail::field(r.cpuinfo, "model name");
  auto const flags = detail::field(r.cpuinfo, "flags");
  std::string isa;
  for (char const* f : {"avx2", "fma", "avx512f"})
    if (flags && detail::has_word(*flags, f))
      isa += (isa.empty() ? "" : " ") + std::string(f);
  auto c = detail::make(
      "cpu", (model ? *model : std::string("unknown model")) + ", " +
                 std::to_string(r.hardware_threads) + " hardware threads, " +
                 (flags ? (isa.empty() ? "no avx2/fma/avx512f" : isa) : "flags unknown"));
  if (!flags) {
    detail::set(c, level::warning, "/proc/cpuinfo lists no flags",
                "run on Linux x86-64 to see the instruction sets");
    return c;
  }
  std::string missing;
  for (auto [bit, name] : {std::pair{build_avx2, "avx2"}, std::pair{build_fma, "fma"},
                           std::pair{build_avx512f, "avx512f"}})
    if ((r.options & bit) && !detail::has_word(*flags, name))
      missing += (missing.empty() ? "" : ", ") + std::string(name);
  if (!missing.empty())
    detail::set(c, level::fail, "compiled for " + missing + ", which this CPU lacks",
                "build for this CPU (-march=native on it) or for the oldest CPU of the cluster");
  if (!detail::has_word(*flags, "avx2") || !detail::has_word(*flags, "fma"))
    detail::set(c, level::warning, "no AVX2 or FMA: the kernels run the SSE2 baseline copy",
                "a CPU with AVX2 and FMA runs the GEMM several times faster");
  detail::ok(c, "AVX2 and FMA present");
  return c;
}

/// Memory from /proc/meminfo. FAIL: under 1 GiB available; WARNING: under 4 GiB or under 10%
/// of the total available, or meminfo unreadable.
inline check check_memory(readings const& r) {
  auto const total = detail::meminfo_bytes(r.meminfo, "MemTotal");
  auto const avail = detail::meminfo_bytes(r.meminfo, "MemAvailable");
  if (!total || !avail) {
    auto c = detail::make("memory", "unknown");
    detail::set(c, level::warning, "/proc/meminfo has no MemTotal or MemAvailable",
                "run on Linux 3.14 or later");
    return c;
  }
  auto c = detail::make("memory", detail::bytes_text(*total) + " total, " +
                                      detail::bytes_text(*avail) + " available");
  constexpr std::uint64_t gib = 1ull << 30;
  if (*avail < gib)
    detail::set(c, level::fail, "under 1 GiB available",
                "stop other processes or use a larger machine: a step allocates its activations, "
                "gradients and optimizer state here");
  else if (*avail < 4 * gib || *avail < *total / 10)
    detail::set(c, level::warning, "under 4 GiB (or under 10% of the total) available",
                "check what else runs here; the trainer's memory ledger says what a step needs");
  detail::ok(c, "at least 4 GiB available");
  return c;
}

/// Threads: the hardware's, STRATA_NUM_THREADS (the trainer's threads per rank), OMP_NUM_THREADS
/// and the ranks on this host (LOCAL_WORLD_SIZE). FAIL: STRATA_NUM_THREADS is not 1..1024 (the
/// trainer would throw); WARNING: more threads than hardware threads, OMP_NUM_THREADS
/// malformed, or the hardware's count unknown.
inline check check_threads(readings const& r) {
  auto const* snt = detail::find(r, "STRATA_NUM_THREADS");
  auto const* omp = detail::find(r, "OMP_NUM_THREADS");
  auto const* lws = detail::find(r, "LOCAL_WORLD_SIZE");
  long long ranks = 1;
  if (lws)
    if (auto v = detail::parse_integer(*lws); v && *v >= 1)
      ranks = *v;
  auto c = detail::make(
      "threads", std::to_string(r.hardware_threads) + " hardware threads; STRATA_NUM_THREADS " +
                     (snt ? *snt : "unset") + "; OMP_NUM_THREADS " + (omp ? *omp : "unset") + "; " +
                     std::to_string(ranks) + " rank(s) on this host");
  long long per_rank = r.hardware_threads ? std::max<long long>(1, r.hardware_threads / ranks) : 1;
  if (snt && !snt->empty()) {
    auto v = detail::parse_integer(*snt);
    if (!v || *v < 1 || *v > 1024)
      detail::set(c, level::fail, "STRATA_NUM_THREADS=\"" + *snt + "\" is not 1 to 1024",
                  "set a whole number of threads per rank, or unset it for hardware threads / "
                  "ranks on this host");
    else
      per_rank = *v;
  }
  if (omp && !omp->empty()) {
    auto v = detail::parse_integer(*omp);
    if (!v || *v < 1)
      detail::set(c, level::warning, "OMP_NUM_THREADS=\"" + *omp + "\" is not a positive number",
                  "set OMP_NUM_THREADS=1 (or unset it)");
  }
  if (r.hardware_threads == 0)
    detail::set(c, level::warning, "the number of hardware threads is unknown",
                "set STRATA_NUM_THREADS");
  else if (per_rank * ranks > static_cast<long long>(r.hardware_threads))
    detail::set(c, level::warning,
                std::to_string(ranks) + " rank(s) x " + std::to_string(per_rank) +
                    " threads = " + std::to_string(per_rank * ranks) + " threads on " +
                    std::to_string(r.hardware_threads) + " hardware threads: oversubscribed",
                "set STRATA_NUM_THREADS to hardware threads / ranks on this host");
  detail::ok(c, "no more threads than hardware threads");
  return c;
}

/// MPI: the library this program runs with against the headers it was compiled with. OK when
/// not built with MPI (absence is not a failure); FAIL: another implementation or another
/// major version (another ABI); WARNING: the library's version unreadable.
inline check check_mpi(readings const& r) {
  if (r.mpi_header.empty()) {
    auto c = detail::make("mpi", "not built with MPI");
    c.reason = "the local backend (ranks as threads) and NCCL need no MPI";
    return c;
  }
  std::string lib = r.mpi_library.substr(0, r.mpi_library.find('\n'));
  auto c = detail::make("mpi", "compiled against " + r.mpi_header + "; runs " +
                                   (lib.empty() ? std::string("unknown") : lib));
  auto const h = detail::identify_mpi(r.mpi_header), l = detail::identify_mpi(r.mpi_library);
  if (l.implementation.empty())
    detail::set(c, level::warning, "MPI_Get_library_version names no known implementation",
                "check which libmpi the loader picks (ldd strata_report)");
  else if (h.implementation != l.implementation || h.major != l.major)
    detail::set(c, level::fail,
                "compiled against " + h.implementation + " " + std::to_string(h.major) + ", runs " +
                    l.implementation + " " + std::to_string(l.major) + ": another ABI",
                "put the MPI the program was built with first on LD_LIBRARY_PATH, or rebuild "
                "with the cluster's MPI (and launch with its mpirun)");
  detail::ok(c, "the library matches the headers");
  return c;
}

/// CUDA's driver and runtime. OK when not built with CUDA; WARNING: no driver (no GPU on this
/// machine: the host path still runs); FAIL: the driver is older than the runtime
/// (cudaErrorInsufficientDriver).
inline check check_cuda(readings const& r) {
  if (!r.found.cuda) {
    auto c = detail::make("cuda", "not built with CUDA");
    c.reason = "the host path needs no CUDA";
    return c;
  }
  auto c = detail::make(
      "cuda",
      "runtime " +
          (r.cuda_runtime ? detail::cuda_version_text(r.cuda_runtime) : std::string("unknown")) +
          ", driver " +
          (r.cuda_driver ? detail::cuda_version_text(r.cuda_driver) : std::string("none")));
  if (r.cuda_driver == 0)
    detail::set(c, level::warning,
                "no CUDA driver: no GPU on this machine, or the driver is not installed",
                "the cuda device and NCCL need a GPU and its driver; the host path runs");
  else if (r.cuda_runtime != 0 && r.cuda_driver < r.cuda_runtime)
    detail::set(c, level::fail,
                "the driver supports CUDA " + detail::cuda_version_text(r.cuda_driver) +
                    ", older than the runtime's " + detail::cuda_version_text(r.cuda_runtime),
                "update the GPU driver, or build with a CUDA toolkit no newer than the driver");
  detail::ok(c, "the driver supports the runtime");
  return c;
}

/// NCCL: the library against the headers. OK when not built with NCCL; WARNING: the version
/// unknown; FAIL: the library is older than the headers (calls strata makes may be missing).
inline check check_nccl(readings const& r) {
  if (!r.found.nccl) {
    auto c = detail::make("nccl", "not built with NCCL");
    c.reason = "the local and MPI backends need no NCCL";
    return c;
  }
  auto c = detail::make(
      "nccl",
      "compiled against " + detail::nccl_version_text(r.nccl_header) + ", runs " +
          (r.nccl_library ? detail::nccl_version_text(r.nccl_library) : std::string("unknown")));
  if (r.nccl_library == 0)
    detail::set(c, level::warning, "ncclGetVersion failed",
                "check which libnccl the loader picks (ldd)");
  else if (r.nccl_library < r.nccl_header)
    detail::set(c, level::fail, "the library is older than the headers strata was compiled with",
                "put the NCCL the program was built with first on LD_LIBRARY_PATH");
  detail::ok(c, "the library is at least the headers' version");
  return c;
}

/// GPUs and their memory. OK when not built with CUDA; WARNING: no GPU visible (this is not a
/// failure: the host path runs), or a GPU whose memory is more than 10% in use already; FAIL:
/// more ranks on this host (LOCAL_WORLD_SIZE) than GPUs (NCCL refuses two ranks on one GPU).
inline check check_gpus(readings const& r) {
  if (!r.found.cuda) {
    auto c = detail::make("gpus", "not built with CUDA");
    c.reason = "the host path needs no GPU";
    return c;
  }
  std::string list;
  for (std::size_t i = 0; i < r.gpus.size(); ++i) {
    auto const& g = r.gpus[i];
    list += (i ? "; " : "") + std::to_string(i) + ": " + g.name + ", sm_" +
            std::to_string(g.major) + std::to_string(g.minor) + ", " +
            detail::bytes_text(g.total_bytes) + " (" + detail::bytes_text(g.free_bytes) + " free)";
  }
  auto const* cvd = detail::find(r, "CUDA_VISIBLE_DEVICES");
  auto c = detail::make("gpus", std::to_string(r.gpu_count) + " GPU(s)" +
                                    (list.empty() ? "" : ": " + list) +
                                    (cvd ? "; CUDA_VISIBLE_DEVICES=" + *cvd : ""));
  if (r.gpu_count == 0) {
    detail::set(
        c, level::warning, "no GPU visible" + (r.gpu_error.empty() ? "" : " (" + r.gpu_error + ")"),
        cvd ? "check CUDA_VISIBLE_DEVICES" : "the host path runs; the cuda device needs a GPU");
    return c;
  }
  if (auto const* lws = detail::find(r, "LOCAL_WORLD_SIZE"))
    if (auto v = detail::parse_integer(*lws); v && *v > r.gpu_count)
      detail::set(c, level::fail,
                  "LOCAL_WORLD_SIZE=" + *lws + " ranks on this host share " +
                      std::to_string(r.gpu_count) + " GPU(s)",
                  "launch one rank per GPU (NCCL before 2.30 refuses two ranks on one GPU)");
  for (std::size_t i = 0; i < r.gpus.size(); ++i)
    if (r.gpus[i].free_bytes < r.gpus[i].total_bytes - r.gpus[i].total_bytes / 10)
      detail::set(c, level::warning,
                  "GPU " + std::to_string(i) + " has " +
                      detail::bytes_text(r.gpus[i].total_bytes - r.gpus[i].free_bytes) +
                      " in use by another process",
                  "nvidia-smi shows which process holds it");
  detail::ok(c, "GPUs visible, memory free");
  return c;
}

/// /dev/shm, which NCCL and Open MPI's shared-memory transports use. FAIL: missing or not
/// writable; WARNING: under 1 GiB in size or free (Docker's default is 64 MiB).
inline check check_shm(readings const& r) {
  auto const& s = r.shm;
  auto c = detail::make("shm", s.present ? "/dev/shm " + detail::bytes_text(s.total_bytes) + ", " +
                                               detail::bytes_text(s.free_bytes) + " free" +
                                               (s.writable ? "" : ", not writable")
                                         : "/dev/shm missing");
  constexpr std::uint64_t gib = 1ull << 30;
  if (!s.present || !s.writable)
    detail::set(c, level::fail, s.present ? "/dev/shm is not writable" : "no /dev/shm",
                "mount a writable tmpfs on /dev/shm (Docker: --ipc=host or --shm-size=8g): NCCL "
                "and Open MPI's vader transport put their buffers there");
  else if (s.total_bytes < gib || s.free_bytes < gib)
    detail::set(c, level::warning, "under 1 GiB of shared memory (Docker's default is 64 MiB)",
                "Docker: --ipc=host or --shm-size=8g; elsewhere remount /dev/shm larger; NCCL "
                "fails with \"unhandled system error\" when it runs out");
  detail::ok(c, "at least 1 GiB free");
  return c;
}

/// Network interfaces (getifaddrs). FAIL: none up, or an Open MPI or Gloo interface variable
/// (OMPI_MCA_btl_tcp_if_include, OMPI_MCA_oob_tcp_if_include, GLOO_SOCKET_IFNAME) naming an
/// interface that does not exist; WARNING: loopback only (one machine).
inline check check_network(readings const& r) {
  std::string list;
  bool any_up = false, outside = false;
  for (auto const& i : r.interfaces) {
    std::string addrs;
    for (auto const& a : i.ipv4)
      addrs += (addrs.empty() ? "" : " ") + a;
    list += (list.empty() ? "" : "; ") + i.name + (i.up ? " up" : " down") +
            (i.loopback ? " loopback" : "") + (addrs.empty() ? "" : " " + addrs);
    any_up = any_up || i.up;
    outside = outside || (i.up && !i.loopback && !i.ipv4.empty());
  }
  auto c = detail::make("network", list.empty() ? "no interfaces" : list);
  if (!any_up)
    detail::set(c, level::fail, "no network interface is up",
                "bring an interface up (ip link set lo up at least)");
  for (char const* v :
       {"OMPI_MCA_btl_tcp_if_include", "OMPI_MCA_oob_tcp_if_include", "GLOO_SOCKET_IFNAME"}) {
    auto const* spec = detail::find(r, v);
    if (!spec)
      continue;
    for (auto const& name : detail::split(*spec, ',')) {
      if (name.find('/') != std::string::npos)
        continue; // a subnet (CIDR), not a name
      bool const exists = std::any_of(r.interfaces.begin(), r.interfaces.end(),
                                      [&](interface_info const& i) { return i.name == name; });
      if (!exists)
        detail::set(c, level::fail,
                    std::string(v) + " names " + name + ", which does not exist here",
                    "use one of: " + detail::interface_names(r.interfaces));
    }
  }
  if (any_up && !outside)
    detail::set(c, level::warning, "only loopback has an IPv4 address: one machine only",
                "other hosts reach this one through an interface with an address");
  detail::ok(c, "an interface with an IPv4 address is up");
  return c;
}

/// The launch variables torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
/// MASTER_ADDR, MASTER_PORT). FAIL: one of RANK and WORLD_SIZE without the other, a value that
/// is not a number, RANK >= WORLD_SIZE, LOCAL_RANK >= LOCAL_WORLD_SIZE, WORLD_SIZE > 1 without
/// MASTER_ADDR and MASTER_PORT, MASTER_PORT not a port number, WORLD_SIZE differing from
/// Open MPI's OMPI_COMM_WORLD_SIZE; WARNING: MASTER_PORT below 1024, MASTER_ADDR or
/// MASTER_PORT set without WORLD_SIZE (ignored).
inline check check_launch(readings const& r) {
  std::string shown;
  for (char const* v :
       {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"})
    if (auto const* x = detail::find(r, v))
      shown += (shown.empty() ? "" : " ") + std::string(v) + "=" + *x;
  auto c = detail::make("launch",
                        shown.empty() ? "no launch variables (one process, or mpirun)" : shown);
  auto integer = [&](char const* name) -> std::optional<long long> {
    auto const* x = detail::find(r, name);
    if (!x)
      return std::nullopt;
    auto v = detail::parse_integer(*x);
    if (!v || *v < 0) {
      detail::set(c, level::fail, std::string(name) + "=\"" + *x + "\" is not a whole number >= 0",
                  "set it to a rank or a count");
      return std::nullopt;
    }
    return v;
  };
  auto const rank = integer("RANK"), world = integer("WORLD_SIZE");
  auto const local_rank = integer("LOCAL_RANK"), local_world = integer("LOCAL_WORLD_SIZE");
  bool const has_rank = detail::find(r, "RANK") != nullptr;
  bool const has_world = detail::find(r, "WORLD_SIZE") != nullptr;
  std::string const fix = "launch with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT all set "
                          "(torchrun, strata_run) or none (mpirun, one process)";
  if (has_rank != has_world)
    detail::set(c, level::fail,
                std::string(has_rank ? "RANK" : "WORLD_SIZE") + " is set without " +
                    (has_rank ? "WORLD_SIZE" : "RANK"),
                fix);
  if (world && *world < 1)
    detail::set(c, level::fail, "WORLD_SIZE is 0", "a world has at least one rank");
  if (rank && world && *rank >= *world)
    detail::set(c, level::fail,
                "RANK=" + std::to_string(*rank) +
                    " is not below WORLD_SIZE=" + std::to_string(*world),
                "ranks are 0 to WORLD_SIZE - 1");
  if (local_rank && local_world && *local_rank >= *local_world)
    detail::set(c, level::fail,
                "LOCAL_RANK=" + std::to_string(*local_rank) +
                    " is not below LOCAL_WORLD_SIZE=" + std::to_string(*local_world),
                "local ranks are 0 to LOCAL_WORLD_SIZE - 1");
  if (local_world && world && *local_world > *world)
    detail::set(c, level::fail, "LOCAL_WORLD_SIZE exceeds WORLD_SIZE",
                "the ranks on one host are some of the world's");
  auto const* port = detail::find(r, "MASTER_PORT");
  if (port) {
    auto v = detail::parse_integer(*port);
    if (!v || *v < 1 || *v > 65535)
      detail::set(c, level::fail, "MASTER_PORT=\"" + *port + "\" is not a port number (1 to 65535)",
                  "set MASTER_PORT to a free TCP port, e.g. 29500");
    else if (*v < 1024)
      detail::set(c, level::warning, "MASTER_PORT " + *port + " is a privileged port (< 1024)",
                  "use a port of 1024 or above, e.g. 29500");
  }
  auto const* addr = detail::find(r, "MASTER_ADDR");
  if (world && *world > 1 && (!addr || addr->empty() || !port))
    detail::set(c, level::fail, "WORLD_SIZE > 1 without MASTER_ADDR and MASTER_PORT",
                "set MASTER_ADDR to rank 0's host and MASTER_PORT to a free port");
  if (!has_world && (addr || port))
    detail::set(c, level::warning, "MASTER_ADDR or MASTER_PORT set without WORLD_SIZE",
                "mpirun's ranks use them for the store; otherwise they are ignored");
  if (auto const* ompi = detail::find(r, "OMPI_COMM_WORLD_SIZE"); ompi && world)
    if (auto v = detail::parse_integer(*ompi); v && *v != *world)
      detail::set(c, level::fail,
                  "WORLD_SIZE=" + std::to_string(*world) + " but Open MPI's world has " + *ompi +
                      " ranks",
                  "launch with mpirun -np " + std::to_string(*world) + ", or unset WORLD_SIZE");
  detail::ok(c, shown.empty() ? "nothing to check" : "consistent");
  return c;
}

/// strata's own variables: STRATA_COMM_TIMEOUT and STRATA_RDZV_TIMEOUT (positive seconds),
/// STRATA_COMM_CHECKED (0/1/on/off/true/false), STRATA_MPI_PROGRESS_US (whole number >= 0),
/// STRATA_FLIGHT_RECORDER (0 to 2^24 records), STRATA_ISA (base), STRATA_STORE_ADDR,
/// STRATA_FLIGHT_RECORDER_DIR, STRATA_NUM_THREADS (checked by `threads`). FAIL: a
/// malformed value (strata would throw config_error); WARNING: a STRATA_ variable strata does not
/// read (a typo?).
inline check check_strata_env(readings const& r) {
  std::string shown;
  for (auto const& [k, v] : r.env)
    if (k.rfind("STRATA_", 0) == 0)
      shown += (shown.empty() ? "" : " ") + k + "=" + v;
  auto c = detail::make("strata_env", shown.empty() ? "none set" : shown);
  auto bad = [&](std::string const& k, std::string const& v, char const* what) {
    detail::set(c, level::fail, k + "=\"" + v + "\" is not " + what,
                "fix or unset it: strata throws config_error when it reads it");
  };
  for (auto const& [k, v] : r.env) {
    if (k.rfind("STRATA_", 0) != 0)
      continue;
    if (k == "STRATA_COMM_TIMEOUT" || k == "STRATA_RDZV_TIMEOUT") {
      auto s = detail::parse_number(v);
      if (!v.empty() && (!s || !(*s > 0) || *s > 1e7))
        bad(k, v, "a positive number of seconds");
    } else if (k == "STRATA_COMM_CHECKED") {
      if (!v.empty() && v != "0" && v != "1" && v != "on" && v != "off" && v != "true" &&
          v != "false")
        bad(k, v, "0 or 1");
    } else if (k == "STRATA_MPI_PROGRESS_US") {
      auto n = detail::parse_integer(v);
      if (!n || *n < 0)
        bad(k, v, "a whole number of microseconds >= 0");
    } else if (k == "STRATA_FLIGHT_RECORDER") {
      auto n = detail::parse_integer(v);
      if (!v.empty() && (!n || *n < 0 || *n > (1ll << 24)))
        bad(k, v, "a number of records from 0 (off) to 16777216");
    } else if (k == "STRATA_ISA") {
      if (v != "base")
        detail::set(c, level::warning,
                    "STRATA_ISA=\"" + v + "\" is ignored (only \"base\" is read)",
                    "unset it, or STRATA_ISA=base to force the baseline kernels");
    } else if (k != "STRATA_NUM_THREADS" && k != "STRATA_STORE_ADDR" &&
               k != "STRATA_FLIGHT_RECORDER_DIR") {
      detail::set(c, level::warning, k + " is not a variable strata reads",
                  "check its spelling (docs/report.md lists strata's variables)");
    }
  }
  detail::ok(c, shown.empty() ? "nothing to check" : "well-formed");
  return c;
}

/// NCCL's variables. FAIL: NCCL_SOCKET_IFNAME selects no interface that is up; WARNING:
/// NCCL_P2P_DISABLE, NCCL_SHM_DISABLE or NCCL_IB_DISABLE set to 1 (slower transports), or
/// NCCL_DEBUG not one of VERSION, WARN, INFO, TRACE.
inline check check_nccl_env(readings const& r) {
  std::string shown;
  for (auto const& [k, v] : r.env)
    if (k.rfind("NCCL_", 0) == 0)
      shown += (shown.empty() ? "" : " ") + k + "=" + v;
  auto c = detail::make("nccl_env", shown.empty() ? "none set" : shown);
  if (auto const* ifn = detail::find(r, "NCCL_SOCKET_IFNAME"))
    if (!detail::selects_any(*ifn, r.interfaces))
      detail::set(c, level::fail, "NCCL_SOCKET_IFNAME=" + *ifn + " selects no interface that is up",
                  "use one of: " + detail::interface_names(r.interfaces));
  for (char const* v : {"NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "NCCL_IB_DISABLE"})
    if (auto const* x = detail::find(r, v); x && *x == "1")
      detail::set(c, level::warning, std::string(v) + "=1 turns a transport off (slower)",
                  "unset it unless a known fault needs it");
  if (auto const* d = detail::find(r, "NCCL_DEBUG"))
    if (*d != "VERSION" && *d != "WARN" && *d != "INFO" && *d != "TRACE")
      detail::set(c, level::warning, "NCCL_DEBUG=" + *d + " is not VERSION, WARN, INFO or TRACE",
                  "NCCL_DEBUG=WARN (or INFO to see the transports chosen)");
  detail::ok(c, shown.empty() ? "nothing to check" : "consistent with the interfaces");
  return c;
}

/// Every check, in the report's order.
inline std::vector<check> run_checks(readings const& r) {
  return {check_version(r), check_build(r),      check_compiler(r), check_cpu(r),
          check_memory(r),  check_threads(r),    check_mpi(r),      check_cuda(r),
          check_nccl(r),    check_gpus(r),       check_shm(r),      check_network(r),
          check_launch(r),  check_strata_env(r), check_nccl_env(r)};
}

/// The variables the report lists: the launch's, CUDA_VISIBLE_DEVICES, OMP_NUM_THREADS and
/// every NCCL_*, OMPI_*, STRATA_*, GLOO_* and OPENBLAS_* variable.
inline std::map<std::string, std::string> relevant_environment(readings const& r) {
  std::map<std::string, std::string> out;
  for (auto const& [k, v] : r.env) {
    bool keep = k == "RANK" || k == "WORLD_SIZE" || k == "LOCAL_RANK" || k == "LOCAL_WORLD_SIZE" ||
                k == "MASTER_ADDR" || k == "MASTER_PORT" || k == "CUDA_VISIBLE_DEVICES" ||
                k == "OMP_NUM_THREADS";
    for (char const* p : {"NCCL_", "OMPI_", "STRATA_", "GLOO_", "OPENBLAS_"})
      keep = keep || k.rfind(p, 0) == 0;
    if (keep)
      out.emplace(k, v);
  }
  return out;
}

/// 1 when any check failed, else 0 (warnings do not change the exit status).
inline int exit_status(std::vector<check> const& checks) {
  return std::any_of(checks.begin(), checks.end(),
                     [](check const& c) { return c.status == level::fail; })
             ? 1
             : 0;
}

/// The report as text: one block per check (name, outcome, value, reason, fix), then the
/// environment variables, then a summary line.
inline std::string to_text(std::vector<check> const& checks,
                           std::map<std::string, std::string> const& env) {
  std::string s;
  int counts[3] = {0, 0, 0};
  for (auto const& c : checks) {
    ++counts[static_cast<int>(c.status)];
    char head[64];
    std::snprintf(head, sizeof head, "%-8s %-11s ", level_name(c.status), c.name.c_str());
    s += head + c.value + "\n";
    s += "                     " + c.reason + "\n";
    if (!c.fix.empty())
      s += "                     fix: " + c.fix + "\n";
  }
  s += "\nenvironment:\n";
  if (env.empty())
    s += "  (none of the variables strata, NCCL and Open MPI read)\n";
  for (auto const& [k, v] : env)
    s += "  " + k + "=" + v + "\n";
  s += "\n" + std::to_string(counts[0]) + " OK, " + std::to_string(counts[1]) + " WARNING, " +
       std::to_string(counts[2]) + " FAIL\n";
  return s;
}

} // namespace strata::profile
