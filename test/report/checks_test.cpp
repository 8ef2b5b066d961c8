// The environment report's checks (strata/profile/environment.hpp) driven to OK, WARNING and
// FAIL through injected readings: from a machine where every check is OK, one reading changed
// at a time. The headers' version against CMake's project(VERSION).
#include <strata/core/build_info.hpp>
#include <strata/profile/environment.hpp>

#include <catch2/catch.hpp>

#include <functional>
#include <string>
#include <vector>

#ifndef STRATA_PROJECT_VERSION
#error "checks_test.cpp needs STRATA_PROJECT_VERSION, CMake's project version"
#endif

namespace sp = strata::profile;

namespace {

constexpr std::uint64_t gib = 1ull << 30;

// A machine on which every check is OK: a release build with OpenBLAS, MPI, CUDA and NCCL,
// GCC 12, an AVX2 + AVX-512 CPU, 64 GiB, one GPU per rank, 8 GiB of /dev/shm, eth0 and lo.
sp::readings good() {
  sp::readings r;
  r.project_version = strata::version_string();
  r.options = strata::build_openblas | strata::build_avx2 | strata::build_fma;
  r.found = {
      .mpi = true, .cuda = true, .nccl = true, .openblas = true, .eigen = true, .json = true};
  r.compiler = (1ull << 48) | (12ull << 32) | (2ull << 16);
  r.cpuinfo = "processor\t: 0\nmodel name\t: Test CPU 9000\nflags\t\t: fpu sse2 avx avx2 fma "
              "avx512f\n\nprocessor\t: 1\n";
  r.hardware_threads = 16;
  r.meminfo = "MemTotal:       67108864 kB\nMemFree:        1000 kB\n"
              "MemAvailable:   60000000 kB\n";
  r.env = {{"RANK", "1"},
           {"WORLD_SIZE", "4"},
           {"LOCAL_RANK", "1"},
           {"LOCAL_WORLD_SIZE", "2"},
           {"MASTER_ADDR", "10.0.0.1"},
           {"MASTER_PORT", "29500"},
           {"STRATA_NUM_THREADS", "8"},
           {"STRATA_COMM_TIMEOUT", "30"},
           {"NCCL_SOCKET_IFNAME", "eth"},
           {"NCCL_DEBUG", "WARN"}};
  r.mpi_header = "Open MPI 4.1.4";
  r.mpi_library = "Open MPI v4.1.4, package: Debian OpenMPI, ident: 4.1.4";
  r.cuda_runtime = 13000;
  r.cuda_driver = 13000;
  r.gpu_count = 2;
  r.gpus = {{"GPU A", 80 * gib, 79 * gib, 9, 0}, {"GPU B", 80 * gib, 79 * gib, 9, 0}};
  r.nccl_header = 22809;
  r.nccl_library = 22809;
  r.shm = {.present = true, .writable = true, .total_bytes = 8 * gib, .free_bytes = 8 * gib};
  r.interfaces = {{"eth0", {"10.0.0.2"}, true, false}, {"lo", {"127.0.0.1"}, true, true}};
  return r;
}

struct case_ {
  char const* what;
  std::function<void(sp::readings&)> change;
  sp::level expected;
  char const* reason_has; // a piece of the reason ("" for OK)
};

void check_cases(sp::check (*fn)(sp::readings const&), std::vector<case_> const& cases) {
  for (auto const& c : cases) {
    auto r = good();
    c.change(r);
    auto const out = fn(r);
    INFO(c.what << ": " << sp::level_name(out.status) << " " << out.value << " / " << out.reason
                << " / " << out.fix);
    CHECK(out.status == c.expected);
    CHECK(out.reason.find(c.reason_has) != std::string::npos);
    CHECK(!out.reason.empty());
    CHECK(out.fix.empty() == (c.expected == sp::level::ok));
  }
}

auto const same = [](sp::readings&) {};

} // namespace

TEST_CASE("the headers' version is CMake's project version", "[report]") {
  CHECK(strata::version_string() == STRATA_PROJECT_VERSION);
  CHECK(strata::version_string(0x020a03) == "2.10.3");
}

