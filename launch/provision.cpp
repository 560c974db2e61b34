// Provisioning: one facts script per host, then the uploads it lacks, then a check that the
// installed dptrain runs there. The local host goes through the same steps without SSH.
#include "launch/provision.hpp"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <charconv>
#include <chrono>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <sstream>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <openssl/evp.h>

#include "core/error.hpp"
#include "core/fs.hpp"
#include "core/json_error.hpp"
#include "core/recipe.hpp"
#include "launch/job.hpp"
#include "launch/supervisor.hpp"

namespace dptrain {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

// ---- small helpers ----

std::string human_bytes(uint64_t bytes) {
  static const std::array<const char*, 5> units = {"B", "KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes);
  size_t unit = 0;
  while (value >= 1024.0 && unit + 1 < units.size()) {
    value /= 1024.0;
    ++unit;
  }
  if (unit == 0) return fmt::format("{} B", bytes);
  return fmt::format("{:.1f} {}", value, units[unit]);
}

std::string sha256_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(ErrorKind::io, fmt::format("{}: cannot read", printable(path.string())));
  std::unique_ptr<EVP_MD_CTX, decltype(&EVP_MD_CTX_free)> context(EVP_MD_CTX_new(),
                                                                  &EVP_MD_CTX_free);
  if (!context || EVP_DigestInit_ex(context.get(), EVP_sha256(), nullptr) != 1) {
    throw Error(ErrorKind::internal, "cannot initialise SHA-256");
  }
  std::vector<char> buffer(1 << 20);
  while (in) {
    in.read(buffer.data(), static_cast<std::streamsize>(buffer.size()));
    EVP_DigestUpdate(context.get(), buffer.data(), static_cast<size_t>(in.gcount()));
  }
  if (in.bad()) throw Error(ErrorKind::io, fmt::format("{}: read failed", path.string()));
  std::array<unsigned char, EVP_MAX_MD_SIZE> digest{};
  unsigned length = 0;
  EVP_DigestFinal_ex(context.get(), digest.data(), &length);
  std::string hex;
  for (unsigned i = 0; i < length; ++i)
    hex += fmt::format("{:02x}", digest[i]);
  return hex;
}

namespace {

std::string trim(std::string_view text) {
  const auto begin = text.find_first_not_of(" \t\r\n");
  if (begin == std::string_view::npos) return "";
  const auto end = text.find_last_not_of(" \t\r\n");
  return std::string(text.substr(begin, end - begin + 1));
}

template <typename Number>
Number number_or_zero(std::string_view text) {
  Number value{};
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  return error == std::errc() ? value : Number{};
}

// key=value lines, in order (a key may repeat: gpu, sha256).
std::vector<std::pair<std::string, std::string>> key_values(const std::string& output) {
  std::vector<std::pair<std::string, std::string>> pairs;
  std::istringstream lines(output);
  for (std::string line; std::getline(lines, line);) {
    const auto eq = line.find('=');
    if (eq != std::string::npos) pairs.emplace_back(line.substr(0, eq), trim(line.substr(eq + 1)));
  }
  return pairs;
}

}  // namespace

std::vector<GpuFact> parse_gpus(const std::string& csv) {
  std::vector<GpuFact> gpus;
  std::istringstream lines(csv);
  for (std::string line; std::getline(lines, line);) {
    if (trim(line).empty()) continue;
    std::vector<std::string> fields;
    std::istringstream parts(line);
    for (std::string field; std::getline(parts, field, ',');)
      fields.push_back(trim(field));
    fields.resize(3);
    gpus.push_back({fields[0], fields[1], fields[2]});
  }
  return gpus;
}

HostFacts parse_facts(const std::string& output) {
  HostFacts facts;
  std::string gpu_lines;
  for (const auto& [key, value] : key_values(output)) {
    if (key == "workdir") facts.workdir = value;
    if (key == "workdir_missing") facts.workdir_base = value;
    if (key == "hostname") facts.hostname = value;
    if (key == "os") facts.os = value;
    if (key == "cpus") facts.cpus = number_or_zero<int>(value);
    if (key == "memory_kb") facts.memory_bytes = number_or_zero<uint64_t>(value) * 1024;
    if (key == "disk_free_kb") facts.disk_free_bytes = number_or_zero<uint64_t>(value) * 1024;
    if (key == "gpu") gpu_lines += value + "\n";
    if (key == "gpu_note") facts.gpu_note = value;
  }
  facts.gpus = parse_gpus(gpu_lines);
  if (!facts.gpus.empty()) facts.driver_version = facts.gpus.front().driver;
  return facts;
}

namespace {

// ---- what goes to every host ----

struct PlannedFile {
  fs::path local;      // what is uploaded
  fs::path source;     // what the report names: the user's file, not a rewritten copy
  std::string remote;  // relative to the workdir
  int mode = 0644;
  uint64_t bytes = 0;
  std::string sha256;
};

// A local temporary file NAME in a private directory of its own, both removed with this object.
class TempFile {
 public:
  explicit TempFile(const std::string& name)
      : dir_(make_temp_directory("dptrain-provision")), path_(dir_ / name) {}
  ~TempFile() {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  TempFile(const TempFile&) = delete;
  TempFile& operator=(const TempFile&) = delete;
  const fs::path& path() const { return path_; }

 private:
  fs::path dir_;
  fs::path path_;
};

int file_mode(const fs::path& path) {
  return static_cast<int>(fs::status(path).permissions() & fs::perms::all);
}

// A local file to upload; one that is not a regular file is refused naming `flag` (the option
// that gave it, when one did) and the path.
PlannedFile planned(const fs::path& local, const std::string& remote, int mode,
                    const std::string& flag = "") {
  std::error_code ec;
  if (!fs::is_regular_file(local, ec)) {
    throw Error(ErrorKind::usage,
                fmt::format("{}{}: {}", flag.empty() ? "" : flag + " ", local.string(),
                            fs::is_directory(local, ec) ? "is a directory; name the files in it"
                                                        : "no such file"));
  }
  return {local, local, remote, mode, fs::file_size(local), sha256_file(local)};
}

// The recipe goes as it is, except for its data path: a csv file's becomes "data/NAME", and the
// uploaded recipe then finds the uploaded data wherever the workdir is; a token dataset's, which
// is not uploaded, becomes absolute where it was relative (to the recipe's directory here, which
// the workdir is not: the host's copy must be found at the same path).
void plan_recipe(const fs::path& recipe_path, std::vector<PlannedFile>& files,
                 std::unique_ptr<TempFile>& rewritten) {
  const Recipe recipe = load_recipe(recipe_path);  // validates, resolves the data path
  const std::string name = recipe_path.filename().string();
  std::ifstream in(recipe_path);
  nlohmann::json j = nlohmann::json::parse(in);
  const nlohmann::json* given = j.contains("data") && j["data"].is_object() &&
                                        j["data"].contains("path") && j["data"]["path"].is_string()
                                    ? &j["data"]["path"]
                                    : nullptr;
  std::string data_path;
  if (recipe.data.type == "csv") {
    const fs::path data = recipe.data.path;
    data_path = "data/" + data.filename().string();
    files.push_back(planned(data, data_path, 0644));
  } else if (given != nullptr && fs::path(given->get<std::string>()).is_relative()) {
    data_path = fs::path(recipe.data.path).lexically_normal().string();
  } else {
    files.push_back(planned(recipe_path, name, 0644));
    return;
  }
  j["data"]["path"] = data_path;
  rewritten = std::make_unique<TempFile>(name);
  std::ofstream(rewritten->path()) << json_text(j, 2) << "\n";
  files.push_back(planned(rewritten->path(), name, 0644));
  files.back().source = recipe_path;
}

std::vector<PlannedFile> plan_files(const ProvisionOptions& options,
                                    std::unique_ptr<TempFile>& rewritten) {
  std::vector<PlannedFile> files;
  const fs::path binary = options.binary.empty() ? self_executable() : options.binary;
  files.push_back(planned(binary, "bin/dptrain", 0755));
  if (!options.recipe.empty()) plan_recipe(options.recipe, files, rewritten);
  for (const auto& extra : options.uploads) {
    files.push_back(planned(extra, extra.filename().string(), file_mode(extra), "--upload"));
  }
  // The workdir's directories (bin/, data/, runs/ where remote runs go): a file uploaded as one
  // of them would be renamed into it, never installed.
  std::set<std::string> dirs = {"runs"};
  for (const auto& f : files) {
    for (fs::path d = fs::path(f.remote).parent_path(); !d.empty(); d = d.parent_path())
      dirs.insert(d.string());
  }
  for (const auto& f : files) {
    if (dirs.count(f.remote) > 0) {
      throw Error(ErrorKind::usage,
                  fmt::format("--upload {}: WORKDIR/{} is a directory dptrain uses there; "
                              "upload the file under another name",
                              f.source.string(), f.remote));
    }
  }
  std::map<std::string, fs::path> by_remote;
  for (const auto& f : files) {
    // The host reports what it holds one file a line: a name with a line break (or another
    // control character) would never match, and be uploaded again every time.
    if (std::any_of(f.remote.begin(), f.remote.end(),
                    [](char c) { return static_cast<unsigned char>(c) < 0x20 || c == 0x7f; })) {
      throw Error(ErrorKind::usage,
                  fmt::format("--upload {}: its name holds a control character (a line break?); "
                              "rename the file",
                              printable(f.source.string())));
    }
    const auto [it, inserted] = by_remote.emplace(f.remote, f.source);
    if (!inserted) {
      throw Error(ErrorKind::usage, fmt::format("{} and {} would both be WORKDIR/{}; rename one",
                                                it->second.string(), f.source.string(), f.remote));
    }
  }
  return files;
}

// ---- the script that prepares the workdir and reports facts ----

std::string facts_script(const std::string& workdir, const std::vector<PlannedFile>& files,
                         bool create) {
  std::string script = "d=" + remote_path_word(workdir) + "\nrest=\n";
  if (create) {
    std::set<std::string> dirs = {"."};
    for (const auto& f : files)
      dirs.insert(fs::path(f.remote).parent_path().string());
    dirs.erase("");
    script += "mkdir -p";
    for (const auto& dir : dirs)
      script += " \"$d\"/" + shell_quote(dir);
    script += " && cd \"$d\" || exit 1\n";
  } else {
    // A survey creates nothing: a workdir not there yet is judged by the directory above it
    // that is (what mkdir -p would make it in), `rest` the part still to be made.
    script += R"sh(if [ -d "$d" ]; then cd "$d" || exit 1
else
  p=$d
  while [ ! -d "$p" ]; do
    if [ -e "$p" ] || [ -L "$p" ]; then
      if [ "$p" = "$d" ]; then where=there; else where="under it"; fi
      echo "$p is not a directory (the workdir goes $where)" >&2; exit 1
    fi
    p=$(dirname -- "$p")
  done
  if [ "$p" = . ]; then rest=$d; else rest=${d#"$p"}; rest=${rest#/}; fi
  cd "$p" || exit 1
fi
)sh";
  }
  // An existing directory on a read-only filesystem (or one not the user's) passes mkdir -p: a
  // file written and removed says it is usable.
  script += R"sh(w=.dptrain-write-probe.$$
if ! err=$({ : >"$w"; } 2>&1); then echo "cannot write in $(pwd -P): ${err##*: }" >&2; exit 1; fi
rm -f -- "$w"
)sh";
  // The runs go to WORKDIR/runs: something else there fails every launch.
  script += R"sh(if [ -z "$rest" ] && { [ -e runs ] || [ -L runs ]; }; then
  if [ ! -d runs ]; then echo "$(pwd -P)/runs is not a directory (a job's run directories go there)" >&2; exit 1; fi
  if [ ! -w runs ] || [ ! -x runs ]; then echo "$(pwd -P)/runs takes no writes (a job's run directories go there)" >&2; exit 1; fi
fi
)sh";
  // nvidia-smi can hang on a wedged driver: it gets its own timeout.
  script += R"sh(w=$(pwd -P)
if [ -n "$rest" ]; then echo "workdir=${w%/}/$rest"; echo "workdir_missing=$w"; else echo "workdir=$w"; fi
echo "hostname=$(hostname 2>/dev/null || cat /proc/sys/kernel/hostname)"
echo "os=$(. /etc/os-release 2>/dev/null; echo "${PRETTY_NAME:-unknown}")"
echo "cpus=$(nproc 2>/dev/null || getconf _NPROCESSORS_ONLN)"
echo "memory_kb=$(awk '/^MemTotal:/ {print $2}' /proc/meminfo 2>/dev/null)"
echo "disk_free_kb=$(df -Pk . 2>/dev/null | awk 'NR==2 {print $4}')"
if command -v nvidia-smi >/dev/null 2>&1; then
  if out=$(timeout 20 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1); then
    printf '%s\n' "$out" | sed 's/^/gpu=/'
  else
    echo "gpu_note=nvidia-smi failed: $(printf '%s\n' "$out" | head -n 1)"
  fi
else
  echo "gpu_note=no nvidia-smi"
fi
for f in)sh";
  for (const auto& f : files)
    script += " " + shell_quote(f.remote);
  // An upload cut off without its shell's cleanup (killed outright) leaves FILE.tmp-XXXXXXXXXXXX:
  // removed once it is an hour old (not one a provision running now still writes).
  script += R"sh(; do
  find "$(dirname -- "$f")" -maxdepth 1 -type f -name "$(basename -- "$f").tmp-????????????" -mmin +60 -exec rm -f -- {} + 2>/dev/null
  [ -f "$f" ] && echo "sha256=$(sha256sum < "$f" 2>/dev/null | cut -d' ' -f1) $(stat -c %a "$f" 2>/dev/null || echo -) $f"
done
exit 0
)sh";
  return script;
}

