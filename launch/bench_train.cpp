// `dptrain bench train`: a recipe's training throughput per world size, and the scaling report.
#include "launch/bench_train.hpp"

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <memory>
#include <sstream>
#include <system_error>

#include <fmt/format.h>

#include "core/error.hpp"
#include "core/fs.hpp"
#include "core/json_error.hpp"
#include "core/model/flops.hpp"
#include "core/tensor/device.hpp"
#include "core/trainer.hpp"
#include "launch/run_dir.hpp"
#include "launch/status.hpp"
#include "launch/supervisor.hpp"
#include "launch/svg_chart.hpp"

namespace dptrain {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr const char* kPhaseNames[] = {"data", "compute", "comm", "optimizer"};

std::string trim(const std::string& s) {
  const auto begin = s.find_first_not_of(" \t");
  if (begin == std::string::npos) return "";
  const auto end = s.find_last_not_of(" \t");
  return s.substr(begin, end - begin + 1);
}

std::string throughput_unit(bool tokens) {
  return tokens ? "tokens/s" : "samples/s";
}

double throughput(const BenchTrainRow& row, bool tokens) {
  return tokens ? row.tokens_per_s : row.samples_per_s;
}

std::string join_worlds(const std::vector<BenchWorld>& worlds) {
  std::string out;
  for (const auto& w : worlds)
    out += (out.empty() ? "" : ", ") + std::to_string(w.world);
  return out;
}

std::string join(const std::vector<std::string>& items) {
  std::string out;
  for (const auto& item : items)
    out += (out.empty() ? "" : ", ") + item;
  return out;
}

// "41.2%", or "n/a".
std::string mfu_text(const std::optional<double>& mfu) {
  return mfu ? fmt::format("{:.1f}%", 100.0 * *mfu) : "n/a";
}

// The rows' precisions in the order they first appear.
std::vector<std::string> row_precisions(const std::vector<BenchTrainRow>& rows) {
  std::vector<std::string> out;
  for (const auto& r : rows)
    if (std::find(out.begin(), out.end(), r.precision) == out.end()) out.push_back(r.precision);
  return out;
}

}  // namespace

std::vector<int> parse_world_list(const std::string& text, const std::string& flag) {
  std::vector<int> worlds;
  std::string entry;
  std::istringstream in(text);
  bool any = false;
  while (std::getline(in, entry, ',')) {
    any = true;
    const std::string item = trim(entry);
    int value = 0;
    size_t used = 0;
    bool ok = !item.empty() && item.find_first_not_of("0123456789") == std::string::npos;
    if (ok) {
      try {
        value = std::stoi(item, &used);
      } catch (const std::exception&) {
        ok = false;
      }
    }
    if (!ok || used != item.size() || value < 1) {
      // --nnodes lists numbers of hosts, --nproc world sizes.
      throw Error(
          ErrorKind::usage,
          fmt::format("{} {}: '{}' is not {} (a list of positive integers, e.g. 1,2,4)", flag, text,
                      item, flag == "--nnodes" ? "a number of hosts" : "a world size"));
    }
    if (std::find(worlds.begin(), worlds.end(), value) != worlds.end()) {
      throw Error(ErrorKind::usage, fmt::format("{} {}: {} is listed twice", flag, text, value));
    }
    worlds.push_back(value);
  }
  // getline drops a trailing empty entry ("1,2,"): refuse it like an empty one in the middle.
  if (!any || text.back() == ',') {
    throw Error(
        ErrorKind::usage,
        fmt::format("{} '{}': a list of positive world sizes is needed, e.g. 1,2,4", flag, text));
  }
  std::sort(worlds.begin(), worlds.end());
  return worlds;
}

std::vector<std::string> parse_precision_list(const std::string& text, const std::string& flag) {
  std::vector<std::string> out;
  std::string entry;
  std::istringstream in(text);
  while (std::getline(in, entry, ',')) {
    const std::string item = trim(entry);
    if (item != "fp32" && item != "bf16" && item != "fp16") {
      throw Error(ErrorKind::usage,
                  fmt::format("{} {}: '{}' is not a precision (fp32, bf16 or fp16, or a list "
                              "such as bf16,fp32)",
                              flag, text, item));
    }
    if (std::find(out.begin(), out.end(), item) != out.end()) {
      throw Error(ErrorKind::usage, fmt::format("{} {}: {} is listed twice", flag, text, item));
    }
    out.push_back(item);
  }
  // getline drops a trailing empty entry ("bf16,"): refuse it like an empty one in the middle.
  if (out.empty() || text.back() == ',') {
    throw Error(ErrorKind::usage,
                fmt::format("{} '{}': fp32, bf16, fp16 or a list of them is needed, e.g. bf16,fp32",
                            flag, text));
  }
  return out;
}

