// The training loop: data-parallel steps over a Communicator, evaluation, metrics, checkpoints.
#include "core/trainer.hpp"

#include <algorithm>
#include <array>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <numeric>
#include <optional>
#include <random>
#include <thread>

#include <sys/resource.h>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/checkpoint.hpp"
#include "core/checksum.hpp"
#include "core/data/dataset.hpp"
#include "core/data/sampler.hpp"
#include "core/ddp/codec.hpp"
#include "core/ddp/reducer.hpp"
#include "core/error.hpp"
#include "core/fs.hpp"
#include "core/json_error.hpp"
#include "core/model/model.hpp"
#include "core/optim/optimizer.hpp"
#include "core/tensor/blas.hpp"
#include "core/tensor/cpu_ops.hpp"
#include "core/tensor/device.hpp"

namespace dptrain {

namespace fs = std::filesystem;
using nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

// A value, or null for a NaN (none).
nlohmann::json or_null(double v) {
  return std::isnan(v) ? nlohmann::json(nullptr) : nlohmann::json(v);
}

}  // namespace

nlohmann::json TrainResult::to_json() const {
  nlohmann::json j = {{"steps", steps},
                      {"world_size", world_size},
                      {"final_loss", or_null(final_loss)},
                      {"eval_loss", or_null(eval_loss)},
                      {"eval_accuracy", or_null(eval_accuracy)},
                      {"samples_per_s", or_null(samples_per_s)},
                      {"params_checksum", params_checksum},
                      {"last_checkpoint", last_checkpoint.string()}};
  if (tokens_per_sample > 0) {
    j["tokens_per_s"] = or_null(samples_per_s * static_cast<double>(tokens_per_sample));
  }
  j["phases_ms"] = nlohmann::json::object();
  for (size_t i = 0; i < phases_ms.size(); ++i)
    j["phases_ms"][TrainResult::kPhaseNames[i]] = phases_ms[i];
  j["comm_total_ms"] = comm_total_ms;
  // A count of bytes; null where no step here measured it (NaN).
  j["bytes_per_step"] = std::isfinite(bytes_per_step) ? nlohmann::json(std::llround(bytes_per_step))
                                                      : nlohmann::json(nullptr);
  j["optimizer_state_mib"] = optimizer_state_mib;
  j["peak_rss_mib"] = peak_rss_mib;
  return j;
}

namespace {

double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

// Where a step's time goes, in ms: data (sampling, gathering), compute (forward and backward),
// comm (the communication the step waited for: the exposed part), optimizer (clipping, the
// update, ZeRO's parameter all-gather, local SGD's averaging, the sampler's advance). Besides:
// comm_total, all the communication (overlapped or not), and the bytes this rank sent.
struct PhaseTimes {
  double data = 0, compute = 0, comm = 0, optimizer = 0, comm_total = 0, bytes = 0;
  double step = 0;  // the step's whole time, as logged (step_ms)
  void add(const PhaseTimes& o) {
    step += o.step;
    data += o.data;
    compute += o.compute;
    comm += o.comm;
    optimizer += o.optimizer;
    comm_total += o.comm_total;
    bytes += o.bytes;
  }
  PhaseTimes per(int64_t steps) const {
    const double n = steps > 0 ? static_cast<double>(steps) : 1.0;
    return {data / n, compute / n, comm / n, optimizer / n, comm_total / n, bytes / n, step / n};
  }
  // A collective nothing overlaps (the stop flag's, the logged loss's): exposed communication.
  void add_exposed_comm(double ms) {
    comm += ms;
    comm_total += ms;
  }
};

// ceil(a / b)
size_t ceil_div(size_t a, size_t b) {
  return (a + b - 1) / b;
}

// One shard of `n` values split `shards` ways, rounded up to 64 floats (256 bytes), so every
// shard starts where NCCL and the device kernels take their aligned paths.
size_t shard_size(size_t n, size_t shards) {
  constexpr size_t kAlign = 64;
  return ceil_div(ceil_div(n, shards), kAlign) * kAlign;
}

// This process's peak resident memory, in MiB.
double peak_rss_mib() {
  rusage usage{};
  ::getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_maxrss) / 1024.0;  // ru_maxrss is in KiB on Linux
}

