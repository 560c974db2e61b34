// The training loop: data-parallel steps over a Communicator, evaluation, metrics, checkpoints.
#include "core/trainer.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <thread>

#include <sys/resource.h>
#include <vector>

#include <fmt/format.h>

#include "core/checkpoint.hpp"
#include "core/checksum.hpp"
#include "core/data/dataset.hpp"
#include "core/data/sampler.hpp"
#include "core/error.hpp"
#include "core/fs.hpp"
#include "core/model/model.hpp"
#include "core/optim/optimizer.hpp"
#include "core/tensor/cpu_ops.hpp"
#include "core/tensor/device.hpp"

namespace dptrain {

namespace fs = std::filesystem;
using nlohmann::json;
using Clock = std::chrono::steady_clock;

nlohmann::json TrainResult::to_json() const {
  nlohmann::json j = {{"steps", steps},
                      {"world_size", world_size},
                      {"final_loss", final_loss},
                      {"eval_loss", eval_loss},
                      {"eval_accuracy", eval_accuracy},
                      {"samples_per_s", samples_per_s},
                      {"params_checksum", params_checksum},
                      {"last_checkpoint", last_checkpoint.string()}};
  if (tokens_per_sample > 0) {
    j["tokens_per_s"] = samples_per_s * static_cast<double>(tokens_per_sample);
  }
  j["phases_ms"] = {{"data", phases_ms[0]},
                    {"compute", phases_ms[1]},
                    {"comm", phases_ms[2]},
                    {"optimizer", phases_ms[3]}};
  j["peak_rss_mib"] = peak_rss_mib;
  return j;
}

namespace {

double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

// Where a step's time goes, in ms: data (sampling, gathering), compute (forward and backward),
// comm (the gradient all-reduce, all of it exposed: nothing overlaps it yet), optimizer
// (clipping, the update, the sampler's advance).
struct PhaseTimes {
  double data = 0, compute = 0, comm = 0, optimizer = 0;
  void add(const PhaseTimes& o) {
    data += o.data;
    compute += o.compute;
    comm += o.comm;
    optimizer += o.optimizer;
  }
  PhaseTimes per(int64_t steps) const {
    const double n = steps > 0 ? static_cast<double>(steps) : 1.0;
    return {data / n, compute / n, comm / n, optimizer / n};
  }
};

// This process's peak resident memory, in MiB.
double peak_rss_mib() {
  rusage usage{};
  ::getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_maxrss) / 1024.0;  // ru_maxrss is in KiB on Linux
}

// The loop's state; one instance per rank and run.
class TrainingRun {
 public:
  TrainingRun(const Recipe& recipe, Communicator& comm, const TrainerOptions& options)
      : recipe_(recipe),
        comm_(comm),
        options_(options),
        rank_(comm.rank()),
        world_(comm.size()),
        nominal_world_(options.nominal_world > 0 ? options.nominal_world : world_),
        micro_batch_(recipe.train.batch_per_rank),
        global_batch_(global_batch(recipe, world_, nominal_world_)),
        micro_batches_(global_batch_ / micro_batch_),
        lr_scale_(recipe.distributed.resize == "scale_lr"
                      ? static_cast<double>(world_) / static_cast<double>(nominal_world_)
                      : 1.0),
        ops_(options.ops ? options.ops : make_ops(recipe.train.device, options.device_index)),
        dtype_(parse_precision(recipe.train.precision)),
        staged_(ops_->device() != "cpu" && !comm.device_memory()),
        model_(make_model(recipe.model, ops_, dtype_)),
        data_(load_data(recipe.data, recipe.model, recipe.seed)),
        sampler_(data_.train->size(), global_batch_, recipe.seed),
        num_params_(model_->num_params()),
        params_buffer_(ops_->allocate(num_params_ * sizeof(float))),
        grad_buffer_(ops_->allocate((num_params_ + 1) * sizeof(float))),
        params_(params_buffer_.as<float>(), num_params_),
        grads_(grad_buffer_.as<float>(), num_params_),
        optimizer_(make_optimizer(recipe.optimizer, num_params_, model_->no_decay(), *ops_)),
        scaler_(recipe.train.precision == "fp16"),
        idx_(static_cast<size_t>(micro_batch_)),
        x_(static_cast<size_t>(micro_batch_ * data_.train->features())),
        y_(static_cast<size_t>(micro_batch_ * data_.train->labels_per_sample())) {
    // A fixed BLAS thread count keeps summation order, and so results, reproducible.
    set_blas_threads(static_cast<int>(recipe.train.threads_per_rank));
  }

