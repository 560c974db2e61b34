// The typed recipe: JSON -> Recipe with every default filled in, validated with JSON-pointer paths.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace dptrain {

struct TrainingPosition;  // core/checkpoint.hpp

struct ModelSpec {
  std::string type = "mlp";  // "mlp" | "gpt"
  // mlp
  int64_t input = 784;  // features per sample
  std::vector<int64_t> hidden = {256, 256};
  int64_t classes = 10;
  std::string activation = "relu";  // "relu" | "gelu"
  // gpt: a decoder-only transformer (pre-LayerNorm blocks, GELU MLP, tied LM head)
  int64_t vocab = 256;    // tokens; at least the dataset's vocabulary
  int64_t context = 128;  // positions (the window a sample trains on)
  int64_t layers = 4;
  int64_t heads = 4;
  int64_t width = 128;  // embedding width; a multiple of heads
  int64_t mlp_ratio = 4;
  double dropout = 0.0;  // only 0 for now
  bool operator==(const ModelSpec&) const = default;
};

struct DataSpec {
  std::string type = "synthetic-classification";  // | "csv" | "tokens"
  int64_t samples = 60000;  // synthetic: number of samples generated (train + eval)
  double noise = 1.0;       // synthetic: std-dev of each class cluster around its centre
  // csv: the file; tokens: the dataset directory `dptrain data prepare` wrote (checked when a
  // run starts, so a recipe validates without its data). Relative paths resolve against the
  // recipe's folder.
  std::string path;
  std::string header = "auto";  // csv: "auto" | "yes" | "no"
  double eval_fraction = 0.1;   // share of samples held out for evaluation, in [0, 1)
  bool operator==(const DataSpec&) const = default;
};

struct TrainSpec {
  int64_t steps = 500;  // optimizer steps
  int64_t batch_per_rank = 64;
  int64_t grad_accum = 1;      // micro-batches per optimizer step
  std::string device = "cpu";  // "cpu" | "cuda" (one GPU per rank)
  // "fp32" | "bf16" | "fp16": the compute type (bf16/fp16 keep f32 master weights and optimizer
  // state; fp16 adds dynamic loss scaling). 16-bit needs device "cuda".
  std::string precision = "fp32";
  int64_t threads_per_rank = 1;  // BLAS threads per rank
  bool operator==(const TrainSpec&) const = default;
};

struct ScheduleSpec {
  std::string type = "cosine";  // "constant" | "cosine" | "linear"
  int64_t warmup = 0;           // linear warm-up steps from 0 to lr
  double min_lr_ratio = 0.0;    // final lr = lr * min_lr_ratio
  bool operator==(const ScheduleSpec&) const = default;
};

struct OptimizerSpec {
  std::string type = "adamw";  // "adamw" | "sgd"
  double lr = 1e-3;
  double weight_decay = 0.0;
  double momentum = 0.9;  // sgd
  bool nesterov = false;  // sgd
  double beta1 = 0.9;     // adamw
  double beta2 = 0.999;   // adamw
  double eps = 1e-8;      // adamw
  ScheduleSpec schedule;
  double clip_grad_norm = 0.0;  // 0 = no clipping
  bool operator==(const OptimizerSpec&) const = default;
};

struct CompressionSpec {
  // The gradients' wire format: "none" (f32); "fp16" or "bf16" (cast before the all-reduce, summed
  // in 16 bits, cast back: half the bytes); "int8" (blockwise scaled), "topk" (the largest
  // `ratio` of the values) or "powersgd" (a rank-`rank` factorisation), these three with error
  // feedback: what a rank did not send is added to its next step's gradients.
  std::string type = "none";
  int64_t block = 256;  // int8: values sharing one scale
  double ratio = 0.01;  // topk: the share of values sent, in (0, 1]
  int64_t rank = 4;     // powersgd: the factorisation's rank
  bool operator==(const CompressionSpec&) const = default;
};
// Whether a compression type keeps error-feedback state (int8, topk, powersgd).
bool is_error_feedback_codec(const std::string& type);