Recipe with_device_and_precision(const Recipe& recipe, const std::string& device,
                                 const std::string& precision, const std::string& source) {
  Recipe r = recipe;
  r.train.device = device;
  r.train.precision = precision;
  // The recipe's own validation: the same one-line errors, naming the JSON field, as a rank's.
  return parse_recipe(to_json(r), source, fs::current_path());
}

std::optional<double> model_flops_utilization(double throughput_per_s, double flops_per_unit,
                                              int world, double peak_tflops) {
  if (!(peak_tflops > 0) || !(flops_per_unit > 0) || world < 1) return std::nullopt;
  return throughput_per_s * flops_per_unit / (static_cast<double>(world) * peak_tflops * 1e12);
}

std::vector<int> default_node_counts(int count) {
  std::vector<int> out;
  for (int n = 1; n < count; n *= 2)
    out.push_back(n);
  out.push_back(std::max(count, 1));
  return out;
}

Recipe bench_recipe(const Recipe& recipe, int world, int base_world,
                    const BenchTrainOptions& options) {
  Recipe r = recipe;
  r.train.steps = options.steps;
  r.checkpoint.every = 0;  // only at the end, after the timing
  r.eval.every = 0;
  r.distributed.check_every = 0;
  r.log.every = std::min(r.log.every, options.steps);
  // The schedule only sets the learning rate, not the cost of a step; warm-up must fit the run.
  r.optimizer.schedule.warmup = std::min(r.optimizer.schedule.warmup, options.steps);
  if (options.scaling == BatchScaling::strong) {
    // Over the ranks that compute gradients (parameter servers take no batch).
    check_has_workers(recipe, base_world);
    check_has_workers(recipe, world);
    const int servers = server_ranks(recipe);
    const int workers = world - servers;
    const int base_workers = base_world - servers;
    const int64_t ranks_x_batch = recipe.train.batch_per_rank * base_workers;
    if (ranks_x_batch % workers != 0) {
      throw Error(ErrorKind::usage,
                  fmt::format("--strong: world size {} cannot keep the global batch of world size "
                              "{} (batch_per_rank {} x {} worker rank(s) x grad_accum {}): {} does "
                              "not split evenly over {} worker rank(s); choose world sizes whose "
                              "workers divide {}",
                              world, base_world, recipe.train.batch_per_rank, base_workers,
                              recipe.train.grad_accum, ranks_x_batch, workers, ranks_x_batch));
    }
    r.train.batch_per_rank = ranks_x_batch / workers;
  }
  // The final evaluation is not timed; a slice of the held-out split keeps it short.
  const int64_t eval_cap = global_batch(r, world);
  if (r.eval.max_samples == 0 || r.eval.max_samples > eval_cap) r.eval.max_samples = eval_cap;
  return r;
}

double scaling_efficiency(double throughput_w, int world, double base_throughput, int base_world) {
  if (base_throughput <= 0 || world <= 0) return 0;
  return throughput_w * static_cast<double>(base_world) /
         (static_cast<double>(world) * base_throughput);
}

double median(std::vector<double> values) {
  if (values.empty()) throw Error(ErrorKind::internal, "median of no values");
  std::sort(values.begin(), values.end());
  const size_t mid = values.size() / 2;
  return values.size() % 2 == 1 ? values[mid] : (values[mid - 1] + values[mid]) / 2;
}

json BenchTrainRow::to_json() const {
  json j = {{"precision", precision},
            {"world", world},
            {"workers", computing()},
            {"batch_per_rank", batch_per_rank},
            {"global_batch", global_batch},
            {"samples_per_s", samples_per_s},
            {"step_ms", step_ms},
            {"efficiency", efficiency},
            {"mfu", mfu ? json(*mfu) : json(nullptr)},
            {"peak_rss_mib", peak_rss_mib},
            {"run_dirs", run_dirs}};
  if (nodes > 0) j["nodes"] = nodes;
  if (tokens_per_s > 0) j["tokens_per_s"] = tokens_per_s;
  json phases = json::object();
  for (size_t i = 0; i < phases_ms.size(); ++i)
    phases[kPhaseNames[i]] = phases_ms[i];
  j["phases_ms"] = phases;
  return j;
}

