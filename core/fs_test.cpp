// Tests of the durable file helpers, on real files.
#include "core/fs.hpp"

#include <doctest/doctest.h>

#include <filesystem>
#include <string>

#include "core/error.hpp"
#include "tests/temp_dir.hpp"

using namespace dptrain;
namespace fs = std::filesystem;

TEST_CASE("write_file_atomic: replaces the file whole; an error names it, not its temporary") {
  test::TempDir tmp;
  write_file_atomic(tmp / "a.json", "first");
  write_file_atomic(tmp / "a.json", "second");
  CHECK(read_file(tmp / "a.json") == "second");
  for (const auto& entry : fs::directory_iterator(tmp.path()))
    CHECK(entry.path().filename() == "a.json");  // no temporary left behind

  const fs::path nowhere = tmp / "no-such-dir" / "b.json";
  try {
    write_file_atomic(nowhere, "x");
    FAIL("wrote into a directory that does not exist");
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::io);
    CHECK(std::string(e.what()) == nowhere.string() + ": cannot create: No such file or directory");
  }
}
