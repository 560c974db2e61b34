// `dptrain data prepare --text FILE... --out DATASET`: text files -> a token dataset directory.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <map>
#include <memory>
#include <set>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include <fmt/chrono.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli/commands.hpp"
#include "cli/env.hpp"
#include "cli/json_errors.hpp"
#include "cli/run_report.hpp"
#include "core/data/tokens.hpp"
#include "core/error.hpp"
#include "core/fs.hpp"
#include "core/json_error.hpp"
#include "launch/status.hpp"
#include "launch/supervisor.hpp"

namespace dptrain::cli {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

struct PrepareOptions {
  std::vector<std::string> text;
  std::string out;
  std::string tokenizer = "byte";
  double val_fraction = 0.1;
  std::string dtype = "auto";
  bool force = false;
  bool json = false;
};

struct Source {
  fs::path path;
  uint64_t bytes = 0;
};

// What was written, as printed.
struct PrepareSummary {
  explicit PrepareSummary(std::vector<std::string>& given) : warnings(given) {}
  fs::path path;
  std::vector<Source> sources;
  uint64_t bytes = 0;
  std::string tokenizer;
  std::string tokenizer_checksum;  // Tokenizer::checksum
  int64_t vocab = 0;
  int64_t tokens = 0, train_tokens = 0, val_tokens = 0;
  int dtype_bytes = 2;
  // Each also printed on stderr as it is found; the command's own (Outcome::warnings), so that a
  // JSON error carries those given before it failed.
  std::vector<std::string>& warnings;
};

// One line, whatever the paths in it hold (a file name with a newline).
[[noreturn]] void refuse(const std::string& message) {
  throw Error(ErrorKind::usage, printable(message));
}

// A prepare of a large text takes a while: it shows where it is on stderr (WorkStatus: rewritten
// in place on a terminal, a line now and then in a pipe), and it stops at the next step of work
// once SIGINT or SIGTERM came (the handlers only record them), so that what it wrote can be
// removed first.
class PrepareStatus {
 public:
  explicit PrepareStatus(bool tty) : work_(stderr, tty) {}

  // Error(interrupted | terminated), exit 130 | 143, once a stop signal came.
  void check_stop() const {
    const int sig = pending_stop_signal();
    if (sig == 0) return;
    throw stop_error(sig, "data prepare ", ": nothing was written" + out_note_);
  }
  // After what the stop message says about DATASET.
  void set_output(const fs::path& out, bool existed) {
    out_note_ = fmt::format(", {} {}", out.string(), existed ? "is as it was" : "was not made");
  }

  // check_stop(), then WorkStatus::show.
  void show(const std::string& what, uint64_t done, uint64_t total, bool bytes) {
    check_stop();
    work_.show(what, done, total, bytes ? "" : "tokens");
  }
  // The same as a core callback, for one step of work.
  WorkProgress step(std::string what, uint64_t total, bool bytes) {
    return [this, what = std::move(what), total, bytes](uint64_t done) {
      show(what, done, total, bytes);
    };
  }

  void line(const std::string& text) { work_.line(text); }
  void erase() { work_.erase(); }

