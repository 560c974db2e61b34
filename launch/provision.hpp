// `dptrain provision`: gather facts about every host and install dptrain, the recipe, its data
// and extra files into a work directory there, all hosts at once.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "launch/hostfile.hpp"
#include "launch/ssh.hpp"

namespace dptrain {

struct ProvisionOptions {
  std::string workdir = kDefaultWorkdir;       // on every host; a leading "~/" is that host's home
  std::filesystem::path recipe;                // optional; a csv data file it names goes along
  std::vector<std::filesystem::path> uploads;  // extra files, into the workdir by their names
  std::filesystem::path binary;                // the dptrain to install; empty: this executable
  SshOptions ssh;
  // Told how each upload goes, from the hosts' threads (at once): the host, the file (its path
  // in the workdir), the bytes sent of it (0 as it starts) and its size. A file the host already
  // holds is told once, as all sent, without a start.
  std::function<void(const std::string& host, const std::string& file, uint64_t sent,
                     uint64_t size)>
      on_upload;
  // Told once, before any host is reached: the bytes of every file to every host, the most
  // the uploads send (what on_upload tells adds up to it for the hosts that get theirs).
  std::function<void(uint64_t bytes)> on_planned;
};

struct GpuFact {
  std::string name;
  std::string memory;  // as nvidia-smi prints it: "81559 MiB"
  std::string driver;
};

struct HostFacts {
  std::string hostname;
  std::string os;  // PRETTY_NAME from /etc/os-release
  int cpus = 0;
  uint64_t memory_bytes = 0;
  uint64_t disk_free_bytes = 0;  // in the workdir
  std::string workdir;           // absolute, on the host
  // Where a survey found the workdir not made yet (provision makes it): the directory above it
  // that is there; empty where the workdir is there.
  std::string workdir_base;
  std::vector<GpuFact> gpus;    // none is a fact, not an error
  std::string gpu_note;         // why there are none: "no nvidia-smi", "nvidia-smi failed: ..."
  std::string driver_version;   // of the first GPU; empty without one
  std::string dptrain_version;  // `WORKDIR/bin/dptrain --version` once provisioned
};

// One file provision puts on a host.
struct UploadRecord {
  enum class Status {
    pending,  // not reached: the host failed first
    uploaded,
    skipped,  // the host already had it (same sha256)
  };
  std::filesystem::path local;
  std::string remote;  // relative to the workdir: "bin/dptrain", "recipe.json", "data/x.csv"
  uint64_t bytes = 0;
  Status status = Status::pending;
  double seconds = 0;  // how long the upload took (uploaded only)
};

struct HostReport {
  HostSpec host;
  std::string error;     // empty when the host is provisioned; else one line naming the host
  bool stopped = false;  // the error is a stop signal's (SIGINT, SIGTERM), not the host's fault
  bool facts_known = false;
  HostFacts facts;
  std::vector<UploadRecord> uploads;
  bool ok() const { return error.empty(); }
};

// Where commands run and files go on one host: over SSH, or in this process for localhost.
class HostShell {
 public:
  virtual ~HostShell() = default;
  // sh command line; output captured; the SSH options' command timeout applies.
  virtual SshSession::Result run(const std::string& command) = 0;
  // `sent` (may be empty) is told the bytes sent so far as the upload goes.
  virtual void upload(const std::filesystem::path& local, const std::string& path, int mode,
                      const std::function<void(uint64_t sent)>& sent) = 0;
};
// Error(ssh) naming the host when it cannot be reached or authenticated.
std::unique_ptr<HostShell> open_host_shell(const HostSpec& host, const SshOptions& options);

// Facts about one host without uploading or creating anything: a workdir not there yet is judged
// by the directory above it that is (whether it takes writes, its free space). The installed
// dptrain's version is not read (version_command): a binary that hangs is a version problem, not
// the workdir's.
HostFacts survey_host(HostShell& shell, const HostSpec& host, const std::string& workdir);

// `BINARY --version --json` as a remote sh command line (`binary_word` already quoted for sh, as
// remote_path_word gives it) that gives up after version_probe_seconds(), with exit
// kVersionTimedOut, rather than hold the connection for the SSH command timeout: a binary that
// hangs as it starts is said to.
constexpr int kVersionTimedOut = 124;  // timeout(1)'s status
std::string version_command(const std::string& binary_word);
// The same for `BINARY ARGS` (`args` already quoted for sh): the probes doctor runs there.
std::string bounded_command(const std::string& binary_word, const std::string& args);
// 30, or DPTRAIN_TEST_VERSION_PROBE_S (tests).
int version_probe_seconds();

// Provisions every host in parallel and reports each, failures included. Throws only for
// problems with the local side, before any host is contacted (a missing file, a bad recipe).
// A HostSpec with is_local() is provisioned in this process, without SSH.
std::vector<HostReport> provision(const std::vector<HostSpec>& hosts,
                                  const ProvisionOptions& options);

// "uploaded", "skipped" or "pending".
const char* upload_status_name(UploadRecord::Status status);
// {"host", "ok", "error" (null when ok), "facts" (null when unknown), "uploads": [...]}
nlohmann::json to_json(const HostReport& report);

// Parsers of what the facts script prints (exposed for tests).
HostFacts parse_facts(const std::string& output);
// What `dptrain --version --json` printed over SSH as `dptrain --version` says it: "dptrain X.Y.Z"
// from its JSON line, or the last line of the output that starts so (a build or program that
// answers with the line alone); a login shell's start-up files may print a banner before either.
// The trimmed output where no line does.
std::string version_line(const std::string& output);
// The agent protocol (kAgentProtocol) that output says the binary speaks: its JSON line's
// "agent_protocol"; 1 for a build from before it was said (a JSON line without one, or the
// "dptrain X" line alone of a build from before --version --json); 0 where the output is
// neither (not known).
int agent_protocol_of(const std::string& output);
// The dynamic loader's complaint in a program's output ("error while loading shared libraries:
// libgloo.so.0: cannot open shared object file: ..."), from that phrase on, wherever it is among
// the lines (a login banner may come first); empty when there is none.
std::string loader_failure(const std::string& output);
// Lines of `nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader`.
std::vector<GpuFact> parse_gpus(const std::string& csv);

// "1.5 GiB", "512 KiB", "17 B".
std::string human_bytes(uint64_t bytes);
// The sha256 of a local file as 64 lower-case hex digits; Error(io) naming it when unreadable.
std::string sha256_file(const std::filesystem::path& path);

}  // namespace dptrain