BenchTrainRow row_from_results(const std::vector<json>& results, int world, int64_t batch_per_rank,
                               int64_t global_batch_size) {
  if (results.empty()) {
    throw Error(ErrorKind::internal, fmt::format("world size {}: no run to report", world));
  }
  BenchTrainRow row;
  row.world = world;
  row.batch_per_rank = batch_per_rank;
  row.global_batch = global_batch_size;
  std::vector<double> samples, tokens, peak, step_ms;
  std::array<std::vector<double>, 4> phases;
  for (const auto& r : results) {
    const json& measured = r.value("samples_per_s", json());
    const double s = measured.is_number() ? measured.get<double>() : 0.0;
    if (!(s > 0)) {
      throw Error(ErrorKind::internal,
                  fmt::format("world size {}: the run reported no throughput (samples_per_s {})",
                              world, s));
    }
    samples.push_back(s);
    step_ms.push_back(1000.0 * static_cast<double>(global_batch_size) / s);
    tokens.push_back(r.value("tokens_per_s", 0.0));
    peak.push_back(r.value("peak_rss_mib", 0.0));
    const json p = r.value("phases_ms", json::object());
    for (size_t i = 0; i < phases.size(); ++i)
      phases[i].push_back(p.value(kPhaseNames[i], 0.0));
    if (r.contains("run_dir")) row.run_dirs.push_back(r["run_dir"].get<std::string>());
  }
  row.samples_per_s = median(samples);
  row.tokens_per_s = median(tokens);
  row.peak_rss_mib = median(peak);
  for (size_t i = 0; i < phases.size(); ++i)
    row.phases_ms[i] = median(phases[i]);
  // Each field's median on its own: with an even count of runs, the step time's is not the one
  // the median throughput implies.
  row.step_ms = median(step_ms);
  return row;
}

void fill_efficiency(std::vector<BenchTrainRow>& rows) {
  for (auto& row : rows) {
    const auto base = std::find_if(rows.begin(), rows.end(), [&row](const BenchTrainRow& r) {
      return r.precision == row.precision;
    });
    row.efficiency = scaling_efficiency(row.samples_per_s, row.computing(), base->samples_per_s,
                                        base->computing());
  }
}

json PrecisionRatio::to_json() const {
  return {{"world", world}, {"precision", precision}, {"baseline", baseline}, {"ratio", ratio}};
}

std::string cpu_model_from_cpuinfo(const std::string& cpuinfo) {
  std::string fallback;
  std::istringstream in(cpuinfo);
  for (std::string line; std::getline(in, line);) {
    const auto colon = line.find(':');
    if (colon == std::string::npos) continue;
    const std::string key = trim(line.substr(0, colon));
    const std::string value = trim(line.substr(colon + 1));
    if (value.empty()) continue;
    if (key == "model name") return value;
    if (fallback.empty() && (key == "Hardware" || key == "CPU part")) fallback = value;
  }
  return fallback.empty() ? "unknown CPU" : fallback;
}

MachineInfo local_machine(const std::string& backend, int64_t threads_per_rank,
                          const std::string& device) {
  MachineInfo m;
  m.cpus = online_cpus();
  std::string cpuinfo;
  try {
    cpuinfo = read_file("/proc/cpuinfo");
  } catch (const Error&) {
    // Not Linux, or /proc not mounted: the model is only descriptive.
  }
  m.cpu_model = cpu_model_from_cpuinfo(cpuinfo);
  m.device = device;
  if (device == "cuda") {
    m.gpus = cuda_device_count();
    m.gpu_model = cuda_device_name(0);
  }
  m.backend = backend;
  m.threads_per_rank = threads_per_rank;
  return m;
}