 private:
  WorkStatus work_;
  std::string out_note_;
};

void check_options(const PrepareOptions& o) {
  if (o.text.empty()) refuse("data prepare: no --text FILE given (the text to tokenize)");
  if (o.out.empty()) refuse("data prepare: no --out DATASET given (the directory to write)");
  if (std::find(o.text.begin(), o.text.end(), "") != o.text.end()) {
    refuse("--text '': an empty file name (give the text's path)");
  }
  if (o.tokenizer != "byte" && o.tokenizer != "char") {
    refuse(fmt::format("--tokenizer: must be byte or char, got '{}'", o.tokenizer));
  }
  if (!(o.val_fraction >= 0.0 && o.val_fraction < 1.0)) {
    refuse(fmt::format("--val-fraction: must be in [0, 1), got {}", o.val_fraction));
  }
  if (o.dtype != "auto" && o.dtype != "uint16" && o.dtype != "uint32") {
    refuse(fmt::format("--dtype: must be auto, uint16 or uint32, got '{}'", o.dtype));
  }
}

// `.NAME.tmp-PID` and `.NAME.old-PID`: a prepare's temporary dataset and the dataset it replaces.
fs::path sibling(const fs::path& out, const char* what, pid_t pid) {
  return out.parent_path() / fmt::format(".{}.{}-{}", out.filename().string(), what, pid);
}

// OUT as an absolute path without a trailing slash, so that it has a parent to rename in.
fs::path output_path(const std::string& out) {
  fs::path path = fs::absolute(out).lexically_normal();
  if (path.filename().empty()) path = path.parent_path();
  if (path == path.root_path()) refuse(fmt::format("--out: cannot write a dataset to {}", out));
  // The dataset replaces OUT by a rename: OUT holding the current directory would take the
  // directory the user stands in away from under them.
  std::error_code ec;
  const fs::path here = fs::current_path(ec);
  const fs::path real = fs::weakly_canonical(path, ec);
  if (!here.empty() && !ec) {
    const auto [end, at] = std::mismatch(real.begin(), real.end(), here.begin(), here.end());
    if (end == real.end()) {
      refuse(
          fmt::format("--out {}: {} the current directory (the dataset replaces its "
                      "directory): give the name of a directory to create, as --out DATASET",
                      out, real == here ? "is" : "holds"));
    }
  }
  // A file where a parent directory should be: the caller's to fix, as for a file at OUT.
  if (const auto file = file_in_the_way(path)) {
    refuse(fmt::format("--out {}: {} is not a directory", out, file->string()));
  }
  // A place no directory can be made in (a read-only filesystem, /proc): said before the text is
  // read (a large corpus takes minutes), as the caller's to fix, by a directory made in the
  // nearest one that exists and removed at once.
  fs::path at = path.parent_path();
  while (at != at.root_path() && !fs::exists(fs::symlink_status(at, ec)))
    at = at.parent_path();
  std::string probe = (at / ".dptrain-probe-XXXXXX").string();
  if (::mkdtemp(probe.data()) == nullptr) {
    const int error = errno;
    refuse(fmt::format("--out {}: cannot make a directory in {}: {}", out, at.string(),
                       std::strerror(error)));
  }
  ::rmdir(probe.c_str());
  // The dataset is written beside OUT first (.NAME.tmp-PID): a name that leaves no room for that
  // is said now, not after the text is read.
  const long name_max = ::pathconf(at.c_str(), _PC_NAME_MAX);
  const size_t longest = sibling(path, "tmp", ::getpid()).filename().string().size();
  if (name_max > 0 && longest > static_cast<size_t>(name_max)) {
    refuse(
        fmt::format("--out {}: a name of {} bytes is too long: the dataset is written beside "
                    "it first as .NAME.tmp-PID ({} bytes), and names in {} are at most {} "
                    "bytes; give a shorter name",
                    out, path.filename().string().size(), longest, at.string(), name_max));
  }
  return path;
}

constexpr size_t kReadChunk = size_t{8} << 20;

// An open file descriptor, closed when it goes.
struct FileDescriptor {
  int fd = -1;
  explicit FileDescriptor(int f) : fd(f) {}
  ~FileDescriptor() {
    if (fd >= 0) ::close(fd);
  }
  FileDescriptor(const FileDescriptor&) = delete;
  FileDescriptor& operator=(const FileDescriptor&) = delete;
};

// How much text a prepare may hold: what it holds in memory for each byte of text, at most (the
// text and its int32 tokens, one a byte at most, while it tokenizes; then the tokens and a token
// file's bytes, 2 or 4 a token, while it writes; the width is known before reading unless the
// char vocabulary decides it), and so the most text this machine's available memory allows
// (no limit when that is unknown).
struct TextBudget {
  uint64_t per_byte = 0;
  uint64_t limit = UINT64_MAX;

