// Durable file helpers.
#include "core/fs.hpp"

#include <fcntl.h>
#include <poll.h>
#include <pwd.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <system_error>
#include <vector>

#include <fmt/format.h>

#include "core/error.hpp"

namespace dptrain {

namespace {

class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }
  int release() {
    int fd = fd_;
    fd_ = -1;
    return fd;
  }

 private:
  int fd_;
};

[[noreturn]] void throw_io(const std::filesystem::path& path, const char* what) {
  throw Error(ErrorKind::io, fmt::format("{}: cannot {}: {}", printable(path.string()), what,
                                         std::strerror(errno)));
}

void write_all(int fd, const void* data, size_t size, const std::filesystem::path& path) {
  const char* p = static_cast<const char*>(data);
  while (size > 0) {
    ssize_t n = ::write(fd, p, size);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw_io(path, "write");
    }
    p += n;
    size -= static_cast<size_t>(n);
  }
}

}  // namespace

namespace {

// Reads the open `fd` (of `path`, for errors) to its end a piece at a time; `size` is what
// fstat says it holds (0 where it cannot say: a pipe), so small files use a small buffer.
uint64_t read_pieces(int fd, uint64_t size, const std::filesystem::path& path,
                     const std::function<void(const char*, size_t)>& piece) {
  std::vector<char> buffer(std::clamp<uint64_t>(size + 1, uint64_t{1} << 16, uint64_t{8} << 20));
  uint64_t total = 0;
  for (;;) {
    const ssize_t n = ::read(fd, buffer.data(), buffer.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw_io(path, "read");
    if (n == 0) return total;
    piece(buffer.data(), static_cast<size_t>(n));
    total += static_cast<uint64_t>(n);
  }
}

// The size of a regular file open as `fd`; 0 for anything else.
uint64_t regular_size(int fd, const std::filesystem::path& path) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) throw_io(path, "read");
  return S_ISREG(st.st_mode) ? static_cast<uint64_t>(st.st_size) : 0;
}

}  // namespace

std::string read_file(const std::filesystem::path& path) {
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) throw_io(path, "read");
  const uint64_t size = regular_size(fd.get(), path);
  // A regular file's room is taken at once: where memory runs short, that is std::bad_alloc
  // (out of memory), never a read that stops early and passes for a short file.
  std::string out;
  out.reserve(static_cast<size_t>(size));
  read_pieces(fd.get(), size, path, [&](const char* data, size_t n) { out.append(data, n); });
  return out;
}

uint64_t read_file_pieces(const std::filesystem::path& path,
                          const std::function<void(const char*, size_t)>& piece) {
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) throw_io(path, "read");
  return read_pieces(fd.get(), regular_size(fd.get(), path), path, piece);
}

namespace {
std::atomic<int (*)()> g_pending_stop{nullptr};
}  // namespace

void set_stop_check(int (*pending_stop)()) {
  g_pending_stop.store(pending_stop);
}

int read_stoppable(const std::filesystem::path& path, size_t limit, std::string& out,
                   bool& too_long) {
  too_long = false;
  // Non-blocking: opening a FIFO for reading would wait for a writer, where no stop could end
  // the wait once its signal had come before it.
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK));
  if (fd.get() < 0) return -1;
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) return -1;
  const bool pipe = S_ISFIFO(st.st_mode);
  // Anything else reads as usual (a terminal, a device: blocking).
  if (!pipe && ::fcntl(fd.get(), F_SETFL, 0) != 0) return -1;
  char buffer[1 << 16];
  for (;;) {
    if (pipe) {
      const auto check = g_pending_stop.load();
      if (check != nullptr && check() != 0) {
        errno = EINTR;
        return -1;
      }
      // Linux reports nothing on a FIFO no writer has opened yet: the wait goes on.
      pollfd p{fd.get(), POLLIN, 0};
      const int ready = ::poll(&p, 1, 100);
      if (ready < 0 && errno != EINTR) return -1;
      if (ready <= 0) continue;
    }
    const ssize_t n = ::read(fd.get(), buffer, sizeof buffer);
    if (n < 0 && (errno == EAGAIN || (pipe && errno == EINTR))) continue;
    if (n < 0) return -1;
    if (n == 0) return 0;
    out.append(buffer, static_cast<size_t>(n));
    if (out.size() > limit) {
      too_long = true;
      return 0;
    }
  }
}