  TrainResult run() {
    start();
    const int64_t total = recipe_.train.steps;
    const int64_t warmup = std::min<int64_t>(10, (total - step_) / 5);
    Clock::time_point steady_start = Clock::now();
    int64_t steady_steps = 0;
    Clock::time_point window_start = Clock::now();
    int64_t window_steps = 0;
    PhaseTimes window_phases, steady_phases;
    double last_loss = 0;
    const int64_t first_step = step_;
    first_step_ = step_;
    run_start_ = Clock::now();
    bool stop = false;
    for (; step_ < total && !stop; ++step_) {
      if (options_.progress) options_.progress->set_step(step_);
      mark(Phase::data);
      if (options_.before_step) options_.before_step(step_);
      const auto t0 = Clock::now();
      PhaseTimes phases;
      const double local_loss = compute_gradients(phases);
      float stop_flag = options_.stop_requested && options_.stop_requested() ? 1.0f : 0.0f;
      {
        // Each rank's gradients are already scaled by 1 / (micro-batches in the step), so
        // their sum is the mean over the global batch however the micro-batches were shared.
        ops_->upload(&stop_flag, grad_buffer_.as<float>() + num_params_, sizeof(float));
        const auto tc = Clock::now();
        mark_collective();
        allreduce_gradients(grad_buffer_.as<float>(), num_params_ + 1);
        phases.comm = ms_since(tc);
      }
      mark(Phase::optimizer);
      const auto to = Clock::now();
      ops_->download(grad_buffer_.as<float>() + num_params_, &stop_flag, sizeof(float));
      stop = stop_flag > 0.0f;
      const double norm =
          unscale_and_clip(*ops_, grads_, scaler_.scale(), recipe_.optimizer.clip_grad_norm);
      const double lr = lr_scale_ * learning_rate(recipe_.optimizer, step_, total);
      // fp16: a step whose gradients overflowed is skipped (every rank agrees: the norm comes
      // from the same reduced gradients) and the loss scale shrinks.
      if (scaler_.update(std::isfinite(norm))) optimizer_->step(params_, grads_, lr);
      advance_sampler();
      ops_->synchronize();
      phases.optimizer = ms_since(to);
      if (options_.debug_step_delay_ms > 0) {
        std::this_thread::sleep_for(std::chrono::milliseconds(options_.debug_step_delay_ms));
      }
      const int64_t done = step_ + 1;
      const double step_ms = ms_since(t0);
      ++window_steps;
      window_phases.add(phases);
      if (done - first_step == warmup) {
        steady_start = Clock::now();
        steady_steps = 0;
        steady_phases = {};
      } else {
        ++steady_steps;
        steady_phases.add(phases);
      }
      const bool last = done == total || stop;
      if (done % recipe_.log.every == 0 || last) {
        double loss = local_loss;
        mark_collective();
        comm_.allreduce(&loss, 1, ReduceOp::sum);
        loss /= static_cast<double>(micro_batches_);
        last_loss = loss;
        const double window_s = ms_since(window_start) / 1000.0;
        log_step(done, loss, lr, norm, static_cast<double>(window_steps * global_batch_) / window_s,
                 step_ms, window_phases.per(window_steps));
        window_start = Clock::now();
        window_steps = 0;
        window_phases = {};
      }
      if (recipe_.distributed.check_every > 0 && done % recipe_.distributed.check_every == 0) {
        check_replicas(done);
      }
      if (recipe_.eval.every > 0 && done % recipe_.eval.every == 0 && !last) evaluate(done);
      if (recipe_.checkpoint.every > 0 && done % recipe_.checkpoint.every == 0 && !last) {
        checkpoint(done);
      }
    }
    const double steady_s = ms_since(steady_start) / 1000.0;
    if (stop) return stop_early();
    double peak_rss = peak_rss_mib();
    mark_collective();
    comm_.allreduce(&peak_rss, 1, ReduceOp::max);
    TrainResult result;
    result.peak_rss_mib = peak_rss;
    const PhaseTimes per_step = steady_phases.per(steady_steps);
    result.phases_ms = {per_step.data, per_step.compute, per_step.comm, per_step.optimizer};
    result.steps = step_;
    result.world_size = world_;
    result.tokens_per_sample = tokens_per_sample_;
    result.final_loss = last_loss;
    if (steady_steps > 0 && steady_s > 0) {
      result.samples_per_s = static_cast<double>(steady_steps * global_batch_) / steady_s;
    }
    const auto [eval_loss, eval_acc] = evaluate(step_);
    result.eval_loss = eval_loss;
    result.eval_accuracy = eval_acc;
    result.params_checksum = check_replicas(step_);
    result.last_checkpoint = checkpoint(step_);
    mark(Phase::done);
    if (rank_ == 0) {
      write_file_atomic(options_.run_dir / "result.json", result.to_json().dump(2) + "\n");
      json event = result.to_json();
      event["event"] = "result";
      emit(event);
    }
    return result;
  }