TEST_CASE("every check is OK on a good machine", "[report]") {
  auto const checks = sp::run_checks(good());
  CHECK(checks.size() == 15);
  for (auto const& c : checks) {
    INFO(c.name << ": " << c.reason << " / " << c.fix);
    CHECK(c.status == sp::level::ok);
  }
  CHECK(sp::exit_status(checks) == 0);
}

TEST_CASE("version: OK, WARNING, FAIL", "[report]") {
  check_cases(
      sp::check_version,
      {{"agree", same, sp::level::ok, "agree"},
       {"unknown", [](auto& r) { r.project_version.clear(); }, sp::level::warning, "unknown"},
       {"differ", [](auto& r) { r.project_version = "9.9.9"; }, sp::level::fail, "9.9.9"}});
}

TEST_CASE("build: OK, WARNING, FAIL", "[report]") {
  check_cases(
      sp::check_build,
      {{"release", same, sp::level::ok, "release"},
       {"debug", [](auto& r) { r.options |= strata::build_assertions; }, sp::level::warning,
        "debug build"},
       {"no openblas", [](auto& r) { r.found.openblas = false; }, sp::level::warning, "OpenBLAS"},
       {"no -march", [](auto& r) { r.options &= ~(strata::build_avx2 | strata::build_fma); },
        sp::level::warning, "without AVX2"},
       {"fast math",
        [](auto& r) { r.options |= strata::build_fast_math | strata::build_assertions; },
        sp::level::fail, "-ffast-math"}});
}

TEST_CASE("compiler: OK, WARNING, FAIL", "[report]") {
  check_cases(sp::check_compiler,
              {{"gcc 12", same, sp::level::ok, "GCC 12"},
               {"clang 17", [](auto& r) { r.compiler = (2ull << 48) | (17ull << 32); },
                sp::level::ok, "GCC 12"},
               {"gcc 11", [](auto& r) { r.compiler = (1ull << 48) | (11ull << 32); },
                sp::level::warning, "GCC 11.0.0 is older"},
               {"unknown", [](auto& r) { r.compiler = 0; }, sp::level::warning, "unknown"},
               {"gcc 9", [](auto& r) { r.compiler = (1ull << 48) | (9ull << 32); }, sp::level::fail,
                "no C++20 concepts"}});
}

TEST_CASE("cpu: OK, WARNING, FAIL", "[report]") {
  check_cases(sp::check_cpu, {{"avx2", same, sp::level::ok, "AVX2"},
                              {"no flags", [](auto& r) { r.cpuinfo = "processor : 0\n"; },
                               sp::level::warning, "no flags"},
                              {"no avx2",
                               [](auto& r) {
                                 r.cpuinfo = "flags : fpu sse2 avx\n";
                                 r.options = 0;
                               },
                               sp::level::warning, "SSE2 baseline"},
                              {"avx512f compiled, missing",
                               [](auto& r) {
                                 r.cpuinfo = "flags : fpu sse2 avx avx2 fma\n";
                                 r.options |= strata::build_avx512f;
                               },
                               sp::level::fail, "avx512f, which this CPU lacks"}});
  // "avx2" is a whole word of the flags, not a prefix of another.
  auto r = good();
  r.cpuinfo = "flags : sse2 avx2x fmax\n";
  r.options = 0;
  CHECK(sp::check_cpu(r).status == sp::level::warning);
}

TEST_CASE("memory: OK, WARNING, FAIL", "[report]") {
  check_cases(
      sp::check_memory,
      {{"60 GB", same, sp::level::ok, "4 GiB"},
       {"unreadable", [](auto& r) { r.meminfo = "nothing"; }, sp::level::warning, "MemAvailable"},
       {"3 GiB", [](auto& r) { r.meminfo = "MemTotal: 8000000 kB\nMemAvailable: 3000000 kB\n"; },
        sp::level::warning, "under 4 GiB"},
       {"5% of 1 TiB",
        [](auto& r) { r.meminfo = "MemTotal: 1073741824 kB\nMemAvailable: 53687091 kB\n"; },
        sp::level::warning, "10%"},
       {"500 MiB", [](auto& r) { r.meminfo = "MemTotal: 8000000 kB\nMemAvailable: 512000 kB\n"; },
        sp::level::fail, "under 1 GiB"}});
}

