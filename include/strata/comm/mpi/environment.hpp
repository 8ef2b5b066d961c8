// The MPI backend's process environment: MPI start-up and shutdown, the key-value store,
// the watchdog, the world communicator, and mpi::run.
#pragma once

#include <strata/comm/mpi/communicator.hpp>
#include <strata/comm/rendezvous/tcp_store.hpp>

#include <chrono>
#include <cstdlib>
#include <exception>
#include <memory>
#include <string>

namespace strata::comm::mpi {

/// Starts MPI (MPI_THREAD_MULTIPLE: the watchdog thread may end the job while the rank's
/// thread is inside MPI, and the progress thread completes non-blocking operations while the
/// rank's thread computes), the key-value store, the watchdog and the progress thread; ends
/// them in reverse.
/// One per process, constructed on every rank; the communicators it hands out must be
/// destroyed before it.
///
/// The key-value store serves the watchdog's reports. Rank 0 serves it: at MASTER_ADDR and
/// MASTER_PORT when both are set (the environment-variable rendezvous of the field), else on
/// a free port of 127.0.0.1 when every rank shares one machine, else of STRATA_STORE_ADDR
/// (or this machine's name), told to the others by MPI_Bcast. When RANK and WORLD_SIZE are
/// set they must agree with MPI's.
///
/// The progress thread (mpi/progress.hpp) polls every STRATA_MPI_PROGRESS_US
/// microseconds (default 50) while a non-blocking operation is in flight, and sleeps
/// otherwise; STRATA_MPI_PROGRESS_US=0 turns it off.
class environment {
public:
  environment(int& argc, char**& argv, comm_options const& options = comm_options::from_env())
      : ctx_{options, nullptr, nullptr, nullptr} {
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (!initialized) {
      int provided = 0;
      STRATA_MPI_CHECK(MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided));
      owns_mpi_ = true;
      if (provided < MPI_THREAD_MULTIPLE)
        std::fprintf(stderr,
                     "strata: MPI provides thread level %d < MPI_THREAD_MULTIPLE; the "
                     "watchdog's MPI_Abort from its own thread may not be honoured\n",
                     provided);
    }
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    STRATA_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &rank_));
    STRATA_MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &size_));
    check_env_agrees();
    start_store();
    recorder_ = std::make_unique<flight_recorder>(ctx_.options.flight_recorder, rank_, size_);
    ctx_.recorder = recorder_.get();
    dog_ = std::make_unique<detail::watchdog>(rank_, size_, ctx_.options, host_, port_,
                                              recorder_.get());
    ctx_.dog = dog_.get();
    int level = MPI_THREAD_SINGLE;
    MPI_Query_thread(&level);
    progress_ = std::make_unique<detail::progress_thread>(
        level == MPI_THREAD_MULTIPLE ? progress_from_env() : std::chrono::microseconds(0));
    ctx_.progress = progress_.get();
  }

  environment(environment const&) = delete;
  environment& operator=(environment const&) = delete;

  ~environment() {
    progress_.reset();
    dog_.reset();                // stops publishing to the store
    MPI_Barrier(MPI_COMM_WORLD); // no rank still talks to the store
    server_.reset();
    if (owns_mpi_)
      MPI_Finalize();
  }

  int rank() const noexcept { return rank_; }
  int size() const noexcept { return size_; }
  comm_options const& options() const noexcept { return ctx_.options; }
  /// This process's flight recorder (every communicator's last calls).
  flight_recorder& recorder() noexcept { return *recorder_; }
  /// The progress thread's pause between polls; zero when it is off (STRATA_MPI_PROGRESS_US=0,
  /// or MPI started without MPI_THREAD_MULTIPLE).
  std::chrono::microseconds progress_interval() const noexcept {
    return progress_->running() ? progress_->interval() : std::chrono::microseconds(0);
  }

  /// A communicator over every process (a duplicate of MPI_COMM_WORLD).
  communicator world() {
    MPI_Comm dup = MPI_COMM_NULL;
    STRATA_MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, &dup));
    return communicator(dup, &ctx_, 1 + worlds_++);
  }

  /// Ends the job from any thread: prints `message` here and on every live rank, then
  /// MPI_Abort.
  [[noreturn]] void fail(std::string const& message) { dog_->fail(message); }

  /// The store's address.
  std::string const& store_host() const noexcept { return host_; }
  std::uint16_t store_port() const noexcept { return port_; }