 private:
  // Every rank agreed to stop after step_: checkpoint it and leave; resume continues from it.
  TrainResult stop_early() {
    TrainResult result;
    result.steps = step_;
    result.world_size = world_;
    result.stopped = true;
    result.params_checksum = check_replicas(step_);
    result.last_checkpoint = checkpoint(step_);
    emit({{"event", "info"},
          {"message", fmt::format("stopped on request after step {}; resume continues from {}",
                                  step_, result.last_checkpoint.filename().string())}});
    return result;
  }

  bool writes_checkpoints() const { return rank_ == 0 || options_.node_leader; }

  void start() {
    if (writes_checkpoints()) remove_incomplete_checkpoints(options_.run_dir / "checkpoints");
    if (world_ > micro_batches_) {
      emit({{"event", "info"},
            {"message", fmt::format("{} ranks share {} micro-batches a step: {} rank(s) idle; "
                                    "distributed.resize \"scale_lr\" would use them",
                                    world_, micro_batches_, world_ - micro_batches_)}});
    }
    const fs::path from = resume_source();
    if (from.empty()) {
      fresh_start();
    } else {
      restore(from, source_rank_);
    }
    json rendezvous = {{"event", "rendezvous"},
                       {"world_size", world_},
                       {"nominal_world_size", nominal_world_},
                       {"global_batch", global_batch_},
                       {"step", step_}};
    if (!from.empty()) rendezvous["resumed_from"] = from.filename().string();
    emit(rendezvous);
  }

  void fresh_start() {
    if (rank_ == 0) {
      std::vector<float> host(num_params_);
      model_->init_params(host, recipe_.seed);
      ops_->upload(host.data(), params_.data(), params_.size_bytes());
      // A restart that found no checkpoint starts over, and so do its metrics.
      if (!options_.resume_from.empty()) truncate_metrics_after(0);
    }
    broadcast_device(params_.data(), params_.size_bytes(), 0);
    emit({{"event", "info"},
          {"message", fmt::format("{} on {} rank(s){}, global batch {}", model_->describe(), world_,
                                  device_description(), global_batch_)}});
  }

  // ", cuda:0 (NVIDIA H200), bf16" on a GPU; nothing on the CPU in fp32.
  std::string device_description() const {
    std::string out;
    if (ops_->device() != "cpu") {
      out = ", " + ops_->device();
      const std::string name = cuda_device_name(options_.device_index);
      if (!name.empty()) out += " (" + name + ")";
      out += ", " + comm_.backend();
    }
    if (dtype_ != DType::f32) out += ", " + recipe_.train.precision;
    return out;
  }

  // The collectives the big buffers need: in place on the device when the communicator takes
  // device memory (NCCL, or any communicator on the CPU), else through host memory (Gloo with a
  // GPU).
  void allreduce_device(float* data, size_t count) {
    if (!staged_) {
      comm_.allreduce(data, count, ReduceOp::sum);
      return;
    }
    staging_.resize(count);
    ops_->download(data, staging_.data(), count * sizeof(float));
    comm_.allreduce(staging_.data(), count, ReduceOp::sum);
    ops_->upload(staging_.data(), data, count * sizeof(float));
  }

