// A temporary directory that removes itself: shared by unit and integration tests.
//
// Names come from mkdtemp (and a random part for unique_path), never from the process id alone:
// a test killed part-way leaves its directory behind, and a later process that happens to get
// the same pid must not find those files in what it takes for a fresh, empty directory.
#pragma once

#include <atomic>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <system_error>

#include "core/fs.hpp"

namespace dptrain::test {

class TempDir {
 public:
  // 0755 rather than mkdtemp's 0700: some tests run commands as another user inside it.
  TempDir() : path_(make_temp_directory("dptrain-test")) {
    std::filesystem::permissions(
        path_, std::filesystem::perms::owner_all | std::filesystem::perms::group_read |
                   std::filesystem::perms::group_exec | std::filesystem::perms::others_read |
                   std::filesystem::perms::others_exec);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::filesystem::path& path() const { return path_; }
  std::filesystem::path operator/(const std::string& name) const { return path_ / name; }

  // Writes `contents` to `relative` under this directory (its parents made as needed).
  std::filesystem::path write(const std::filesystem::path& relative,
                              const std::string& contents) const {
    const std::filesystem::path file = path_ / relative;
    std::filesystem::create_directories(file.parent_path());
    std::ofstream(file, std::ios::binary) << contents;
    return file;
  }

  // A name under the system temp folder that no other process can have chosen (nothing is
  // created): a random part besides the counter, since pids repeat.
  static std::filesystem::path unique_path(const std::string& stem) {
    static std::atomic<int> counter{0};
    static const unsigned long long salt = [] {
      std::random_device random;
      return (static_cast<unsigned long long>(random()) << 32) | random();
    }();
    return std::filesystem::temp_directory_path() /
           (stem + "-" + std::to_string(salt) + "-" + std::to_string(++counter));
  }

 private:
  std::filesystem::path path_;
};

}  // namespace dptrain::test
