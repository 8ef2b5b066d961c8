// An NCCL error that may come from the machine (a system error) carries the troubleshooting
// detector's check of this host (/dev/shm, the interfaces, the driver against the runtime);
// other errors do not. Built with g++ against NCCL's headers; needs no GPU (ncclGetErrorString
// and the CUDA version queries answer without one).
#include <strata/comm/nccl/error.hpp>
#include <strata/profile/troubleshoot.hpp>

#include <catch2/catch.hpp>

#include <string>

namespace {

std::string message_of(ncclResult_t rc) {
  try {
    strata::comm::detail::throw_nccl(rc, "ncclAllReduce(...)", "here.cpp", 1);
  } catch (strata::comm::nccl_error const& e) {
    return e.what();
  }
  return {};
}

} // namespace

TEST_CASE("an NCCL system error lists the host's likely causes; an argument error does not",
          "[nccl][troubleshoot]") {
  std::string const system = message_of(ncclSystemError);
  INFO(system);
  CHECK(system.find("ncclAllReduce(...) failed at here.cpp:1") != std::string::npos);
  CHECK(system.find("strata checked this host for the known causes of NCCL system errors") !=
        std::string::npos);
  CHECK(system.find("shm") != std::string::npos);
  std::string const argument = message_of(ncclInvalidArgument);
  INFO(argument);
  CHECK(argument.find("strata checked this host") == std::string::npos);
}