  // The gradient all-reduce in distributed.compression's wire format: f32 as they are, or cast to
  // fp16/bf16 before the collective (which sums in 16 bits) and back after: half the bytes.
  void allreduce_gradients(float* data, size_t count) {
    if (wire_ == DType::f32) {
      allreduce_device(data, count);
      return;
    }
    ensure(*ops_, wire_buffer_, static_cast<int64_t>(count), wire_);
    ops_->cast(data, DType::f32, wire_buffer_.data(), wire_, static_cast<int64_t>(count));
    if (staged_) {
      wire_staging_.resize(count);
      ops_->download(wire_buffer_.data(), wire_staging_.data(), count * sizeof(uint16_t));
      allreduce_16bit(wire_staging_.data(), count);
      ops_->upload(wire_staging_.data(), wire_buffer_.data(), count * sizeof(uint16_t));
    } else {
      allreduce_16bit(wire_buffer_.data(), count);
    }
    ops_->cast(wire_buffer_.data(), wire_, data, DType::f32, static_cast<int64_t>(count));
  }

  void allreduce_16bit(void* data, size_t count) {
    if (wire_ == DType::bf16) {
      comm_.allreduce(static_cast<BFloat16*>(data), count, ReduceOp::sum);
    } else {
      comm_.allreduce(static_cast<Half*>(data), count, ReduceOp::sum);
    }
  }

  void broadcast_device(void* data, size_t bytes, int root) {
    if (!staged_) {
      comm_.broadcast(data, bytes, root);
      return;
    }
    staging_.resize((bytes + sizeof(float) - 1) / sizeof(float));
    if (rank_ == root) ops_->download(data, staging_.data(), bytes);
    comm_.broadcast(staging_.data(), bytes, root);
    ops_->upload(staging_.data(), data, bytes);
  }

  // A device buffer's floats on the host (checkpoints, checksums).
  std::vector<float> to_host(std::span<const float> device) {
    std::vector<float> out(device.size());
    ops_->download(device.data(), out.data(), device.size_bytes());
    return out;
  }

  // The checkpoint to continue from and the rank that reads it (source_rank_); empty: a fresh
  // start. For "newest" every node leader looks in its own run_dir and the newest step wins.
  fs::path resume_source() {
    const std::string& how = options_.resume_from.native();
    source_rank_ = 0;
    if (how != "newest" && how != "newest-or-start") return options_.resume_from;
    fs::path mine;
    int64_t my_step = -1;
    if (writes_checkpoints()) {
      try {
        mine =
            find_valid_checkpoint(options_.run_dir / "checkpoints", [this](const std::string& w) {
              emit({{"event", "info"}, {"message", "warning: " + w}});
            });
        my_step = checkpoint_step(mine);
      } catch (const Error&) {
        // None on this node.
      }
    }
    std::vector<int64_t> steps(static_cast<size_t>(world_));
    mark_collective();
    comm_.allgather(&my_step, sizeof(my_step), steps.data());
    const auto newest = std::max_element(steps.begin(), steps.end());
    if (*newest < 0) {
      if (how == "newest") {
        throw Error(
            ErrorKind::checkpoint,
            fmt::format("no valid checkpoint on any of the {} node(s) of this run", world_));
      }
      return {};
    }
    source_rank_ = static_cast<int>(newest - steps.begin());
    // Every rank needs the name only for messages; the source rank holds the real path.
    return rank_ == source_rank_ ? mine : fs::path(checkpoint_name(*newest));
  }