  explicit TextBudget(const PrepareOptions& o) {
    const bool wide = o.dtype == "uint32" || (o.tokenizer == "char" && o.dtype != "uint16");
    per_byte = 4 + (wide ? 4 : 2);
    if (const uint64_t available = available_memory(); available > 0) {
      limit = available / per_byte;
    }
  }

  // Refused before the memory runs out (the kernel would kill the prepare, or another process,
  // with no word of why): `what` is how much text there is, or would be.
  [[noreturn]] void refuse_over(const std::string& what) const {
    refuse(
        fmt::format("{}: a prepare holds the text and its tokens in memory ({} bytes a byte of "
                    "text), and {} is available (MemAvailable): at most {} of text; prepare "
                    "less text, or free memory",
                    what, per_byte, human_size(limit * per_byte), human_size(limit)));
  }
};

// Appends the file's bytes to text, a chunk at a time: the progress line moves and a stop signal
// is seen between chunks (also while a read from a pipe waits). More than `limit` bytes of text
// in all is refused as it is reached (a pipe, or a device such as /dev/zero, has no size).
void append_text(const fs::path& path, std::string& text, const TextBudget& budget,
                 PrepareStatus& status) {
  std::error_code ec;
  if (fs::is_directory(path, ec))
    refuse(fmt::format("{}: cannot read: is a directory", printable(path.string())));
  int fd = -1;
  // A FIFO's open waits for a writer: a stop signal ends the wait.
  while ((fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC)) < 0 && errno == EINTR)
    status.check_stop();
  const FileDescriptor in(fd);
  if (in.fd < 0)
    refuse(fmt::format("{}: cannot read: {}{}", printable(path.string()), std::strerror(errno),
                       path == "-" ? " (for standard input, give /dev/stdin)" : ""));
  struct stat st {};
  const bool regular = ::fstat(in.fd, &st) == 0 && S_ISREG(st.st_mode);
  const uint64_t size = regular ? static_cast<uint64_t>(st.st_size) : 0;
  const std::string what = "reading " + printable(path.filename().string());
  const size_t file_start = text.size();
  uint64_t done = 0;
  for (;;) {
    status.show(what, done, std::max(size, done), true);
    // Into the room run_prepare reserved, so that a large text is not copied as it grows.
    const size_t start = text.size(), room = text.capacity() - start;
    const size_t chunk = room >= kReadChunk / 2 ? std::min(room, kReadChunk) : kReadChunk;
    text.resize(start + chunk);
    const ssize_t n = ::read(in.fd, text.data() + start, chunk);
    const int error = errno;
    text.resize(start + static_cast<size_t>(std::max<ssize_t>(n, 0)));
    if (n == 0) break;
    if (n < 0) {
      if (error == EINTR) continue;
      refuse(fmt::format("{}: cannot read: {}", printable(path.string()), std::strerror(error)));
    }
    // A token file (a dataset's train.bin given for its text) is no text: its bytes would be
    // tokenized as if they were, with no word of it.
    const uint64_t magic = sizeof(kTokenFileMagic);
    if (done < magic && done + static_cast<uint64_t>(n) >= magic &&
        text.compare(file_start, magic, kTokenFileMagic, magic) == 0) {
      refuse(
          fmt::format("{}: a dptrain token file (it starts with {}), not text: give the text "
                      "files it was prepared from (a prepared dataset is used as it is, as "
                      "data.path)",
                      printable(path.string()), std::string_view(kTokenFileMagic, magic)));
    }
    done += static_cast<uint64_t>(n);
    if (text.size() > budget.limit) {
      budget.refuse_over(fmt::format("{}: the text passes {} ({} of this file read)",
                                     printable(path.string()), human_size(budget.limit),
                                     human_size(done)));
    }
  }
  // A file written to while it was read holds neither the old text nor the new one. (Fewer
  // bytes than its size: truncated; more: appended, or a file whose size says nothing, as
  // /proc's, which its size and mtime then tell apart.)
  struct stat after {};
  if (regular &&
      (::fstat(in.fd, &after) != 0 || done < size || static_cast<uint64_t>(after.st_size) != size ||
       after.st_mtim.tv_sec != st.st_mtim.tv_sec || after.st_mtim.tv_nsec != st.st_mtim.tv_nsec)) {
    refuse(
        fmt::format("{}: changed while it was read ({} bytes when opened, {} read, {} now); "
                    "prepare it once nothing writes to it",
                    path.string(), size, done, static_cast<uint64_t>(after.st_size)));
  }
}