struct DistributedSpec {
  std::string backend = "auto";  // "auto" | "gloo" | "nccl" (auto: nccl when on cuda)
  // "allreduce": every step sums the gradients; "local_sgd": each rank steps alone and the
  // parameters are averaged every `period` steps (after `start` fully synchronous steps); "ps":
  // the last `servers` ranks hold the parameters and optimizer state, sharded, and the other
  // ranks (workers) push gradients to them and pull parameters, up to `staleness` steps ahead of
  // the slowest worker.
  std::string sync = "allreduce";
  int64_t period = 8;     // local_sgd
  int64_t start = 0;      // local_sgd
  int64_t servers = 1;    // ps
  int64_t staleness = 0;  // ps
  // 1: the optimizer state is sharded across ranks (reduce-scatter, update the own shard,
  // all-gather the parameters); 0: every rank holds all of it.
  int64_t zero = 0;
  double bucket_mb = 25.0;
  bool overlap = true;
  CompressionSpec compression;
  int64_t check_every = 100;  // compare parameter checksums across ranks every N steps; 0 = never
  double timeout_s = 300.0;   // every store wait and collective
  // When a job runs on fewer (or more) ranks than it started with (an elastic job that lost a
  // node, a resume on another world size): "keep_global_batch" keeps the global batch through
  // more (or fewer) micro-batches per rank; "scale_lr" keeps micro-batches per rank, so the
  // global batch follows the world size, and scales the learning rate with it.
  std::string resize = "keep_global_batch";
  bool operator==(const DistributedSpec&) const = default;
};

struct CheckpointSpec {
  int64_t every = 100;  // 0 = only at the end
  int64_t keep = 3;
  bool operator==(const CheckpointSpec&) const = default;
};

struct EvalSpec {
  int64_t every = 100;      // 0 = only at the end
  int64_t max_samples = 0;  // 0 = the whole held-out split
  bool operator==(const EvalSpec&) const = default;
};

struct FaultToleranceSpec {
  int64_t max_restarts = 0;        // restarts after failures, for the whole job
  double restart_backoff_s = 1.0;  // before the first restart; doubled each time, at most 30
  double hang_timeout_s = 0.0;     // no progress this long on a rank: a hang; 0 = off
  double rejoin_timeout_s = 60.0;  // elastic jobs: how long a lost node may take to come back
  bool operator==(const FaultToleranceSpec&) const = default;
};

struct LogSpec {
  int64_t every = 10;
  bool operator==(const LogSpec&) const = default;
};

struct Recipe {
  std::string name = "run";
  uint64_t seed = 1;
  ModelSpec model;
  DataSpec data;
  TrainSpec train;
  OptimizerSpec optimizer;
  DistributedSpec distributed;
  CheckpointSpec checkpoint;
  EvalSpec eval;
  LogSpec log;
  FaultToleranceSpec fault_tolerance;  // launch/resume flags override these

  // Field-wise: parse_recipe(to_json(r)) == r.
  bool operator==(const Recipe&) const = default;
};

// Every count of steps (train.steps, warm-up, the every/period fields, a benchmark's --steps):
// far beyond any run, and far inside int64 and a double's exact integers, so that step
// arithmetic (the warm-up's fraction, a step + an interval) cannot overflow or round. (Steps x
// global batch, for the samples per second, is computed in double.)
inline constexpr int64_t kMaxSteps = 1'000'000'000'000;

// The longest duration a recipe field or a flag in seconds may give (about 11.6 days): longer
// ones would overflow the clocks' conversions. 0 means "off" where a field allows it.
inline constexpr double kMaxSeconds = 1e6;

// Where a recipe comes from: a user's file refuses fields that do not apply to the kind chosen
// ("momentum" with "adamw"); a recipe stored in run.json by an earlier version, which carries
// every field, is read as it is.
enum class RecipeOrigin { user, stored };