// A file the host already has: its content's hash and its permission bits (-1: unknown).
struct RemoteFile {
  std::string sha256;
  int mode = -1;
};

// "sha256=HASH MODE PATH" lines (MODE octal, or "-"): what the host already has.
std::map<std::string, RemoteFile> remote_files(const std::string& output) {
  std::map<std::string, RemoteFile> found;
  for (const auto& [key, value] : key_values(output)) {
    const auto first = value.find(' ');
    const auto second = first == std::string::npos ? first : value.find(' ', first + 1);
    if (key != "sha256" || second == std::string::npos) continue;
    RemoteFile file{value.substr(0, first)};
    const std::string mode = value.substr(first + 1, second - first - 1);
    const char* end = mode.data() + mode.size();
    int parsed = 0;
    const auto [stop, error] = std::from_chars(mode.data(), end, parsed, 8);
    if (error == std::errc{} && stop == end) file.mode = parsed;
    found[value.substr(second + 1)] = file;
  }
  return found;
}

// ---- where commands run and files go: over SSH, or on this machine ----

class SshTarget : public HostShell {
 public:
  explicit SshTarget(std::unique_ptr<SshSession> session) : session_(std::move(session)) {}
  SshSession::Result run(const std::string& command) override { return session_->run(command); }
  void upload(const fs::path& local, const std::string& path, int mode,
              const std::function<void(uint64_t sent)>& sent) override {
    session_->upload(local, path, mode, sent);
  }

