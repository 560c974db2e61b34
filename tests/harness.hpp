// Integration-test helpers: run the real dptrain binary, temp dirs, files, processes.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tests/temp_dir.hpp"

namespace dptrain::test {

struct CommandResult {
  int exit_code = -1;  // 128 + signal when killed by one
  std::string out;
  std::string err;
  double seconds = 0;
};

using Env = std::map<std::string, std::string>;

std::string binary();                // the dptrain under test
std::filesystem::path source_dir();  // the repository

// Runs dptrain with args to completion (killed after `timeout`), capturing stdout and stderr.
CommandResult run_dptrain(const std::vector<std::string>& args, const Env& env = {},
                          std::chrono::seconds timeout = std::chrono::seconds(300));

// The same on a terminal of its own (a pseudo-terminal `columns` wide): what a person sees,
// stdout and stderr together in `out`, with the terminal's "\r\n" line ends.
CommandResult run_dptrain_on_terminal(const std::vector<std::string>& args, const Env& env = {},
                                      std::chrono::seconds timeout = std::chrono::seconds(300),
                                      int columns = 200);

// How a Background process starts: as usual, or as a launcher starts a rank (SIGTERM blocked
// across exec, ProcessSpec::hold_sigterm) with a SIGTERM already pending: a preemption that
// comes while the rank is still loading. Or ignoring SIGINT, as a shell script starts a job in
// the background ("dptrain ... &").
// Or with SIGCHLD ignored, as some parents (a CI harness) leave it.
enum class StartWith { nothing, pending_sigterm, sigint_ignored, sigchld_ignored };

// A dptrain process running in the background; output goes to files. Killed on destruction.
class Background {
 public:
  Background(const std::vector<std::string>& args, const Env& env = {},
             StartWith start = StartWith::nothing);
  ~Background();
  Background(const Background&) = delete;
  Background& operator=(const Background&) = delete;
  pid_t pid() const { return pid_; }
  // Waits for exit (up to timeout; then SIGKILL and returns -1). Exit code or 128 + signal.
  int wait(std::chrono::seconds timeout = std::chrono::seconds(300));
  std::string out() const;
  std::string err() const;

 private:
  pid_t pid_ = -1;
  bool reaped_ = false;
  int status_ = -1;
  std::filesystem::path out_file_, err_file_;
};

void write_text(const std::filesystem::path& path, const std::string& text);
// write_text, then mode 0755: a script a test hands dptrain to run (as a host's binary, say).
void write_script(const std::filesystem::path& path, const std::string& text);
std::string read_text(const std::filesystem::path& path);
std::vector<float> read_floats(const std::filesystem::path& path);
// Writes `recipe` as JSON into dir/name and returns the path.
std::filesystem::path write_recipe(const std::filesystem::path& dir, const nlohmann::json& recipe,
                                   const std::string& name = "recipe.json");
// A small, quick MLP recipe on synthetic data; tests patch what they need.
nlohmann::json small_recipe();
// small_recipe() made long enough to crash and resume in: 120 steps, a checkpoint every 20.
nlohmann::json resumable_recipe();
// recipes/gpt-tiny.json on the token dataset at `dataset`; with `layers` > 0 its model shrunk to
// a GPT that trains in seconds: context 16, 2 heads, `layers` blocks of `width` (vocab `vocab`).
nlohmann::json gpt_recipe(const std::filesystem::path& dataset, int layers = 0, int width = 32,
                          int64_t vocab = 256);
// params.bin of the checkpoint `latest` names in run_dir.
std::filesystem::path latest_params(const std::filesystem::path& run_dir);
nlohmann::json parse_json(const std::string& text);
std::vector<nlohmann::json> read_jsonl(const std::filesystem::path& path);
// The "message" of the last `event` in an --events file; empty when there is none.
std::string last_event_message(const std::filesystem::path& events, const std::string& event);

// Polls `condition` every 20 ms until true or timeout; returns whether it became true.
bool eventually(const std::function<bool()>& condition,
                std::chrono::milliseconds timeout = std::chrono::seconds(60));
bool process_alive(pid_t pid);  // exists and is not a zombie
// The pid of a child that has exited and been reaped: a process killed before it could clean up.
pid_t gone_pid();
// Whether `pid` is dptrain itself (not the test's fork before its exec) and has a handler for
// `sig` in place (its SigCgt mask in /proc): a signal sent then reaches the command's own code.
bool catches_signal(pid_t pid, int sig);
// Worker pids of the newest generation recorded in run_dir/run.json.
std::vector<pid_t> worker_pids(const std::filesystem::path& run_dir);

// A TCP port held by a socket that listens and never accepts (the kernel completes connections
// into its backlog): a port another program cannot listen on, or a server that never says a
// word. `any`: on every address, else on 127.0.0.1. Closed when destroyed.
class HeldPort {
 public:
  explicit HeldPort(bool any);
  ~HeldPort();
  HeldPort(const HeldPort&) = delete;
  HeldPort& operator=(const HeldPort&) = delete;
  uint16_t port() const { return port_; }

 private:
  int fd_ = -1;
  uint16_t port_ = 0;
};

}  // namespace dptrain::test