int resolve_dtype(const std::string& dtype, int64_t vocab, const std::string& tokenizer) {
  if (dtype == "uint32") return 4;
  const int64_t uint16_ids = dtype_capacity(2);
  if (vocab <= uint16_ids) return 2;
  if (dtype == "uint16") {
    refuse(
        fmt::format("--dtype uint16 holds {} ids, but the {} vocabulary has {} (use --dtype "
                    "uint32 or auto)",
                    uint16_ids, tokenizer, vocab));
  }
  if (vocab > dtype_capacity(4)) {
    refuse(fmt::format("the {} vocabulary has {} ids, more than uint32 holds", tokenizer, vocab));
  }
  return 4;
}

std::string utc_now() {
  return fmt::format("{:%Y-%m-%dT%H:%M:%SZ}", fmt::gmtime(std::time(nullptr)));
}

json meta_json(const PrepareSummary& s, double val_fraction) {
  json sources = json::array();
  for (const auto& src : s.sources)
    sources.push_back({{"path", src.path.string()}, {"bytes", src.bytes}});
  return {{"format", "dptrain-tokens"}, {"version", kTokenFileVersion},
          {"created_at", utc_now()},    {"created_by", "dptrain " DPTRAIN_VERSION},
          {"sources", sources},         {"bytes", s.bytes},
          {"tokenizer", s.tokenizer},   {"tokenizer_checksum", s.tokenizer_checksum},
          {"vocab", s.vocab},           {"dtype", dtype_name(s.dtype_bytes)},
          {"tokens", s.tokens},         {"train_tokens", s.train_tokens},
          {"val_tokens", s.val_tokens}, {"val_fraction", val_fraction}};
}

// A warning: on stderr as every warning, and in the --json "warnings".
void warn(PrepareStatus& status, std::vector<std::string>& warnings, const std::string& text) {
  warnings.push_back(printable(text));
  status.line("dptrain: warning: " + warnings.back());
}

// What a prepare of OUT that was killed (SIGKILL, a crash, a power cut) left beside it: its
// `.NAME.tmp-PID` is removed, and its `.NAME.old-PID` (the dataset it was replacing, between its
// two renames) is put back when OUT is missing, else removed. Only for a PID that is gone: a
// prepare still running keeps its own. Each is a warning (stderr, and the --json "warnings"): a
// script learns that a directory was removed or put back.
void remove_stale_siblings(const fs::path& out, PrepareStatus& status,
                           std::vector<std::string>& warnings) {
  const std::string name = out.filename().string();
  std::error_code ec;
  std::vector<std::pair<fs::path, long>> olds;
  for (const auto& entry : fs::directory_iterator(out.parent_path(), ec)) {
    const std::string file = entry.path().filename().string();
    if (const long pid = temporary_pid(file, "." + name + ".tmp-");
        pid > 0 && !process_alive(pid)) {
      std::error_code rm_ec;
      fs::remove_all(entry.path(), rm_ec);
      warn(status, warnings,
           fmt::format("removed {}: left by a data prepare (pid {}) that was killed{}",
                       entry.path().string(), pid,
                       rm_ec ? fmt::format(" (not all: {})", rm_ec.message()) : ""));
    } else if (const long old_pid = temporary_pid(file, "." + name + ".old-");
               old_pid > 0 && !process_alive(old_pid)) {
      olds.emplace_back(entry.path(), old_pid);
    }
  }
  for (const auto& [old, pid] : olds) {
    std::error_code mv_ec;
    if (!fs::exists(fs::symlink_status(out, mv_ec))) {
      fs::rename(old, out, mv_ec);
      if (!mv_ec) {
        warn(status, warnings,
             fmt::format("put back {} from {}: a data prepare (pid {}) was killed while "
                         "replacing it",
                         out.string(), old.string(), pid));
        continue;
      }
    }
    fs::remove_all(old, mv_ec);
    warn(
        status, warnings,
        fmt::format("removed {}: the dataset a data prepare (pid {}) replaced", old.string(), pid));
  }
}

