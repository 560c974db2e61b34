// Integration-test helpers: run the real dptrain binary, temp dirs, files, processes.
#include "tests/harness.hpp"

#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <pty.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <thread>

extern char** environ;

namespace dptrain::test {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

// The build's paths, unless the environment names others (a prebuilt bundle run on another
// machine: tests/gpu/run.sh).
std::string binary() {
  const char* other = std::getenv("DPTRAIN_TEST_BINARY");
  return other != nullptr && *other != '\0' ? other : DPTRAIN_BINARY;
}
fs::path source_dir() {
  const char* other = std::getenv("DPTRAIN_TEST_SOURCE_DIR");
  return other != nullptr && *other != '\0' ? other : DPTRAIN_SOURCE_DIR;
}

namespace {

// dptrain's argv and environment (this process's, with `env` on top), as execve takes them.
struct ExecArgs {
  std::vector<std::string> argv_s, env_s;
  std::vector<char*> argv, envp;
  ExecArgs(const std::vector<std::string>& args, const Env& env) {
    argv_s = {binary()};
    argv_s.insert(argv_s.end(), args.begin(), args.end());
    for (char** e = environ; *e; ++e) {
      const std::string entry(*e);
      if (!env.count(entry.substr(0, entry.find('=')))) env_s.push_back(entry);
    }
    for (const auto& [k, v] : env)
      env_s.push_back(k + "=" + v);
    for (auto& a : argv_s)
      argv.push_back(a.data());
    argv.push_back(nullptr);
    for (auto& e : env_s)
      envp.push_back(e.data());
    envp.push_back(nullptr);
  }
};

pid_t spawn(const std::vector<std::string>& args, const Env& env, const fs::path& out,
            const fs::path& err, StartWith start = StartWith::nothing) {
  ExecArgs exec(args, env);
  sigset_t term;
  sigemptyset(&term);
  sigaddset(&term, SIGTERM);
  const pid_t pid = ::fork();
  if (pid == 0) {
    if (start == StartWith::pending_sigterm) {
      ::sigprocmask(SIG_BLOCK, &term, nullptr);
      ::kill(::getpid(), SIGTERM);  // pending until the program unblocks it
    }
    // The test runner's own dispositions (a script's `ctest &` ignores SIGINT) are not the
    // command's: each starts with the defaults unless a test asks otherwise.
    ::signal(SIGINT, start == StartWith::sigint_ignored ? SIG_IGN : SIG_DFL);
    ::signal(SIGCHLD, start == StartWith::sigchld_ignored ? SIG_IGN : SIG_DFL);
    const int o = ::open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    const int e = ::open(err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    const int in = ::open("/dev/null", O_RDONLY);
    ::dup2(o, 1);
    ::dup2(e, 2);
    ::dup2(in, 0);
    ::execve(exec.argv[0], exec.argv.data(), exec.envp.data());
    ::_exit(127);
  }
  if (pid < 0) throw std::runtime_error("fork failed");
  return pid;
}

int decode(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return -1;
}

}  // namespace

Background::Background(const std::vector<std::string>& args, const Env& env, StartWith start)
    : out_file_(TempDir::unique_path("dptrain-out")),
      err_file_(TempDir::unique_path("dptrain-err")) {
  pid_ = spawn(args, env, out_file_, err_file_, start);
}

Background::~Background() {
  if (!reaped_ && pid_ > 0) {
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
  }
  std::error_code ec;
  fs::remove(out_file_, ec);
  fs::remove(err_file_, ec);
}

int Background::wait(std::chrono::seconds timeout) {
  if (reaped_) return status_;
  const auto deadline = Clock::now() + timeout;
  for (;;) {
    int status = 0;
    if (::waitpid(pid_, &status, WNOHANG) == pid_) {
      reaped_ = true;
      status_ = decode(status);
      return status_;
    }
    if (Clock::now() > deadline) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
      reaped_ = true;
      status_ = -1;
      return -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

std::string Background::out() const {
  return read_text(out_file_);
}
std::string Background::err() const {
  return read_text(err_file_);
}

CommandResult run_dptrain(const std::vector<std::string>& args, const Env& env,
                          std::chrono::seconds timeout) {
  const auto t0 = Clock::now();
  Background p(args, env);
  CommandResult r;
  r.exit_code = p.wait(timeout);
  r.out = p.out();
  r.err = p.err();
  r.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  return r;
}

CommandResult run_dptrain_on_terminal(const std::vector<std::string>& args, const Env& given,
                                      std::chrono::seconds timeout, int columns) {
  const auto t0 = Clock::now();
  // A terminal that moves the cursor, whatever this environment's TERM (unless the test gives
  // one).
  Env env = given;
  env.emplace("TERM", "xterm");
  ExecArgs exec(args, env);
  winsize size{};
  size.ws_row = 40;
  size.ws_col = static_cast<unsigned short>(columns);
  int terminal = -1;
  const pid_t pid = ::forkpty(&terminal, nullptr, nullptr, &size);
  if (pid == 0) {
    ::signal(SIGINT, SIG_DFL);  // as spawn: not the test runner's dispositions
    ::signal(SIGCHLD, SIG_DFL);
    ::execve(exec.argv[0], exec.argv.data(), exec.envp.data());
    ::_exit(127);
  }
  if (pid < 0) throw std::runtime_error("forkpty failed");
  CommandResult r;
  const auto deadline = t0 + timeout;
  for (;;) {
    pollfd p{terminal, POLLIN, 0};
    if (::poll(&p, 1, 100) > 0) {
      char buffer[4096];
      const ssize_t n = ::read(terminal, buffer, sizeof buffer);
      if (n <= 0) break;  // EIO once every holder of the terminal's other side has closed it
      r.out.append(buffer, static_cast<size_t>(n));
    }
    if (Clock::now() > deadline) {
      ::kill(pid, SIGKILL);
      break;
    }
  }
  ::close(terminal);
  int status = 0;
  ::waitpid(pid, &status, 0);
  r.exit_code = Clock::now() > deadline ? -1 : decode(status);
  r.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  return r;
}

void write_text(const fs::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
  if (!out) throw std::runtime_error("cannot write " + path.string());
}

void write_script(const fs::path& path, const std::string& text) {
  write_text(path, text);
  fs::permissions(path, fs::perms::owner_all | fs::perms::group_read | fs::perms::group_exec |
                            fs::perms::others_read | fs::perms::others_exec);
}

std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::vector<float> read_floats(const fs::path& path) {
  const std::string raw = read_text(path);
  std::vector<float> out(raw.size() / sizeof(float));
  std::memcpy(out.data(), raw.data(), out.size() * sizeof(float));
  return out;
}

fs::path write_recipe(const fs::path& dir, const nlohmann::json& recipe, const std::string& name) {
  const fs::path path = dir / name;
  write_text(path, recipe.dump(2));
  return path;
}

nlohmann::json small_recipe() {
  return nlohmann::json::parse(R"({
    "name": "small", "seed": 7,
    "model": {"type": "mlp", "input": 32, "hidden": [48, 24], "classes": 5},
    "data": {"type": "synthetic-classification", "samples": 4000, "noise": 1.0},
    "train": {"steps": 60, "batch_per_rank": 16},
    "optimizer": {"type": "adamw", "lr": 0.003, "weight_decay": 0.01,
                  "schedule": {"type": "cosine", "warmup": 5}, "clip_grad_norm": 1.0},
    "distributed": {"check_every": 10, "timeout_s": 60},
    "checkpoint": {"every": 20, "keep": 3},
    "eval": {"every": 30},
    "log": {"every": 5}
  })");
}

nlohmann::json resumable_recipe() {
  auto r = small_recipe();
  r["train"]["steps"] = 120;
  r["checkpoint"] = {{"every", 20}, {"keep", 3}};
  return r;
}

nlohmann::json gpt_recipe(const fs::path& dataset, int layers, int width, int64_t vocab) {
  nlohmann::json r = nlohmann::json::parse(read_text(source_dir() / "recipes/gpt-tiny.json"));
  r["data"]["path"] = dataset.string();
  if (layers > 0) {
    r["model"] = {{"type", "gpt"},    {"vocab", vocab}, {"context", 16},
                  {"layers", layers}, {"heads", 2},     {"width", width}};
  }
  return r;
}

fs::path latest_params(const fs::path& run_dir) {
  const std::string latest = read_text(run_dir / "checkpoints/latest");
  return run_dir / "checkpoints" / latest.substr(0, latest.find('\n')) / "params.bin";
}

nlohmann::json parse_json(const std::string& text) {
  return nlohmann::json::parse(text);
}

std::vector<nlohmann::json> read_jsonl(const fs::path& path) {
  std::vector<nlohmann::json> out;
  std::istringstream in(read_text(path));
  for (std::string line; std::getline(in, line);) {
    if (!line.empty()) out.push_back(nlohmann::json::parse(line));
  }
  return out;
}

std::string last_event_message(const fs::path& events, const std::string& event) {
  std::string message;
  for (const auto& e : read_jsonl(events)) {
    if (e.value("event", "") == event) message = e.value("message", "");
  }
  return message;
}

bool eventually(const std::function<bool()>& condition, std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  while (Clock::now() < deadline) {
    if (condition()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return condition();
}

bool catches_signal(pid_t pid, int sig) {
  std::ifstream status("/proc/" + std::to_string(pid) + "/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("Name:", 0) == 0 && line.find("dptrain") == std::string::npos) return false;
    if (line.rfind("SigCgt:", 0) == 0) {
      return (std::stoull(line.substr(7), nullptr, 16) >> (sig - 1) & 1) == 1;
    }
  }
  return false;
}

pid_t gone_pid() {
  const pid_t gone = ::fork();
  if (gone == 0) ::_exit(0);
  if (gone < 0 || ::waitpid(gone, nullptr, 0) != gone) throw std::runtime_error("fork failed");
  return gone;
}

bool process_alive(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  if (!stat) return false;
  std::string content;
  std::getline(stat, content);
  const auto close = content.rfind(')');
  return close != std::string::npos && content.size() > close + 2 && content[close + 2] != 'Z';
}

std::vector<pid_t> worker_pids(const fs::path& run_dir) {
  std::vector<pid_t> pids;
  const auto text = read_text(run_dir / "run.json");
  const auto info = nlohmann::json::parse(text, nullptr, false);
  if (info.is_discarded() || !info.contains("generations") || info["generations"].empty()) {
    return pids;
  }
  const auto& gen = info["generations"].back();
  if (gen.contains("pids")) pids = gen["pids"].get<std::vector<pid_t>>();
  return pids;
}

HeldPort::HeldPort(bool any) : fd_(::socket(AF_INET, SOCK_STREAM, 0)) {
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(any ? INADDR_ANY : INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  if (fd_ < 0 || ::bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
      ::listen(fd_, 8) != 0 || ::getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    throw std::runtime_error(std::string("HeldPort: ") + std::strerror(errno));
  }
  port_ = ntohs(addr.sin_port);
}

HeldPort::~HeldPort() {
  if (fd_ >= 0) ::close(fd_);
}

}  // namespace dptrain::test