 private:
  std::unique_ptr<SshSession> session_;
};

struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

class LocalTarget : public HostShell {
 public:
  LocalTarget(std::chrono::milliseconds timeout, std::function<void()> check_stop)
      : timeout_(timeout), check_stop_(std::move(check_stop)) {}

  // sh -c COMMAND with stdout and stderr captured; killed (its whole group) after the timeout,
  // or when check_stop throws (SshOptions::check_stop), the exception passing on.
  SshSession::Result run(const std::string& command) override {
    Fd out_read, out_write, err_read, err_write;
    int fds[2];
    if (::pipe2(fds, O_CLOEXEC) != 0) throw Error(ErrorKind::internal, "pipe failed");
    out_read.fd = fds[0], out_write.fd = fds[1];
    if (::pipe2(fds, O_CLOEXEC) != 0) throw Error(ErrorKind::internal, "pipe failed");
    err_read.fd = fds[0], err_write.fd = fds[1];
    const pid_t pid = ::fork();
    if (pid < 0) throw Error(ErrorKind::internal, "fork failed");
    if (pid == 0) {
      ::setpgid(0, 0);
      const int null = ::open("/dev/null", O_RDONLY);
      ::dup2(null, 0);
      ::dup2(out_write.fd, 1);
      ::dup2(err_write.fd, 2);
      ::execl("/bin/sh", "sh", "-c", command.c_str(), static_cast<char*>(nullptr));
      ::_exit(127);
    }
    // Here too, so that a kill of its group cannot come before the child made it (EACCES once
    // it has exec'd: it made the group itself by then).
    ::setpgid(pid, pid);
    ::close(std::exchange(out_write.fd, -1));
    ::close(std::exchange(err_write.fd, -1));
    SshSession::Result result;
    int status = 0;
    const auto reap = [&] {
      while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
      }
    };
    bool in_time = false;
    try {
      in_time = collect(out_read.fd, err_read.fd, result);
    } catch (...) {
      ::kill(-pid, SIGKILL);
      reap();
      throw;
    }
    if (!in_time) ::kill(-pid, SIGKILL);
    reap();
    if (!in_time) {
      throw Error(ErrorKind::ssh, fmt::format("a command on localhost did not finish within {}s",
                                              timeout_.count() / 1000));
    }
    result.exit_status = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    return result;
  }

  void upload(const fs::path& local, const std::string& path, int mode,
              const std::function<void(uint64_t sent)>& sent) override {
    const fs::path temp = path + fmt::format(".tmp-{}", ::getpid());
    try {
      fs::copy_file(local, temp, fs::copy_options::overwrite_existing);
      fs::permissions(temp, static_cast<fs::perms>(mode));
      fs::rename(temp, path);
      if (sent) sent(fs::file_size(path));
    } catch (const fs::filesystem_error& e) {
      std::error_code ec;
      fs::remove(temp, ec);
      throw Error(ErrorKind::io, fmt::format("cannot copy {} to {}: {}", local.string(), path,
                                             e.code().message()));
    }
  }

 private:
  // Reads both pipes to their end; false when the timeout came first.
  bool collect(int out_fd, int err_fd, SshSession::Result& result) const {
    const auto deadline = Clock::now() + timeout_;
    std::array<pollfd, 2> fds = {{{out_fd, POLLIN, 0}, {err_fd, POLLIN, 0}}};
    std::array<std::string*, 2> sinks = {&result.out, &result.err};
    while (fds[0].fd >= 0 || fds[1].fd >= 0) {
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
      if (left <= 0) return false;
      const int wait_ms = static_cast<int>(check_stop_ ? std::min<int64_t>(left, 250) : left);
      if (::poll(fds.data(), fds.size(), wait_ms) < 0 && errno != EINTR) break;
      if (check_stop_) check_stop_();
      for (size_t i = 0; i < fds.size(); ++i) {
        if (fds[i].fd < 0 || fds[i].revents == 0) continue;
        char buffer[4096];
        const ssize_t n = ::read(fds[i].fd, buffer, sizeof buffer);
        if (n > 0) {
          sinks[i]->append(buffer, static_cast<size_t>(n));
        } else if (n == 0 || errno != EINTR) {
          fds[i].fd = -1;  // poll skips negative descriptors
        }
      }
    }
    return true;
  }

  std::chrono::milliseconds timeout_;
  std::function<void()> check_stop_;
};

}  // namespace

