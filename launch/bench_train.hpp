// `dptrain bench train`: a recipe's training throughput per world size, and the scaling report.
#pragma once

#include <array>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/recipe.hpp"
#include "launch/hostfile.hpp"
#include "launch/job.hpp"
#include "launch/status.hpp"

namespace dptrain {

// Weak: batch_per_rank stays, so the global batch grows with the world. Strong: the global batch
// of the smallest world stays, so batch_per_rank shrinks as the world grows.
enum class BatchScaling { weak, strong };

struct BenchTrainOptions {
  int64_t steps = 50;  // per run; the recipe's train.steps is overridden
  int repeats = 1;     // runs per world size; every reported number is the median
  BatchScaling scaling = BatchScaling::weak;
  // One sweep over the world sizes per precision, in this order; empty: the recipe's own.
  std::vector<std::string> precisions;
};

// One point of the sweep.
struct BenchWorld {
  int world = 1;
  std::vector<HostSpec> hosts;  // --hosts: the first hosts given; empty: `world` local ranks
};

// "1,2,4" (--nproc; --nnodes with hosts): positive integers, any order, each once. Returned in
// ascending order. Error(usage) naming `flag` and the bad entry.
std::vector<int> parse_world_list(const std::string& text, const std::string& flag);
// 1, 2, 4, ... up to `count`, and `count` itself: the default --nnodes for `count` hosts.
std::vector<int> default_node_counts(int count);

// "bf16,fp32" (--precision): each of fp32, bf16, fp16 at most once, kept in the order given (the
// order the sweeps run). Error(usage) naming `flag` and the bad entry.
std::vector<std::string> parse_precision_list(const std::string& text, const std::string& flag);

// The recipe with train.device and train.precision replaced, validated again as a rank will
// parse it: an invalid combination is the recipe's own Error(recipe), one line naming the field
// (bf16 on the CPU: "SOURCE: /train/precision: \"bf16\" needs /train/device \"cuda\" ...").
Recipe with_device_and_precision(const Recipe& recipe, const std::string& device,
                                 const std::string& precision, const std::string& source);

// The H100 and H200 SXM dense bf16 tensor-core peak, TFLOP/s per GPU: MFU's default on cuda.
constexpr double kDefaultCudaPeakTflops = 989.0;

// Model FLOP utilisation: throughput (tokens/s, or samples/s for a model without tokens) x model
// FLOPs per token (sample) / (world x peak). The throughput is the whole world's, the peak one
// device's. nullopt when the peak or the FLOPs are not positive.
std::optional<double> model_flops_utilization(double throughput, double flops_per_unit, int world,
                                              double peak_tflops);

// The recipe as a benchmark run at `world` ranks trains it: `options.steps` steps, checkpoint and
// evaluation only at the end (after the timing), no replica checks, log.every at most the steps;
// under strong scaling batch_per_rank is set so that world x batch_per_rank equals base_world x
// the recipe's. Error(usage) naming the world size when that is not a whole number.
Recipe bench_recipe(const Recipe& recipe, int world, int base_world,
                    const BenchTrainOptions& options);

// Efficiency of `world` ranks against the sweep's smallest world `base_world`:
// throughput x base_world / (world x base_throughput). 1 is linear scaling. Under weak scaling
// that compares samples/s per rank; under strong scaling (one global batch) it equals the
// speed-up in step time divided by world / base_world: the same ratio.
double scaling_efficiency(double throughput, int world, double base_throughput, int base_world);

// The median (the mean of the two middle values for an even count). Error(internal) when empty.
double median(std::vector<double> values);

struct BenchTrainRow {
  std::string precision = "fp32";  // train.precision of the runs
  int world = 1;
  // The ranks that compute gradients: the world less a parameter-server recipe's servers (0:
  // the world). Batches and scaling are theirs.
  int workers = 0;
  int nodes = 0;  // hosts used with --hosts; 0: local ranks
  int64_t batch_per_rank = 0;
  int64_t global_batch = 0;
  double samples_per_s = 0;  // steady state, the median over repeats
  double tokens_per_s = 0;   // token models (gpt); else 0
  // Wall time of a steady step: the median over repeats of 1000 x global_batch / samples_per_s
  // (with an even count of repeats, not quite that of the median samples_per_s).
  double step_ms = 0;
  // Mean ms per steady step on rank 0: data, forward+backward, exposed gradient all-reduce,
  // optimizer (each the median over repeats).
  std::array<double, 4> phases_ms{};
  double efficiency = 0;      // scaling_efficiency against the precision's first row
  std::optional<double> mfu;  // model_flops_utilization; only with a peak (GPU, --peak-tflops)
  double peak_rss_mib = 0;    // the largest of any rank
  std::vector<std::string> run_dirs;
  int computing() const { return workers > 0 ? workers : world; }
  nlohmann::json to_json() const;
};

// bench train's thresholds for CI (--min-throughput, --min-efficiency, --min-mfu); unset: not
// checked. Throughput is in the table's unit (tokens/s for token models, else samples/s).
struct BenchThresholds {
  std::optional<double> throughput;   // each precision's largest world
  std::optional<double> efficiency;   // every row (a fraction)
  std::optional<double> mfu_percent;  // each precision's largest world
};

// A row from the result JSON of each repeat (the trainer's TrainResult::to_json): the median of
// every field. Error(internal) naming the world size when a result has no positive throughput.
BenchTrainRow row_from_results(const std::vector<nlohmann::json>& results, int world,
                               int64_t batch_per_rank, int64_t global_batch);
// Fills every row's efficiency against the first row of its precision (its smallest world).
void fill_efficiency(std::vector<BenchTrainRow>& rows);

// One precision's throughput against the baseline precision's at one world size.
struct PrecisionRatio {
  int world = 1;
  std::string precision;  // e.g. bf16
  std::string baseline;   // fp32 when it ran, else the first precision listed
  double ratio = 0;       // throughput(precision) / throughput(baseline)
  nlohmann::json to_json() const;
};

struct MachineInfo {
  int cpus = 0;
  std::string cpu_model;
  std::string device = "cpu";  // "cpu" | "cuda"
  int gpus = 0;                // cuda: devices visible to this process
  std::string gpu_model;       // cuda: device 0's name, e.g. "NVIDIA H200"
  std::string backend;         // auto | gloo | nccl
  int64_t threads_per_rank = 1;
};
// The "model name" of /proc/cpuinfo's text (else its "Hardware" or "CPU part"); "unknown CPU".
std::string cpu_model_from_cpuinfo(const std::string& cpuinfo);
// This machine: online CPUs and /proc/cpuinfo's model; for device "cuda" also the visible GPUs.
MachineInfo local_machine(const std::string& backend, int64_t threads_per_rank,
                          const std::string& device = "cpu");

struct BenchTrainReport {
  std::string recipe_name;
  std::string recipe_file;
  bool tokens = false;  // throughput in tokens/s
  BenchTrainOptions options;
  MachineInfo machine;
  std::vector<std::string> hosts;  // --hosts, as displayed; empty: this machine
  std::string run_dir;             // the sweep's directory (one run directory per world)
  std::vector<std::string> notes;  // e.g. more rank threads than CPUs
  // MFU: the peak FLOP/s of one device (none: MFU n/a) and where that figure comes from.
  std::optional<double> peak_tflops;
  std::string peak_source;
  // Set by run_bench_train from the model: FLOPs per token (tokens) or per sample, and how.
  double flops_per_unit = 0;
  std::string flops_formula;
  std::vector<std::string> precisions;  // in the order they ran
  std::vector<BenchTrainRow> rows;      // per precision, per world size ascending