TEST_CASE("threads: OK, WARNING, FAIL", "[report]") {
  check_cases(
      sp::check_threads,
      {{"8 x 2 on 16", same, sp::level::ok, "no more threads"},
       {"default", [](auto& r) { r.env.erase("STRATA_NUM_THREADS"); }, sp::level::ok,
        "no more threads"},
       {"oversubscribed", [](auto& r) { r.env["STRATA_NUM_THREADS"] = "16"; }, sp::level::warning,
        "32 threads on 16"},
       {"OMP_NUM_THREADS", [](auto& r) { r.env["OMP_NUM_THREADS"] = "many"; }, sp::level::warning,
        "OMP_NUM_THREADS"},
       {"unknown hardware", [](auto& r) { r.hardware_threads = 0; }, sp::level::warning, "unknown"},
       {"malformed", [](auto& r) { r.env["STRATA_NUM_THREADS"] = "4x"; }, sp::level::fail,
        "STRATA_NUM_THREADS=\"4x\""},
       {"zero", [](auto& r) { r.env["STRATA_NUM_THREADS"] = "0"; }, sp::level::fail, "1 to 1024"}});
}

TEST_CASE("mpi: OK, WARNING, FAIL", "[report]") {
  check_cases(
      sp::check_mpi,
      {{"match", same, sp::level::ok, "matches"},
       {"not built", [](auto& r) { r.mpi_header.clear(); }, sp::level::ok, "need no MPI"},
       {"unreadable", [](auto& r) { r.mpi_library.clear(); }, sp::level::warning,
        "no known implementation"},
       {"mpich", [](auto& r) { r.mpi_library = "MPICH Version:\t4.0.2\nMPICH Release date: ..."; },
        sp::level::fail, "runs MPICH 4"},
       {"open mpi 5",
        [](auto& r) { r.mpi_library = "Open MPI v5.0.3, package: Open MPI, ident: 5.0.3"; },
        sp::level::fail, "another ABI"}});
}

TEST_CASE("cuda: OK, WARNING, FAIL", "[report]") {
  check_cases(
      sp::check_cuda,
      {{"13.0", same, sp::level::ok, "supports"},
       {"not built", [](auto& r) { r.found.cuda = false; }, sp::level::ok, "needs no CUDA"},
       {"no driver", [](auto& r) { r.cuda_driver = 0; }, sp::level::warning, "no CUDA driver"},
       {"old driver", [](auto& r) { r.cuda_driver = 12020; }, sp::level::fail,
        "CUDA 12.2, older than the runtime's 13.0"}});
}

TEST_CASE("nccl: OK, WARNING, FAIL", "[report]") {
  check_cases(
      sp::check_nccl,
      {{"2.28.9", same, sp::level::ok, "at least"},
       {"not built", [](auto& r) { r.found.nccl = false; }, sp::level::ok, "need no NCCL"},
       {"newer library", [](auto& r) { r.nccl_library = 23001; }, sp::level::ok, "at least"},
       {"unknown", [](auto& r) { r.nccl_library = 0; }, sp::level::warning, "ncclGetVersion"},
       {"older library", [](auto& r) { r.nccl_library = 21805; }, sp::level::fail,
        "older than the headers"}});
  auto r = good();
  CHECK(sp::check_nccl(r).value == "compiled against 2.28.9, runs 2.28.9");
}

TEST_CASE("gpus: OK, WARNING, FAIL", "[report]") {
  check_cases(sp::check_gpus,
              {{"two GPUs, two ranks", same, sp::level::ok, "visible"},
               {"not built", [](auto& r) { r.found.cuda = false; }, sp::level::ok, "needs no GPU"},
               {"no GPU (this machine)",
                [](auto& r) {
                  r.gpu_count = 0;
                  r.gpus.clear();
                  r.gpu_error = "cudaErrorNoDevice";
                },
                sp::level::warning, "no GPU visible (cudaErrorNoDevice)"},
               {"memory in use", [](auto& r) { r.gpus[1].free_bytes = 40 * gib; },
                sp::level::warning, "GPU 1 has 40.0 GiB in use"},
               {"more ranks than GPUs", [](auto& r) { r.env["LOCAL_WORLD_SIZE"] = "4"; },
                sp::level::fail, "4 ranks on this host share 2 GPU(s)"}});
}

