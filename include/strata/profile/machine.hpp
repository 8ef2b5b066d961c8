// Reading the parts of the machine that the environment report and the troubleshooting
// detectors both check: /dev/shm (statvfs, access), the network interfaces (getifaddrs) and the
// process's environment. POSIX only; CUDA, MPI and NCCL are read by the code built with them.
#pragma once

#include <strata/profile/environment.hpp>

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cstdint>
#include <map>
#include <string>
#include <utility>

extern char** environ; // POSIX: the process's environment

namespace strata::profile {

/// r.shm from statvfs("/dev/shm") and access(W_OK); left "not present" when statvfs fails.
inline void read_shm(readings& r) {
  struct statvfs s {};
  if (statvfs("/dev/shm", &s) != 0)
    return;
  r.shm.present = true;
  r.shm.writable = access("/dev/shm", W_OK) == 0;
  r.shm.total_bytes = static_cast<std::uint64_t>(s.f_blocks) * s.f_frsize;
  r.shm.free_bytes = static_cast<std::uint64_t>(s.f_bavail) * s.f_frsize;
}

/// r.interfaces from getifaddrs: each interface once, with its IPv4 addresses, up and loopback.
inline void read_interfaces(readings& r) {
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0)
    return;
  std::map<std::string, interface_info> by_name;
  for (ifaddrs* a = list; a != nullptr; a = a->ifa_next) {
    auto& i = by_name[a->ifa_name];
    i.name = a->ifa_name;
    i.up = i.up || (a->ifa_flags & IFF_UP) != 0;
    i.loopback = i.loopback || (a->ifa_flags & IFF_LOOPBACK) != 0;
    if (a->ifa_addr != nullptr && a->ifa_addr->sa_family == AF_INET) {
      char buf[INET_ADDRSTRLEN] = {};
      auto const* in = reinterpret_cast<sockaddr_in const*>(a->ifa_addr);
      if (inet_ntop(AF_INET, &in->sin_addr, buf, sizeof buf) != nullptr)
        i.ipv4.emplace_back(buf);
    }
  }
  freeifaddrs(list);
  for (auto& [name, i] : by_name)
    r.interfaces.push_back(std::move(i));
}

/// r.env: every variable of the process's environment.
inline void read_environment(readings& r) {
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    std::string const kv(*e);
    auto const eq = kv.find('=');
    if (eq != std::string::npos)
      r.env.emplace(kv.substr(0, eq), kv.substr(eq + 1));
  }
}

} // namespace strata::profile