  // One rank (rank 0, or the node leader that holds the newest checkpoint) reads it and
  // broadcasts it, so ranks on other nodes need no copy.
  void restore(const fs::path& dir, int source) {
    // step, epoch, samples_in_epoch, optimizer_steps, loss scale (a power of two), its clean steps
    std::vector<int64_t> header(6, 0);
    if (rank_ == source) {
      CheckpointData ckpt = read_checkpoint(dir);
      const auto& p = ckpt.position;
      if (p.recipe_hash != recipe_hash(recipe_)) {
        throw Error(ErrorKind::checkpoint,
                    fmt::format("{}: written by a different recipe (hash {}, this recipe {})",
                                dir.string(), p.recipe_hash, recipe_hash(recipe_)));
      }
      if (ckpt.params.size() != params_.size() ||
          ckpt.optimizer_state.size() != optimizer_->state().size()) {
        throw Error(ErrorKind::checkpoint,
                    fmt::format("{}: holds {} parameters, the model has {}", dir.string(),
                                ckpt.params.size(), params_.size()));
      }
      ops_->upload(ckpt.params.data(), params_.data(), params_.size_bytes());
      const auto state = optimizer_->state();
      ops_->upload(ckpt.optimizer_state.data(), state.data(), state.size_bytes());
      header = {p.step,
                p.epoch,
                p.samples_in_epoch,
                p.optimizer_steps,
                static_cast<int64_t>(p.loss_scale),
                p.loss_scale_clean_steps};
    }
    comm_.broadcast(header.data(), header.size() * sizeof(int64_t), source);
    broadcast_device(params_.data(), params_.size_bytes(), source);
    const auto state = optimizer_->state();
    broadcast_device(state.data(), state.size_bytes(), source);
    scaler_.restore(static_cast<double>(header[4]), header[5]);
    step_ = header[0];
    // Positions count samples: under another global batch (scale_lr on another world size) the
    // next step starts right where the last one ended, and no sample of the epoch is skipped or
    // seen twice.
    position_ = sampler_.normalize({header[1], header[2]});
    optimizer_->set_steps(header[3]);
    if (rank_ == 0) truncate_metrics_after(step_);
    std::string where = source == 0 ? "" : fmt::format(" (read on rank {})", source);
    emit({{"event", "info"},
          {"message", fmt::format("resumed from {}{} at step {} on {} rank(s), global batch {}",
                                  dir.filename().string(), where, step_, world_, global_batch_)}});
  }

  void mark(Phase phase) {
    if (options_.progress) options_.progress->enter(phase);
  }
  void mark_collective() {
    if (options_.progress) options_.progress->enter_collective();
  }

  // This rank's micro-batches j = rank, rank + world, ... of the step's global batch; the
  // gradients are summed scaled by 1 / (micro-batches in the step). Returns the sum of their
  // mean losses.
  double compute_gradients(PhaseTimes& phases) {
    mark(Phase::compute);
    ops_->fill_zero(grads_.data(), grads_.size_bytes());
    // fp16: the loss scale rides on the gradient scale; unscale_and_clip takes it off.
    const float scale = static_cast<float>(scaler_.scale()) / static_cast<float>(micro_batches_);
    double loss = 0;
    for (int64_t j = rank_; j < micro_batches_; j += world_) {
      const auto td = Clock::now();
      sampler_.indices(position_, j * micro_batch_, idx_);
      data_.train->gather(idx_, x_.data(), y_.data());
      const auto tf = Clock::now();
      phases.data += std::chrono::duration<double, std::milli>(tf - td).count();
      loss += model_->forward_backward(params_, Batch{x_.data(), y_.data(), micro_batch_}, grads_,
                                       scale);
      // The device queues work ahead of the host: wait so the phase times are true.
      ops_->synchronize();
      phases.compute += ms_since(tf);
    }
    return loss;
  }

  void advance_sampler() { position_ = sampler_.advance(position_); }

  void log_step(int64_t step, double loss, double lr, double norm, double samples_per_s,
                double step_ms, const PhaseTimes& phases) {
    if (rank_ != 0) return;
    json line = {{"step", step},
                 {"epoch", position_.epoch},
                 {"loss", loss},
                 {"lr", lr},
                 {"grad_norm", norm},
                 {"samples_per_s", samples_per_s},
                 {"step_ms", step_ms},
                 {"data_ms", phases.data},
                 {"compute_ms", phases.compute},
                 {"comm_ms", phases.comm},
                 {"optimizer_ms", phases.optimizer},
                 {"grad_bytes", (num_params_ + 1) * dtype_size(wire_)}};
    if (tokens_per_sample_ > 0) {
      line["tokens_per_s"] = samples_per_s * static_cast<double>(tokens_per_sample_);
    }
    append_line(options_.run_dir / "metrics.jsonl", line.dump());
    json event = line;
    event["event"] = "progress";
    event["steps"] = recipe_.train.steps;
    const int64_t done_here = step - first_step_;
    if (done_here > 0) {
      event["eta_s"] = ms_since(run_start_) / 1000.0 / static_cast<double>(done_here) *
                       static_cast<double>(recipe_.train.steps - step);
    }
    emit(event);
  }