std::unique_ptr<HostShell> open_host_shell(const HostSpec& host, const SshOptions& options) {
  if (host.is_local()) {
    return std::make_unique<LocalTarget>(options.command_timeout, options.check_stop);
  }
  return std::make_unique<SshTarget>(SshSession::connect(host, options));
}

namespace {

// Creates the workdir and reports facts, and the sha256 of `files` already there.
SshSession::Result prepare_workdir(HostShell& shell, const HostSpec& host,
                                   const std::string& workdir,
                                   const std::vector<PlannedFile>& files, bool create = true) {
  // A relative one is the home directory's on every host: an SSH login starts there, and this
  // machine's shell (localhost) starts where dptrain was run.
  const bool from_home =
      host.is_local() && !workdir.empty() && workdir.front() != '/' && workdir.front() != '~';
  auto result = shell.run(
      "sh -c " + shell_quote(facts_script(from_home ? "~/" + workdir : workdir, files, create)));
  if (result.exit_status != 0) {
    throw Error(ErrorKind::ssh, fmt::format("cannot use the workdir {} on {}: {}", workdir,
                                            host.display(), first_line(result.err)));
  }
  return result;
}

SshSession::Result installed_version(HostShell& shell, const std::string& absolute_workdir) {
  return shell.run(version_command(shell_quote(absolute_workdir + "/bin/dptrain")));
}

// ---- one host ----

// `report.uploads` lists `files`, in order, each pending; each is marked as it is done.
// A stop signal (SIGINT, SIGTERM) ends a host's provisioning between its steps and between an
// upload's chunks: Error(interrupted | terminated) saying where. An upload cut off leaves nothing
// (its remote shell removes the partial file at the short count).
void check_stop(std::string_view where) {
  if (const int sig = pending_stop_signal()) throw stop_error(sig, "", where);
}

void provision_host(HostReport& report, const ProvisionOptions& options,
                    const std::vector<PlannedFile>& files) {
  const std::string name = report.host.display();
  check_stop(" before connecting");
  auto target = open_host_shell(report.host, options.ssh);
  check_stop(" after connecting");
  const auto prepared = prepare_workdir(*target, report.host, options.workdir, files);
  report.facts = parse_facts(prepared.out);
  report.facts_known = true;
  const std::string& workdir = report.facts.workdir;
  const auto present = remote_files(prepared.out);
  uint64_t needed = 0;
  std::vector<std::string> chmod;  // same content, other permissions: "MODE PATH" pairs
  for (size_t i = 0; i < files.size(); ++i) {
    const auto it = present.find(files[i].remote);
    if (it != present.end() && it->second.sha256 == files[i].sha256) {
      report.uploads[i].status = UploadRecord::Status::skipped;
      // (An empty one is nothing to count, and would read as an upload's start.)
      if (options.on_upload && files[i].bytes > 0) {
        options.on_upload(name, files[i].remote, files[i].bytes, files[i].bytes);
      }
      if (it->second.mode != files[i].mode) {
        chmod.push_back(fmt::format("chmod {:o} {}", files[i].mode,
                                    shell_quote(workdir + "/" + files[i].remote)));
      }
    } else {
      needed += files[i].bytes;
    }
  }
  if (!chmod.empty()) {
    const auto repaired = target->run(fmt::format("{}", fmt::join(chmod, " && ")));
    if (repaired.exit_status != 0) {
      throw Error(ErrorKind::ssh, fmt::format("cannot set the permissions of files in {} on {}: {}",
                                              workdir, name, first_line(repaired.err)));
    }
  }
  // Unknown (0) is left to the uploads themselves to report.
  if (report.facts.disk_free_bytes > 0 && needed > report.facts.disk_free_bytes) {
    throw Error(ErrorKind::ssh,
                fmt::format("disk full on {}: {} has {} free, the uploads need {}", name, workdir,
                            human_bytes(report.facts.disk_free_bytes), human_bytes(needed)));
  }
  for (size_t i = 0; i < files.size(); ++i) {
    if (report.uploads[i].status == UploadRecord::Status::pending) {
      const PlannedFile& f = files[i];
      const std::string during = fmt::format(" while uploading {}", f.remote);
      check_stop(during);
      if (options.on_upload) options.on_upload(name, f.remote, 0, f.bytes);
      const std::function<void(uint64_t)> sent = [&options, &name, &f, &during](uint64_t bytes) {
        if (options.on_upload) options.on_upload(name, f.remote, bytes, f.bytes);
        if (bytes < f.bytes) check_stop(during);  // a finished upload is reported as such
      };
      const auto started = std::chrono::steady_clock::now();
      target->upload(files[i].local, workdir + "/" + files[i].remote, files[i].mode, sent);
      report.uploads[i].seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
      report.uploads[i].status = UploadRecord::Status::uploaded;
    }
  }
  check_stop(" before its dptrain was checked (its files are in place)");
  const auto version = installed_version(*target, workdir);
  if (version.exit_status == kVersionTimedOut) {
    throw Error(ErrorKind::ssh,
                fmt::format("the dptrain installed in {} on {} did not answer --version within "
                            "{} s (it hangs as it starts)",
                            workdir, name, version_probe_seconds()));
  }
  if (version.exit_status != 0) {
    throw Error(ErrorKind::ssh,
                fmt::format("the dptrain installed in {} does not run on {} (exit {}): {}", workdir,
                            name, version.exit_status, first_line(version.err + version.out)));
  }
  // As `--version --json` and run.json say it: "0.1.0", not "dptrain 0.1.0".
  std::string said = version_line(version.out);
  if (said.starts_with("dptrain ")) said.erase(0, std::string_view("dptrain ").size());
  report.facts.dptrain_version = said;
}

// The last line of `output` that is what `dptrain --version --json` prints: an object with a
// "version" string. Discarded when there is none.
nlohmann::json version_object(const std::string& output) {
  nlohmann::json found = nlohmann::json(nlohmann::json::value_t::discarded);
  std::istringstream lines(output);
  for (std::string line; std::getline(lines, line);) {
    const std::string t = trim(line);
    if (!t.starts_with('{')) continue;
    const nlohmann::json j = nlohmann::json::parse(t, nullptr, false);
    if (j.is_object() && j.contains("version") && j["version"].is_string()) found = j;
  }
  return found;
}

}  // namespace

