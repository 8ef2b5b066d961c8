// strata_report: the environment report (DeepSpeed's ds_report): strata's version and build,
// the compiler, CPU, memory, threads, MPI, CUDA, NCCL, GPUs, /dev/shm, the network interfaces
// and the launch environment, each OK, WARNING or FAIL with a reason and a fix
// (strata/profile/environment.hpp holds the checks; this program reads the machine).
//
//   strata_report [--json]
//
// Exit status: 0 when no check failed (warnings, and CUDA or MPI being absent, do not count);
// 1 when a check failed; 2 a wrong command line. docs/report.md describes every check.
#include <strata/core/build_info.hpp>
#include <strata/profile/environment.hpp>
#include <strata/profile/machine.hpp>

#include <nlohmann/json.hpp>

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#if STRATA_REPORT_MPI
#include <mpi.h>
#endif
#if STRATA_REPORT_CUDA
#include <cuda_runtime_api.h>
#endif
#if STRATA_REPORT_NCCL
#include <nccl.h>
#endif

#ifndef STRATA_PROJECT_VERSION
#define STRATA_PROJECT_VERSION ""
#endif

namespace {

namespace sp = strata::profile;
using json = nlohmann::ordered_json;

constexpr char const* usage_text =
    "usage: strata_report [--json]\n"
    "\n"
    "  checks strata's build, the compiler, CPU, memory, threads, MPI, CUDA, NCCL, GPUs,\n"
    "  /dev/shm, the network interfaces and the launch environment; each OK, WARNING or FAIL\n"
    "  with a reason and a fix\n"
    "  --json  the same as one JSON object\n"
    "\n"
    "exit status: 0 no check failed (warnings do not count), 1 a check failed, 2 a wrong "
    "command line\n";

std::string read_file(char const* path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

void read_mpi(sp::readings& r) {
#if STRATA_REPORT_MPI
#if defined(OMPI_MAJOR_VERSION)
  r.mpi_header = "Open MPI " + std::to_string(OMPI_MAJOR_VERSION) + "." +
                 std::to_string(OMPI_MINOR_VERSION) + "." + std::to_string(OMPI_RELEASE_VERSION);
#elif defined(MVAPICH2_VERSION)
  r.mpi_header = std::string("MVAPICH ") + MVAPICH2_VERSION;
#elif defined(I_MPI_VERSION)
  r.mpi_header = std::string("Intel(R) MPI ") + I_MPI_VERSION;
#elif defined(MPICH_VERSION)
  r.mpi_header = std::string("MPICH ") + MPICH_VERSION;
#else
  r.mpi_header = "MPI " + std::to_string(MPI_VERSION) + "." + std::to_string(MPI_SUBVERSION);
#endif
  // MPI_Get_library_version may be called before MPI_Init (MPI 3.0, section 8.1.1): the report
  // starts no MPI runtime.
  char text[MPI_MAX_LIBRARY_VERSION_STRING] = {};
  int len = 0;
  if (MPI_Get_library_version(text, &len) == MPI_SUCCESS)
    r.mpi_library.assign(text, static_cast<std::size_t>(std::max(0, len)));
  while (!r.mpi_library.empty() && (r.mpi_library.back() == '\n' || r.mpi_library.back() == '\0'))
    r.mpi_library.pop_back();
#else
  (void)r;
#endif
}

void read_cuda(sp::readings& r) {
#if STRATA_REPORT_CUDA
  int v = 0;
  if (cudaRuntimeGetVersion(&v) == cudaSuccess)
    r.cuda_runtime = v;
  v = 0;
  if (cudaDriverGetVersion(&v) == cudaSuccess)
    r.cuda_driver = v;
  int count = 0; // left unwritten when there is no driver
  if (auto const e = cudaGetDeviceCount(&count); e != cudaSuccess) {
    r.gpu_error = std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e);
    count = 0;
    (void)cudaGetLastError();
  }
  r.gpu_count = count;
  for (int d = 0; d < count; ++d) {
    sp::gpu_info g;
    cudaDeviceProp p{};
    if (cudaGetDeviceProperties(&p, d) == cudaSuccess) {
      g.name = p.name;
      g.total_bytes = p.totalGlobalMem;
      g.major = p.major;
      g.minor = p.minor;
    }
    std::size_t free = 0, total = 0;
    if (cudaSetDevice(d) == cudaSuccess && cudaMemGetInfo(&free, &total) == cudaSuccess) {
      g.free_bytes = free;
      g.total_bytes = total;
    }
    r.gpus.push_back(g);
  }
#else
  (void)r;
#endif
}

void read_nccl(sp::readings& r) {
#if STRATA_REPORT_NCCL
  r.nccl_header = NCCL_VERSION_CODE;
  int v = 0;
  if (ncclGetVersion(&v) == ncclSuccess)
    r.nccl_library = v;
#else
  (void)r;
#endif
}

sp::readings read_machine() {
  sp::readings r;
  auto const facts = strata::build_facts::of_this_build();
  r.project_version = STRATA_PROJECT_VERSION;
  r.options = static_cast<std::uint32_t>(facts.options);
  r.build_hash = facts.hash;
  r.found = {.mpi = STRATA_REPORT_MPI != 0,
             .cuda = STRATA_REPORT_CUDA != 0,
             .nccl = STRATA_REPORT_NCCL != 0,
             .openblas = STRATA_REPORT_OPENBLAS != 0,
             .eigen = STRATA_REPORT_EIGEN != 0,
             .json = true};
  r.compiler = strata::compiler_code;
#if defined(__VERSION__)
  r.compiler_text = __VERSION__;
#endif
  r.cpuinfo = read_file("/proc/cpuinfo");
  r.hardware_threads = std::thread::hardware_concurrency();
  r.meminfo = read_file("/proc/meminfo");
  sp::read_environment(r);
  read_mpi(r);
  read_cuda(r);
  read_nccl(r);
  sp::read_shm(r);
  sp::read_interfaces(r);
  return r;
}

json to_json(sp::readings const& r, std::vector<sp::check> const& checks) {
  json j;
  char hash[24];
  std::snprintf(hash, sizeof hash, "%016llx", static_cast<unsigned long long>(r.build_hash));
  j["strata_version"] = strata::version_string(r.version);
  j["build_hash"] = hash;
  json cs = json::array();
  int counts[3] = {0, 0, 0};
  for (auto const& c : checks) {
    ++counts[static_cast<int>(c.status)];
    cs.push_back({{"name", c.name},
                  {"status", sp::level_name(c.status)},
                  {"value", c.value},
                  {"reason", c.reason},
                  {"fix", c.fix}});
  }
  j["checks"] = std::move(cs);
  j["environment"] = sp::relevant_environment(r);
  j["summary"] = {{"ok", counts[0]}, {"warning", counts[1]}, {"fail", counts[2]}};
  j["exit_status"] = sp::exit_status(checks);
  return j;
}

} // namespace

int main(int argc, char** argv) {
  bool as_json = false;
  for (int i = 1; i < argc; ++i) {
    std::string const a = argv[i];
    if (a == "--json") {
      as_json = true;
    } else if (a == "--help" || a == "-h" || a == "help") {
      std::fputs(usage_text, stdout);
      return 0;
    } else {
      std::fprintf(stderr, "strata_report: unknown argument \"%s\"\n\n%s", argv[i], usage_text);
      return 2;
    }
  }
  try {
    auto const r = read_machine();
    auto const checks = sp::run_checks(r);
    if (as_json)
      std::printf("%s\n", to_json(r, checks).dump(2).c_str());
    else
      std::fputs(sp::to_text(checks, sp::relevant_environment(r)).c_str(), stdout);
    return sp::exit_status(checks);
  } catch (std::exception const& e) {
    std::fprintf(stderr, "strata_report: %s\n", e.what());
    return 1;
  }
}