  int base_world() const { return rows.empty() ? 1 : rows.front().world; }
  // Every precision but the baseline against it, per world size both ran; empty with one.
  std::vector<PrecisionRatio> precision_ratios() const;
  nlohmann::json to_json() const;
  // The `#` header (recipe, steps, machine, precisions, how the batch scales, MFU's formula and
  // peak), a units row, one line per row, then one "# bf16 / fp32 throughput: 2.71x (world 1)"
  // line per precision ratio.
  std::string table() const;
  // One line per threshold a row falls short of, naming precision, world, the figure and the
  // option ("fp32 at world 2: 1234 samples/s is below --min-throughput 2000"); empty: all met.
  std::vector<std::string> shortfalls(const BenchThresholds& min) const;
  // Throughput against world size, with an ideal linear-scaling dashed line (per precision).
  std::string svg() const;
};

// Runs the recipe once at one world size, in the run directory named `label` ("w2", "w2-r1"),
// and returns rank 0's result JSON with "run_dir" added; throws Error when the run fails.
using BenchRunner = std::function<nlohmann::json(const Recipe& recipe, const BenchWorld& world,
                                                 const std::string& label)>;

// Every world's recipe first (a strong-scaling refusal happens before any run), then for each of
// `options.precisions` (the recipe's train.precision when empty) `options.repeats` runs per world
// in ascending order, the recipe's train.precision set to it (labels "w2", or "w2-bf16" when
// several precisions run). `progress` gets one line per run started and per world measured.
// `report` arrives with recipe, machine, hosts and peak filled; the model's FLOPs, the
// precisions, the rows (with MFU when report.peak_tflops is set) are added.
void run_bench_train(const Recipe& recipe, const std::vector<BenchWorld>& worlds,
                     const BenchRunner& runner,
                     const std::function<void(const std::string&)>& progress,
                     BenchTrainReport& report);

// Validates each world's bench_recipe and loads its data as a run would, so a world size whose
// global batch the training split cannot hold is refused (Error(recipe) naming `flag` and the
// world size), as is one --strong cannot split (Error(usage)), before any run starts. A recipe
// the benchmark's changes made invalid is named as `source` (the file, and the flags given).
void check_bench_worlds(const Recipe& recipe, const std::vector<BenchWorld>& worlds,
                        const BenchTrainOptions& options, const std::string& flag,
                        const std::string& source);

// The sweep's directory, created: `dir` (Error(usage) unless it is absent or empty), or
// runs_root/bench-train-<UTC time> (a suffix keeps two sweeps in one second apart).
std::filesystem::path create_sweep_dir(const std::filesystem::path& dir,
                                       const std::filesystem::path& runs_root);

// A BenchRunner that launches every run through run_job: `spec` with its recipe, hosts and world
// size replaced, in sweep_dir/LABEL, the job's console lines (rank output, progress) in
// LABEL/console.log. A completed run's local checkpoints are deleted: a benchmark has nothing to
// resume, and a large model's would fill the disk. A failed run throws Error: rank_failed (exit 3)
// with the run's error, ssh (4), interrupted (130) or terminated (143), its directory first put
// in `*failed_run` (when given). With a `terminal`, the run's progress is also shown on its
// progress line (on a terminal only).
BenchRunner job_runner(const JobSpec& spec, const std::filesystem::path& sweep_dir,
                       StatusPrinter* terminal = nullptr,
                       std::filesystem::path* failed_run = nullptr);

}  // namespace dptrain
