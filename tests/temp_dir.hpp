// A temporary directory that removes itself: shared by unit and integration tests.
#pragma once

#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <string>
#include <system_error>

namespace dptrain::test {

class TempDir {
 public:
  TempDir() : path_(unique_path("dptrain-test")) { std::filesystem::create_directories(path_); }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::filesystem::path& path() const { return path_; }
  std::filesystem::path operator/(const std::string& name) const { return path_ / name; }

  // A fresh name under the system temp folder (nothing is created).
  static std::filesystem::path unique_path(const std::string& stem) {
    static std::atomic<int> counter{0};
    return std::filesystem::temp_directory_path() /
           (stem + "-" + std::to_string(::getpid()) + "-" + std::to_string(++counter));
  }

 private:
  std::filesystem::path path_;
};

}  // namespace dptrain::test