std::vector<std::string> BenchTrainReport::shortfalls(const BenchThresholds& min) const {
  std::vector<std::string> out;
  const std::string unit = throughput_unit(tokens);
  for (size_t i = 0; i < rows.size(); ++i) {
    const BenchTrainRow& row = rows[i];
    // Rows are per precision, world size ascending: the precision's last is its largest world.
    const bool largest = i + 1 == rows.size() || rows[i + 1].precision != row.precision;
    const std::string where = fmt::format("{} at world {}", row.precision, row.world);
    if (min.efficiency && row.efficiency < *min.efficiency) {
      out.push_back(fmt::format("{}: scaling efficiency {:.3g} is below --min-efficiency {}", where,
                                row.efficiency, *min.efficiency));
    }
    if (!largest) continue;
    const double throughput = tokens ? row.tokens_per_s : row.samples_per_s;
    if (min.throughput && throughput < *min.throughput) {
      // Whole numbers, but never a 0 for a small figure.
      const std::string shown =
          throughput < 100 ? fmt::format("{:.3g}", throughput) : fmt::format("{:.0f}", throughput);
      out.push_back(fmt::format("{}: {} {} is below --min-throughput {}", where, shown, unit,
                                *min.throughput));
    }
    if (min.mfu_percent && row.mfu && 100.0 * *row.mfu < *min.mfu_percent) {
      out.push_back(fmt::format("{}: MFU {:.3g}% is below --min-mfu {}%", where, 100.0 * *row.mfu,
                                *min.mfu_percent));
    }
  }
  return out;
}

std::vector<PrecisionRatio> BenchTrainReport::precision_ratios() const {
  const std::vector<std::string> ran = precisions.empty() ? row_precisions(rows) : precisions;
  std::vector<PrecisionRatio> out;
  if (ran.size() < 2) return out;
  const std::string baseline =
      std::find(ran.begin(), ran.end(), "fp32") != ran.end() ? "fp32" : ran.front();
  for (const auto& precision : ran) {
    if (precision == baseline) continue;
    for (const auto& row : rows) {
      if (row.precision != precision) continue;
      const auto base = std::find_if(rows.begin(), rows.end(), [&](const BenchTrainRow& r) {
        return r.precision == baseline && r.world == row.world;
      });
      if (base == rows.end() || !(base->samples_per_s > 0)) continue;
      out.push_back({row.world, precision, baseline, row.samples_per_s / base->samples_per_s});
    }
  }
  return out;
}

json BenchTrainReport::to_json() const {
  json machine_json = {{"cpus", machine.cpus},
                       {"cpu_model", machine.cpu_model},
                       {"device", machine.device},
                       {"backend", machine.backend},
                       {"threads_per_rank", machine.threads_per_rank}};
  if (machine.device == "cuda") {
    machine_json["gpus"] = machine.gpus;
    machine_json["gpu_model"] = machine.gpu_model;
  }
  json rows_json = json::array();
  for (const auto& row : rows)
    rows_json.push_back(row.to_json());
  json ratios = json::array();
  for (const auto& ratio : precision_ratios())
    ratios.push_back(ratio.to_json());
  json mfu = {{"peak_tflops", peak_tflops ? json(*peak_tflops) : json(nullptr)},
              {"peak_source", peak_source.empty() ? json(nullptr) : json(peak_source)},
              {"formula", flops_formula}};
  mfu[tokens ? "flops_per_token" : "flops_per_sample"] = flops_per_unit;
  return {{"benchmark", "train"},
          {"recipe", recipe_name},
          {"recipe_file", recipe_file},
          {"steps", options.steps},
          {"repeats", options.repeats},
          {"scaling", options.scaling == BatchScaling::weak ? "weak" : "strong"},
          {"throughput_unit", throughput_unit(tokens)},
          {"precisions", precisions.empty() ? row_precisions(rows) : precisions},
          {"precision_ratios", ratios},
          {"mfu_basis", mfu},
          {"baseline_world", base_world()},
          {"machine", machine_json},
          {"hosts", hosts},
          {"run_dir", run_dir},
          {"notes", notes},
          {"rows", rows_json}};
}