// Writes everything into a temporary sibling of OUT, then renames it into place: a failure or a
// stop signal leaves OUT as it was and no temporary behind.
void write_dataset(const PrepareSummary& s, const Tokenizer& tokenizer,
                   const std::vector<int32_t>& tokens, double val_fraction, bool force,
                   PrepareStatus& status) {
  const fs::path out = s.path;
  const fs::path parent = out.parent_path();
  std::error_code ec;
  if (!fs::create_directories(parent, ec) && ec) {
    throw Error(ErrorKind::io,
                fmt::format("{}: cannot create: {}", printable(parent.string()), ec.message()));
  }
  const fs::path tmp = sibling(out, "tmp", ::getpid());
  const fs::path old = sibling(out, "old", ::getpid());
  fs::remove_all(tmp, ec);
  bool moved_old = false;
  try {
    fs::create_directory(tmp);
    const std::span<const int32_t> all(tokens);
    const auto train = static_cast<size_t>(s.train_tokens);
    const auto write = [&](const char* file, std::span<const int32_t> part) {
      write_token_file(tmp / file, s.vocab, part, s.dtype_bytes,
                       status.step(fmt::format("writing {}", file), part.size(), false));
      status.check_stop();
    };
    write("train.bin", all.first(train));
    write("val.bin", all.subspan(train));
    tokenizer.save(tmp);
    write_file_atomic(tmp / "meta.json", json_text(meta_json(s, val_fraction), 2) + "\n");
    fsync_directory(tmp);
    status.check_stop();  // the last moment a stop leaves OUT as it was
    if (!force) {
      // What check_dataset_output allowed (OUT absent, or an empty directory) or nothing: another
      // process that wrote OUT meanwhile wins, and this one is refused. Renaming onto an empty
      // directory fails once it is not empty; onto nothing, RENAME_NOREPLACE fails once OUT is.
      // A filesystem without rename flags (NFS, SMB: EINVAL) gets the same one-winner rule from
      // an empty directory made first: mkdir fails for the second, as a rename onto a directory
      // that is no longer empty does.
      const auto rename_into_place = [&]() -> int {
        if (!fs::exists(fs::symlink_status(out))) {
          if (::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, out.c_str(), RENAME_NOREPLACE) == 0) {
            return 0;
          }
          if (errno != EINVAL) return errno;
          if (::mkdir(out.c_str(), 0755) != 0) return errno;
        }
        return ::rename(tmp.c_str(), out.c_str()) == 0 ? 0 : errno;
      };
      if (const int failed = rename_into_place(); failed != 0) {
        fs::remove_all(tmp, ec);
        if (failed == EEXIST || failed == ENOTEMPTY) {
          refuse(
              fmt::format("{}: another process wrote a dataset there meanwhile; nothing was "
                          "written (use --force to replace it)",
                          out.string()));
        }
        throw fs::filesystem_error("rename", tmp, out,
                                   std::error_code(failed, std::generic_category()));
      }
    } else {
      if (fs::exists(fs::symlink_status(out))) {
        fs::rename(out, old);
        moved_old = true;
      }
      fs::rename(tmp, out);
    }
    fsync_directory(parent);
  } catch (...) {
    fs::remove_all(tmp, ec);
    if (moved_old && !fs::exists(out, ec)) fs::rename(old, out, ec);
    try {
      throw;
    } catch (const fs::filesystem_error& e) {
      // The file it failed on, where that is not the dataset itself (its temporary directory).
      const std::string at =
          e.path1().empty() || e.path1() == out ? "" : printable(e.path1().string()) + ": ";
      throw Error(ErrorKind::io,
                  fmt::format("{}: cannot write the dataset, nothing was written: {}{}",
                              printable(out.string()), at, e.code().message()));
    } catch (const Error& e) {
      if (e.kind() != ErrorKind::io) throw;
      // A write cut short by a stop signal is the stop, not a broken disk.
      status.check_stop();
      throw Error(ErrorKind::io,
                  fmt::format("{}: cannot write the dataset, nothing was written: {}",
                              printable(out.string()), e.what()));
    }
  }
  if (moved_old) fs::remove_all(old, ec);
}