  // Each rank scores a strided shard of the held-out split; the sums are reduced.
  std::pair<double, double> evaluate(int64_t step) {
    mark(Phase::eval);
    const auto& eval = *data_.eval;
    int64_t n = eval.size();
    if (recipe_.eval.max_samples > 0) n = std::min(n, recipe_.eval.max_samples);
    double sums[3] = {0, 0, 0};  // loss_sum, correct, count
    constexpr int64_t kChunk = 512;
    std::vector<int64_t> idx;
    std::vector<float> x;
    std::vector<int32_t> y;
    for (int64_t begin = rank_ * kChunk; begin < n; begin += world_ * kChunk) {
      const int64_t count = std::min(kChunk, n - begin);
      idx.resize(static_cast<size_t>(count));
      for (int64_t i = 0; i < count; ++i)
        idx[static_cast<size_t>(i)] = begin + i;
      x.resize(static_cast<size_t>(count * eval.features()));
      y.resize(static_cast<size_t>(count * eval.labels_per_sample()));
      eval.gather(idx, x.data(), y.data());
      const EvalStats s = model_->evaluate(params_, Batch{x.data(), y.data(), count});
      sums[0] += s.loss_sum;
      sums[1] += static_cast<double>(s.correct);
      sums[2] += static_cast<double>(s.count);
    }
    mark_collective();
    comm_.allreduce(sums, 3, ReduceOp::sum);
    if (sums[2] == 0) return {0.0, 0.0};
    const double loss = sums[0] / sums[2];
    const double accuracy = sums[1] / sums[2];
    if (rank_ == 0) {
      const json line = {{"step", step}, {"eval_loss", loss}, {"eval_accuracy", accuracy}};
      append_line(options_.run_dir / "metrics.jsonl", line.dump());
      json event = line;
      event["event"] = "eval";
      emit(event);
    }
    return {loss, accuracy};
  }

  // Every rank must hold the same parameters; a mismatch means a bug or a bad node.
  std::string check_replicas(int64_t step) {
    const std::vector<float> host = to_host(params_);
    const uint64_t mine = checksum64(host.data(), host.size() * sizeof(float));
    std::vector<uint64_t> all(static_cast<size_t>(world_));
    mark_collective();
    comm_.allgather(&mine, sizeof(mine), all.data());
    for (int r = 0; r < world_; ++r) {
      if (all[static_cast<size_t>(r)] != all[0]) {
        throw Error(
            ErrorKind::comm,
            fmt::format("rank {} parameters diverged from rank 0 at step {} (checksum {} "
                        "vs {})",
                        r, step, checksum_hex(all[static_cast<size_t>(r)]), checksum_hex(all[0])));
      }
    }
    return checksum_hex(mine);
  }

  fs::path checkpoint(int64_t step) {
    mark(Phase::checkpoint);
    fs::path written;
    if (writes_checkpoints()) {
      TrainingPosition pos;
      pos.step = step;
      pos.epoch = position_.epoch;
      pos.samples_in_epoch = position_.sample;
      pos.world_size = world_;
      pos.global_batch = global_batch_;
      pos.optimizer_steps = optimizer_->steps();
      pos.recipe_hash = recipe_hash(recipe_);
      pos.rng_state = fmt::format("sampler seed={} epoch={}", recipe_.seed, position_.epoch);
      pos.loss_scale = scaler_.scale();
      pos.loss_scale_clean_steps = scaler_.clean_steps();
      std::function<void()> hook;
      if (options_.before_checkpoint_commit) {
        hook = [this, step] { options_.before_checkpoint_commit(step); };
      }
      written = write_checkpoint(options_.run_dir / "checkpoints", pos, to_host(params_),
                                 to_host(optimizer_->state()), recipe_.checkpoint.keep, hook);
      emit({{"event", "checkpoint"}, {"step", step}, {"path", written.string()}});
    } else {
      written = options_.run_dir / "checkpoints" / checkpoint_name(step);
    }
    // Nobody runs ahead of a checkpoint being written: a failure right after it loses nothing.
    mark_collective();
    comm_.barrier();
    return written;
  }