std::string BenchTrainReport::table() const {
  std::string out;
  const auto add = [&out](const std::string& line) { out += line + "\n"; };
  add(
      fmt::format("# dptrain bench train: recipe {} ({}), {} steps per run, median of {} run(s) "
                  "per world size",
                  recipe_name, recipe_file, options.steps, options.repeats));
  std::string device = machine.device;
  if (machine.device == "cuda") {
    device += machine.gpus > 0
                  ? fmt::format(" ({} x {} visible here)", machine.gpus, machine.gpu_model)
                  : " (no GPU visible here)";
  }
  add(fmt::format("# machine: {} CPUs ({}), device {}, backend {}, {} BLAS thread(s) per rank",
                  machine.cpus, machine.cpu_model, device, machine.backend,
                  machine.threads_per_rank));
  if (!hosts.empty()) add("# hosts: " + join(hosts));
  const std::vector<std::string> ran = precisions.empty() ? row_precisions(rows) : precisions;
  const bool several = ran.size() > 1;
  if (several) {
    add(fmt::format("# precision: {}: one sweep each, in this order", join(ran)));
  } else if (!ran.empty()) {
    add("# precision: " + ran.front());
  }
  const int base = base_world();
  if (!rows.empty()) {
    const BenchTrainRow& first = rows.front();
    const int64_t accum = first.batch_per_rank > 0
                              ? first.global_batch / (first.batch_per_rank * first.computing())
                              : 1;
    // Parameter servers take no batch: the worker ranks (world less the servers) do.
    const std::string ranks =
        first.computing() != first.world
            ? fmt::format("(world - {} servers)", first.world - first.computing())
            : std::string("world");
    if (options.scaling == BatchScaling::weak) {
      add(
          fmt::format("# weak scaling: batch_per_rank {} stays, so the global batch grows with "
                      "the world ({} x {} x grad_accum {})",
                      first.batch_per_rank, ranks, first.batch_per_rank, accum));
    } else {
      add(
          fmt::format("# strong scaling: the global batch stays {} (world {}'s), so "
                      "batch_per_rank = {} / ({} x grad_accum {})",
                      first.global_batch, base, first.global_batch, ranks, accum));
    }
  }
  // W counts the ranks that compute gradients: with parameter servers, the world less them.
  const int servers = rows.empty() ? 0 : rows.front().world - rows.front().computing();
  const int base_w = base - servers;
  add((base_w == 1 ? "# efficiency: throughput(W) / (W x throughput(1)); 100% is linear scaling"
                   : fmt::format("# efficiency: throughput(W) x {} / (W x throughput({})); 100% is "
                                 "linear scaling",
                                 base_w, base_w)) +
      (servers > 0 ? fmt::format(", W the worker ranks (world - {} servers)", servers) : "") +
      (several ? " (each precision against its own)" : ""));
  add("# ms: steady-state mean per step on rank 0 (warm-up steps excluded); fwd+bwd = forward "
      "and backward, comm = exposed gradient all-reduce");
  const bool mfu_column =
      peak_tflops.has_value() ||
      std::any_of(rows.begin(), rows.end(), [](const auto& r) { return r.mfu.has_value(); });
  if (peak_tflops) {
    add(fmt::format("# MFU: {} x model FLOPs / (world x peak); peak {:g} TFLOP/s per device ({})",
                    throughput_unit(tokens), *peak_tflops, peak_source));
    if (!flops_formula.empty()) add("# model FLOPs: " + flops_formula);
  } else if (!mfu_column) {
    add(machine.device == "cpu" ? "# MFU: n/a (CPU): --peak-tflops X gives it against X"
                                : "# MFU: n/a");
  }
  for (const auto& note : notes)
    add("# note: " + note);
  const bool with_nodes = !hosts.empty();
  const std::string unit = throughput_unit(tokens);
  const auto precision_cell = [several](const std::string& text) {
    return several ? fmt::format(" {:>9}", text) : std::string();
  };
  const auto mfu_cell = [mfu_column](const std::string& text) {
    return mfu_column ? fmt::format(" {:>7}", text) : std::string();
  };
  add(fmt::format("#{}{:>6}{} {:>7} {:>12} {:>9} {:>8} {:>8} {:>8} {:>9} {:>10}{} {:>9}",
                  several ? fmt::format("{:>9} ", "precision") : "", "world",
                  with_nodes ? fmt::format(" {:>5}", "nodes") : "", "global", "throughput", "step",
                  "data", "fwd+bwd", "comm", "optimizer", "efficiency", mfu_cell("MFU"), "peak"));
  add(fmt::format("#{}{:>6}{} {:>7} {:>12} {:>9} {:>8} {:>8} {:>8} {:>9} {:>10}{} {:>9}",
                  several ? fmt::format("{:>9} ", "") : "", "ranks",
                  with_nodes ? fmt::format(" {:>5}", "hosts") : "", "batch", unit, "ms", "ms", "ms",
                  "ms", "ms", "%", mfu_cell(""), "MiB"));
  for (const auto& r : rows) {
    add(fmt::format(
        "{} {:>6}{} {:>7} {:>12.1f} {:>9.2f} {:>8.2f} {:>8.2f} {:>8.2f} {:>9.2f} "
        "{:>10.1f}{} {:>9.1f}",
        precision_cell(r.precision), r.world, with_nodes ? fmt::format(" {:>5}", r.nodes) : "",
        r.global_batch, throughput(r, tokens), r.step_ms, r.phases_ms[0], r.phases_ms[1],
        r.phases_ms[2], r.phases_ms[3], 100.0 * r.efficiency, mfu_cell(mfu_text(r.mfu)),
        r.peak_rss_mib));
  }
  for (const auto& ratio : precision_ratios()) {
    add(fmt::format("# {} / {} throughput: {:.2f}x (world {})", ratio.precision, ratio.baseline,
                    ratio.ratio, ratio.world));
  }
  return out;
}