void print_summary(const PrepareSummary& s, bool as_json) {
  if (as_json) {
    json out = {{"path", s.path.string()},
                {"files", s.sources.size()},
                {"bytes", s.bytes},
                {"tokens", s.tokens},
                {"tokenizer", s.tokenizer},
                {"vocab", s.vocab},
                {"train_tokens", s.train_tokens},
                {"val_tokens", s.val_tokens},
                {"dtype", dtype_name(s.dtype_bytes)},
                {"warnings", s.warnings}};
    add_success(out);
    std::printf("%s\n", json_text(out).c_str());
    return;
  }
  std::printf("%s",
              fmt::format("files         {}\n"
                          "bytes         {}\n"
                          "tokens        {}\n"
                          "tokenizer     {}\n"
                          "vocab         {}\n"
                          "train tokens  {}\n"
                          "val tokens    {}\n"
                          "dtype         {}\n"
                          "path          {}\n",
                          s.sources.size(), s.bytes, s.tokens, s.tokenizer, s.vocab, s.train_tokens,
                          s.val_tokens, dtype_name(s.dtype_bytes), printable(s.path.string()))
                  .c_str());
}

int run_prepare(const PrepareOptions& o, std::vector<std::string>& warnings) {
  check_options(o);
  install_stop_signal_handlers();
  PrepareStatus status(StatusPrinter::is_terminal(stderr));
  PrepareSummary s(warnings);
  s.path = output_path(o.out);
  remove_stale_siblings(s.path, status, s.warnings);
  check_dataset_output(s.path, o.force);
  std::error_code ec;
  status.set_output(s.path, fs::exists(fs::symlink_status(s.path, ec)));

  // A file given twice (under two names: a link and its target, as a glob of
  // /usr/share/common-licenses/* gives) is read once: twice, the held-out text at the end would
  // also be in the training text, and the split would no longer hold out anything.
  std::vector<std::string> texts;
  std::map<std::pair<dev_t, ino_t>, std::string> seen;
  for (const auto& name : o.text) {
    struct stat st {};
    if (::stat(name.c_str(), &st) == 0 && S_ISREG(st.st_mode)) {
      const auto [at, fresh] = seen.emplace(std::make_pair(st.st_dev, st.st_ino), name);
      if (!fresh) {
        warn(status, s.warnings,
             fmt::format("--text {}: the same file as {}, given before: read once", name,
                         at->second));
        continue;
      }
    }
    texts.push_back(name);
  }
  const TextBudget budget(o);
  uint64_t expected = 0;
  for (const auto& name : texts) {
    const uintmax_t size = fs::file_size(name, ec);
    if (!ec) expected += size;
  }
  if (expected > budget.limit) {
    budget.refuse_over(fmt::format("{}: {} of text", fmt::join(texts, ", "), human_size(expected)));
  }
  std::string text;
  text.reserve(expected + kReadChunk);  // room for the read that finds the end
  for (const auto& name : texts) {
    const fs::path path = name;
    const size_t start = text.size();
    append_text(path, text, budget, status);
    const std::string_view part = std::string_view(text).substr(start);
    if (o.tokenizer == "char") {
      try {
        // validates without a copy of the text
        Tokenizer::chars_of(
            part, status.step("checking the UTF-8 of " + printable(path.filename().string()),
                              part.size(), true));
      } catch (const Error& e) {
        if (e.kind() != ErrorKind::usage) throw;
        refuse(fmt::format("{}: {} (--tokenizer char needs UTF-8 text)", name, e.what()));
      }
    }
    s.sources.push_back({fs::absolute(path).lexically_normal(), part.size()});
  }
  s.bytes = text.size();
  if (text.empty()) refuse(fmt::format("no text in {}", fmt::join(texts, ", ")));

  const Tokenizer tokenizer =
      o.tokenizer == "char"
          ? Tokenizer::chars_of(text, status.step("listing the characters", text.size(), true))
          : Tokenizer::byte();
  const std::vector<int32_t> tokens =
      tokenizer.encode(text, status.step("tokenizing", text.size(), true));
  std::string().swap(text);  // the tokens hold it now; its memory is better used for writing
  s.tokenizer = tokenizer.type();
  s.tokenizer_checksum = tokenizer.checksum();
  s.vocab = tokenizer.vocab();
  s.dtype_bytes = resolve_dtype(o.dtype, s.vocab, s.tokenizer);
  s.tokens = static_cast<int64_t>(tokens.size());
  s.val_tokens = static_cast<int64_t>(std::llround(o.val_fraction * static_cast<double>(s.tokens)));
  s.train_tokens = s.tokens - s.val_tokens;
  if (s.train_tokens < 2 || (o.val_fraction > 0 && s.val_tokens < 2)) {
    refuse(
        fmt::format("--val-fraction {} of {} tokens leaves {} for training and {} for "
                    "validation; each needs at least 2 (give more text{})",
                    o.val_fraction, s.tokens, s.train_tokens, s.val_tokens,
                    o.val_fraction > 0 ? ", or --val-fraction 0 for no validation" : ""));
  }
  write_dataset(s, tokenizer, tokens, o.val_fraction, o.force, status);
  status.erase();
  print_summary(s, o.json);
  return 0;
}

}  // namespace