private:
  static char const* env(char const* name) {
    char const* v = std::getenv(name);
    return v && *v ? v : nullptr;
  }

  // STRATA_MPI_PROGRESS_US: the progress thread's pause between two polls (0: no thread).
  static std::chrono::microseconds progress_from_env() {
    char const* v = env("STRATA_MPI_PROGRESS_US");
    if (!v)
      return std::chrono::microseconds(50);
    char* end = nullptr;
    long const us = std::strtol(v, &end, 10);
    if (end == v || *end != '\0' || us < 0)
      throw config_error(std::string("STRATA_MPI_PROGRESS_US='") + v +
                         "' is not a whole number of microseconds >= 0 (0 turns the progress "
                         "thread off)");
    return std::chrono::microseconds(us);
  }

  void check_env_agrees() const {
    auto agree = [&](char const* name, int mpi_value) {
      if (char const* v = env(name); v && std::to_string(mpi_value) != v)
        throw config_error(std::string("strata: ") + name + "=" + v + " but MPI says " +
                           std::to_string(mpi_value) + " on this process (MPI world of " +
                           std::to_string(size_) + "); processes started without mpirun " +
                           "cannot form an MPI world with Open MPI: launch with mpirun -np " +
                           (env("WORLD_SIZE") ? env("WORLD_SIZE") : "N") +
                           ", or unset RANK and WORLD_SIZE");
    };
    agree("WORLD_SIZE", size_);
    agree("RANK", rank_);
  }

  void start_store() {
    char const* addr = env("MASTER_ADDR");
    char const* port = env("MASTER_PORT");
    if (addr && port) {
      host_ = addr;
      port_ = static_cast<std::uint16_t>(std::strtoul(port, nullptr, 10));
      if (rank_ == 0)
        server_ = std::make_unique<tcp_store_server>(host_, port_);
      return;
    }
    MPI_Comm node = MPI_COMM_NULL;
    STRATA_MPI_CHECK(
        MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node));
    int node_size = 0;
    MPI_Comm_size(node, &node_size);
    MPI_Comm_free(&node);
    int on_one_machine = node_size == size_ ? 1 : 0;
    STRATA_MPI_CHECK(
        MPI_Allreduce(MPI_IN_PLACE, &on_one_machine, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD));
    char name[MPI_MAX_PROCESSOR_NAME + 1] = {};
    int len = 0;
    if (on_one_machine)
      std::snprintf(name, sizeof name, "127.0.0.1");
    else if (char const* a = env("STRATA_STORE_ADDR"))
      std::snprintf(name, sizeof name, "%s", a);
    else
      MPI_Get_processor_name(name, &len);
    int p = 0;
    if (rank_ == 0) {
      server_ = std::make_unique<tcp_store_server>(name, 0);
      p = server_->port();
    }
    STRATA_MPI_CHECK(MPI_Bcast(name, sizeof name, MPI_CHAR, 0, MPI_COMM_WORLD));
    STRATA_MPI_CHECK(MPI_Bcast(&p, 1, MPI_INT, 0, MPI_COMM_WORLD));
    host_ = name;
    port_ = static_cast<std::uint16_t>(p);
  }

  detail::context ctx_;
  bool owns_mpi_ = false;
  int rank_ = 0;
  int size_ = 1;
  std::string host_;
  std::uint16_t port_ = 0;
  std::unique_ptr<tcp_store_server> server_;
  std::unique_ptr<flight_recorder> recorder_; // before dog_: the watchdog dumps it
  std::unique_ptr<detail::watchdog> dog_;
  std::unique_ptr<detail::progress_thread> progress_;
  std::uint64_t worlds_ = 0;
};

/// Runs `fn(world)` on this process under MPI and returns 0. An exception escaping `fn` —
/// the rank's own, or a comm_desync — ends the job: the message is printed here and on
/// every live rank (through the store), then MPI_Abort. Timeouts are the watchdog's.
template <class Fn>
int run(int& argc, char**& argv, Fn&& fn, comm_options const& options = comm_options::from_env()) {
  environment env(argc, argv, options);
  try {
    communicator world = env.world();
    fn(world);
  } catch (std::exception const& e) {
    env.fail("strata: rank " + std::to_string(env.rank()) + " failed: " + e.what());
  } catch (...) {
    env.fail("strata: rank " + std::to_string(env.rank()) +
             " failed with a non-standard exception");
  }
  return 0;
}

} // namespace strata::comm::mpi