std::string BenchTrainReport::svg() const {
  const std::vector<std::string> ran = row_precisions(rows);
  const bool several = ran.size() > 1;
  std::vector<ChartSeries> series;
  for (const auto& precision : ran) {
    ChartSeries measured;
    measured.name = several ? precision : "measured";
    measured.markers = true;
    ChartSeries ideal;
    ideal.name = several ? precision + " ideal (linear scaling)" : "ideal (linear scaling)";
    ideal.dashed = true;
    if (!several) ideal.color = "#888888";
    const auto first = std::find_if(
        rows.begin(), rows.end(), [&](const BenchTrainRow& r) { return r.precision == precision; });
    const double base_throughput = throughput(*first, tokens);
    const double base = static_cast<double>(first->computing());
    for (const auto& r : rows) {
      if (r.precision != precision) continue;
      const double w = static_cast<double>(r.world);
      measured.points.emplace_back(w, throughput(r, tokens));
      ideal.points.emplace_back(w, base_throughput * static_cast<double>(r.computing()) / base);
    }
    series.push_back(measured);
    series.push_back(ideal);
  }
  if (series.empty()) {
    // No rows: an empty plot that still names what it would show.
    series.push_back({"measured", {}, "", false, true});
    series.push_back({"ideal (linear scaling)", {}, "#888888", true, false});
  }
  ChartOptions chart;
  chart.title =
      fmt::format("{}: training throughput by world size ({} scaling, {} steps)", recipe_name,
                  options.scaling == BatchScaling::weak ? "weak" : "strong", options.steps);
  chart.x_label = "world size (ranks)";
  chart.integer_x = true;
  chart.y_label = throughput_unit(tokens);
  return svg_line_chart(series, chart);
}

