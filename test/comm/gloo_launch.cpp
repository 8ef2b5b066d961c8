// Starts N processes the way torchrun does, without mpirun: each child gets RANK, LOCAL_RANK,
// WORLD_SIZE, MASTER_ADDR=127.0.0.1 and MASTER_PORT (a free port of 127.0.0.1), then runs the
// program. Fails when any child fails or the whole run outlives its timeout (then it kills the
// children still running and names them).
//
//   strata_gloo_launch [--timeout SECONDS] [--expect-killed RANK] N PROGRAM [ARGS...]
//
// --expect-killed R: rank R must end by SIGKILL (the kill test), every other rank with 0.
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

namespace {

int free_port() {
  int const fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof a;
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    std::perror("strata_gloo_launch: finding a free port");
    std::exit(2);
  }
  ::close(fd);
  return ntohs(a.sin_port);
}

[[noreturn]] void usage() {
  std::fprintf(stderr, "usage: strata_gloo_launch [--timeout SECONDS] [--expect-killed RANK] N "
                       "PROGRAM [ARGS...]\n");
  std::exit(2);
}

} // namespace

int main(int argc, char** argv) {
  double timeout = 300;
  int expect_killed = -1;
  int i = 1;
  for (; i < argc && std::strncmp(argv[i], "--", 2) == 0; i += 2) {
    if (i + 1 >= argc)
      usage();
    if (std::strcmp(argv[i], "--timeout") == 0)
      timeout = std::atof(argv[i + 1]);
    else if (std::strcmp(argv[i], "--expect-killed") == 0)
      expect_killed = std::atoi(argv[i + 1]);
    else
      usage();
  }
  if (argc - i < 2)
    usage();
  int const n = std::atoi(argv[i]);
  if (n < 1)
    usage();
  char** const program = argv + i + 1;
  std::string const port = std::to_string(free_port());
  std::fflush(nullptr);

  std::vector<pid_t> pids(static_cast<std::size_t>(n), -1);
  for (int r = 0; r < n; ++r) {
    pid_t const pid = ::fork();
    if (pid < 0) {
      std::perror("strata_gloo_launch: fork");
      return 2;
    }
    if (pid == 0) {
      std::string const rank = std::to_string(r), size = std::to_string(n);
      ::setenv("RANK", rank.c_str(), 1);
      ::setenv("LOCAL_RANK", rank.c_str(), 1);
      ::setenv("WORLD_SIZE", size.c_str(), 1);
      ::setenv("LOCAL_WORLD_SIZE", size.c_str(), 1);
      ::setenv("MASTER_ADDR", "127.0.0.1", 1);
      ::setenv("MASTER_PORT", port.c_str(), 1);
      ::execv(program[0], program);
      std::perror("strata_gloo_launch: exec");
      std::_Exit(127);
    }
    pids[static_cast<std::size_t>(r)] = pid;
  }

  auto const deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout);
  int running = n;
  bool ok = true;
  while (running > 0) {
    int status = 0;
    pid_t const pid = ::waitpid(-1, &status, WNOHANG);
    if (pid > 0) {
      int r = 0;
      while (pids[static_cast<std::size_t>(r)] != pid)
        ++r;
      pids[static_cast<std::size_t>(r)] = -1;
      --running;
      bool const killed = WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL;
      bool const good = r == expect_killed ? killed : WIFEXITED(status) && WEXITSTATUS(status) == 0;
      if (!good) {
        ok = false;
        if (WIFSIGNALED(status))
          std::fprintf(stderr, "strata_gloo_launch: rank %d ended by signal %d\n", r,
                       WTERMSIG(status));
        else
          std::fprintf(stderr, "strata_gloo_launch: rank %d exited with %d%s\n", r,
                       WEXITSTATUS(status), r == expect_killed ? " (expected SIGKILL)" : "");
      }
      continue;
    }
    if (std::chrono::steady_clock::now() >= deadline) {
      std::string left;
      for (int r = 0; r < n; ++r)
        if (pids[static_cast<std::size_t>(r)] > 0) {
          ::kill(pids[static_cast<std::size_t>(r)], SIGKILL);
          left += (left.empty() ? "" : ", ") + std::to_string(r);
        }
      std::fprintf(stderr, "strata_gloo_launch: timed out after %g s; killed ranks [%s]\n", timeout,
                   left.c_str());
      while (::waitpid(-1, nullptr, 0) > 0) {
      }
      return 1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return ok ? 0 : 1;
}