// The job's nominal world size: this rank's own (TrainerOptions::nominal_world), else rank 0's,
// else the world size. A rank started without one (by hand, or by a scheduler that gives it to
// rank 0 alone) takes rank 0's, which may be the one the run records: workers started again by
// hand on fewer ranks keep the run's global batch. Ranks given different ones are refused by
// check_same_start.
int agreed_nominal_world(Communicator& comm, const TrainerOptions& options) {
  int64_t rank0 = options.nominal_world;
  if (comm.size() > 1) {
    if (options.progress) options.progress->enter_collective("broadcast of the nominal world size");
    comm.broadcast(&rank0, sizeof rank0, 0);
    // Starting again (loading the data), which the hang watch tells from waiting in a collective.
    if (options.progress) options.progress->enter(Phase::starting);
  }
  if (options.nominal_world > 0) return options.nominal_world;
  return rank0 > 0 ? static_cast<int>(rank0) : comm.size();
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
        nominal_world_(agreed_nominal_world(comm, options)),
        servers_(server_ranks(recipe)),
        data_world_(world_ - servers_),
        data_rank_(rank_ < data_world_ ? rank_ : -1),
        micro_batch_(recipe.train.batch_per_rank),
        global_batch_(global_batch(recipe, world_, nominal_world_)),
        micro_batches_(global_batch_ / micro_batch_),
        // As the global batch scales: by the workers (parameter servers compute no gradients).
        lr_scale_(recipe.distributed.resize == "scale_lr" && nominal_world_ > servers_
                      ? static_cast<double>(data_world_) /
                            static_cast<double>(nominal_world_ - servers_)
                      : 1.0),
        ops_(options.ops ? options.ops : make_ops(recipe.train.device, options.device_index)),
        dtype_(parse_precision(recipe.train.precision)),
        staged_(ops_->device() != "cpu" && !comm.device_memory()),
        model_(make_model(recipe.model, ops_, dtype_)),
        data_(load_data(recipe.data, recipe.model, recipe.seed)),
        sampler_(data_.train->size(), global_batch_, recipe.seed),
        num_params_(model_->num_params()),
        shard_(shards_ > 1 ? shard_size(num_params_, static_cast<size_t>(shards_)) : num_params_),
        padded_(shard_ * static_cast<size_t>(shards_)),
        params_buffer_(ops_->allocate(padded_ * sizeof(float))),
        grad_buffer_(ops_->allocate((padded_ + 1) * sizeof(float))),
        params_(params_buffer_.as<float>(), num_params_),
        grads_(grad_buffer_.as<float>(), num_params_),
        optimizer_(make_optimizer(recipe.optimizer, shard_index_ >= 0 ? shard_ : 0,
                                  shard_no_decay(), *ops_)),
        scaler_(recipe.train.precision == "fp16"),
        idx_(static_cast<size_t>(micro_batch_)),
        x_(static_cast<size_t>(micro_batch_ * data_.train->features())),
        y_(static_cast<size_t>(micro_batch_ * data_.train->labels_per_sample())) {
    // A fixed BLAS thread count keeps summation order, and so results, reproducible. A GPU rank
    // does not load OpenBLAS for it (nor at all, unless something multiplies on the CPU).
    if (recipe.train.device == "cpu") {
      set_blas_threads(static_cast<int>(recipe.train.threads_per_rank));
    }
    if (shards_ > 1) {
      // The padding past the last parameter stays zero: reduce-scatter and all-gather move it.
      ops_->fill_zero(params_buffer_.data(), padded_ * sizeof(float));
      ops_->fill_zero(grad_buffer_.data(), (padded_ + 1) * sizeof(float));
    }
    // ZeRO-1 by reduce-scatter (NCCL) needs its shard's gradients, on one rank too.
    if (zero_ && !zero_by_allreduce_) shard_grads_ = ops_->allocate(shard_ * sizeof(float));
    if ((!zero_ || zero_by_allreduce_) && !ps_ && (!local_sgd_ || recipe.distributed.start > 0)) {
      ReducerOptions reducer;
      reducer.bucket_elems = bucket_elements(recipe.distributed.bucket_mb);
      reducer.overlap = recipe.distributed.overlap;
      reducer.compression = recipe.distributed.compression;
      reducer.staged = staged_;
      reducer.seed = recipe.seed;
      reducer.progress = options.progress;
      reducer_ = std::make_unique<GradientReducer>(
          comm, *ops_, std::span<float>(grad_buffer_.as<float>(), num_params_), model_->tensors(),
          reducer);
      model_->on_gradients_ready([this](size_t from) { reducer_->ready(from); });
      flag_at_ = num_params_;  // where the reducer sums it: right after the gradients
    }
  }

  TrainResult run() {
    if (!start()) {
      TrainResult done;
      done.already_completed = true;
      return done;
    }
    if (server_) return serve();
    const int64_t total = recipe_.train.steps;
    const int64_t warmup = warmup_steps(total - step_);
    Clock::time_point steady_start = Clock::now();
    int64_t steady_steps = 0;
    Clock::time_point window_start = Clock::now();
    Clock::time_point shown = Clock::now();  // the last progress or tick event
    int64_t window_steps = 0;
    PhaseTimes window_phases, steady_phases;
    const int64_t first_step = step_;
    run_start_ = Clock::now();
    bool stop = false;
    for (; step_ < total && !stop; ++step_) {
      if (options_.progress) options_.progress->set_step(step_);
      mark(Phase::data);
      if (options_.before_step) options_.before_step(step_);
      const auto t0 = Clock::now();
      const int64_t done = step_ + 1;
      PhaseTimes phases;
      float stop_flag = stop_asked() ? 1.0f : 0.0f;
      // local_sgd after its synchronous start: this rank steps on its own gradients.
      const bool local = local_sgd_ && step_ >= recipe_.distributed.start;
      const double local_loss = compute_gradients(phases, local, stop_flag);
      if (!local && !ps_) stop = exchange_gradients(phases, stop_flag);
      // A worker of the parameter-server mode pushes its gradients and pulls the parameters; the
      // servers tell it the gradient norm.
      double norm = ps_ ? push_and_pull(done, phases) : 0.0;
      // The step the servers chose to stop after (a stop asked for on any rank): all ranks meet.
      if (ps_ && done == ps_stop_at_) stop = true;
      mark(Phase::optimizer);
      const auto to = Clock::now();
      const double exposed_before_update = phases.comm;
      const double lr = lr_scale_ * learning_rate(recipe_.optimizer, step_, total);
      // fp16 above the smallest loss scale: an overflow is a skipped step and a smaller scale.
      const bool overflow_skips = scaler_.enabled() && scaler_.scale() > 1.0;
      if (!ps_) norm = update(lr, local, phases);
      if (!std::isfinite(norm) && !overflow_skips) throw diverged(done, "gradient norm", norm);
      const bool averaged = local && averaging_step(done);
      if (averaged) stop = average_replicas(stop_flag, phases);
      // Local SGD between averagings: a stop waits for the next one where that comes soon, else
      // it is taken at this step's end (below).
      const bool stop_waits = local && !averaged && local_stop_waits(done);
      const int64_t batch_epoch = position_.epoch;  // the epoch this step's batch came from
      advance_sampler();
      ops_->synchronize();
      // ZeRO-1's all-gather and local SGD's averaging happen in this phase but are communication.
      phases.optimizer = ms_since(to) - (phases.comm - exposed_before_update);
      if (options_.debug_step_delay_ms > 0) {
        std::this_thread::sleep_for(std::chrono::milliseconds(options_.debug_step_delay_ms));
      }
      // A stop asked for while this step ran is answered at its end, not after one more step
      // (the flag that rode the gradient exchange was read as the step began): a long step's
      // stop must fit the launcher's grace. A log step carries it on the loss's all-reduce; the
      // others, when the steps are long (TrainerOptions::stop_check_step_ms), on their own.
      // Local SGD's steps too (every rank counts the same steps), but for an averaging, which
      // took the flag, and those whose stop waits for it; short ones every
      // local_stop_check_interval() steps (no gradient exchange takes their stop, and the next
      // log step may be far off). Not parameter servers (their workers may be steps apart: the
      // servers choose a step to stop after, ps_stop_at_, from the requests the pushes carry).
      // Every rank makes this call, whether or not it has a stop_requested. The ranks' step times
      // ride along (mean_step_ms_).
      const bool check_due = local
                                 ? stop_check_each_step_ || done % local_stop_check_interval() == 0
                                 : stop_check_each_step_;
      if (!stop && !averaged && !stop_waits && !ps_ && !log_step_due(done, false) && check_due) {
        // (In f64, as the loss's: a sum of 0s and 1s.)
        double sums[2] = {stop_asked() ? 1.0 : 0.0, ms_since(t0)};
        const auto ts = Clock::now();
        mark_collective("allreduce of the stop flag");
        comm_.allreduce(sums, 2, ReduceOp::sum);
        if (world_ > 1) phases.add_exposed_comm(ms_since(ts));  // one rank: no one to wait for
        stop = sums[0] > 0.5;
        mean_step_ms_ = sums[1] / static_cast<double>(world_);
      }
      // A log step sums the loss over the ranks (the stop requests riding along): communication
      // that waits for the slowest rank as the gradients' does, counted as exposed and in the
      // step's time (the ranks compare the time before it for stop_check_each_step_).
      const bool logging = log_step_due(done, stop);
      double loss = local_loss;
      if (logging) {
        const auto tl = Clock::now();
        stop = sum_loss_and_stop(loss, stop, /*take_stop=*/!stop_waits, ms_since(t0));
        if (world_ > 1) phases.add_exposed_comm(ms_since(tl));
      }
      // Local SGD stopping between its averagings: its replicas differ, and a checkpoint holds one
      // model. They are averaged now, not at the next scheduled averaging, which is further off
      // than a stop's grace may be (the work since the last checkpoint would be lost): an early
      // averaging, as a checkpoint.every step's, that an uninterrupted run does not have. (Its
      // time adds to the step's communication so far.)
      if (stop && local && !averaged) {
        PhaseTimes averaging;
        average_replicas(1.0f, averaging);
        phases.add_exposed_comm(averaging.comm);
        phases.bytes += averaging.bytes;
      }
      phases.step = ms_since(t0);
      ++window_steps;
      window_phases.add(phases);
      if (done - first_step == warmup) {
        ops_->restart_profile();
        steady_start = Clock::now();
        steady_steps = 0;
        steady_phases = {};
      } else {
        ++steady_steps;
        steady_phases.add(phases);
      }
      if (logging) {
        shown = Clock::now();
        loss /= static_cast<double>(micro_batches_);
        // fp16 above the smallest scale: an overflowed forward is a skipped step, as above.
        if (!std::isfinite(loss) && !overflow_skips) throw diverged(done, "loss", loss);
        last_loss_ = loss;
        const double window_s = ms_since(window_start) / 1000.0;
        log_step(done, batch_epoch, loss, lr, norm,
                 static_cast<double>(window_steps) * static_cast<double>(global_batch_) / window_s,
                 window_phases.per(window_steps));
        window_start = Clock::now();
        window_steps = 0;
        window_phases = {};
      } else if (rank_ == 0 && ms_since(shown) >= 1000.0) {
        // Slow steps between log steps: a terminal's progress line still moves (the step and
        // the time left; the loss is summed over the ranks only at log steps).
        shown = Clock::now();
        json tick = {{"event", "tick"}, {"step", done}, {"steps", total}};
        if (const auto eta = eta_s(done)) tick["eta_s"] = *eta;
        emit(tick);
      }
      // Steps done: what an evaluation or checkpoint after this step reports in the heartbeat.
      if (options_.progress) options_.progress->set_step(done);
      periodic_work(done, done == total || stop);
    }
    const double steady_s = ms_since(steady_start) / 1000.0;
    // A stop agreed on at the last step finds nothing left to stop: the run completes.
    if (stop && step_ < total) return stop_early();
    TrainResult result;
    // Measured per steady step; none (null in result.json, as samples_per_s) when this
    // invocation ran no step (a resume from the final checkpoint).
    const double none = std::numeric_limits<double>::quiet_NaN();
    const PhaseTimes per_step = steady_steps > 0
                                    ? steady_phases.per(steady_steps)
                                    : PhaseTimes{none, none, none, none, none, none, none};
    result.phases_ms = {per_step.data, per_step.compute, per_step.comm, per_step.optimizer};
    result.comm_total_ms = per_step.comm_total;
    result.bytes_per_step = per_step.bytes;
    result.optimizer_state_mib = optimizer_state_mib();
    result.steps = step_;
    result.world_size = world_;
    result.tokens_per_sample = tokens_per_sample_;
    result.final_loss = last_loss_;
    if (steady_steps > 0 && steady_s > 0) {
      result.samples_per_s =
          static_cast<double>(steady_steps) * static_cast<double>(global_batch_) / steady_s;
    }
    return finish(result);
  }

 private:
  // The end of a run on every rank (parameter servers too): peak memory, the final evaluation,
  // replica check and checkpoint; rank 0 writes result.json.
  TrainResult finish(TrainResult& result) {
    // The most any rank holds: under ps rank 0 is a worker, which holds no optimizer state.
    double maxima[2] = {peak_rss_mib(), result.optimizer_state_mib};
    mark_collective("allreduce of the peak memory and optimizer state");
    comm_.allreduce(maxima, 2, ReduceOp::max);
    result.peak_rss_mib = maxima[0];
    result.optimizer_state_mib = maxima[1];
    // Resumed at the last step from the run directory's own checkpoint of it (the run ended
    // after its final checkpoint, before it was recorded as done): nothing trained here. The
    // evaluation at this step is in metrics.jsonl already, and the checkpoint is this step's:
    // neither is made again. The run's measurements stand, where result.json holds this state.
    // Rank 0's word, as the checkpoint's collectives are every rank's.
    bool again = resumed_ && step_ == first_step_;
    if (again) {
      int64_t own = 0;
      if (rank_ == 0) {
        const std::string& how = options_.resume_from.native();
        std::error_code ec;
        // "newest": rank 0's own only where it read it (another node's is not in its directory).
        own =
            ((how == "newest" || how == "newest-or-start") && source_rank_ == 0) ||
            fs::weakly_canonical(options_.resume_from, ec) ==
                fs::weakly_canonical(options_.run_dir / "checkpoints" / checkpoint_name(step_), ec);
      }
      mark_collective("broadcast of whether the run's own final checkpoint was resumed");
      comm_.broadcast(&own, sizeof(own), 0);
      again = own != 0;
    }
    const auto [eval_loss, eval_acc] = evaluate(step_, /*record=*/!again);
    result.eval_loss = eval_loss;
    result.eval_accuracy = eval_acc;
    result.params_checksum = check_replicas(step_);
    result.last_checkpoint =
        again ? options_.run_dir / "checkpoints" / checkpoint_name(step_) : checkpoint(step_);
    mark(Phase::done);
    if (again && rank_ == 0) keep_measurements(result);
    if (rank_ == 0) {
      // The event first: from it on, a stop signal no longer ends the run as interrupted (the
      // worker's), so a result.json on disk is never one of a run recorded as interrupted.
      json event = result.to_json();
      event["event"] = "result";
      emit(event);
      run_file_write([&] {
        write_file_atomic(options_.run_dir / "result.json", json_text(result.to_json(), 2) + "\n");
      });
    }
    return result;
  }

  // A loss or gradient norm that is not finite at step `done`: what a restart from a checkpoint
  // would meet again (the training is deterministic), so the error is the recipe's (exit 2 from a
  // rank, which the launcher does not restart). Thrown on every rank alike where the value is
  // the ranks' common one (the reduced gradients' norm of all-reduce and ZeRO, the summed loss);
  // a local SGD step's norm is its rank's own, and a parameter server's workers may see it at
  // different steps: there the first rank to find it fails and the launcher stops the others.
  // Always before the step's checkpoint, so none holds the non-finite values.
  Error diverged(int64_t done, const char* what, double value) const {
    return Error(
        ErrorKind::recipe,
        fmt::format("rank {}: the training diverged at step {} (after {} done): its {} is {}; a "
                    "restart would diverge again: lower /optimizer/lr or set "
                    "/optimizer/clip_grad_norm, and launch again",
                    rank_, done, done - 1, what,
                    std::isnan(value) ? "nan" : fmt::format("{}", value)));
  }

  // Whether this rank was asked to stop (TrainerOptions::stop_requested): how each mode's ranks
  // then agree on where is theirs (the gradient exchange, a stop sum, an averaging, a push).
  bool stop_asked() const { return options_.stop_requested && options_.stop_requested(); }

  // Whether step `done` ends with the loss summed over the ranks (and logged): every log.every
  // steps, at the end, and when stopping.
  bool log_step_due(int64_t done, bool stop) const {
    return done % recipe_.log.every == 0 || done == recipe_.train.steps || stop;
  }

  // Sums `loss` over the ranks, the stop requests riding along (a stop asked for during the step
  // is answered at its end; with parameter servers at a sync point, ps_sync_point); returns
  // whether to stop.
  // `take_stop` false (a local SGD step whose stop waits for the next averaging): the requests
  // are summed (every rank makes the same call) but not acted on. `step_ms`, this rank's time for
  // the step, is averaged over the ranks: whether the steps until the next log step sum the stop
  // at their end (stop_check_each_step_), and whether local SGD's stop waits for its averaging
  // (local_stop_waits), the same on every rank.
  bool sum_loss_and_stop(double& loss, bool stop, bool take_stop = true, double step_ms = 0) {
    double sums[3] = {loss, 0.0, step_ms};
    if (stop_asked()) sums[1] = 1.0;
    mark_collective("allreduce of the loss");
    comm_.allreduce(sums, 3, ReduceOp::sum);
    loss = sums[0];
    mean_step_ms_ = sums[2] / static_cast<double>(world_);
    stop_check_each_step_ = mean_step_ms_ >= options_.stop_check_step_ms;
    return stop || (take_stop && sums[1] > 0.0);
  }

  // What every rank does after step `done`, the same collectives in the same order: the replica
  // check, the evaluation and the checkpoint when they are due (the last two wait for the end).
  void periodic_work(int64_t done, bool last) {
    if (recipe_.distributed.check_every > 0 && done % recipe_.distributed.check_every == 0) {
      check_replicas(done);
    }
    if (recipe_.eval.every > 0 && done % recipe_.eval.every == 0 && !last) evaluate(done);
    if (recipe_.checkpoint.every > 0 && done % recipe_.checkpoint.every == 0 && !last) {
      checkpoint(done);
    }
  }

  // Every rank agreed to stop after step_: checkpoint it and leave; resume continues from it.
  TrainResult stop_early() {
    TrainResult result;
    result.steps = step_;
    result.world_size = world_;
    result.stopped = true;
    result.params_checksum = check_replicas(step_);
    // An evaluation due at this step runs now: the resumed run starts after it, and its record
    // would lack it.
    if (recipe_.eval.every > 0 && step_ % recipe_.eval.every == 0) evaluate(step_);
    result.last_checkpoint = checkpoint(step_);
    emit({{"event", "info"},
          {"message",
           options_.resume_how.empty()
               ? fmt::format("stopped on request after step {}; checkpointed as {}", step_,
                             result.last_checkpoint.filename().string())
               : fmt::format("stopped on request after step {}; {} continues from {}", step_,
                             options_.resume_how, result.last_checkpoint.filename().string())}});
    return result;
  }

  bool writes_checkpoints() const {
    return (rank_ == 0 || options_.node_leader) && shares_run_dir_with_ < 0;
  }

  // Node leaders whose run directories are one directory (a shared filesystem, or hosts whose
  // workdirs lead to one place) would write, verify and prune the same checkpoint at once and
  // spoil each other's. Each writer leaves a marker with a random name in its run directory; one
  // that finds the marker of a lower rank's writer there leaves the writing to that rank. Two
  // collectives, once per generation.
  void claim_run_directory() {
    uint64_t token = 0;
    fs::path marker;
    if (writes_checkpoints()) {
      std::random_device random;
      while (token == 0)
        token = (uint64_t{random()} << 32) | random();
      marker = options_.run_dir / writer_marker(token);
      fs::create_directories(options_.run_dir);
      try {
        write_file_atomic(marker, std::to_string(rank_) + "\n");
      } catch (const Error& e) {
        // The hidden marker's own name would mean nothing to the reader: only why.
        const std::string what = first_line(e.what());
        const size_t reason = what.rfind(": ");
        throw Error(ErrorKind::checkpoint,
                    fmt::format("{}: cannot write a file in the run directory: {}",
                                printable(options_.run_dir.string()),
                                reason == std::string::npos ? what : what.substr(reason + 2)));
      }
    }
    std::vector<uint64_t> tokens(static_cast<size_t>(world_));
    mark_collective("allgather of the shared-directory tokens");
    comm_.allgather(&token, sizeof(token), tokens.data());
    int32_t shares_with = -1;
    for (int r = 0; token != 0 && r < rank_ && shares_with < 0; ++r) {
      const uint64_t other = tokens[static_cast<size_t>(r)];
      std::error_code ec;
      if (other != 0 && fs::exists(options_.run_dir / writer_marker(other), ec)) shares_with = r;
    }
    // Also the barrier that keeps every marker until every writer has looked.
    std::vector<int32_t> verdicts(static_cast<size_t>(world_));
    mark_collective("allgather of the shared-directory verdicts");
    comm_.allgather(&shares_with, sizeof(shares_with), verdicts.data());
    if (!marker.empty()) {
      std::error_code ignored;
      fs::remove(marker, ignored);
    }
    shares_run_dir_with_ = shares_with;
    std::string shared;
    for (int r = 0; r < world_; ++r) {
      const int32_t with = verdicts[static_cast<size_t>(r)];
      if (with >= 0)
        shared += fmt::format("{}rank {} with rank {}", shared.empty() ? "" : ", ", r, with);
    }
    if (!shared.empty()) {
      emit({{"event", "info"},
            {"message", fmt::format("node leaders share a run directory ({}): one filesystem; "
                                    "only the lower rank writes checkpoints there",
                                    shared)}});
    }
  }

  static std::string writer_marker(uint64_t token) { return fmt::format(".writer-{:016x}", token); }

  // Whether the optimizer state is split between ranks (ZeRO-1, parameter servers).
  bool sharded() const { return shards_ > 1 || ps_; }

  double optimizer_state_mib() const {
    return static_cast<double>(optimizer_->state().size_bytes()) / (1024.0 * 1024.0);
  }

  // Ranks started by hand or by another scheduler may have been given different recipes, data or
  // start options: their collectives would mismatch (a hang until the timeout) or, worse, match
  // and train something nobody asked for. One allgather compares what every rank must share: the
  // recipe's hash (recipe_hash leaves data.path out: each host may keep the data elsewhere), the
  // data's fingerprint, how the ranks start (--resume) and the nominal world size. It also
  // carries rank 0's word that the run already completed (TrainerOptions::run_completed): the
  // return value, the same on every rank.
  bool check_same_start() {
    enum Field : size_t { kRecipe, kData, kResume, kNominal, kCompleted, kFields };
    const std::string& how = options_.resume_from.native();
    std::array<uint64_t, kFields> mine{};
    mine[kRecipe] = std::stoull(recipe_hash(recipe_), nullptr, 16);
    mine[kData] = checksum64(data_.fingerprint.data(), data_.fingerprint.size());
    mine[kResume] = how.empty() ? 0 : how == "newest" ? 1 : how == "newest-or-start" ? 2 : 3;
    mine[kNominal] = static_cast<uint64_t>(nominal_world_);
    mine[kCompleted] = rank_ == 0 && options_.run_completed ? 1 : 0;
    std::vector<std::array<uint64_t, kFields>> all(static_cast<size_t>(world_));
    mark_collective("allgather of what the ranks start with");
    comm_.allgather(mine.data(), sizeof(mine), all.data());
    // "rank 1 (X), rank 3 (Y) differ(s) from rank 0's (Z)", X as `name` gives a rank's value.
    const auto differing = [&](Field field, const auto& name) {
      std::vector<std::string> others;
      for (size_t r = 1; r < all.size(); ++r) {
        if (all[r][field] != all[0][field])
          others.push_back(fmt::format("rank {} ({})", r, name(all[r][field])));
      }
      if (others.empty()) return std::string();
      return fmt::format("{} differ{} from rank 0's ({})", fmt::join(others, ", "),
                         others.size() == 1 ? "s" : "", name(all[0][field]));
    };
    const auto hex = [](uint64_t v) { return fmt::format("{:016x}", v); };
    // Every difference is named, not only the first: one restart fixes them all.
    std::vector<std::string> problems;
    if (const std::string d = differing(kRecipe, hex); !d.empty()) {
      problems.push_back(
          fmt::format("the ranks were given different recipes: {}; hashes of the "
                      "recipe with every default, data.path aside: start every "
                      "rank with the same recipe",
                      d));
    }
    if (const std::string d = differing(kData, hex); !d.empty()) {
      problems.push_back(fmt::format(
          "the ranks were given different data: {} (checksums of each rank's data fingerprint; "
          "this rank's {} holds '{}'): give every rank the same data (token files prepared from "
          "the same text with the same options, or copies)",
          d,
          recipe_.data.path.empty() ? "data.type " + recipe_.data.type
                                    : "data.path " + recipe_.data.path,
          data_.fingerprint));
    }
    if (const std::string d = differing(kResume,
                                        [](uint64_t v) {
                                          return v == 0   ? std::string("no --resume")
                                                 : v == 1 ? std::string("--resume newest")
                                                 : v == 2 ? std::string("--resume newest-or-start")
                                                          : std::string("--resume CHECKPOINT");
                                        });
        !d.empty()) {
      problems.push_back(
          fmt::format("the ranks were started with different --resume: {}: start "
                      "every rank with the same --resume",
                      d));
    }
    if (const std::string d = differing(kNominal, [](uint64_t v) { return std::to_string(v); });
        !d.empty()) {
      problems.push_back(
          fmt::format("the ranks were given different nominal world sizes "
                      "(--nominal-world, DPTRAIN_NOMINAL_WORLD; a rank given none takes rank "
                      "0's): {}: give every rank the same, or none but rank 0",
                      d));
    }
    if (!problems.empty()) {
      throw Error(ErrorKind::recipe, fmt::format("rank {}: {}", rank_, fmt::join(problems, "; ")));
    }
    return all[0][kCompleted] != 0;
  }

  // Whether there is a run to train: false when rank 0's record says it already completed.
  bool start() {
    if (check_same_start()) return false;
    claim_run_directory();
    if (writes_checkpoints()) remove_incomplete_checkpoints(options_.run_dir / "checkpoints");
    if (data_world_ > micro_batches_) {
      emit({{"event", "info"},
            {"message", fmt::format("warning: {} ranks share {} micro-batches a step: {} rank(s) "
                                    "idle; distributed.resize \"scale_lr\" would use them",
                                    data_world_, micro_batches_, data_world_ - micro_batches_)}});
    }
    const fs::path from = resume_source();
    if (from.empty()) {
      fresh_start();
    } else {
      restore(from, source_rank_);
      resumed_ = true;
    }
    first_step_ = step_;  // parameter servers too, which never enter run()'s loop
    json rendezvous = {{"event", "rendezvous"},
                       {"world_size", world_},
                       {"nominal_world_size", nominal_world_},
                       {"global_batch", global_batch_},
                       {"step", step_},
                       {"backend", comm_.backend()}};
    if (!from.empty()) rendezvous["resumed_from"] = from.filename().string();
    emit(rendezvous);
    return true;
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
          {"message",
           fmt::format("{} on {} rank(s){}, global batch {}{}", model_->describe(), world_,
                       device_description(), global_batch_, exchange_description())}});
  }

  // How the ranks combine their work, when it is not the default bucketed f32 all-reduce:
  // "; ZeRO-1: optimizer state 1.2 MiB per rank (4.8 MiB unsharded)" (in the unit that suits
  // it: a small model's is KiB, not "0.0 MiB"), "; local SGD, averaging every 8 steps".
  std::string exchange_description() const {
    std::string out;
    if (zero_) {
      const double shard_bytes = optimizer_state_mib() * 1024.0 * 1024.0;
      const double whole_bytes =
          shard_bytes * static_cast<double>(num_params_) / static_cast<double>(shard_);
      out += fmt::format("; ZeRO-1: optimizer state {} per rank ({} unsharded)",
                         human_size(static_cast<uint64_t>(std::llround(shard_bytes))),
                         human_size(static_cast<uint64_t>(std::llround(whole_bytes))));
    }
    if (local_sgd_) {
      out += fmt::format("; local SGD, averaging every {} steps", recipe_.distributed.period);
      if (recipe_.distributed.start > 0) {
        out += fmt::format(" after {} synchronous", recipe_.distributed.start);
      }
    }
    if (recipe_.distributed.compression.type != "none" && !local_sgd_) {
      out += "; gradients compressed " + recipe_.distributed.compression.type;
    }
    return out;
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
  // GPU). The gradients' all-reduce is the GradientReducer's.
  void allreduce_device(float* data, size_t count, ReduceOp op) {
    dptrain::allreduce_device(comm_, *ops_, data, count, op, staged_, staging_);
  }

  // Every rank's `count` values at `own` into `out` (world x count), rank after rank.
  void allgather_device(const float* own, size_t count, float* out) {
    const size_t bytes = count * sizeof(float);
    if (!staged_) {
      comm_.allgather(own, bytes, out);
      return;
    }
    const size_t total = count * static_cast<size_t>(world_);
    staging_.resize(total);
    float* mine = staging_.data() + static_cast<size_t>(rank_) * count;
    ops_->download(own, mine, bytes);
    comm_.allgather(mine, bytes, staging_.data());
    ops_->upload(staging_.data(), out, total * sizeof(float));
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
    int64_t my_step = -1;  // -2: this node holds checkpoints, but none this run can use
    PassedOver passed{[this](const std::string& w) {
                        emit({{"event", "info"}, {"message", "warning: " + w}});
                      },
                      {}};
    if (writes_checkpoints()) {
      // None on this node is not an error (another may hold one); one out of reach is.
      if (auto found = passed.search(options_.run_dir / "checkpoints", written_by(recipe_))) {
        mine = std::move(*found);
        my_step = checkpoint_step(mine);
      } else if (!list_checkpoints(options_.run_dir / "checkpoints").empty()) {
        my_step = -2;
      }
    }
    std::vector<int64_t> steps(static_cast<size_t>(world_));
    mark_collective("allgather of the checkpoint steps");
    comm_.allgather(&my_step, sizeof(my_step), steps.data());
    const auto newest = std::max_element(steps.begin(), steps.end());
    if (*newest < 0) {
      // Starting over would write over them (another recipe's, or damaged ones): as a restart
      // or a resume, this stops instead.
      if (const auto holder = std::find(steps.begin(), steps.end(), int64_t{-2});
          holder != steps.end()) {
        // Why, on every rank's error (whichever the launcher shows says it): each holding
        // rank's reasons, in rank order, every rank making the same broadcasts.
        const int holding = static_cast<int>(holder - steps.begin());
        const bool several = std::count(steps.begin(), steps.end(), int64_t{-2}) > 1;
        std::string why;
        for (int r = holding; r < world_; ++r) {
          if (steps[static_cast<size_t>(r)] != -2) continue;
          if (several) why += fmt::format("\n  rank {}'s:", r);
          why += broadcast_text(r == rank_ ? passed.lines() : std::string(), r);
        }
        throw Error(ErrorKind::checkpoint,
                    fmt::format("rank {}'s run directory holds checkpoints, but none this run can "
                                "use: starting over would write over them; repair them; to start "
                                "over, launch into a new run directory{}",
                                holding, why));
      }
    }
    passed.tell();
    if (*newest < 0) {
      if (how == "newest") {
        // Where rank 0 looked, on every rank's error (whichever the launcher shows says it): a
        // mistyped workdir shows there.
        const std::string where =
            broadcast_text(printable((options_.run_dir / "checkpoints").string()), 0);
        throw Error(ErrorKind::checkpoint,
                    fmt::format("no valid checkpoint on any node of this run ({} rank(s); rank 0 "
                                "looked in {})",
                                world_, where));
      }
      return {};
    }
    source_rank_ = static_cast<int>(newest - steps.begin());
    // What this node holds past its own valid one was skipped (damaged, another recipe's), even
    // where another node's copy of that step is the one continued from: set aside, as resume
    // does, so that neither `latest` nor a later search here leads to it, and the run writes its
    // own checkpoints of those steps.
    const auto warn = [this](const std::string& w) {
      emit({{"event", "info"}, {"message", "warning: " + w}});
    };
    if (writes_checkpoints() &&
        set_aside_newer(options_.run_dir / "checkpoints", std::max<int64_t>(my_step, -1), warn) &&
        !mine.empty()) {
      try {
        point_latest_at(options_.run_dir / "checkpoints", mine);
      } catch (const Error& e) {
        warn(e.what());  // `latest` is rewritten with the next checkpoint
      }
    }
    // Every rank needs the name only for messages; the source rank holds the real path.
    return rank_ == source_rank_ ? mine : fs::path(checkpoint_name(*newest));
  }

  // `root`'s text on every rank (a collective).
  std::string broadcast_text(const std::string& text, int root) {
    int64_t size = static_cast<int64_t>(text.size());
    mark_collective("broadcast of a text's size");
    comm_.broadcast(&size, sizeof(size), root);
    std::string out = rank_ == root ? text : std::string(static_cast<size_t>(size), '\0');
    if (size > 0) {
      mark_collective("broadcast of a text");
      comm_.broadcast(out.data(), out.size(), root);
    }
    return out;
  }

  // One rank (rank 0, or the node leader that holds the newest checkpoint) reads it and
  // broadcasts it, so ranks on other nodes need no copy.
  void restore(const fs::path& dir, int source) {
    // step, epoch, samples_in_epoch, optimizer_steps, loss scale (a power of two), its clean
    // steps, the size of the comm state, the world size that wrote it, the last loss (its bits),
    // the global batch it was written with
    std::vector<int64_t> header(10, 0);
    std::vector<float> full_state;  // ZeRO-1: the whole optimizer state, for every rank's shard
    std::vector<float> comm_state;
    if (rank_ == source) {
      CheckpointData ckpt = read_checkpoint(dir);
      const auto& p = ckpt.position;
      if (const std::string why = recipe_mismatch(recipe_, p.recipe_hash); !why.empty()) {
        throw Error(ErrorKind::checkpoint, fmt::format("{}: {}", printable(dir.string()), why));
      }
      require_same_data(dir, p.data_fingerprint, data_.fingerprint, recipe_.data,
                        "a resume on it would not continue the same run; put the data back as "
                        "it was, or start a new run");
      if (ckpt.params.size() != params_.size()) {
        throw Error(ErrorKind::checkpoint,
                    fmt::format("{}: params.bin holds {} parameters, the model has {}",
                                printable(dir.string()), ckpt.params.size(), params_.size()));
      }
      if (const size_t want = state_per_param() * num_params_;
          ckpt.optimizer_state.size() != want) {
        throw Error(ErrorKind::checkpoint,
                    fmt::format("{}: optimizer.bin holds {} values, the model's {} optimizer "
                                "needs {} ({} per parameter)",
                                printable(dir.string()), ckpt.optimizer_state.size(),
                                recipe_.optimizer.type, want, state_per_param()));
      }
      ops_->upload(ckpt.params.data(), params_.data(), params_.size_bytes());
      if (sharded()) {
        full_state = std::move(ckpt.optimizer_state);
      } else {
        const auto state = optimizer_->state();
        ops_->upload(ckpt.optimizer_state.data(), state.data(), state.size_bytes());
      }
      comm_state = std::move(ckpt.comm_state);
      header = {p.step,
                p.epoch,
                p.samples_in_epoch,
                p.optimizer_steps,
                static_cast<int64_t>(p.loss_scale),
                p.loss_scale_clean_steps,
                static_cast<int64_t>(comm_state.size()),
                p.world_size,
                std::bit_cast<int64_t>(p.loss),
                p.global_batch};
    }
    comm_.broadcast(header.data(), header.size() * sizeof(int64_t), source);
    broadcast_device(params_.data(), params_.size_bytes(), source);
    if (sharded()) {
      full_state.resize(state_per_param() * num_params_);
      comm_.broadcast(full_state.data(), full_state.size() * sizeof(float), source);
      restore_state_shard(full_state);
    } else {
      const auto state = optimizer_->state();
      broadcast_device(state.data(), state.size_bytes(), source);
    }
    restore_comm_state(comm_state, static_cast<size_t>(header[6]), header[7], source);
    scaler_.restore(static_cast<double>(header[4]), header[5]);
    step_ = header[0];
    last_loss_ = std::bit_cast<double>(header[8]);
    // Positions count samples: under another global batch (scale_lr on another world size) the
    // next step starts right where the last one ended, and no sample of the epoch is skipped or
    // seen twice.
    position_ = sampler_.normalize({header[1], header[2]});
    optimizer_->set_steps(header[3]);
    if (rank_ == 0) truncate_metrics_after(step_);
    std::string where = source == 0 ? "" : fmt::format(" (read on rank {})", source);
    emit({{"event", "info"},
          {"message", fmt::format("resumed from {}{} at step {} on {} rank(s), global batch {}{}",
                                  dir.filename().string(), where, step_, world_, global_batch_,
                                  nominal_world_ == world_
                                      ? std::string()
                                      : fmt::format(" (the job's nominal world size is {})",
                                                    nominal_world_))}});
    // keep_global_batch keeps it over any world size, given the job's nominal one: ranks started
    // without a launcher on fewer ranks than wrote the checkpoint and no --nominal-world change
    // the batch, and so the training, unless told.
    if (rank_ == 0 && header[9] > 0 && header[9] != global_batch_ &&
        recipe_.distributed.resize != "scale_lr") {
      // The nominal world that gives the checkpoint's batch here (servers and all), if any.
      std::string keep;
      for (int n = 1; n <= 65536 && keep.empty(); ++n) {
        if (global_batch(recipe_, world_, n) == header[9])
          keep =
              fmt::format(": workers keep the batch of {} with --nominal-world {}", header[9], n);
      }
      emit({{"event", "info"},
            {"message", fmt::format("warning: the global batch changes from the checkpoint's {} "
                                    "to {} (distributed.resize is \"{}\"; the nominal world size "
                                    "here is {}){}",
                                    header[9], global_batch_, recipe_.distributed.resize,
                                    nominal_world_, keep)}});
    }
  }

  // The replica states a checkpoint holds (`size` values on the source rank, all_replica_states):
  // this rank's own on the same world size. On another, compression's residuals start from zero
  // (the split of what was held back between ranks has no meaning there) and local SGD's replicas
  // from the average the optimizer blob holds.
  void restore_comm_state(std::vector<float>& all, size_t size, int64_t written_by, int source) {
    const size_t own = replica_state_size();
    if (size == 0 || own == 0) return;
    all.resize(size);
    comm_.broadcast(all.data(), size * sizeof(float), source);
    if (written_by == world_ && size == own * static_cast<size_t>(world_)) {
      const std::span<const float> mine =
          std::span<const float>(all).subspan(static_cast<size_t>(rank_) * own, own);
      if (local_sgd_) {
        ops_->upload(mine.data(), optimizer_->state().data(), mine.size_bytes());
      } else {
        reducer_->restore_state(mine);
      }
      return;
    }
    emit({{"event", "info"},
          {"message",
           local_sgd_ ? fmt::format("warning: the checkpoint's optimizer states are from {} "
                                    "replica(s); on {} rank(s) each starts from their average",
                                    written_by, world_)
                      : fmt::format("warning: the checkpoint's compression residuals are from {} "
                                    "rank(s); on {} they start from zero",
                                    written_by, world_)}});
  }

  void mark(Phase phase) {
    if (options_.progress) options_.progress->enter(phase);
  }
  void mark_collective(const char* what) {
    if (options_.progress) options_.progress->enter_collective(what);
  }

  // This rank's micro-batches j = rank, rank + world, ... of the step's global batch.
  int64_t own_micro_batches() const { return micro_batches_of(data_rank_); }
  int64_t micro_batches_of(int64_t data_rank) const {
    if (data_rank < 0 || data_rank >= micro_batches_) return 0;
    return (micro_batches_ - data_rank + data_world_ - 1) / data_world_;
  }

  // This rank's micro-batches of the step; the gradients are summed scaled by 1 / (micro-batches
  // in the step), so the ranks' sum is the mean over the global batch however the micro-batches
  // were shared; a local step (local SGD) takes the mean over this rank's own. Returns the sum of
  // their mean losses. Unless local, the gradient exchange starts during the last micro-batch's
  // backward pass, with `stop_flag` riding along.
  double compute_gradients(PhaseTimes& phases, bool local, float stop_flag) {
    mark(Phase::compute);
    ops_->fill_zero(grads_.data(), grads_.size_bytes());
    const int64_t own = own_micro_batches();
    // fp16: the loss scale rides on the gradient scale; unscale_and_clip takes it off.
    const float scale = static_cast<float>(scaler_.scale()) /
                        static_cast<float>(local ? std::max<int64_t>(own, 1) : micro_batches_);
    if (!local) ops_->upload(&stop_flag, grad_buffer_.as<float>() + flag_at_, sizeof(float));
    // No communication on the accumulation micro-batches: only the last one's backward pass
    // starts buckets (a rank with none starts them at once).
    if (!local && reducer_ && own == 0) reducer_->begin();
    double loss = 0;
    for (int64_t j = data_rank_; j < micro_batches_; j += data_world_) {
      if (!local && reducer_ && j + data_world_ >= micro_batches_) reducer_->begin();
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

  // Sums the step's gradients over the ranks (and the stop flags); returns whether any rank asked
  // to stop. The bucketed all-reduce (overlapped with the backward pass), or with ZeRO-1 over
  // NCCL a reduce-scatter of this rank's shard.
  bool exchange_gradients(PhaseTimes& phases, float stop_flag) {
    float* flag = grad_buffer_.as<float>() + flag_at_;
    if (zero_ && !zero_by_allreduce_) {
      const auto tc = Clock::now();
      mark_collective("reduce-scatter of the gradients");
      // Only NCCL comes here (Gloo sums by the all-reduce): device memory, never staged.
      comm_.reduce_scatter(grad_buffer_.as<float>(), shard_grads_.as<float>(), shard_,
                           ReduceOp::sum);
      mark_collective("allreduce of the stop flag");
      comm_.allreduce(&stop_flag, 1, ReduceOp::sum);
      phases.comm = phases.comm_total = ms_since(tc);
      phases.bytes = static_cast<double>((padded_ + 1) * sizeof(float));
      return stop_flag > 0.0f;
    }
    mark(Phase::collective);
    const ExchangeStats stats = reducer_->finish();
    phases.comm = stats.exposed_ms;
    phases.comm_total = stats.comm_ms;
    phases.bytes = static_cast<double>(stats.bytes);
    ops_->download(flag, &stop_flag, sizeof(float));
    // ZeRO-1 with padding: the flag's slot is the first padding gradient of the last shard.
    if (zero_ && padded_ > num_params_) ops_->fill_zero(flag, sizeof(float));
    // The sum of 0s and 1s: anything else means the flag's slot was overwritten, a bug that must
    // not pass for a stop request.
    if (!(stop_flag >= 0.0f && stop_flag <= static_cast<float>(world_) &&
          stop_flag == std::floor(stop_flag))) {
      throw Error(ErrorKind::internal,
                  fmt::format("rank {}: the ranks' stop requests summed to {} at step {}", rank_,
                              stop_flag, step_));
    }
    return stop_flag > 0.0f;
  }

  // Clipping, loss-scale unscaling and the optimizer step on this rank's parameters (ZeRO-1: its
  // shard, then the all-gather). Returns the gradient norm.
  double update(double lr, bool local, PhaseTimes& phases) {
    if (local && own_micro_batches() == 0) return 0.0;  // an idle rank's local step: nothing
    if (!zero_) {
      const double norm =
          unscale_and_clip(*ops_, grads_, scaler_.scale(), recipe_.optimizer.clip_grad_norm);
      // fp16: a step whose gradients overflowed is skipped (every rank agrees: the norm comes
      // from the same reduced gradients) and the loss scale shrinks.
      if (scaler_.update(std::isfinite(norm))) optimizer_->step(params_, grads_, lr);
      return norm;
    }
    const std::span<float> shard_grads(
        zero_by_allreduce_ ? grad_buffer_.as<float>() + static_cast<size_t>(rank_) * shard_
                           : shard_grads_.as<float>(),
        shard_);
    // The norm of all gradients: every rank holds them all after an all-reduce (and then sums
    // them in the same order as without ZeRO); after a reduce-scatter, one more small all-reduce
    // of every shard's part.
    const double norm = unscale_and_clip(
        *ops_, shard_grads, scaler_.scale(), recipe_.optimizer.clip_grad_norm, [&] {
          if (zero_by_allreduce_) {
            return ops_->sum_squares(grads_.data(), static_cast<int64_t>(grads_.size()));
          }
          double squares =
              ops_->sum_squares(shard_grads.data(), static_cast<int64_t>(shard_grads.size()));
          mark_collective("allreduce of the gradient norm");
          comm_.allreduce(&squares, 1, ReduceOp::sum);
          return squares;
        });
    if (scaler_.update(std::isfinite(norm))) {
      float* own = params_buffer_.as<float>() + static_cast<size_t>(rank_) * shard_;
      optimizer_->step({own, shard_}, shard_grads, lr);
      // Communication, though the optimizer phase waits for it: counted as exposed, and out of
      // the optimizer's time by the caller.
      ops_->synchronize();
      const auto tg = Clock::now();
      mark_collective("allgather of the parameters");
      allgather_device(own, shard_, params_buffer_.as<float>());
      const double gather_ms = ms_since(tg);
      phases.comm += gather_ms;
      phases.comm_total += gather_ms;
      phases.bytes += static_cast<double>(shard_ * sizeof(float));
    }
    return norm;
  }

  // local_sgd: `data` averaged over the ranks, each weighted by its micro-batches a step: with
  // more ranks than micro-batches (an elastic job that grew) an idle rank's stale replica must
  // not count, and an uneven split counts each rank by its share.
  void average_replicas_of(float* data, size_t count) {
    if (micro_batches_ % data_world_ == 0) {
      allreduce_device(data, count, ReduceOp::avg);
      return;
    }
    const auto n = static_cast<int64_t>(count);
    ops_->scale(n, static_cast<float>(own_micro_batches()), data);
    allreduce_device(data, count, ReduceOp::sum);
    ops_->scale(n, 1.0f / static_cast<float>(micro_batches_), data);
  }

  // Whether every rank must hold the same parameters after step `done`: an evaluation, a
  // checkpoint, a replica check, or the end.
  bool needs_one_model(int64_t done) const {
    const auto every = [done](int64_t n) { return n > 0 && done % n == 0; };
    return done == recipe_.train.steps || every(recipe_.eval.every) ||
           every(recipe_.checkpoint.every) || every(recipe_.distributed.check_every);
  }

  // local_sgd: the steps after which the replicas are averaged: every `period` local steps, and
  // wherever one model must be seen.
  bool averaging_step(int64_t done) const {
    return (done - recipe_.distributed.start) % recipe_.distributed.period == 0 ||
           needs_one_model(done);
  }

  // local_sgd, after step `done`, no averaging: whether a stop waits for the next scheduled
  // averaging, as it does where that comes within TrainerOptions::local_stop_wait_ms at the
  // ranks' mean step time (mean_step_ms_); else the stop is taken at once, with an early
  // averaging. The same on every rank.
  bool local_stop_waits(int64_t done) const {
    const int64_t period = recipe_.distributed.period;
    const int64_t to_next = period - (done - recipe_.distributed.start) % period;
    return static_cast<double>(to_next) * mean_step_ms_ <= options_.local_stop_wait_ms;
  }
  // local_sgd, steps too short to sum a stop each (stop_check_each_step_ off): every how many
  // steps one sums it where it does not wait (local_stop_waits), so that a stop is taken within
  // about local_stop_wait_ms. The same on every rank.
  int64_t local_stop_check_interval() const {
    if (!(mean_step_ms_ > 0.0)) return 1;
    return static_cast<int64_t>(std::clamp(options_.local_stop_wait_ms / mean_step_ms_, 1.0, 1e9));
  }

  // ps: the steps after which every worker waits for the servers to apply that very step (no
  // staleness there), so that all ranks meet: the log steps (the loss and stop requests are
  // summed), wherever one model must be seen, and the step the servers chose to stop after
  // (ps_stop_at_).
  bool ps_sync_point(int64_t done) const {
    return log_step_due(done, false) || needs_one_model(done) || done == ps_stop_at_;
  }

  // A server making version `version`, the servers having agreed that a stop was asked for: the
  // first step no worker can have pushed without knowing of the stop, which all ranks then meet
  // at and checkpoint. A worker pushes its next step once it has a reply at least as new as its
  // step less the staleness; every reply before this one was older than `version`, so a worker
  // that has not seen one since pushes steps up to version + staleness (each on a reply older than
  // `version`), and learns of the stop in the reply to that push, before its next.
  int64_t choose_ps_stop(int64_t version) const {
    return version + recipe_.distributed.staleness + 1;
  }

  // A worker's step in the parameter-server mode: its gradients' shards to the servers, the
  // parameters back, at least as new as `staleness` steps ago (exactly this step's at a sync
  // point). Returns the gradient norm the servers saw for that version.
  double push_and_pull(int64_t done, PhaseTimes& phases) {
    const auto tc = Clock::now();
    mark_collective("parameter-server push and pull");
    const int64_t need =
        ps_sync_point(done) ? done : std::max<int64_t>(done - recipe_.distributed.staleness, 0);
    const size_t msg = kPsHeaderFloats + shard_;
    const auto servers = static_cast<size_t>(servers_);
    // A stop asked for here rides along; the servers choose the step to stop after.
    const bool asked = stop_asked();
    // Every value of both is written below (headers, shards) or by the receives.
    ps_out_.resize(servers * msg);
    ps_in_.resize(servers * msg);
    ps_host_.resize(padded_, 0.0f);  // the padding stays zero
    ops_->download(grads_.data(), ps_host_.data(), grads_.size_bytes());
    std::vector<std::unique_ptr<Communicator::Request>> requests;
    // The replies' receives first: a server's send completes only once they are posted.
    for (size_t k = 0; k < servers; ++k) {
      requests.push_back(comm_.irecv(&ps_in_[k * msg], msg * sizeof(float),
                                     data_world_ + static_cast<int>(k), kPsReplyTag));
    }
    for (size_t k = 0; k < servers; ++k) {
      write_ps_header(&ps_out_[k * msg], {step_, need, asked ? 1 : 0});
      std::copy_n(ps_host_.begin() + static_cast<ptrdiff_t>(k * shard_), shard_,
                  ps_out_.begin() + static_cast<ptrdiff_t>(k * msg + kPsHeaderFloats));
      requests.push_back(comm_.isend(&ps_out_[k * msg], msg * sizeof(float),
                                     data_world_ + static_cast<int>(k), kPsPushTag));
    }
    for (auto& request : requests)
      request->wait();
    PsHeader reply;
    for (size_t k = 0; k < servers; ++k) {
      reply = read_ps_header(&ps_in_[k * msg]);
      if (reply.step < need) {
        throw Error(ErrorKind::internal,
                    fmt::format("rank {}: server {} answered step {} with version {}, needed {}",
                                rank_, k, step_, reply.step, need));
      }
      // A stop step this push did not know of must be a later step (choose_ps_stop).
      if (reply.stop > 0 && ps_stop_at_ == 0 && reply.stop <= done) {
        throw Error(ErrorKind::internal,
                    fmt::format("rank {}: server {} chose to stop after step {}, which this rank "
                                "pushed without knowing",
                                rank_, k, reply.stop));
      }
      if (reply.stop > 0) ps_stop_at_ = reply.stop;
      std::copy_n(ps_in_.begin() + static_cast<ptrdiff_t>(k * msg + kPsHeaderFloats), shard_,
                  ps_host_.begin() + static_cast<ptrdiff_t>(k * shard_));
    }
    ops_->upload(ps_host_.data(), params_.data(), params_.size_bytes());
    phases.comm = phases.comm_total = ms_since(tc);
    phases.bytes = static_cast<double>(servers * msg * sizeof(float));
    return std::bit_cast<double>(reply.value);
  }

  // A parameter server's run: collects every worker's gradients for the next step, in whatever
  // order they come, applies them to its shard (summed in worker order, so s = 0 is
  // deterministic), and answers each worker as soon as the version it needs exists. At the sync
  // points it joins the workers' collectives.
  TrainResult serve() {
    const int64_t total = recipe_.train.steps;
    const size_t msg = kPsHeaderFloats + shard_;
    const auto workers = static_cast<size_t>(data_world_);
    std::vector<int> worker_ranks(workers);
    std::iota(worker_ranks.begin(), worker_ranks.end(), 0);
    // Gradients that arrived, by step and worker (empty: not yet); a worker is at most
    // `staleness` + 1 steps ahead of the servers.
    std::map<int64_t, std::vector<std::vector<float>>> pushed;
    std::vector<int64_t> needs(workers, -1);  // the version each waiting worker needs
    std::vector<std::vector<float>> replies(workers, std::vector<float>(msg));
    std::vector<std::unique_ptr<Communicator::Request>> sending(workers);
    std::vector<float> incoming(msg);
    ps_host_.resize(shard_);  // this shard's parameters, as the workers get them
    const size_t begin = static_cast<size_t>(shard_index_) * shard_;
    ops_->download(params_buffer_.as<float>() + begin, ps_host_.data(), shard_ * sizeof(float));
    double norm = 0;
    const auto answer = [&] {
      for (size_t w = 0; w < workers; ++w) {
        if (needs[w] < 0 || needs[w] > step_) continue;
        if (sending[w]) sending[w]->wait();  // the last reply's buffer is free
        write_ps_header(replies[w].data(), {step_, std::bit_cast<int64_t>(norm), ps_stop_at_});
        std::copy(ps_host_.begin(), ps_host_.end(),
                  replies[w].begin() + static_cast<ptrdiff_t>(kPsHeaderFloats));
        sending[w] =
            comm_.isend(replies[w].data(), msg * sizeof(float), static_cast<int>(w), kPsReplyTag);
        needs[w] = -1;
      }
    };
    bool stop = false;
    int64_t marked = -1;
    while (step_ < total && !stop) {
      if (options_.progress) options_.progress->set_step(step_);
      // One collective per version, as a worker counts one per push: hang attribution compares
      // the counts.
      if (marked != step_) {
        mark(Phase::data);
        if (options_.before_step) options_.before_step(step_);  // fault injection, as workers
        mark_collective("parameter-server push and pull");
        marked = step_;
      } else {
        mark(Phase::collective);
      }
      const auto w = static_cast<size_t>(
          comm_.recv_any(incoming.data(), msg * sizeof(float), worker_ranks, kPsPushTag));
      const PsHeader push = read_ps_header(incoming.data());
      if (push.step < step_) {
        throw Error(ErrorKind::internal,
                    fmt::format("rank {}: worker {} pushed step {}, already applied (now {})",
                                rank_, w, push.step, step_));
      }
      if (push.stop != 0) ps_stop_asked_ = true;
      auto& slot = pushed[push.step];
      slot.resize(workers);
      slot[w].assign(incoming.begin() + static_cast<ptrdiff_t>(kPsHeaderFloats), incoming.end());
      needs[w] = push.value;
      for (auto next = pushed.find(step_);
           !stop && next != pushed.end() &&
           std::none_of(next->second.begin(), next->second.end(),
                        [](const std::vector<float>& g) { return g.empty(); });
           next = pushed.find(step_)) {
        mark(Phase::optimizer);
        norm = apply_pushed(next->second, total);
        pushed.erase(next);
        ++step_;
        answer();
        if (ps_sync_point(step_)) {
          // Every worker waits for exactly this version, and has it now: the step boundary all
          // ranks share. At the step the servers chose to stop after, every rank stops.
          const bool stop_here = step_ == ps_stop_at_;
          if (log_step_due(step_, stop_here)) {
            double loss = 0;
            stop = sum_loss_and_stop(loss, stop_here);
          }
          if (options_.progress) options_.progress->set_step(step_);
          periodic_work(step_, step_ == total || stop);
        }
      }
      answer();  // a worker ahead may take a version it finds recent enough
    }
    for (auto& request : sending) {
      if (request) request->wait();
    }
    if (stop && step_ < total) return stop_early();  // as run()'s
    TrainResult result;
    result.steps = step_;
    result.world_size = world_;
    result.optimizer_state_mib = optimizer_state_mib();
    return finish(result);
  }

  // One server step: the workers' gradients for this shard summed in worker order, clipped by
  // the norm over every server's shard, and the optimizer's update. Returns that norm.
  double apply_pushed(const std::vector<std::vector<float>>& grads, int64_t total) {
    std::vector<float>& sum = ps_sum_;
    sum.assign(shard_, 0.0f);
    for (const std::vector<float>& g : grads) {
      for (size_t i = 0; i < shard_; ++i)
        sum[i] += g[i];
    }
    const size_t begin = static_cast<size_t>(shard_index_) * shard_;
    const std::span<float> own_grads(grad_buffer_.as<float>() + begin, shard_);
    const std::span<float> own_params(params_buffer_.as<float>() + begin, shard_);
    ops_->upload(sum.data(), own_grads.data(), own_grads.size_bytes());
    // The servers learn of a stop at different times (a worker's pushes reach them in turn): they
    // agree on it as they sum the norm, each making the same version, and choose one stop step.
    if (stop_asked()) ps_stop_asked_ = true;
    const double norm =
        unscale_and_clip(*ops_, own_grads, 1.0, recipe_.optimizer.clip_grad_norm, [&] {
          const auto sums = sum_over_servers(
              {ops_->sum_squares(own_grads.data(), static_cast<int64_t>(own_grads.size())),
               ps_stop_asked_ ? 1.0 : 0.0});
          if (sums[1] > 0.0 && ps_stop_at_ == 0) ps_stop_at_ = choose_ps_stop(step_ + 1);
          return sums[0];
        });
    const double lr = lr_scale_ * learning_rate(recipe_.optimizer, step_, total);
    if (std::isfinite(norm)) optimizer_->step(own_params, own_grads, lr);
    ops_->download(own_params.data(), ps_host_.data(), own_params.size_bytes());
    return norm;
  }

  // The servers' values summed in server order (a message to and from every other server).
  using ServerSums = std::array<double, 2>;
  ServerSums sum_over_servers(const ServerSums& mine) {
    std::vector<ServerSums> all(static_cast<size_t>(servers_), ServerSums{});
    all[static_cast<size_t>(shard_index_)] = mine;
    std::vector<std::unique_ptr<Communicator::Request>> requests;
    for (int k = 0; k < servers_; ++k) {
      if (k == shard_index_) continue;
      requests.push_back(comm_.irecv(&all[static_cast<size_t>(k)], sizeof(ServerSums),
                                     data_world_ + k, kPsNormTag));
      requests.push_back(comm_.isend(&all[static_cast<size_t>(shard_index_)], sizeof(ServerSums),
                                     data_world_ + k, kPsNormTag));
    }
    for (auto& request : requests)
      request->wait();
    ServerSums total{};
    for (const ServerSums& v : all) {
      for (size_t i = 0; i < total.size(); ++i)
        total[i] += v[i];
    }
    return total;
  }

  // local_sgd: averages the parameters over the ranks, and agrees on stopping (a stop between
  // averagings waits for one, or makes one: local_stop_waits). Each rank keeps its own optimizer
  // state (a checkpoint holds every rank's, see replica_state), so a checkpoint changes nothing the
  // ranks go on with and a resume continues bit-identically; but from a stop's early averaging,
  // which an uninterrupted run does not have.
  bool average_replicas(float stop_flag, PhaseTimes& phases) {
    const auto tc = Clock::now();
    mark_collective("allreduce of the stop flag");
    comm_.allreduce(&stop_flag, 1, ReduceOp::sum);
    const bool stop = stop_flag > 0.0f;
    mark_collective("allreduce of the parameters (local SGD)");
    average_replicas_of(params_.data(), num_params_);
    const size_t values = num_params_;
    if (scaler_.enabled()) {
      // Local steps each judged overflow by their own rank's gradients (an idle rank not at
      // all): the ranks agree on the most careful scale, so every rank holds what a checkpoint
      // stores and a resume is bit-identical.
      double scaler[2] = {scaler_.scale(), static_cast<double>(scaler_.clean_steps())};
      mark_collective("allreduce of the loss scale");
      comm_.allreduce(scaler, 2, ReduceOp::min);
      scaler_.restore(scaler[0], static_cast<int64_t>(scaler[1]));
    }
    // The optimizer's step count (AdamW's bias correction) differs where a rank skipped a step
    // (an fp16 overflow) or had no micro-batch; the ranks agree on the largest at every averaging,
    // so a checkpoint's one count is every rank's.
    double steps = static_cast<double>(optimizer_->steps());
    mark_collective("allreduce of the optimizer steps");
    comm_.allreduce(&steps, 1, ReduceOp::max);
    optimizer_->set_steps(static_cast<int64_t>(steps));
    phases.comm = phases.comm_total = ms_since(tc);
    phases.bytes = static_cast<double>(values * sizeof(float));
    return stop;
  }

  // The weight-decay exemptions within this rank's shard, relative to it (all of them without
  // ZeRO).
  std::vector<ParamRange> shard_no_decay() const {
    if (shard_index_ < 0) return {};
    const std::vector<ParamRange> all = model_->no_decay();
    if (shards_ == 1) return all;
    const size_t begin = static_cast<size_t>(shard_index_) * shard_;
    const size_t end = begin + shard_;
    std::vector<ParamRange> out;
    for (const ParamRange& r : all) {
      const size_t lo = std::max(begin, r.offset);
      const size_t hi = std::min(end, r.offset + r.size);
      if (lo < hi) out.push_back({lo - begin, hi - lo});
    }
    return out;
  }

  void advance_sampler() { position_ = sampler_.advance(position_); }

  // The parameter-server mode's messages: a header, then a shard of floats. A push: the step,
  // the version the worker needs next, and 1 where a stop was asked for there. A reply: the
  // version, the gradient norm's bits, and the step the servers chose to stop after (0: none).
  struct PsHeader {
    int64_t step = 0;
    int64_t value = 0;
    int64_t stop = 0;
  };
  static constexpr size_t kPsHeaderFloats = 3 * sizeof(int64_t) / sizeof(float);
  static constexpr uint32_t kPsPushTag = 1, kPsReplyTag = 2, kPsNormTag = 3;
  static void write_ps_header(float* at, const PsHeader& header) {
    const int64_t words[3] = {header.step, header.value, header.stop};
    std::memcpy(at, words, sizeof(words));
  }
  static PsHeader read_ps_header(const float* at) {
    int64_t words[3];
    std::memcpy(words, at, sizeof(words));
    return {words[0], words[1], words[2]};
  }

  void log_step(int64_t step, int64_t epoch, double loss, double lr, double norm,
                double samples_per_s, const PhaseTimes& phases) {
    if (rank_ != 0) return;
    json line = {{"step", step},
                 {"epoch", epoch},
                 {"loss", loss},
                 {"lr", lr},
                 {"grad_norm", norm},
                 {"samples_per_s", samples_per_s},
                 {"step_ms", phases.step},
                 {"data_ms", phases.data},
                 {"compute_ms", phases.compute},
                 {"comm_ms", phases.comm},
                 {"comm_total_ms", phases.comm_total},
                 {"optimizer_ms", phases.optimizer},
                 {"grad_bytes", std::llround(phases.bytes)}};
    if (tokens_per_sample_ > 0) {
      line["tokens_per_s"] = samples_per_s * static_cast<double>(tokens_per_sample_);
    }
    run_file_write([&] { append_line(options_.run_dir / "metrics.jsonl", json_text(line)); });
    json event = line;
    event["event"] = "progress";
    event["steps"] = recipe_.train.steps;
    if (const auto eta = eta_s(step)) event["eta_s"] = *eta;
    emit(event);
  }

  // The seconds left after `step` at this invocation's pace so far; none before its first step.
  std::optional<double> eta_s(int64_t step) const {
    const int64_t done_here = step - first_step_;
    if (done_here <= 0) return std::nullopt;
    return ms_since(run_start_) / 1000.0 / static_cast<double>(done_here) *
           static_cast<double>(recipe_.train.steps - step);
  }

  // The measurements of the run's result.json (throughput, phases, peak memory) when it is of
  // the state `result` ends in (its steps and parameters): a resume at the last step measured
  // nothing.
  void keep_measurements(TrainResult& result) const {
    json before;
    try {
      before = parse_json(read_file(options_.run_dir / "result.json"));
      if (!before.is_object() || before.value("steps", json()) != result.steps ||
          before.value("params_checksum", json()) != result.params_checksum) {
        return;
      }
    } catch (const std::exception&) {
      return;  // none, or unreadable: this result is all there is
    }
    const auto number = [&](const char* key, double fallback) {
      const auto it = before.find(key);
      return it != before.end() && it->is_number() ? it->get<double>() : fallback;
    };
    result.samples_per_s = number("samples_per_s", result.samples_per_s);
    result.comm_total_ms = number("comm_total_ms", result.comm_total_ms);
    result.bytes_per_step = number("bytes_per_step", result.bytes_per_step);
    result.peak_rss_mib = number("peak_rss_mib", result.peak_rss_mib);
    if (const auto it = before.find("phases_ms"); it != before.end() && it->is_object()) {
      for (size_t i = 0; i < result.phases_ms.size(); ++i) {
        const auto v = it->find(TrainResult::kPhaseNames[i]);
        if (v != it->end() && v->is_number()) result.phases_ms[i] = v->get<double>();
      }
    }
  }

  // Each rank scores a strided shard of the held-out split; the sums are reduced. Loss and
  // accuracy are NaN (none, nothing logged) when there is no held-out data. Rank 0 logs them,
  // unless `record` is false (they are logged already).
  std::pair<double, double> evaluate(int64_t step, bool record = true) {
    mark(Phase::eval);
    const auto& eval = *data_.eval;
    int64_t n = eval.size();
    if (recipe_.eval.max_samples > 0) n = std::min(n, recipe_.eval.max_samples);
    double sums[3] = {0, 0, 0};  // loss_sum, correct, count
    constexpr int64_t kChunk = 512;
    std::vector<int64_t> idx;
    std::vector<float> x;
    std::vector<int32_t> y;
    // Parameter servers hold no whole model: they add nothing.
    for (int64_t begin = data_rank_ * kChunk; data_rank_ >= 0 && begin < n;
         begin += data_world_ * kChunk) {
      // Each chunk is progress: an eval longer than --hang-timeout that moves is not a hang.
      mark(Phase::eval);
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
    mark_collective("allreduce of the eval sums");
    comm_.allreduce(sums, 3, ReduceOp::sum);
    if (sums[2] == 0) {
      return {std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::quiet_NaN()};
    }
    const double loss = sums[0] / sums[2];
    const double accuracy = sums[1] / sums[2];
    if (rank_ == 0 && record) {
      const json line = {{"step", step}, {"eval_loss", loss}, {"eval_accuracy", accuracy}};
      run_file_write([&] { append_line(options_.run_dir / "metrics.jsonl", json_text(line)); });
      json event = line;
      event["event"] = "eval";
      emit(event);
    }
    return {loss, accuracy};
  }

  // Every rank must hold the same parameters; a mismatch means a bug or a bad node.
  std::string check_replicas(int64_t step) {
    // A parameter server holds a shard, not a replica: it sends a placeholder, left unchecked.
    uint64_t mine = 0;
    if (!server_) {
      const std::vector<float> host = to_host(params_);
      mine = checksum64(host.data(), host.size() * sizeof(float));
    }
    std::vector<uint64_t> all(static_cast<size_t>(world_));
    mark_collective("allgather of the replica checksums");
    comm_.allgather(&mine, sizeof(mine), all.data());
    for (int r = 0; r < data_world_; ++r) {
      if (all[static_cast<size_t>(r)] != all[0]) {
        throw Error(
            ErrorKind::comm,
            fmt::format("rank {} parameters diverged from rank 0 at step {} (checksum {} "
                        "vs {})",
                        r, step, checksum_hex(all[static_cast<size_t>(r)]), checksum_hex(all[0])));
      }
    }
    return checksum_hex(all[0]);
  }

  // Values of optimizer state per parameter (adamw 2, sgd 1).
  size_t state_per_param() const { return optimizer_state_per_param(recipe_.optimizer); }

  // The rank that holds shard `index`: ZeRO-1 rank `index`, the parameter-server mode its
  // index-th server.
  size_t owner_of(size_t index) const {
    return (ps_ ? static_cast<size_t>(data_world_) : 0) + index;
  }

  // The whole optimizer state in the unsharded layout (what a checkpoint holds, whatever the
  // world size and sync mode). Sharded (ZeRO-1, parameter servers) every rank's shard is gathered:
  // a collective every rank calls (ranks without a shard send zeros). Otherwise only the ranks
  // that write checkpoints need it.
  std::vector<float> full_optimizer_state() {
    if (shards_ == 1 && !ps_) {
      return writes_checkpoints() ? to_host(optimizer_->state()) : std::vector<float>{};
    }
    const size_t k = state_per_param();
    std::vector<float> own = to_host(optimizer_->state());
    own.resize(k * shard_, 0.0f);
    std::vector<float> gathered(own.size() * static_cast<size_t>(world_));
    mark_collective("allgather of the optimizer state");
    comm_.allgather(own.data(), own.size() * sizeof(float), gathered.data());
    // gathered: rank-major [rank][k][shard]; the full layout: [k][parameter].
    std::vector<float> full(k * num_params_);
    for (size_t kk = 0; kk < k; ++kk) {
      for (size_t i = 0; i < num_params_; ++i) {
        full[kk * num_params_ + i] =
            gathered[(owner_of(i / shard_) * k + kk) * shard_ + i % shard_];
      }
    }
    return full;
  }

  // Sharded: this rank's shard of a full optimizer state (the padding past the last parameter
  // zero), onto the device; nothing for a rank without a shard.
  void restore_state_shard(const std::vector<float>& full) {
    if (shard_index_ < 0) return;
    const size_t k = state_per_param();
    std::vector<float> own(k * shard_, 0.0f);
    const size_t begin = static_cast<size_t>(shard_index_) * shard_;
    for (size_t kk = 0; kk < k; ++kk) {
      for (size_t off = 0; off < shard_ && begin + off < num_params_; ++off) {
        own[kk * shard_ + off] = full[kk * num_params_ + begin + off];
      }
    }
    const auto state = optimizer_->state();
    ops_->upload(own.data(), state.data(), state.size_bytes());
  }

  // Every rank's error-feedback residuals, rank after rank (a collective when there are any).
  // What a rank carries between steps that no other rank holds: compression's error-feedback
  // residuals, or under local SGD its replica's optimizer state. Empty when there is none.
  size_t replica_state_size() const {
    if (local_sgd_) return optimizer_->state().size();
    return reducer_ ? reducer_->state_size() : 0;
  }

  // Every rank's replica state, rank after rank (the checkpoint's comm blob).
  std::vector<float> all_replica_states() {
    const size_t size = replica_state_size();
    if (size == 0) return {};
    const std::vector<float> own = local_sgd_ ? to_host(optimizer_->state()) : reducer_->state();
    std::vector<float> all(size * static_cast<size_t>(world_));
    mark_collective(local_sgd_ ? "allgather of the replicas' optimizer states"
                               : "allgather of the compression residuals");
    comm_.allgather(own.data(), size * sizeof(float), all.data());
    return all;
  }

  // local_sgd: the replicas' optimizer states of `all` (all_replica_states) averaged as their
  // parameters are (average_replicas_of), which a resume on another world size starts from.
  std::vector<float> replicas_mean(const std::vector<float>& all) const {
    const size_t size = all.size() / static_cast<size_t>(world_);
    std::vector<double> sum(size, 0.0);
    for (int r = 0; r < world_; ++r) {
      const auto weight = static_cast<double>(micro_batches_of(r));
      for (size_t i = 0; i < size; ++i)
        sum[i] += weight * all[static_cast<size_t>(r) * size + i];
    }
    std::vector<float> mean(size);
    for (size_t i = 0; i < size; ++i)
      mean[i] = static_cast<float>(sum[i] / static_cast<double>(micro_batches_));
    return mean;
  }

  fs::path checkpoint(int64_t step) {
    mark(Phase::checkpoint);
    fs::path written;
    // A node leader that is a parameter server holds only its shard up to date: every writer gets
    // the workers' parameters (they are all the same at a checkpoint).
    if (ps_) broadcast_device(params_.data(), params_.size_bytes(), 0);
    const std::vector<float> comm_state = all_replica_states();
    const std::vector<float> optimizer_state =
        local_sgd_ ? (writes_checkpoints() ? replicas_mean(comm_state) : std::vector<float>{})
                   : full_optimizer_state();
    if (writes_checkpoints()) {
      TrainingPosition pos;
      pos.step = step;
      pos.epoch = position_.epoch;
      pos.samples_in_epoch = position_.sample;
      pos.world_size = world_;
      pos.global_batch = global_batch_;
      pos.optimizer_steps = ps_ ? step : optimizer_->steps();  // workers hold no optimizer
      pos.recipe_hash = recipe_hash(recipe_);
      pos.model = to_json(recipe_)["model"].dump();
      pos.data_fingerprint = data_.fingerprint;
      pos.rng_state = fmt::format("sampler seed={} epoch={}", recipe_.seed, position_.epoch);
      pos.loss_scale = scaler_.scale();
      pos.loss_scale_clean_steps = scaler_.clean_steps();
      pos.loss = last_loss_;
      std::function<void()> hook;
      if (options_.before_checkpoint_commit) {
        hook = [this, step] { options_.before_checkpoint_commit(step); };
      }
      written = write_checkpoint(options_.run_dir / "checkpoints", pos, to_host(params_),
                                 optimizer_state, recipe_.checkpoint.keep, hook, comm_state);
      emit({{"event", "checkpoint"}, {"step", step}, {"path", written.string()}});
    } else {
      written = options_.run_dir / "checkpoints" / checkpoint_name(step);
    }
    // Nobody runs ahead of a checkpoint being written: a failure right after it loses nothing.
    // (Rank 0 has written it by now: the others wait here while it does.)
    mark_collective("barrier after the checkpoint is written");
    comm_.barrier();
    return written;
  }

  void truncate_metrics_after(int64_t step) {
    run_file_write(
        [&] { dptrain::truncate_metrics_after(options_.run_dir / "metrics.jsonl", step); });
  }

  // A file of the run that cannot be written (a full disk, a pipe in its place) fails the rank
  // as a checkpoint that cannot be written does (exit 5): a restart would meet it again, so the
  // launcher does not make one.
  template <typename Write>
  static void run_file_write(Write&& write) {
    try {
      write();
    } catch (const Error& e) {
      if (e.kind() != ErrorKind::io) throw;
      throw Error(ErrorKind::checkpoint, e.what());
    }
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
  // sync "ps": the last servers_ ranks are parameter servers; the others (data_world_ of them)
  // compute. Otherwise every rank computes: data_rank_ = rank_ (-1 on a server).
  const int servers_;
  const int data_world_;
  const int data_rank_;
  const int64_t micro_batch_;
  const int64_t global_batch_;
  const int64_t micro_batches_;  // per step, over all ranks
  const double lr_scale_;
  std::shared_ptr<Ops> ops_;
  const DType dtype_;
  // Gloo on a GPU: the big collectives go through host memory (staging_).
  const bool staged_;
  const bool local_sgd_ = recipe_.distributed.sync == "local_sgd";
  const bool zero_ = recipe_.distributed.zero == 1;
  const bool ps_ = servers_ > 0;
  // Whether a step that is not a log step sums the stop at its end (sum_loss_and_stop decides,
  // at each log step, from the ranks' mean step time): on until the first log step, whose steps
  // are not measured yet (every rank starts alike; the first steps of a long run may be long).
  bool stop_check_each_step_ = true;
  // The ranks' mean step time as they last summed it (a log step's sum_loss_and_stop, or a step's
  // own stop sum); unknown (infinite: taken as long, as above) until the first.
  double mean_step_ms_ = std::numeric_limits<double>::infinity();
  // ps: the step the servers stop after, once one was asked for (choose_ps_stop); 0 until then.
  // A worker learns it from the servers' replies.
  int64_t ps_stop_at_ = 0;
  // A server: whether a stop was asked for, by this rank or in a worker's push.
  bool ps_stop_asked_ = false;
  // ZeRO-1 over Gloo: its reduce-scatter is an all-reduce and a slice anyway, so the bucketed,
  // overlapped all-reduce serves, and each rank updates its shard of the summed gradients. NCCL
  // reduce-scatters (half the bytes, no overlap).
  const bool zero_by_allreduce_ = zero_ && comm_.backend() != "nccl";
  const bool server_ = ps_ && data_rank_ < 0;
  std::unique_ptr<Model> model_;
  DataSplits data_;
  // A token model's context: tokens/s = samples/s x this (0 for other data).
  const int64_t tokens_per_sample_ = data_.train->labels_per_sample() > 1
                                         ? data_.train->labels_per_sample() - 1
                                         : 0;
  DistributedSampler sampler_;
  const size_t num_params_;
  // The parameters split into shards_ shards of shard_ values, padded with zeros to shards_ x
  // shard_ (padded_): ZeRO-1 gives rank r shard r, the parameter-server mode server k shard k
  // (workers none); otherwise one shard of everything that every rank holds. shard_index_ is this
  // rank's shard (-1: none); its optimizer state covers that shard only.
  const int shards_ = zero_ ? world_ : (ps_ ? servers_ : 1);
  const int shard_index_ = zero_ ? rank_ : (ps_ ? (server_ ? rank_ - data_world_ : -1) : 0);
  const size_t shard_;
  const size_t padded_;
  Buffer params_buffer_;
  // The gradients plus one slot: the stop flag rides along with the gradient all-reduce, so
  // agreeing to stop costs no extra collective.
  Buffer grad_buffer_;
  Buffer shard_grads_;        // ZeRO-1 by reduce-scatter: this rank's shard of the summed gradients
  size_t flag_at_ = padded_;  // the stop flag's slot in grad_buffer_
  std::span<float> params_;   // device memory of ops_, as are grads_ and the optimizer's state
  std::span<float> grads_;
  std::unique_ptr<Optimizer> optimizer_;
  LossScaler scaler_;
  std::vector<float> staging_;
  // The parameter-server mode's host buffers: messages out and in, and parameters (gradients).
  std::vector<float> ps_out_, ps_in_, ps_host_;
  std::vector<float> ps_sum_;  // a server's sum of the workers' gradients
  // The gradient all-reduce (none with ZeRO-1, nor for a local SGD run without a synchronous
  // start).
  std::unique_ptr<GradientReducer> reducer_;
  std::vector<int64_t> idx_;
  std::vector<float> x_;
  std::vector<int32_t> y_;
  int64_t step_ = 0;
  int64_t first_step_ = 0;
  bool resumed_ = false;  // from a checkpoint
  // The loss last logged (summed over the ranks), or the checkpoint's resumed from; NaN when none.
  double last_loss_ = std::numeric_limits<double>::quiet_NaN();
  Clock::time_point run_start_;
  DataPosition position_;
  int source_rank_ = 0;
  // A node leader whose run directory is rank N's too (claim_run_directory): N; else -1.
  int shares_run_dir_with_ = -1;
};

}  // namespace

void truncate_metrics_after(const fs::path& metrics_file, int64_t step) {
  std::error_code ec;
  if (!fs::exists(metrics_file, ec)) return;
  check_regular_or_missing(metrics_file);
  std::string kept;
  const std::string text = read_file(metrics_file);
  size_t pos = 0;
  while (pos < text.size()) {
    size_t end = text.find('\n', pos);
    if (end == std::string::npos) end = text.size();
    const std::string line = text.substr(pos, end - pos);
    pos = end + 1;
    const json j = parse_json(line, false);
    // A torn last line from the crash, or one that is not the trainer's (a step that is not a
    // number): status and report pass over it, and so does a resume.
    if (j.is_discarded() || !j.is_object() || !j.contains("step") || !j["step"].is_number()) {
      continue;
    }
    if (j["step"].get<double>() <= static_cast<double>(step)) kept += line + "\n";
  }
  write_file_atomic(metrics_file, kept);
}

int64_t global_batch(const Recipe& recipe, int world_size, int nominal_world) {
  const int batch_world =
      recipe.distributed.resize == "scale_lr" || nominal_world <= 0 ? world_size : nominal_world;
  // Parameter servers compute no gradients: the batch is the workers'.
  return std::max<int64_t>(batch_world - server_ranks(recipe), 0) * recipe.train.batch_per_rank *
         recipe.train.grad_accum;
}

void check_levers(const Recipe& recipe) {
  if (const CompressionSpec& c = recipe.distributed.compression; c.type == "powersgd") {
    // A rank no smaller than what some matrix gains from is clamped per matrix; one at which no
    // matrix gains would send everything whole while the run says it compresses.
    const auto tensors = make_model(recipe.model)->tensors();
    size_t best = 0;  // the largest rank at which some matrix is still factorised
    bool any = false;
    for (const ParamTensor& t : tensors) {
      any = any || powersgd_rank_for(t, static_cast<size_t>(c.rank)) > 0;
      for (size_t r = std::min(t.rows, t.cols); r > best; --r) {
        if (powersgd_rank_for(t, r) == r) {
          best = r;
          break;
        }
      }
    }
    if (!any && best == 0) {
      // Not even rank 1 gains: every matrix is too small (a 1 x N one, say) to factorise.
      throw Error(ErrorKind::recipe,
                  "/distributed/compression/type: powersgd compresses none of the model's weight "
                  "matrices at any rank (each is too small for P and Q to be smaller); use int8 "
                  "or topk, or no compression");
    }
    if (!any) {
      throw Error(ErrorKind::recipe,
                  fmt::format("/distributed/compression/rank: {} compresses none of the model's "
                              "weight matrices (as P and Q each would be no smaller); use at most "
                              "{}",
                              c.rank, best));
    }
  }
}

namespace {

void check_runnable_here(const Recipe& recipe, int world_size, int nominal_world) {
  check_has_workers(recipe, world_size);
  check_levers(recipe);
  // Its size only: synthetic data is not generated here (the ranks do); CSV rows and token
  // checksums are checked. A CSV file's rows are /data/path's problems, one a line, as `recipe
  // validate` words them.
  const int64_t samples = recipe_training_samples(recipe);
  DistributedSampler sampler(samples, global_batch(recipe, world_size, nominal_world), recipe.seed);
}

}  // namespace

int64_t warmup_steps(int64_t steps) {
  return std::min<int64_t>(10, steps / 5);
}

int64_t recipe_training_samples(const Recipe& recipe) {
  try {
    return training_samples(recipe.data, recipe.model, recipe.seed);
  } catch (const Error& e) {
    if (recipe.data.type != "csv" || e.kind() != ErrorKind::recipe) throw;
    // A problem that names its own field (the split's /data/eval_fraction) keeps it; a row's
    // problem starts with the file's path, which may lie under /data/ too.
    const std::string what = e.what();
    throw Error(ErrorKind::recipe, what.starts_with("/data/eval_fraction: ")
                                       ? what
                                       : prefix_lines(what, [](std::string_view) {
                                           return std::string("/data/path: ");
                                         }));
  }
}

void check_runnable(const Recipe& recipe, int world_size, int nominal_world,
                    const RecipeSource& origin) {
  try {
    check_runnable_here(recipe, world_size, nominal_world);
  } catch (const Error& e) {
    const std::string what = e.what();
    if (origin.file.empty() || e.kind() != ErrorKind::recipe ||
        what.starts_with(origin.file + ": ")) {
      throw;
    }
    throw Error(ErrorKind::recipe, origin.place(what));
  }
}

TrainResult train(const Recipe& recipe, Communicator& comm, const TrainerOptions& options) {
  check_has_workers(recipe, comm.size());
  if (comm.backend() == "nccl" && !options.ops) {
    // NCCL orders its stream after the op table's compute stream: it must be the one used here.
    throw Error(ErrorKind::internal,
                "train: an NCCL communicator needs the op table it was made with (options.ops)");
  }
  TrainingRun run(recipe, comm, options);
  return run.run();
}

}  // namespace dptrain