std::string version_line(const std::string& output) {
  if (const nlohmann::json j = version_object(output); !j.is_discarded()) {
    return "dptrain " + j["version"].get<std::string>();
  }
  std::string found;
  std::istringstream lines(output);
  for (std::string line; std::getline(lines, line);) {
    if (const std::string t = trim(line); t.starts_with("dptrain ")) found = t;
  }
  return found.empty() ? trim(output) : found;
}

int agent_protocol_of(const std::string& output) {
  const nlohmann::json j = version_object(output);
  // Builds from before --version --json answer with the line alone: older than the number.
  if (j.is_discarded()) return version_line(output).starts_with("dptrain ") ? 1 : 0;
  const nlohmann::json said = j.value("agent_protocol", nlohmann::json(1));
  return said.is_number_integer() && said.get<int>() > 0 ? said.get<int>() : 0;
}

std::string loader_failure(const std::string& output) {
  constexpr std::string_view kPhrase = "error while loading shared libraries";
  const size_t at = output.find(kPhrase);
  if (at == std::string::npos) return {};
  return trim(output.substr(at, output.find('\n', at) - at));
}

HostFacts survey_host(HostShell& shell, const HostSpec& host, const std::string& workdir) {
  return parse_facts(prepare_workdir(shell, host, workdir, {}, /*create=*/false).out);
}