void run_bench_train(const Recipe& recipe, const std::vector<BenchWorld>& worlds,
                     const BenchRunner& runner,
                     const std::function<void(const std::string&)>& progress,
                     BenchTrainReport& report) {
  if (worlds.empty()) throw Error(ErrorKind::usage, "bench train: no world size to run");
  const BenchTrainOptions& o = report.options;
  const int base_world = worlds.front().world;
  std::vector<Recipe> recipes;
  for (const auto& w : worlds)
    recipes.push_back(bench_recipe(recipe, w.world, base_world, o));
  const std::vector<std::string> precisions =
      o.precisions.empty() ? std::vector<std::string>{recipe.train.precision} : o.precisions;
  const bool several = precisions.size() > 1;
  report.precisions = precisions;
  report.tokens = recipe.model.type == "gpt";
  report.flops_per_unit = report.tokens ? training_flops_per_token(recipe.model)
                                        : training_flops_per_sample(recipe.model);
  report.flops_formula = training_flops_formula(recipe.model);
  const int total_runs = static_cast<int>(worlds.size() * precisions.size()) * o.repeats;
  int started = 0;
  progress(fmt::format(
      "bench train: {}, {} steps at world sizes {} ({} scaling){}{}, in {}", report.recipe_name,
      o.steps, join_worlds(worlds), o.scaling == BatchScaling::weak ? "weak" : "strong",
      several ? fmt::format(", precisions {}", join(precisions)) : "",
      o.repeats > 1 ? fmt::format(", {} runs each", o.repeats) : "", report.run_dir));
  for (const auto& note : report.notes)
    progress("bench train: note: " + note);
  for (const auto& precision : precisions) {
    // "bench train: world 2" alone, "bench train: bf16 world 2" when precisions alternate.
    const std::string what = several ? precision + " " : "";
    for (size_t i = 0; i < worlds.size(); ++i) {
      const BenchWorld& w = worlds[i];
      Recipe r = recipes[i];
      r.train.precision = precision;
      std::vector<json> results;
      for (int k = 1; k <= o.repeats; ++k) {
        std::string label = fmt::format("w{}", w.world);
        if (several) label += "-" + precision;
        if (o.repeats > 1) label += fmt::format("-r{}", k);
        progress(fmt::format("bench train: {}world {} (run {} of {}): {} steps, global batch {}",
                             what, w.world, ++started, total_runs, o.steps,
                             global_batch(r, w.world)));
        results.push_back(runner(r, w, label));
      }
      BenchTrainRow row =
          row_from_results(results, w.world, r.train.batch_per_rank, global_batch(r, w.world));
      row.workers = w.world - server_ranks(r);
      row.precision = precision;
      row.nodes = static_cast<int>(w.hosts.size());
      if (report.peak_tflops) {
        row.mfu = model_flops_utilization(throughput(row, report.tokens), report.flops_per_unit,
                                          w.world, *report.peak_tflops);
        // More FLOPs than the peak allows: the peak is wrong, not the measurement (once).
        if (row.mfu && *row.mfu > 1.0 &&
            std::none_of(report.notes.begin(), report.notes.end(),
                         [](const std::string& n) { return n.starts_with("MFU above 100%"); })) {
          report.notes.push_back(fmt::format(
              "MFU above 100% ({} at world {}): the peak of {} TFLOP/s per device is below "
              "what it did; give its real peak with --peak-tflops",
              mfu_text(row.mfu), w.world, *report.peak_tflops));
          progress("bench train: note: " + report.notes.back());
        }
      }
      report.rows.push_back(row);
      fill_efficiency(report.rows);
      const BenchTrainRow& done = report.rows.back();
      progress(fmt::format(
          "bench train: {}world {}: {:.1f} {}, {:.2f} ms/step, efficiency "
          "{:.1f}%{}",
          what, w.world, throughput(done, report.tokens), throughput_unit(report.tokens),
          done.step_ms, 100.0 * done.efficiency, done.mfu ? ", MFU " + mfu_text(done.mfu) : ""));
    }
  }
}

void check_bench_worlds(const Recipe& recipe, const std::vector<BenchWorld>& worlds,
                        const BenchTrainOptions& options, const std::string& flag,
                        const std::string& source) {
  if (worlds.empty()) return;
  for (const auto& w : worlds) {
    const Recipe r = bench_recipe(recipe, w.world, worlds.front().world, options);
    // What the ranks will parse: the recipe with the benchmark's changes must still be valid.
    parse_recipe(to_json(r), fmt::format("{} (as benchmarked at world size {})", source, w.world),
                 fs::current_path());
    try {
      check_runnable(r, w.world);
    } catch (const Error& e) {
      if (e.kind() != ErrorKind::recipe) throw;
      throw Error(ErrorKind::recipe, fmt::format("{}: world size {}: {}", flag, w.world, e.what()));
    }
  }
}

fs::path create_sweep_dir(const fs::path& dir, const fs::path& runs_root) {
  std::error_code ec;
  fs::path path = dir;
  if (!path.empty()) {
    if (fs::exists(path, ec) && !(fs::is_directory(path, ec) && fs::is_empty(path, ec))) {
      throw Error(ErrorKind::usage,
                  fmt::format("--run-dir {}: already exists and is not an empty directory; "
                              "choose another",
                              path.string()));
    }
  } else {
    // 2026-11-30T08:43:38Z -> 20261130-084338
    std::string stamp;
    for (const char c : utc_timestamp()) {
      if (c >= '0' && c <= '9') stamp += c;
      if (c == 'T') stamp += '-';
    }
    const fs::path base = runs_root / ("bench-train-" + stamp);
    path = base;
    for (int i = 2; fs::exists(path, ec); ++i)
      path = fmt::format("{}-{}", base.string(), i);
  }
  fs::create_directories(path, ec);
  if (ec) {
    // The caller's to fix, as a launch's run directory is: a usage error.
    throw Error(ErrorKind::usage, fmt::format("{}: cannot create the benchmark directory: {}",
                                              printable(path.string()), ec.message()));
  }
  return resolved_path(path);
}