TEST_CASE("shm: OK, WARNING, FAIL", "[report]") {
  check_cases(
      sp::check_shm,
      {{"8 GiB", same, sp::level::ok, "1 GiB"},
       {"docker's 64 MiB", [](auto& r) { r.shm.total_bytes = r.shm.free_bytes = 64ull << 20; },
        sp::level::warning, "64 MiB"},
       {"full", [](auto& r) { r.shm.free_bytes = 100ull << 20; }, sp::level::warning,
        "under 1 GiB"},
       {"read-only", [](auto& r) { r.shm.writable = false; }, sp::level::fail, "not writable"},
       {"missing", [](auto& r) { r.shm = {}; }, sp::level::fail, "no /dev/shm"}});
}

TEST_CASE("network: OK, WARNING, FAIL", "[report]") {
  check_cases(
      sp::check_network,
      {{"eth0", same, sp::level::ok, "IPv4"},
       {"subnet", [](auto& r) { r.env["OMPI_MCA_btl_tcp_if_include"] = "10.0.0.0/8"; },
        sp::level::ok, "IPv4"},
       {"loopback only", [](auto& r) { r.interfaces.erase(r.interfaces.begin()); },
        sp::level::warning, "only loopback"},
       {"none up",
        [](auto& r) {
          for (auto& i : r.interfaces)
            i.up = false;
        },
        sp::level::fail, "no network interface is up"},
       {"ompi names eth1", [](auto& r) { r.env["OMPI_MCA_btl_tcp_if_include"] = "lo,eth1"; },
        sp::level::fail, "names eth1, which does not exist"}});
}