// How much of a CSV dataset parsing reads: its first data row, whose columns must match
// model.input (cheap: every load of a recipe does it), or every row, each checked as a launch
// reads it (labels in [0, classes), numbers; `recipe validate`), every wrong row a problem at
// /data/path naming the file and line; or none: the data is not read at all (the recipe of a run
// whose data has moved or sits on a hung mount, read to tell which checkpoints it wrote).
enum class DataCheck { none, first_row, every_row };

// Parses and validates. `source` names the file in error messages; `base_dir` resolves relative
// data paths (which are stored absolute in the result). Throws Error(recipe) whose message holds
// one line per problem, each "SOURCE: /json/pointer: what is wrong".
Recipe parse_recipe(const nlohmann::json& j, const std::string& source,
                    const std::filesystem::path& base_dir, RecipeOrigin origin = RecipeOrigin::user,
                    DataCheck data = DataCheck::first_row);
// Where a recipe's problems are said to be: its file, and the recipe's own place in that file
// ("/recipe" in a run.json; "" in a recipe file), before each problem's pointer.
struct RecipeSource {
  RecipeSource(std::string f = "", std::string u = "") : file(std::move(f)), under(std::move(u)) {}
  RecipeSource(const char* f) : file(f) {}
  std::string file;
  std::string under;
  // "FILE: UNDER/pointer: ..." for each line of `problems` ("/pointer: ..." lines; a line without
  // a pointer gets the file only); without a file, the problems as they are.
  std::string place(const std::string& problems) const;
};
// A run directory's run.json: its recipe is at /recipe.
RecipeSource recorded_recipe_source(const std::filesystem::path& run_dir);

// The recipe a run directory's run.json (`info`) records, read as stored: problems name
// RUN_DIR/run.json and their pointers start at /recipe, where the recipe is in that file.
Recipe parse_recorded_recipe(const nlohmann::json& info, const std::filesystem::path& run_dir,
                             DataCheck data = DataCheck::first_row);
// Reads the file (io problems are recipe errors naming the file) and parses it.
Recipe load_recipe(const std::filesystem::path& path, DataCheck data = DataCheck::first_row);
// The resolved recipe: every field that applies (not "momentum" for "adamw"), defaults
// included. parse_recipe(to_json(r)) == r where r holds the defaults in the other fields (as any
// recipe parsed from a user's file does).
nlohmann::json to_json(const Recipe& r);
// The parameters of the model a spec describes (what make_model(spec)->num_params() gives),
// computed without building it; nothing when the count passes 2^64 - 1. parse_recipe refuses
// models above 2^40 parameters.
std::optional<uint64_t> parameter_count(const ModelSpec& model);
// The ranks that hold the parameters and take no batch: the last /distributed/servers ranks
// under sync "ps", none otherwise.
int server_ranks(const Recipe& r);
// Refuses (a recipe error naming /distributed/servers) a world of `world_size` ranks in which the
// parameter servers leave no worker.
void check_has_workers(const Recipe& r, int world_size);
// A stable hex digest of every field (those that do not apply too) but data.path, recorded in
// checkpoints and compared between ranks. Where the data lies is left out: each host may keep
// it elsewhere (a provisioned copy), and what it holds is compared by its fingerprint.
std::string recipe_hash(const Recipe& r);
// Why a checkpoint whose recorded recipe hash is `recorded` was not written by this recipe
// ("written by a different recipe (hash ..., this run's ...)"); empty when it was. Hashes that
// earlier builds wrote (data.path included) are recognised.
std::string recipe_mismatch(const Recipe& r, const std::string& recorded);
// recipe_mismatch as a filter for try_find_valid_checkpoint: checkpoints of other recipes (one
// copied in from another run) are skipped, not resumed from to fail there.
std::function<std::string(const TrainingPosition&)> written_by(const Recipe& r);

}  // namespace dptrain