void setup_data(CLI::App& app, Outcome& outcome) {
  app.require_subcommand(1);
  auto o = std::make_shared<PrepareOptions>();
  CLI::App* prepare = app.add_subcommand(
      "prepare", "Tokenize text files into a dataset directory (train.bin, val.bin, tokenizer)");
  prepare->add_option("--text", o->text, "Text files, concatenated in this order")
      ->type_name("FILE")
      ->check(handles_empty());
  prepare
      ->add_option("--out", o->out,
                   "Dataset directory to write (a recipe's data.path); must be new or empty")
      ->type_name("DATASET");
  prepare
      ->add_option("--tokenizer", o->tokenizer,
                   "byte: one id per byte (vocab 256); char: one id per distinct Unicode "
                   "character of the text (UTF-8)")
      ->type_name("byte|char")
      ->capture_default_str();
  prepare
      ->add_option("--val-fraction", o->val_fraction,
                   "Share of the tokens, at the end of the text, held out as val.bin; in [0, 1)")
      ->type_name("F")
      ->check(non_negative_number())
      ->capture_default_str();
  prepare
      ->add_option("--dtype", o->dtype,
                   "Token width on disk: auto (uint16 when the vocabulary fits 65536 ids), "
                   "uint16 or uint32")
      ->type_name("auto|uint16|uint32")
      ->capture_default_str();
  prepare->add_flag("--force", o->force, "Replace DATASET if it already holds a dataset");
  prepare->add_flag("--json", o->json, "Print one JSON object with the counts on stdout");
  prepare->callback([o, &outcome] {
    outcome.json = o->json;
    outcome.exit_code = run_prepare(*o, outcome.warnings);
  });
}

}  // namespace dptrain::cli
