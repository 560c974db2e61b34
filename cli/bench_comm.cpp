// `dptrain bench comm`: collective bandwidth in nccl-tests' format, on ranks launched like a job.
// The launcher side parses the flags, starts the ranks through run_job, and prints the table (or
// JSON) from rank 0's result; each rank runs `dptrain bench comm --worker OPTIONS`, over Gloo on
// host memory or over NCCL on its GPU's memory.
#include <algorithm>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "cli/commands.hpp"
#include "cli/env.hpp"
#include "cli/host_options.hpp"
#include "cli/json_errors.hpp"
#include "cli/run_report.hpp"
#include "core/bench/comm_bench.hpp"
#include "core/comm/auth.hpp"
#include "core/comm/gloo_communicator.hpp"
#include "core/comm/nccl_communicator.hpp"
#include "core/comm/net.hpp"
#include "core/comm/tcp_store.hpp"
#include "core/error.hpp"
#include "core/fault.hpp"
#include "core/fs.hpp"
#include "core/heartbeat.hpp"
#include "core/json_error.hpp"
#include "core/tensor/device.hpp"
#include "core/tensor/ops.hpp"
#include "launch/job.hpp"
#include "launch/run_dir.hpp"
#include "launch/status.hpp"
#include "launch/supervisor.hpp"