TEST_CASE("launch: OK, WARNING, FAIL", "[report]") {
  auto erase_all = [](auto& r) {
    for (char const* v :
         {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"})
      r.env.erase(v);
  };
  check_cases(sp::check_launch,
              {{"torchrun's", same, sp::level::ok, "consistent"},
               {"none", erase_all, sp::level::ok, "nothing to check"},
               {"privileged port", [](auto& r) { r.env["MASTER_PORT"] = "80"; }, sp::level::warning,
                "privileged"},
               {"master without world",
                [&](auto& r) {
                  erase_all(r);
                  r.env["MASTER_ADDR"] = "127.0.0.1";
                },
                sp::level::warning, "without WORLD_SIZE"},
               {"rank without world", [](auto& r) { r.env.erase("WORLD_SIZE"); }, sp::level::fail,
                "RANK is set without WORLD_SIZE"},
               {"world without rank", [](auto& r) { r.env.erase("RANK"); }, sp::level::fail,
                "WORLD_SIZE is set without RANK"},
               {"rank >= world", [](auto& r) { r.env["RANK"] = "4"; }, sp::level::fail,
                "RANK=4 is not below WORLD_SIZE=4"},
               {"rank not a number", [](auto& r) { r.env["RANK"] = "one"; }, sp::level::fail,
                "RANK=\"one\""},
               {"local rank", [](auto& r) { r.env["LOCAL_RANK"] = "2"; }, sp::level::fail,
                "LOCAL_RANK=2 is not below LOCAL_WORLD_SIZE=2"},
               {"port not a port", [](auto& r) { r.env["MASTER_PORT"] = "70000"; }, sp::level::fail,
                "not a port number"},
               {"port text", [](auto& r) { r.env["MASTER_PORT"] = "http"; }, sp::level::fail,
                "not a port number"},
               {"no master", [](auto& r) { r.env.erase("MASTER_ADDR"); }, sp::level::fail,
                "without MASTER_ADDR"},
               {"open mpi disagrees", [](auto& r) { r.env["OMPI_COMM_WORLD_SIZE"] = "2"; },
                sp::level::fail, "Open MPI's world has 2"}});
}

TEST_CASE("strata_env: OK, WARNING, FAIL", "[report]") {
  check_cases(
      sp::check_strata_env,
      {{"timeout 30", same, sp::level::ok, "well-formed"},
       {"all of them",
        [](auto& r) {
          r.env["STRATA_COMM_CHECKED"] = "off";
          r.env["STRATA_RDZV_TIMEOUT"] = "0.5";
          r.env["STRATA_MPI_PROGRESS_US"] = "0";
          r.env["STRATA_ISA"] = "base";
          r.env["STRATA_STORE_ADDR"] = "10.0.0.1";
          r.env["STRATA_FLIGHT_RECORDER"] = "2000";
          r.env["STRATA_FLIGHT_RECORDER_DIR"] = "/tmp";
        },
        sp::level::ok, "well-formed"},
       {"typo", [](auto& r) { r.env["STRATA_COMM_TIMOUT"] = "30"; }, sp::level::warning,
        "STRATA_COMM_TIMOUT is not a variable strata reads"},
       {"isa", [](auto& r) { r.env["STRATA_ISA"] = "avx512"; }, sp::level::warning, "ignored"},
       {"timeout", [](auto& r) { r.env["STRATA_COMM_TIMEOUT"] = "-1"; }, sp::level::fail,
        "STRATA_COMM_TIMEOUT=\"-1\""},
       {"checked", [](auto& r) { r.env["STRATA_COMM_CHECKED"] = "yes"; }, sp::level::fail,
        "0 or 1"},
       {"progress", [](auto& r) { r.env["STRATA_MPI_PROGRESS_US"] = "1.5"; }, sp::level::fail,
        "microseconds"},
       {"flight recorder", [](auto& r) { r.env["STRATA_FLIGHT_RECORDER"] = "lots"; },
        sp::level::fail, "0 (off) to 16777216"}});
}

TEST_CASE("nccl_env: OK, WARNING, FAIL", "[report]") {
  check_cases(sp::check_nccl_env,
              {{"eth prefix", same, sp::level::ok, "consistent"},
               {"exact", [](auto& r) { r.env["NCCL_SOCKET_IFNAME"] = "=eth0"; }, sp::level::ok,
                "consistent"},
               {"exclude lo", [](auto& r) { r.env["NCCL_SOCKET_IFNAME"] = "^lo,docker"; },
                sp::level::ok, "consistent"},
               {"p2p off", [](auto& r) { r.env["NCCL_P2P_DISABLE"] = "1"; }, sp::level::warning,
                "NCCL_P2P_DISABLE=1"},
               {"debug", [](auto& r) { r.env["NCCL_DEBUG"] = "verbose"; }, sp::level::warning,
                "NCCL_DEBUG=verbose"},
               {"missing interface", [](auto& r) { r.env["NCCL_SOCKET_IFNAME"] = "ib0"; },
                sp::level::fail, "NCCL_SOCKET_IFNAME=ib0 selects no interface"},
               {"exact prefix only", [](auto& r) { r.env["NCCL_SOCKET_IFNAME"] = "=eth"; },
                sp::level::fail, "selects no interface"},
               {"everything excluded", [](auto& r) { r.env["NCCL_SOCKET_IFNAME"] = "^eth,lo"; },
                sp::level::fail, "selects no interface"}});
}

TEST_CASE("a FAIL makes the exit status 1, warnings do not", "[report]") {
  auto r = good();
  r.shm.total_bytes = r.shm.free_bytes = 64ull << 20;
  r.cuda_driver = 0;
  auto checks = sp::run_checks(r);
  CHECK(sp::exit_status(checks) == 0);
  r.env["MASTER_PORT"] = "port";
  checks = sp::run_checks(r);
  CHECK(sp::exit_status(checks) == 1);
  auto const text = sp::to_text(checks, sp::relevant_environment(r));
  CHECK(text.find("FAIL     launch") != std::string::npos);
  CHECK(text.find("fix: ") != std::string::npos);
  CHECK(text.find("1 FAIL") != std::string::npos);
}

TEST_CASE("the relevant environment keeps the launch's, NCCL's, Open MPI's and strata's",
          "[report]") {
  sp::readings r;
  r.env = {
      {"RANK", "0"},     {"NCCL_DEBUG", "INFO"}, {"OMPI_MCA_btl", "self"},     {"STRATA_X", "1"},
      {"HOME", "/root"}, {"PATH", "/bin"},       {"CUDA_VISIBLE_DEVICES", "0"}};
  auto const e = sp::relevant_environment(r);
  CHECK(e.size() == 5);
  CHECK(e.count("HOME") == 0);
  CHECK(e.count("OMPI_MCA_btl") == 1);
}