void fsync_directory(const std::filesystem::path& dir) {
  Fd fd(::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (fd.get() < 0) throw_io(dir, "open directory");
  if (::fsync(fd.get()) != 0) throw_io(dir, "fsync directory");
}

namespace {

// Writes `file`; errors name `shown` (the file a temporary stands in for).
void write_synced(const std::filesystem::path& file, std::span<const std::byte> content,
                  const std::filesystem::path& shown) {
  Fd fd(::open(file.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (fd.get() < 0) throw_io(shown, "create");
  write_all(fd.get(), content.data(), content.size(), shown);
  if (::fsync(fd.get()) != 0) throw_io(shown, "fsync");
  if (::close(fd.release()) != 0) throw_io(shown, "close");
}

}  // namespace

void write_file_synced(const std::filesystem::path& path, std::span<const std::byte> content) {
  write_synced(path, content, path);
}

long temporary_pid(std::string_view entry, std::string_view prefix) {
  if (!entry.starts_with(prefix) || entry.size() == prefix.size() ||
      entry.size() > prefix.size() + 9) {
    return 0;
  }
  long pid = 0;
  for (const char c : entry.substr(prefix.size())) {
    if (c < '0' || c > '9') return 0;
    pid = pid * 10 + (c - '0');
  }
  return pid;
}

int online_cpus() {
  const long online = ::sysconf(_SC_NPROCESSORS_ONLN);
  return online > 0 ? static_cast<int>(online) : 0;
}

bool process_alive(long pid) {
  if (pid == ::getpid()) return true;
  if (pid <= 0 || (::kill(static_cast<pid_t>(pid), 0) != 0 && errno != EPERM)) return false;
  // A zombie (exited, its parent not yet told) still takes signals: its state says it is gone.
  // Its whole stat (a name may hold a newline); none where /proc is there: reaped meanwhile.
  std::ifstream stat_file(fmt::format("/proc/{}/stat", pid));
  const std::string stat((std::istreambuf_iterator<char>(stat_file)),
                         std::istreambuf_iterator<char>());
  if (stat.empty()) return !std::filesystem::exists("/proc/self/stat");
  const auto paren = stat.rfind(')');
  return paren == std::string::npos || paren + 2 >= stat.size() || stat[paren + 2] != 'Z';
}

void write_file_atomic(const std::filesystem::path& path, std::string_view content) {
  auto tmp = path;
  tmp += fmt::format(".tmp-{}", ::getpid());
  try {
    // The temporary's name means nothing to the user: errors name the file being written.
    write_synced(tmp, std::as_bytes(std::span(content.data(), content.size())), path);
  } catch (const Error&) {
    ::unlink(tmp.c_str());  // a full disk must not leave a stray temporary behind
    throw;
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    int saved = errno;
    ::unlink(tmp.c_str());
    errno = saved;
    throw_io(path, "rename into place");
  }
  fsync_directory(path.parent_path());
}

const char* non_regular_kind(const std::filesystem::file_status& status) {
  switch (status.type()) {
    case std::filesystem::file_type::none:
    case std::filesystem::file_type::not_found:
    case std::filesystem::file_type::regular:
      return nullptr;
    case std::filesystem::file_type::directory:
      return "a directory";
    case std::filesystem::file_type::symlink:
      return "a symbolic link";
    case std::filesystem::file_type::fifo:
      return "a pipe";
    case std::filesystem::file_type::socket:
      return "a socket";
    default:
      return "a device";
  }
}

void check_regular_or_missing(const std::filesystem::path& path) {
  std::error_code ec;
  const char* what = non_regular_kind(std::filesystem::status(path, ec));
  if (what == nullptr) return;
  // A link to a directory is named as the link it is, as ckpt names it.
  const bool link = std::filesystem::is_symlink(std::filesystem::symlink_status(path, ec));
  throw Error(ErrorKind::io,
              fmt::format("{}: is {}{}, not a regular file: dptrain writes this file itself; "
                          "move it away",
                          path.string(), link ? "a symbolic link to " : "", what));
}

void append_line(const std::filesystem::path& path, std::string_view line) {
  check_regular_or_missing(path);
  Fd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644));
  if (fd.get() < 0) throw_io(path, "open for append");
  std::string buf(line);
  buf.push_back('\n');
  write_all(fd.get(), buf.data(), buf.size(), path);
}

uint64_t size_on_disk(const std::filesystem::path& dir) {
  uint64_t total = 0;
  std::error_code ec;
  for (const auto& entry : std::filesystem::recursive_directory_iterator(dir, ec)) {
    std::error_code size_ec;
    if (entry.is_regular_file(size_ec)) {
      const uintmax_t size = entry.file_size(size_ec);
      if (!size_ec) total += size;
    }
  }
  return total;
}

void check_output_file(const std::string& flag, const std::string& given, std::string_view what) {
  namespace fs = std::filesystem;
  const fs::path out = fs::absolute(given);
  std::error_code ec;
  const fs::file_status status = fs::symlink_status(out, ec);
  if (fs::is_directory(status)) {
    throw Error(ErrorKind::usage,
                fmt::format("{} {}: is a directory; name {} to write", flag, given, what));
  }
  if (!fs::is_directory(out.parent_path(), ec)) {
    if (const auto file = file_in_the_way(out)) {
      throw Error(ErrorKind::usage,
                  fmt::format("{} {}: {} is not a directory", flag, given, file->string()));
    }
    // One above it this user may not search (EACCES) is not "no such" directory.
    if (ec && ec != std::errc::no_such_file_or_directory) {
      throw Error(ErrorKind::usage, fmt::format("{} {}: cannot reach {}: {}", flag, given,
                                                out.parent_path().string(), ec.message()));
    }
    throw Error(ErrorKind::usage, fmt::format("{} {}: no such directory {}", flag, given,
                                              out.parent_path().string()));
  }
  if (const char* kind = non_regular_kind(status)) {
    throw Error(ErrorKind::usage,
                fmt::format("{} {}: is {}, not a regular file; it would be replaced, not written "
                            "through: name a regular file or a new one",
                            flag, given, kind));
  }
}

void check_replaceable(const std::string& flag, const std::string& given,
                       std::string_view own_start, std::string_view own_kind) {
  std::error_code ec;
  const auto size = std::filesystem::file_size(given, ec);
  if (ec || size == 0) return;  // none there (or not a file: check_output_file's), or empty
  std::ifstream in(given, std::ios::binary);
  std::string start(own_start.size(), '\0');
  if (!in) {
    throw Error(ErrorKind::usage,
                fmt::format("{} {}: cannot be read to tell what it holds ({}), so it is not "
                            "replaced; name another file, or remove it first",
                            flag, printable(given), std::strerror(errno)));
  }
  const auto got = in.read(start.data(), static_cast<std::streamsize>(start.size())).gcount();
  if (std::string_view(start).substr(0, static_cast<size_t>(got)) != own_start) {
    throw Error(ErrorKind::usage,
                fmt::format("{} {}: holds something else than {} (it does not start with {}), so "
                            "it is not replaced; name another file, or remove it first",
                            flag, printable(given), own_kind, own_start));
  }
}

std::optional<std::filesystem::path> file_in_the_way(const std::filesystem::path& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  // Followed as the path would be (a link to a directory is one); a dangling link is no file.
  for (fs::path up = path.parent_path(); !up.empty() && up != up.root_path();
       up = up.parent_path()) {
    const fs::file_status st = fs::status(up, ec);
    if (!fs::exists(st)) continue;
    if (fs::is_directory(st)) return std::nullopt;
    return up;
  }
  return std::nullopt;
}

namespace {

// "runs/x/" and "runs/x/." (once normal, "runs/x/") are runs/x, whose filename is x.
std::filesystem::path without_trailing_separator(std::filesystem::path path) {
  while (!path.has_filename() && path.has_relative_path())
    path = path.parent_path();
  return path;
}

}  // namespace

std::filesystem::path resolved_path(const std::filesystem::path& path) {
  const std::filesystem::path absolute = std::filesystem::absolute(path);
  std::error_code ec;
  const std::filesystem::path resolved = std::filesystem::weakly_canonical(absolute, ec);
  return without_trailing_separator(ec ? absolute.lexically_normal() : resolved);
}

std::filesystem::path named_path(const std::filesystem::path& path) {
  std::filesystem::path p = std::filesystem::absolute(path);
  // "x/" and "x/." name x whatever x is ("." and an empty name change nothing).
  while ((!p.has_filename() || p.filename() == ".") && p.has_relative_path())
    p = p.parent_path();
  if (!p.has_relative_path() || p.filename() == "..") return resolved_path(p);
  return resolved_path(p.parent_path()) / p.filename();
}

void require_open_files(uint64_t needed, const std::string& what, const std::string& instead) {
  rlimit files{};
  if (::getrlimit(RLIMIT_NOFILE, &files) != 0 || files.rlim_cur == RLIM_INFINITY) return;
  std::error_code ec;
  uint64_t open_now = 0;
  for (std::filesystem::directory_iterator it("/proc/self/fd", ec), end; !ec && it != end;
       it.increment(ec))
    ++open_now;
  // No descriptor free even to list them: every one is taken. (Without /proc: none counted.)
  const bool full =
      ec == std::errc::too_many_files_open || ec == std::errc::too_many_files_open_in_system;
  if (full) open_now = files.rlim_cur;
  if (open_now + needed <= files.rlim_cur) return;
  const std::string held = ec ? std::string() : fmt::format("{} already are; ", open_now);
  throw Error(ErrorKind::usage,
              fmt::format("{} need about {} open files here, more than the {} this process may "
                          "open ({}'ulimit -n' says the limit, hard limit {}): raise it (ulimit "
                          "-n, LimitNOFILE= for a systemd service, nofile in limits.conf), or {}",
                          what, needed, files.rlim_cur, held,
                          files.rlim_max == RLIM_INFINITY ? std::string("unlimited")
                                                          : std::to_string(files.rlim_max),
                          instead));
}

std::string human_size(uint64_t bytes) {
  if (bytes < 1024) return fmt::format("{} B", bytes);
  double size = static_cast<double>(bytes);
  const char* unit = "B";
  for (const char* next : {"KiB", "MiB", "GiB", "TiB"}) {
    if (size < 1024) break;
    size /= 1024;
    unit = next;
  }
  return fmt::format("{:.1f} {}", size, unit);
}

std::string cwd_gone_note(const std::filesystem::path& path) {
  if (path.is_absolute()) return {};
  std::error_code ec;
  [[maybe_unused]] const auto cwd = std::filesystem::current_path(ec);
  return ec == std::errc::no_such_file_or_directory ? " (the current directory no longer exists)"
                                                    : "";
}

std::optional<std::string> unclaimed_entry(
    const std::filesystem::path& dir,
    const std::function<bool(const std::filesystem::directory_entry&)>& ours) {
  std::optional<std::string> first;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (!ours(entry) && (!first || name < *first)) first = name;
  }
  if (ec) {
    throw Error(ErrorKind::usage,
                fmt::format("{}: cannot list: {}", printable(dir.string()), ec.message()));
  }
  return first;
}

std::filesystem::path make_temp_directory(const std::string& stem) {
  std::error_code ec;
  const std::filesystem::path base = std::filesystem::temp_directory_path(ec);
  if (ec) {
    const char* tmpdir = std::getenv("TMPDIR");
    throw Error(ErrorKind::io, fmt::format("{}: not a usable temporary folder: {}",
                                           tmpdir != nullptr ? tmpdir : "/tmp", ec.message()));
  }
  std::string pattern = (base / (stem + "-XXXXXX")).string();
  if (::mkdtemp(pattern.data()) == nullptr) {
    throw Error(ErrorKind::io, fmt::format("{}: cannot create a temporary directory: {}",
                                           std::filesystem::path(pattern).parent_path().string(),
                                           std::strerror(errno)));
  }
  return pattern;
}

std::filesystem::path home_directory() {
  if (const char* home = std::getenv("HOME"); home && *home) return home;
  if (const passwd* pw = ::getpwuid(::getuid()); pw && pw->pw_dir) return pw->pw_dir;
  return "/";
}

std::filesystem::path expand_home(const std::string& path) {
  if (path == "~") return home_directory();
  if (path.starts_with("~/")) return home_directory() / path.substr(2);
  return path;
}

}  // namespace dptrain
