// mapped_file: a whole file mapped read-only into memory, its pages read on demand (POSIX mmap).
#pragma once

#include <strata/core/error.hpp>

#include <cerrno>
#include <cstddef>
#include <cstring>
#include <filesystem>
#include <span>
#include <string>
#include <utility>

#if !defined(__unix__) && !defined(__APPLE__)
#error "strata/data/mapped_file.hpp maps files with POSIX mmap; this platform has none"
#endif
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

namespace strata::data {

/// A read-only view of a whole file: mmap(PROT_READ, MAP_SHARED) of its bytes. Nothing is read
/// at construction; the system reads a page when it is first touched and may drop it again
/// under memory pressure (it is clean), so a file larger than memory can be mapped. Move-only;
/// the mapping ends with the object. An empty file maps to an empty span.
///
/// The file must not shrink while it is mapped: touching a page past its new end raises
/// SIGBUS (the mapping is not a copy).
class mapped_file {
public:
  mapped_file() = default;

  /// Maps `path`. Throws config_error naming the path, `what` the file is (for the message)
  /// and the system's reason when it cannot be opened, examined or mapped.
  explicit mapped_file(std::filesystem::path path, char const* what = "file")
      : path_(std::move(path)) {
    int const fd = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0)
      throw fail("open", what, errno);
    struct ::stat st {};
    if (::fstat(fd, &st) != 0) {
      int const err = errno;
      ::close(fd);
      throw fail("examine", what, err);
    }
    if (!S_ISREG(st.st_mode)) {
      ::close(fd);
      throw config_error("strata: " + std::string(what) + " '" + path_.string() +
                         "' is not a regular file; give the path of a file");
    }
    size_ = static_cast<std::size_t>(st.st_size);
    if (size_ != 0) {
      void* const p = ::mmap(nullptr, size_, PROT_READ, MAP_SHARED, fd, 0);
      if (p == MAP_FAILED) {
        int const err = errno;
        ::close(fd);
        throw fail("map", what, err);
      }
      data_ = static_cast<std::byte const*>(p);
    }
    ::close(fd); // the mapping keeps the file open
  }

  mapped_file(mapped_file&& o) noexcept
      : path_(std::move(o.path_)), data_(std::exchange(o.data_, nullptr)),
        size_(std::exchange(o.size_, 0)) {}
  mapped_file& operator=(mapped_file&& o) noexcept {
    if (this != &o) {
      unmap();
      path_ = std::move(o.path_);
      data_ = std::exchange(o.data_, nullptr);
      size_ = std::exchange(o.size_, 0);
    }
    return *this;
  }
  mapped_file(mapped_file const&) = delete;
  mapped_file& operator=(mapped_file const&) = delete;
  ~mapped_file() { unmap(); }

  /// The file's bytes (empty for an empty file or a default-constructed object).
  std::span<std::byte const> bytes() const noexcept { return {data_, size_}; }
  std::byte const* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return size_; }
  std::filesystem::path const& path() const noexcept { return path_; }

private:
  config_error fail(char const* action, char const* what, int err) const {
    return config_error("strata: cannot " + std::string(action) + " " + what + " '" +
                        path_.string() + "': " + std::strerror(err) +
                        "; check the path (relative paths start from the working directory)");
  }
  void unmap() noexcept {
    if (data_ != nullptr)
      ::munmap(const_cast<std::byte*>(data_), size_);
    data_ = nullptr;
    size_ = 0;
  }

  std::filesystem::path path_;
  std::byte const* data_ = nullptr;
  std::size_t size_ = 0;
};

} // namespace strata::data