std::string bounded_command(const std::string& binary_word, const std::string& args) {
  // timeout(1) is coreutils' (every Linux host dptrain runs on has it); without it, the plain
  // command, under the SSH command timeout. 137: the binary ignored timeout's SIGTERM and was
  // killed 5 s later. In sh, whatever the user's login shell is (tcsh has no if/then/fi).
  const std::string script = fmt::format(
      "if command -v timeout >/dev/null 2>&1; then timeout -k 5 {} {} {}; s=$?; "
      "if [ $s -eq 124 ] || [ $s -eq 137 ]; then exit {}; fi; exit $s; else exec {} {}; "
      "fi",
      version_probe_seconds(), binary_word, args, kVersionTimedOut, binary_word, args);
  return "sh -c " + shell_quote(script);
}

std::string version_command(const std::string& binary_word) {
  return bounded_command(binary_word, "--version --json");
}

int version_probe_seconds() {
  const char* test = std::getenv("DPTRAIN_TEST_VERSION_PROBE_S");
  return test != nullptr && std::atoi(test) > 0 ? std::atoi(test) : 30;
}

std::vector<HostReport> provision(const std::vector<HostSpec>& hosts,
                                  const ProvisionOptions& options) {
  std::unique_ptr<TempFile> rewritten_recipe;
  const std::vector<PlannedFile> files = plan_files(options, rewritten_recipe);
  if (options.on_planned) {
    uint64_t bytes = 0;
    for (const auto& f : files)
      bytes += f.bytes;
    options.on_planned(bytes * hosts.size());
  }
  const auto outcomes = for_each_host(hosts, [&](const HostSpec& host) {
    HostReport report;
    report.host = host;
    // Every file is pending until the host gets it: a host that fails lists what it lacks.
    for (const auto& f : files)
      report.uploads.push_back({f.source, f.remote, f.bytes, UploadRecord::Status::pending});
    try {
      provision_host(report, options, files);
    } catch (const std::exception& e) {
      // Every line names its host, so a list of failures reads on its own.
      const std::string name = host.display();
      const std::string message = e.what();
      report.error = message.find(name) != std::string::npos ? message : name + ": " + message;
      const auto* error = dynamic_cast<const Error*>(&e);
      report.stopped = error != nullptr && is_stop_kind(error->kind());
    }
    return report;
  });
  std::vector<HostReport> reports;
  for (const auto& outcome : outcomes)
    reports.push_back(*outcome.value);
  return reports;
}

