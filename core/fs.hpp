// Durable file helpers: whole-file reads, atomic writes (temp + fsync + rename + fsync dir).
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>

namespace dptrain {

// Reads a whole file; Error(io) "PATH: cannot read: reason".
std::string read_file(const std::filesystem::path& path);
// Reads a file a piece at a time (at most 8 MiB each), handing each to `piece` in order, so that
// a file of any size is read in little memory. Returns the bytes read; errors as read_file's.
uint64_t read_file_pieces(const std::filesystem::path& path,
                          const std::function<void(const char*, size_t)>& piece);
// Where a stop signal is recorded (the commands' handlers, launch/supervisor.cpp, install it):
// the pending stop's signal, 0 for none. Reads that can wait for ever look at it between waits.
void set_stop_check(int (*pending_stop)());
// Opens `path` for reading and reads at most `limit` bytes of it (more: `too_long` is set and
// the rest is left). From a pipe (a FIFO someone has yet to open or write) it waits in slices of
// at most 100 ms, and ends with errno EINTR once a stop is pending (set_stop_check), even one
// that came before the wait began. A failure is reported as errno, -1 returned; else 0.
int read_stoppable(const std::filesystem::path& path, size_t limit, std::string& out,
                   bool& too_long);
// Writes to a temporary name beside `path`, fsyncs it, renames over `path`, fsyncs the directory.
// A crash leaves either the old file or the new one, never a torn file.
void write_file_atomic(const std::filesystem::path& path, std::string_view content);
// The PID in a temporary's name `PREFIXPID` (write_file_atomic's "NAME.tmp-PID"), or 0 when
// `entry` is not PREFIX followed by digits alone.
long temporary_pid(std::string_view entry, std::string_view prefix);
// Whether process `pid` runs on this machine (this one, or another's it may not signal); a
// zombie, which has exited, does not.
bool process_alive(long pid);
// The CPUs online on this machine; 0 where that is unknown.
int online_cpus();
// Writes a new file (truncating) and fsyncs it; for files inside a directory that is renamed later.
void write_file_synced(const std::filesystem::path& path, std::span<const std::byte> content);
// Appends one line and flushes it to the OS (not fsynced: metrics may lose the last lines in a
// crash). check_regular_or_missing first.
void append_line(const std::filesystem::path& path, std::string_view line);
// What a file that is not a regular one is, for messages: "a pipe", "a directory", "a socket",
// "a device", "a symbolic link" (of a symlink_status); nullptr for a regular file or none.
const char* non_regular_kind(const std::filesystem::file_status& status);
// Error(io) "PATH: is a pipe, not a regular file: ..." when `path` is a pipe, a device or a
// directory: a file of the run that dptrain reads or appends to, where a pipe with no other end
// would block the process for good.
void check_regular_or_missing(const std::filesystem::path& path);
void fsync_directory(const std::filesystem::path& dir);

// Error(usage) "FLAG GIVEN: ..." when write_file_atomic could not write the file an option
// names, found before the work that makes it: a directory, a directory that does not exist, or
// an entry that is not a regular file (a link would be replaced itself, not written through; a
// device or a pipe, /dev/null included, by a regular file). `what` names the file in the
// directory's message ("the HTML file").
void check_output_file(const std::string& flag, const std::string& given, std::string_view what);
// Error(usage) "FLAG GIVEN: holds something else than OWN_KIND ..." for a file there already that
// is not empty and does not start with `own_start` (what the command writes there: "<svg"), or
// that cannot be read to tell: never replaced (a recipe or a dataset, given by a slip). Checked
// after the checks of where the file lies, whose messages say more.
void check_replaceable(const std::string& flag, const std::string& given,
                       std::string_view own_start, std::string_view own_kind);
// The nearest of `path`'s parents that exists, when it is not a directory (a file where a
// directory of the path should be); none otherwise.
std::optional<std::filesystem::path> file_in_the_way(const std::filesystem::path& path);

// Bytes of the regular files under dir, recursively; unreadable entries count as 0.
uint64_t size_on_disk(const std::filesystem::path& dir);

// The first name, in sorted order, of an entry of `dir` that `ours` does not claim (a file of
// the user's where only dptrain's may be); none when `ours` claims every one. Error(usage)
// naming `dir` when it cannot be listed.
std::optional<std::string> unclaimed_entry(
    const std::filesystem::path& dir,
    const std::function<bool(const std::filesystem::directory_entry&)>& ours);

// Error(usage) when `needed` more descriptors than this process holds open now would pass its
// limit on open files (RLIMIT_NOFILE, as main raised it to the hard limit): "WHAT need(s) about N
// open files here, ..." with the limit and how to raise it. Found before the work that opens
// them, not as "Too many open files" from whichever open comes last.
// `instead` is the other way out than raising the limit.
void require_open_files(uint64_t needed, const std::string& what,
                        const std::string& instead = "run fewer ranks on this machine");

// "512 B", "3.4 MiB", "1.2 GiB": binary units, one decimal above bytes.
std::string human_size(uint64_t bytes);

// " (the current directory no longer exists)" when `path` is relative and the process's current
// directory has been deleted (what an ENOENT for a relative path then means); "" otherwise.
std::string cwd_gone_note(const std::filesystem::path& path);

// `path` made absolute as the kernel resolves it: symbolic links in the part that exists are
// followed before ".." applies ("link/../x" is the x beside the link's target, not beside the
// link), and the rest is normalised, without a trailing separator ("runs/x/." is runs/x). The
// lexical form when that fails (a permission).
std::filesystem::path resolved_path(const std::filesystem::path& path);
// `path` absolute, its directory resolved as resolved_path does ("link/../x" as the kernel
// reads it) and its last name kept as given (a link named stays that link), without a trailing
// separator or ".".
std::filesystem::path named_path(const std::filesystem::path& path);

// This user's home directory: $HOME, else the password database's, else "/".
std::filesystem::path home_directory();
// "~" and "~/x" under home_directory(); anything else ("~user/x" too) unchanged.
std::filesystem::path expand_home(const std::string& path);

// A new, empty directory under the system temp folder named STEM-XXXXXX (mkdtemp: mode 0700, a
// name no other process holds, never one a killed process left behind with the same pid).
// Error(io) naming the folder when it cannot be made.
std::filesystem::path make_temp_directory(const std::string& stem);

}  // namespace dptrain