  void truncate_metrics_after(int64_t step) {
    dptrain::truncate_metrics_after(options_.run_dir / "metrics.jsonl", step);
  }

  void emit(const json& event) {
    if (rank_ == 0 && options_.on_event) options_.on_event(event);
  }

  const Recipe& recipe_;
  Communicator& comm_;
  const TrainerOptions& options_;
  const int rank_;
  const int world_;
  const int nominal_world_;
  const int64_t micro_batch_;
  const int64_t global_batch_;
  const int64_t micro_batches_;  // per step, over all ranks
  const double lr_scale_;
  std::shared_ptr<Ops> ops_;
  const DType dtype_;
  // Gloo on a GPU: the big collectives go through host memory (staging_).
  const bool staged_;
  std::unique_ptr<Model> model_;
  DataSplits data_;
  // A token model's context: tokens/s = samples/s x this (0 for other data).
  const int64_t tokens_per_sample_ = data_.train->labels_per_sample() > 1
                                         ? data_.train->labels_per_sample() - 1
                                         : 0;
  DistributedSampler sampler_;
  const size_t num_params_;
  Buffer params_buffer_;
  // The gradients plus one slot: the stop flag rides along with the gradient all-reduce, so
  // agreeing to stop costs no extra collective.
  Buffer grad_buffer_;
  std::span<float> params_;  // device memory of ops_, as are grads_ and the optimizer's state
  std::span<float> grads_;
  std::unique_ptr<Optimizer> optimizer_;
  LossScaler scaler_;
  std::vector<float> staging_;
  // distributed.compression: the gradients' type on the wire (f32: none).
  const DType wire_ = recipe_.distributed.compression.type == "none"
                          ? DType::f32
                          : parse_precision(recipe_.distributed.compression.type);
  Buffer wire_buffer_;                  // the gradients cast to wire_, on the device
  std::vector<uint16_t> wire_staging_;  // and on the host, for Gloo with a GPU
  std::vector<int64_t> idx_;
  std::vector<float> x_;
  std::vector<int32_t> y_;
  int64_t step_ = 0;
  int64_t first_step_ = 0;
  Clock::time_point run_start_;
  DataPosition position_;
  int source_rank_ = 0;
};

}  // namespace

void truncate_metrics_after(const fs::path& metrics_file, int64_t step) {
  std::error_code ec;
  if (!fs::exists(metrics_file, ec)) return;
  std::string kept;
  const std::string text = read_file(metrics_file);
  size_t pos = 0;
  while (pos < text.size()) {
    size_t end = text.find('\n', pos);
    if (end == std::string::npos) end = text.size();
    const std::string line = text.substr(pos, end - pos);
    pos = end + 1;
    const json j = json::parse(line, nullptr, false);
    if (j.is_discarded() || !j.contains("step")) continue;  // a torn last line from the crash
    if (j["step"].get<int64_t>() <= step) kept += line + "\n";
  }
  write_file_atomic(metrics_file, kept);
}

int64_t global_batch(const Recipe& recipe, int world_size, int nominal_world) {
  const int batch_world =
      recipe.distributed.resize == "scale_lr" || nominal_world <= 0 ? world_size : nominal_world;
  return batch_world * recipe.train.batch_per_rank * recipe.train.grad_accum;
}

void check_runnable(const Recipe& recipe, int world_size, int nominal_world) {
  const DataSplits data = load_data(recipe.data, recipe.model, recipe.seed);
  DistributedSampler sampler(data.train->size(), global_batch(recipe, world_size, nominal_world),
                             recipe.seed);
}

TrainResult train(const Recipe& recipe, Communicator& comm, const TrainerOptions& options) {
  TrainingRun run(recipe, comm, options);
  return run.run();
}

}  // namespace dptrain