const char* upload_status_name(UploadRecord::Status status) {
  switch (status) {
    case UploadRecord::Status::uploaded:
      return "uploaded";
    case UploadRecord::Status::skipped:
      return "skipped";
    case UploadRecord::Status::pending:
      break;
  }
  return "pending";
}

nlohmann::json to_json(const HostReport& report) {
  using nlohmann::json;
  json facts = nullptr;
  if (report.facts_known) {
    const HostFacts& f = report.facts;
    json gpus = json::array();
    for (const auto& gpu : f.gpus) {
      gpus.push_back({{"name", gpu.name}, {"memory", gpu.memory}, {"driver", gpu.driver}});
    }
    const auto or_null = [](const std::string& s) { return s.empty() ? json(nullptr) : json(s); };
    facts = {{"hostname", f.hostname},
             {"os", f.os},
             {"cpus", f.cpus},
             {"memory_bytes", f.memory_bytes},
             {"disk_free_bytes", f.disk_free_bytes},
             {"workdir", f.workdir},
             {"gpus", gpus},
             {"gpu_note", or_null(f.gpu_note)},
             {"driver_version", or_null(f.driver_version)},
             {"dptrain_version", or_null(f.dptrain_version)}};
  }
  json uploads = json::array();
  for (const auto& u : report.uploads) {
    uploads.push_back({{"file", u.remote},
                       {"local", fs::absolute(u.local).string()},
                       {"bytes", u.bytes},
                       {"status", upload_status_name(u.status)},
                       {"seconds", u.status == UploadRecord::Status::uploaded ? json(u.seconds)
                                                                              : json(nullptr)}});
  }
  return {{"host", report.host.display()},
          {"ok", report.ok()},
          {"error", report.ok() ? json(nullptr) : json(report.error)},
          {"facts", facts},
          {"uploads", uploads}};
}

}  // namespace dptrain
