// The run directory: run.json (recipe, world size, generations, status), logs/, checkpoints/.
#include "launch/run_dir.hpp"

#include <unistd.h>

#include <ctime>
#include <system_error>

#include <fmt/format.h>

#include "core/comm/auth.hpp"
#include "core/error.hpp"
#include "core/fs.hpp"

namespace dptrain {

namespace fs = std::filesystem;

namespace {

std::string utc_format(const char* format) {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  ::gmtime_r(&now, &tm);
  char buf[64];
  std::strftime(buf, sizeof buf, format, &tm);
  return buf;
}

void make_layout(const fs::path& dir) {
  std::error_code ec;
  fs::create_directories(dir / "logs", ec);
  if (!ec) fs::create_directories(dir / "checkpoints", ec);
  if (ec) {
    throw Error(ErrorKind::io,
                fmt::format("{}: cannot create run directory: {}", dir.string(), ec.message()));
  }
}

}  // namespace

std::string RunDirectory::remote_name() const {
  const std::string base = path_.filename().string();
  const std::string id = info_.value("id", std::string());
  return id.empty() ? base : base + "-" + id;
}

std::string utc_timestamp() {
  return utc_format("%Y-%m-%dT%H:%M:%SZ");
}

std::string this_host() {
  char name[256] = {};
  if (::gethostname(name, sizeof(name) - 1) != 0) return "localhost";
  return name;
}

RunDirectory RunDirectory::create(const fs::path& dir, const fs::path& runs_root,
                                  const std::string& name) {
  fs::path path = dir;
  std::error_code ec;
  if (path.empty()) {
    const fs::path base = runs_root / fmt::format("{}-{}", name, utc_format("%Y%m%d-%H%M%S"));
    path = base;
    for (int i = 2; fs::exists(path, ec); ++i)
      path = fmt::format("{}-{}", base.string(), i);
  } else if (fs::exists(path / "run.json", ec)) {
    throw Error(ErrorKind::usage,
                fmt::format("{}: already holds a run; continue it with 'dptrain resume {}' or "
                            "choose another --run-dir",
                            path.string(), path.string()));
  }
  make_layout(path);
  RunDirectory run(fs::absolute(path).lexically_normal(), nlohmann::json::object());
  run.info_["id"] = generate_job_secret().substr(0, 12);
  run.info_["created_at"] = utc_timestamp();
  run.info_["dptrain_version"] = DPTRAIN_VERSION;
  run.info_["generations"] = nlohmann::json::array();
  return run;
}

RunDirectory RunDirectory::open(const fs::path& dir) {
  nlohmann::json info;
  try {
    info = nlohmann::json::parse(read_file(dir / "run.json"));
  } catch (const Error&) {
    throw Error(ErrorKind::usage,
                fmt::format("{}: not a run directory (no readable run.json)", dir.string()));
  } catch (const nlohmann::json::exception& e) {
    throw Error(ErrorKind::usage,
                fmt::format("{}: run.json is not valid JSON: {}", dir.string(), e.what()));
  }
  make_layout(dir);
  return RunDirectory(fs::absolute(dir).lexically_normal(), std::move(info));
}

void RunDirectory::save() const {
  write_file_atomic(path_ / "run.json", info_.dump(2) + "\n");
}

}  // namespace dptrain