BenchRunner job_runner(const JobSpec& spec, const fs::path& sweep_dir, StatusPrinter* terminal,
                       fs::path* failed_run) {
  return [spec, sweep_dir, terminal, failed_run](const Recipe& recipe, const BenchWorld& world,
                                                 const std::string& label) -> json {
    if (const int sig = pending_stop_signal(); sig != 0) {
      throw Error(sig == SIGTERM ? ErrorKind::terminated : ErrorKind::interrupted,
                  fmt::format("bench train: stopped by {} before world size {}",
                              sig == SIGTERM ? "SIGTERM" : "SIGINT", world.world));
    }
    JobSpec job = spec;
    job.recipe = recipe;
    job.hosts = world.hosts;
    job.world_size = world.world;
    job.nominal_world = world.world;
    job.nodes = {0, 0};
    job.candidates.clear();
    job.benchmark = true;
    RunDirectory run = RunDirectory::create(sweep_dir / label, "", recipe.name);
    run.info()["bench"] = {{"benchmark", "train"}, {"world", world.world}, {"label", label}};
    const fs::path console_path = run.path() / "console.log";
    std::unique_ptr<std::FILE, int (*)(std::FILE*)> console(std::fopen(console_path.c_str(), "w"),
                                                            &std::fclose);
    if (!console) {
      throw Error(ErrorKind::io,
                  fmt::format("{}: cannot create: {}", printable(console_path.string()),
                              std::strerror(errno)));
    }
    // The run a failure from here on is in (cleared once it has its result).
    if (failed_run != nullptr) *failed_run = run.path();
    JobOutcome outcome;
    {
      StatusPrinter status(console.get(), false);
      if (terminal != nullptr) status.mirror_progress(terminal, "bench train: " + label + ": ");
      outcome = run_job(run, job, status);
    }
    // A benchmark's run is never resumed: its checkpoints (a stop's too, which the ranks write
    // on SIGTERM as any run's do) would only fill the disk, however the run ended.
    // (A remote host's agent removes its own: AgentPlan::benchmark.)
    remove_checkpoints(run.path());
    if (outcome.exit_code != 0 && run.info().contains("last_checkpoint")) {
      run.info().erase("last_checkpoint");
      try {
        run.record();
      } catch (const Error&) {  // a full disk: the error below says what matters
      }
    }
    if (outcome.exit_code == 130 || outcome.exit_code == 143) {
      // The job's message would point at a resume, which a benchmark's run never gets.
      const bool term = outcome.exit_code == 143;
      throw Error(term ? ErrorKind::terminated : ErrorKind::interrupted,
                  fmt::format("bench train: stopped by {} during the run at world size {}; a "
                              "benchmark is not resumed: run it again",
                              term ? "SIGTERM" : "SIGINT", world.world));
    }
    if (outcome.exit_code != 0) {
      throw Error(outcome.exit_code == 4 ? ErrorKind::ssh : ErrorKind::rank_failed,
                  fmt::format("bench train: the run at world size {} failed: {}", world.world,
                              outcome.error));
    }
    // The checkpoints' record goes with them: the result, result.json (the same object, written by
    // rank 0 or for a remote one by the launcher) and run.json's copy name no checkpoint. A full
    // disk leaves those files behind; the measurement stands.
    json result = outcome.result;
    result["last_checkpoint"] = nullptr;
    try {
      write_file_atomic(run.path() / "result.json", json_text(result, 2) + "\n");
    } catch (const Error&) {
    }
    run.info().erase("last_checkpoint");
    run.info()["result"] = result;
    run.record();
    result["run_dir"] = run.path().string();
    if (failed_run != nullptr) failed_run->clear();
    return result;
  };
}

}  // namespace dptrain
