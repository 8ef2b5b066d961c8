// The etcd_store's HTTP: one libcurl handle posting JSON to etcd's v3 gateway, each request
// bounded by a deadline, its failures sorted into unreachable, timed out and broken.
#pragma once

#if !__has_include(<curl/curl.h>)
#error                                                                                             \
    "strata/comm/rendezvous/etcd_store.hpp needs libcurl: install libcurl4-openssl-dev (Debian) and link strata::etcd, which CMake defines when find_package(CURL) succeeds (option STRATA_ENABLE_ETCD)"
#endif

#include <strata/comm/rendezvous/detail/socket.hpp>

#include <curl/curl.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <memory>
#include <new>
#include <string>

namespace strata::comm::detail {

// How one request ended: `unreachable` means nothing was sent (the connection was refused or
// the host not found), so the request may be repeated; after `timed_out` or `broken` it may
// have been applied.
enum class http_outcome { ok, unreachable, timed_out, broken };

struct http_reply {
  http_outcome outcome = http_outcome::broken;
  long status = 0;
  std::string body;
  std::string error; // curl's words when outcome is not ok
};

inline void curl_init_once() {
  // curl_global_init is not safe to race with itself; a function-local static runs it once.
  static bool const done = [] {
    if (::curl_global_init(CURL_GLOBAL_DEFAULT) != CURLE_OK)
      throw std::bad_alloc();
    return true;
  }();
  (void)done;
}

// One easy handle, so consecutive requests reuse the HTTP connection. Not thread-safe.
class http_client {
public:
  http_client() {
    curl_init_once();
    handle_.reset(::curl_easy_init());
    if (!handle_)
      throw std::bad_alloc();
    headers_.reset(::curl_slist_append(nullptr, "Content-Type: application/json"));
    // Without this curl waits up to a second for "100 Continue" before large bodies.
    headers_.reset(::curl_slist_append(headers_.release(), "Expect:"));
  }

  // POSTs body to url, giving up at deadline.
  http_reply post(std::string const& url, std::string const& body,
                  store_clock::time_point deadline) {
    http_reply r;
    auto const left = std::chrono::ceil<std::chrono::milliseconds>(deadline - store_clock::now());
    if (left.count() <= 0) {
      r.outcome = http_outcome::timed_out;
      r.error = "deadline passed before the request was sent";
      return r;
    }
    CURL* h = handle_.get();
    ::curl_easy_setopt(h, CURLOPT_URL, url.c_str());
    ::curl_easy_setopt(h, CURLOPT_POST, 1L);
    ::curl_easy_setopt(h, CURLOPT_POSTFIELDS, body.data());
    ::curl_easy_setopt(h, CURLOPT_POSTFIELDSIZE_LARGE, static_cast<curl_off_t>(body.size()));
    ::curl_easy_setopt(h, CURLOPT_HTTPHEADER, headers_.get());
    ::curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, static_cast<long>(left.count()));
    ::curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT_MS, static_cast<long>(left.count()));
    // No signals (SIGALRM for name resolution) in a library, and no proxy: etcd is a
    // cluster-internal service, and an http_proxy meant for the internet must not catch it.
    ::curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
    ::curl_easy_setopt(h, CURLOPT_PROXY, "");
    ::curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, &http_client::append);
    ::curl_easy_setopt(h, CURLOPT_WRITEDATA, &r.body);
    char error_buffer[CURL_ERROR_SIZE] = {};
    ::curl_easy_setopt(h, CURLOPT_ERRORBUFFER, error_buffer);
    CURLcode const rc = ::curl_easy_perform(h);
    ::curl_easy_setopt(h, CURLOPT_ERRORBUFFER, nullptr);
    if (rc == CURLE_OK) {
      ::curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &r.status);
      r.outcome = http_outcome::ok;
      return r;
    }
    r.error = error_buffer[0] != '\0' ? error_buffer : ::curl_easy_strerror(rc);
    switch (rc) {
    case CURLE_COULDNT_CONNECT:
    case CURLE_COULDNT_RESOLVE_HOST:
      r.outcome = http_outcome::unreachable;
      break;
    case CURLE_OPERATION_TIMEDOUT:
      r.outcome = http_outcome::timed_out;
      break;
    default:
      r.outcome = http_outcome::broken;
    }
    return r;
  }

private:
  static std::size_t append(char* data, std::size_t size, std::size_t n, void* out) {
    static_cast<std::string*>(out)->append(data, size * n);
    return size * n;
  }

  struct easy_cleanup {
    void operator()(CURL* h) const noexcept { ::curl_easy_cleanup(h); }
  };
  struct slist_free {
    void operator()(curl_slist* l) const noexcept { ::curl_slist_free_all(l); }
  };
  std::unique_ptr<CURL, easy_cleanup> handle_;
  std::unique_ptr<curl_slist, slist_free> headers_;
};

} // namespace strata::comm::detail