namespace dptrain::cli {

namespace {

using nlohmann::json;

struct BenchCommOptions {
  std::string op = "allreduce";
  std::string backend = "gloo";
  int nproc = 1;
  CLI::Option* nproc_flag = nullptr;  // given or not
  HostOptions hosts;
  RemoteJobOptions remote;
  std::string min_bytes = "8";
  std::string max_bytes = "64M";
  int64_t step_factor = 2;
  std::string dtype = "float";
  std::string redop = "sum";
  int root = 0;
  int warmup = 5;
  int iters = 20;
  double min_busbw = 0;
  CLI::Option* min_busbw_flag = nullptr;  // given or not
  double timeout_s = 60;
  std::string run_dir;
  std::string runs_root = "runs";
  bool json = false;
  std::string worker;  // set in a rank: the options the launcher serialized
};

CommBenchOptions bench_options(const BenchCommOptions& o) {
  CommBenchOptions b;
  b.ops = parse_collectives(o.op, "-o/--op");
  b.min_bytes = parse_size(o.min_bytes, "-b/--minbytes");
  b.max_bytes = parse_size(o.max_bytes, "-e/--maxbytes");
  b.step_factor = static_cast<uint64_t>(o.step_factor);
  b.dtype = parse_dtype(o.dtype, "-d/--dtype");
  b.redop = parse_reduce_op(o.redop, "--redop");
  b.root = o.root;
  b.warmup = o.warmup;
  b.iters = o.iters;
  return b;
}

// Local Gloo ranks hold the largest size in host memory: for an allgather (size: the gathered
// output) the output and a 1/ranks input; for a reduce-scatter (size: the input) the input, the
// copy of it that is all-reduced and a 1/ranks output; for the others the buffer and as much
// again for Gloo's scratch. A size that cannot fit is refused up front, not left to fail every
// rank with an allocation error (or the machine's OOM killer to end them).
void check_local_memory(const CommBenchOptions& options, int ranks) {
  const uint64_t available = available_memory();
  if (available == 0) return;
  // The largest need of the collectives asked for, in sizes.
  const long double part = 1.0L / static_cast<long double>(ranks);
  long double sizes = 0;
  for (const Collective op : options.ops) {
    sizes = std::max(sizes, op == Collective::allgather        ? 1.0L + part
                            : op == Collective::reduce_scatter ? 2.0L + part
                                                               : 2.0L);
  }
  const long double per_rank = static_cast<long double>(options.max_bytes) * sizes;
  const long double needed = per_rank * static_cast<long double>(ranks);
  if (needed > static_cast<long double>(available)) {
    throw Error(ErrorKind::usage,
                fmt::format("-e/--maxbytes: {} bytes would take about {:.1f} GiB on {} local "
                            "rank(s); this machine has {:.1f} GiB available",
                            options.max_bytes, static_cast<double>(needed / (1ULL << 30)), ranks,
                            static_cast<double>(available) / (1ULL << 30)));
  }
}

void check_backend(const std::string& backend) {
  if (backend == "gloo" || backend == "nccl") return;
  throw Error(ErrorKind::usage,
              fmt::format("--backend: unknown backend '{}' (use gloo or nccl)", backend));
}

// With local ranks only, NCCL is checked here, before anything starts: one line naming why it
// cannot be used, rather than every rank failing with it; exit 1, as launch and bench train
// refuse local ranks that need a GPU this machine lacks. (Remote hosts check in their ranks.)
void check_local_nccl(int local_ranks) {
  if (const auto reason = nccl_unavailable_reason()) {
    throw Error(ErrorKind::cuda, fmt::format("--backend nccl: NCCL cannot be used: {}", *reason));
  }
  const int devices = cuda_device_count();
  if (local_ranks > devices) {
    throw Error(ErrorKind::cuda,
                fmt::format("--backend nccl: {} local ranks need a CUDA device each, {} {} visible",
                            local_ranks, devices, devices == 1 ? "is" : "are"));
  }
}

// The ranks' exit, as the error kind main maps back to the same exit code.
ErrorKind failure_kind(int exit_code) {
  switch (exit_code) {
    case 3:
    case 5:  // a rank's own exit 5 (a job's checkpoint code): this benchmark writes none
      return ErrorKind::rank_failed;
    case 4:
      return ErrorKind::ssh;
    case 130:
      return ErrorKind::interrupted;
    case 143:
      return ErrorKind::terminated;
    default:
      return ErrorKind::internal;
  }
}

// One line per collective whose data check failed.
std::vector<std::string> wrong_data_lines(const CommBenchResult& result) {
  std::vector<std::string> lines;
  for (Collective op : result.options.ops) {
    uint64_t wrong = 0;
    std::string sizes;
    for (const auto& row : result.rows) {
      if (row.op != op || row.wrong == 0) continue;
      wrong += row.wrong;
      sizes += fmt::format("{}{}", sizes.empty() ? "" : ", ", row.size);
    }
    if (wrong > 0) {
      lines.push_back(fmt::format("{}: {} wrong element(s) in the data check (sizes {} bytes)",
                                  collective_name(op), wrong, sizes));
    }
  }
  return lines;
}

// A benchmark that ended before its result (stopped, a rank that failed or hung): the sizes
// measured before the end are kept (table.txt, and result.json with "partial": true) and
// printed, then the error; with --json, one object with them, the run directory, the warnings
// and notes said (`warnings`, `notes`) and the failure's fields.
int report_unfinished(const BenchCommOptions& o, RunDirectory& run, const CommBenchResult& partial,
                      const JobOutcome& outcome, std::vector<std::string> warnings,
                      const std::vector<std::string>& notes) {
  // As main ends a failed command: a stop signal that came meanwhile is the exit.
  const ErrorKind kind = kind_after_stop(failure_kind(outcome.exit_code));
  const int code = exit_code(kind);
  json j = {{"status", run_failure_status(kind)}, {"benchmark", "comm"}};
  std::string table;
  if (!partial.rows.empty()) {
    // Only the collectives it reached: one not begun has no figures, not zero ones.
    CommBenchResult measured = partial;
    std::erase_if(measured.options.ops, [&](Collective op) {
      return std::none_of(partial.rows.begin(), partial.rows.end(),
                          [op](const CommBenchRow& row) { return row.op == op; });
    });
    j.update(measured.to_json());
    j["partial"] = true;
    table = format_comm_table(measured) +
            fmt::format("# Partial: {} of {} measurements before the end (see the error)\n",
                        partial.rows.size(), partial.options.measurements());
  }
  j["run_dir"] = run.path().string();
  add_failure(j, code, outcome.error);
  if (!partial.rows.empty()) {
    // Kept where it can be: a full disk must not hide the benchmark's own end.
    try {
      write_file_atomic(run.path() / "table.txt", table);
      write_file_atomic(run.path() / "result.json", json_text(j, 2) + "\n");
      // Also under result in run.json, as a finished one's: status and report show the figures,
      // saying they are partial.
      run.info()["result"] = j;
      run.save();
    } catch (const Error& e) {
      warnings.push_back(fmt::format("{} (the partial result is not kept)", e.what()));
      std::fprintf(stderr, "dptrain: warning: %s\n", warnings.back().c_str());
    }
  }
  j["warnings"] = warnings;
  j["notes"] = notes;
  if (o.json) {
    std::printf("%s\n", json_text(j).c_str());
  } else {
    std::fputs(table.c_str(), stdout);
  }
  std::fflush(stdout);
  print_error_lines(outcome.error);
  return code;
}

int run_bench_launcher(const BenchCommOptions& o) {
  install_stop_signal_handlers();
  // Every flag is checked before anything is created.
  check_backend(o.backend);
  const CommBenchOptions options = bench_options(o);
  JobSpec spec;
  spec.recipe.name = "bench-comm";
  if (!o.hosts.hosts.empty()) {
    spec.hosts = o.hosts.load_for_job(o.nproc_flag->count() > 0);
    spec.world_size = total_slots(spec.hosts);
  } else {
    o.hosts.check_files();
    if (o.nproc < 1) {
      throw Error(ErrorKind::usage, fmt::format("--nproc: must be at least 1, got {}", o.nproc));
    }
    spec.world_size = o.nproc;
  }
  options.validate(spec.world_size, o.backend);
  if (o.min_busbw_flag->count() > 0 && o.min_busbw > 0 && spec.world_size == 1) {
    // One rank moves nothing between ranks: every busbw is 0.
    throw Error(ErrorKind::usage,
                "--min-busbw: with 1 rank no collective moves data between ranks (busbw is 0): "
                "use 2 or more ranks, or leave out --min-busbw");
  }
  if (o.min_busbw_flag->count() > 0 && o.min_busbw > 0) {
    // The threshold is judged at each collective's largest size: one that rounds down to no
    // data (whole elements on every rank) leaves nothing to judge. (0 never fails: allowed, as
    // with one rank.)
    const uint64_t largest = options.sizes().back();
    for (Collective op : options.ops) {
      if (collective_shape(op, largest, dtype_size(options.dtype), spec.world_size).bytes > 0) {
        continue;
      }
      throw Error(ErrorKind::usage,
                  fmt::format("--min-busbw: {} moves no data at its largest size, {} bytes, on {} "
                              "ranks (each rank's part rounds down to whole elements): raise "
                              "-e/--maxbytes",
                              collective_name(op), largest, spec.world_size));
    }
  }
  if (o.hosts.hosts.empty() && o.backend == "gloo") check_local_memory(options, spec.world_size);
  if (o.backend == "nccl" && o.hosts.hosts.empty()) check_local_nccl(spec.world_size);
  spec.nominal_world = spec.world_size;
  spec.remote = o.remote.get(o.hosts);
  spec.env = o.remote.rank_env();
  spec.backend = o.backend;
  // NCCL ranks get one GPU each: the agent narrows CUDA_VISIBLE_DEVICES to local rank r's device.
  spec.one_gpu_per_rank = o.backend == "nccl";
  spec.worker_binary = self_executable();
  json worker = options.to_json();
  worker["timeout_s"] = o.timeout_s;
  worker["backend"] = o.backend;
  spec.worker_args = {"bench", "comm", "--worker", json_text(worker)};
  const int hosts = spec.hosts.empty() ? 1 : static_cast<int>(spec.hosts.size());

  check_hosts_resolve(spec);  // a host name that does not resolve: exit 4, nothing created
  check_store_port(spec);     // a --master-port another process holds: exit 2
  // One that does not parse: exit 2, nothing created. A rank's steps are its measurements.
  const auto fault_warnings =
      check_benchmark_fault_injection(spec, static_cast<int64_t>(options.measurements()));
  RunDirectory run = RunDirectory::create(o.run_dir, o.runs_root, "bench-comm");
  run.info()["benchmark"] = worker;
  // Its ranks write no checkpoints: no empty checkpoints/ beside logs/ (removed only if empty).
  std::error_code no_checkpoints;
  std::filesystem::remove(run.path() / "checkpoints", no_checkpoints);
  // stdout carries only the table or the JSON; progress and rank output go to stderr.
  StatusPrinter status(stderr, StatusPrinter::is_terminal(stderr));
  status.line(fmt::format(
      "dptrain bench comm: {} rank(s) on {}, run directory {}", spec.world_size,
      spec.hosts.empty() ? std::string("this machine") : fmt::format("{} host(s)", hosts),
      printable(run.path().string())));
  for (const auto& warning : fault_warnings)
    status.warning(warning);
  // What the figures mean here, said on stderr and kept for --json's `notes`.
  std::vector<std::string> notes;
  const auto note = [&](std::string text) {
    status.line("bench comm: note: " + text);
    notes.push_back(std::move(text));
  };
  // One rank by default: a figure of 0 everywhere, which `-n 4` (nccl-tests' iterations, not a
  // rank count as in launch) would otherwise leave unexplained.
  if (spec.world_size == 1 && o.nproc_flag->count() == 0 && o.hosts.hosts.empty()) {
    note(
        "1 rank (--nproc's default): no collective moves data between ranks, so every busbw is "
        "0; give --nproc N for N ranks (-n is --iters, as in nccl-tests)");
  }
  // More local ranks than CPUs: each rank's share of the reductions and the copies waits for a
  // CPU, which the times then measure (as bench train says of its largest world).
  const int cpus = online_cpus();
  if (o.hosts.hosts.empty() && o.backend == "gloo" && cpus > 0 && spec.world_size > cpus) {
    note(fmt::format(
        "{} ranks exceed this machine's {} CPUs: the times measure CPU contention as well as "
        "communication",
        spec.world_size, cpus));
  }
  // Rank 0's rows as it measures them: what is kept of a benchmark that does not finish.
  CommBenchResult result;
  result.ranks = spec.world_size;
  result.hosts = hosts;
  result.backend = o.backend;
  result.options = options;
  spec.on_event = [&result](const json& event) {
    if (event.value("event", "") != "bench_progress" || !event.contains("row")) return;
    try {
      result.rows.push_back(row_from_json(event["row"]));
    } catch (const std::exception&) {
      // Another build's rank 0: its progress stays progress.
    }
  };
  const JobOutcome outcome = run_job(run, spec, status);
  // A benchmark cut short keeps its last progress line (where it stopped) above the partial
  // table; a finished one's is erased, as launch's is before its summary: the table says it all.
  if (outcome.exit_code != 0) {
    status.finish();
    return report_unfinished(o, run, result, outcome, status.warnings(), notes);
  }
  status.erase_progress();

  result = CommBenchResult::from_json(outcome.result);
  result.hosts = hosts;
  const std::string table = format_comm_table(result);
  write_file_atomic(run.path() / "table.txt", table);

  std::vector<std::string> errors = wrong_data_lines(result);
  int exit_code = errors.empty() ? 0 : 3;
  // "completed", as every run and benchmark that completed says it (dptrain(1)).
  std::string status_word = errors.empty() ? "completed" : "wrong_data";
  if (o.min_busbw_flag->count() > 0) {
    const auto shortfalls = busbw_shortfalls(result, o.min_busbw);
    errors.insert(errors.end(), shortfalls.begin(), shortfalls.end());
    if (exit_code == 0 && !shortfalls.empty()) {
      exit_code = 6;
      status_word = "below_threshold";
    }
  }
  json j = result.to_json();
  j["status"] = status_word;
  j["run_dir"] = run.path().string();
  if (o.min_busbw_flag->count() > 0) j["min_busbw"] = o.min_busbw;
  j["warnings"] = status.warnings();
  j["notes"] = notes;
  if (exit_code != 0) {
    add_failure(j, exit_code, errors);
  } else {
    add_success(j);
  }
  // Rank 0 does not know the hosts or the verdict: the run keeps the launcher's whole result.
  write_file_atomic(run.path() / "result.json", json_text(j, 2) + "\n");
  run.info()["result"] = j;
  if (exit_code != 0) {
    // The ranks completed, the benchmark did not: status and report say so, as the exit does.
    record_run_failure(run.info(), fmt::format("{}", fmt::join(errors, "\n")));
  }
  run.save();
  if (o.json) {
    std::printf("%s\n", json_text(j).c_str());
  } else {
    std::fputs(table.c_str(), stdout);
  }
  std::fflush(stdout);
  for (const auto& line : errors)
    std::fprintf(stderr, "dptrain: error: %s\n", line.c_str());
  return exit_code;
}

// A rank's identity: set by the launcher for `bench comm --worker`.
int rank_env_int(const char* name, std::optional<int> fallback = std::nullopt) {
  return env_int(name, fallback,
                 fmt::format("{} is not set (bench comm --worker runs as one rank of a job that "
                             "`dptrain bench comm` starts)",
                             name));
}

// One rank: the identity and store come from the environment the launcher sets, as for
// `dptrain worker`.
int run_bench_worker(const std::string& serialized) {
  // A peer that dies mid-collective must surface as a comm error, not as SIGPIPE.
  std::signal(SIGPIPE, SIG_IGN);
  const json j = json::parse(serialized, nullptr, false);
  if (j.is_discarded() || !j.is_object()) {
    throw Error(ErrorKind::usage, "--worker: not a JSON object of bench comm options");
  }
  CommBenchOptions options = CommBenchOptions::from_json(j);
  options.corrupt_rank = env("DPTRAIN_BENCH_CORRUPT") ? rank_env_int("DPTRAIN_BENCH_CORRUPT")
                                                      : -1;  // tests of the check
  const auto timeout =
      std::chrono::milliseconds(static_cast<int64_t>(1000.0 * j.value("timeout_s", 60.0)));
  const int rank = rank_env_int("RANK");
  const int world = rank_env_int("WORLD_SIZE");
  const int generation = rank_env_int("DPTRAIN_GENERATION", 1);
  // Fault injection for tests (dptrain-worker(1)): a step is one measurement, a size of one
  // collective; a fault at step N fires once N measurements are done.
  const FaultInjector faults(parse_faults(env("DPTRAIN_FAULT").value_or("")), rank, generation);
  std::string store_addr = env("DPTRAIN_STORE").value_or("");
  if (store_addr.empty() && env("MASTER_ADDR") && env("MASTER_PORT")) {
    store_addr = *env("MASTER_ADDR") + ":" + *env("MASTER_PORT");
  }
  if (store_addr.empty()) {
    throw Error(ErrorKind::usage, "neither DPTRAIN_STORE nor MASTER_ADDR/MASTER_PORT is set");
  }
  const std::string backend = j.value("backend", "gloo");
  check_backend(backend);
  const bool events = rank == 0 && env("DPTRAIN_EVENTS").value_or("0") == "1";
  const auto emit = [](const json& event) {
    std::printf("@event %s\n", json_text(event).c_str());
    std::fflush(stdout);
  };
  const auto [host, port] = parse_host_port(store_addr);
  const std::string secret = env(kStoreSecretEnv).value_or("");
  faults.before_join();
  TcpStoreClient client(host, port, timeout, secret);
  PrefixStore store(generation_prefix(generation), client);
  store.set_join_advice(launched_join_advice("bench comm's --timeout"));
  std::shared_ptr<Ops> device;  // NCCL's buffers live on it; declared first, destroyed last
  std::unique_ptr<Communicator> comm;
  if (backend == "nccl") {
    NcclOptions nccl;
    nccl.timeout = timeout;
    // One GPU per rank: local rank r on device r, or device 0 when the launcher restricted the
    // rank to one (CUDA_VISIBLE_DEVICES). Where NCCL or the device is missing, the communicator
    // says so (and rank 0 tells the others at once).
    const int devices = cuda_device_count();
    const int local_rank = rank_env_int("LOCAL_RANK", rank);
    nccl.device = devices == 1 ? 0 : local_rank;
    if (!nccl_unavailable_reason() && nccl.device < devices) {
      device = make_ops("cuda", nccl.device);
      nccl.compute_stream = compute_stream(*device);
    }
    auto communicator = std::make_unique<NcclCommunicator>(store, rank, world, nccl);
    // Which NCCL the ranks loaded (the library path decides it), on the launcher's stderr.
    if (events) {
      emit({{"event", "info"}, {"message", "bench comm: " + communicator->describe()}});
    } else if (rank == 0) {
      std::fprintf(stderr, "bench comm: %s\n", communicator->describe().c_str());
    }
    comm = std::move(communicator);
  } else {
    GlooOptions gloo;
    gloo.hostname =
        env("DPTRAIN_BIND_ADDR")
            .value_or(is_loopback_host(host) ? "127.0.0.1" : local_address_towards(host, port));
    gloo.timeout = timeout;
    comm = make_gloo_communicator(store, rank, world, gloo);
  }
  // Where each rank is, so that a collective that times out names the rank it waited for.
  ProgressTracker progress;
  BeatStore beats(host, port, secret, generation, store);
  HeartbeatSender heartbeat(beats.store(), rank, progress, std::chrono::seconds(1));
  const auto flush = [&heartbeat] { heartbeat.flush(); };  // a fault sends it first
  const auto sizes = options.sizes();
  const size_t measurements = options.ops.size() * sizes.size();
  size_t measured = 0;
  const CommBenchResult result = run_comm_bench(
      *comm, options,
      [&](Collective op) {
        if (measured == 0) faults.before_step(0, flush);
        if (!events) return;
        emit(
            {{"event", "info"},
             {"message",
              fmt::format("bench comm: {} on {} rank(s), {} size(s) from {} to {} bytes",
                          collective_name(op), world, sizes.size(), sizes.front(), sizes.back())}});
      },
      device.get(),
      [&](const CommBenchRow& row, size_t done, size_t count) {
        // Rewritten in place on the launcher's terminal; dropped in a pipe, where the line per
        // collective says what runs.
        if (events) {
          emit({{"event", "bench_progress"},
                {"message",
                 fmt::format("bench comm: {} {} bytes ({}/{}): {:.2f} us, busbw {:.2f} GB/s",
                             collective_name(row.op), row.size, done, count, row.time_us,
                             row.busbw)},
                {"row", row_to_json(row)}});
        }
        if (++measured < measurements) faults.before_step(static_cast<int64_t>(measured), flush);
      },
      &progress);
  if (rank == 0) {
    if (events) {
      json event = result.to_json();
      event["event"] = "result";
      emit(event);
    } else {
      std::fputs(format_comm_table(result).c_str(), stdout);
      std::fflush(stdout);
    }
  }
  return 0;
}

}  // namespace

void setup_bench_comm(CLI::App& app, Outcome& outcome) {
  auto o = std::make_shared<BenchCommOptions>();
  app.add_option("-o,--op", o->op,
                 "Collective: allreduce, broadcast, reduce_scatter, allgather, a comma-separated "
                 "list, or all")
      ->capture_default_str();
  app.add_option("--backend", o->backend,
                 "Collective backend: gloo (CPUs, host memory) or nccl (one GPU per rank)")
      ->capture_default_str();
  o->nproc_flag =
      app.add_option("--nproc", o->nproc, "Number of local ranks (default 1; not with --hosts)");
  add_host_options(app, o->hosts, false);
  add_remote_job_options(app, o->remote);
  app.add_option("-b,--minbytes", o->min_bytes, "Smallest size in bytes (K, M, G, T suffixes)")
      ->capture_default_str();
  app.add_option("-e,--maxbytes", o->max_bytes, "Largest size in bytes (K, M, G, T suffixes)")
      ->capture_default_str();
  app.add_option("-f,--stepfactor", o->step_factor, "Multiply the size by this between rows")
      ->check(whole_number<int64_t>("FACTOR", std::numeric_limits<int64_t>::max(), 2))
      ->capture_default_str();
  app.add_option("-d,--dtype", o->dtype,
                 "Element type: float, half or bf16 (also float32/fp32, float16/fp16, bfloat16)")
      ->capture_default_str();
  app.add_option("--redop", o->redop,
                 "Reduction of allreduce and reduce_scatter: sum, avg, max or min")
      ->capture_default_str();
  app.add_option("--root", o->root, "Broadcast's root rank")
      ->check(whole_number<int>("RANK"))
      ->capture_default_str();
  app.add_option("-w,--warmup", o->warmup, "Untimed iterations before each size's timed ones")
      ->check(whole_number<int>("N"))
      ->capture_default_str();
  app.add_option("-n,--iters", o->iters, "Timed iterations per size")
      ->check(whole_number<int>("N", std::numeric_limits<int>::max(), 1))
      ->capture_default_str();
  o->min_busbw_flag =
      app.add_option("--min-busbw", o->min_busbw,
                     "Exit 6 when a collective's busbw at its largest size is below this many GB/s")
          ->check(non_negative_number());
  app.add_option("--timeout", o->timeout_s, "Seconds for the rendezvous and for each collective")
      ->check(seconds_at_least(0.001))  // whole milliseconds are waited for
      ->capture_default_str();
  app.add_option("--run-dir", o->run_dir,
                 "Run directory for the ranks' logs and the result (default: "
                 "RUNS_ROOT/bench-comm-<UTC time>)");
  app.add_option("--runs-root", o->runs_root, "Where new run directories are made")
      ->capture_default_str();
  app.add_flag("--json", o->json, "Print one JSON object with every row instead of the table");
  app.add_option("--worker", o->worker, "Internal: run as one rank with these options")->group("");
  app.callback([o, &outcome] {
    outcome.json = o->json && o->worker.empty();
    if (!o->worker.empty()) {
      try {
        outcome.exit_code = run_bench_worker(o->worker);
      } catch (const Error& e) {
        // Name the rank: many ranks' errors end up in one terminal. (Communicator errors
        // already do.)
        const std::string prefix = fmt::format("rank {}: ", env("RANK").value_or("?"));
        if (std::string(e.what()).rfind(prefix, 0) == 0) throw;
        throw Error(e.kind(), prefix + e.what());
      }
      return;
    }
    outcome.exit_code = run_bench_launcher(*o);
  });
}

}  // namespace dptrain::cli
