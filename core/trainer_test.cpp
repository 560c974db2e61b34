// The training loop over real Gloo communicators in threads: replicas agree, divergence is caught.
#include "core/trainer.hpp"

#include <doctest/doctest.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <array>
#include <cmath>
#include <fstream>
#include <functional>
#include <future>
#include <optional>
#include <thread>

#include "core/checkpoint.hpp"
#include "core/comm/gloo_communicator.hpp"
#include "core/comm/tcp_store.hpp"
#include "core/data/tokens.hpp"
#include "core/error.hpp"
#include "core/fs.hpp"
#include "core/heartbeat.hpp"
#include "core/tensor/emulated_ops.hpp"
#include "tests/device_check_ops.hpp"
#include "tests/gloo_ranks.hpp"
#include "tests/temp_dir.hpp"

namespace fs = std::filesystem;
using namespace dptrain;
using dptrain::test::TempDir;

namespace {

Recipe tiny_recipe() {
  Recipe r;
  r.name = "tiny";
  r.seed = 3;
  r.model.input = 8;
  r.model.hidden = {16};
  r.model.classes = 3;
  r.data.samples = 600;
  r.train.steps = 30;
  r.train.batch_per_rank = 8;
  r.distributed.check_every = 5;
  r.distributed.timeout_s = 20;
  r.checkpoint.every = 0;
  r.eval.every = 0;
  r.log.every = 10;
  return r;
}

// A bad node: rank `victim` gets every float all-reduce result slightly wrong.
class CorruptingCommunicator : public test::ForwardingCommunicator {
 public:
  CorruptingCommunicator(std::unique_ptr<Communicator> inner, int victim)
      : ForwardingCommunicator(std::move(inner)), victim_(victim) {}
  using ForwardingCommunicator::allreduce;
  void allreduce(float* data, size_t count, ReduceOp op) override {
    ForwardingCommunicator::allreduce(data, count, op);
    if (rank() == victim_ && count > 0) data[0] += 1e-3f;
  }

 private:
  int victim_;
};

// Gloo posing as NCCL: "nccl", taking "device" memory (the CPU op table's is host memory). The
// trainer then takes its NCCL paths (ZeRO-1 by reduce-scatter, no staging) on the CPU.
class NcclLikeCommunicator : public test::ForwardingCommunicator {
 public:
  using ForwardingCommunicator::ForwardingCommunicator;
  std::string backend() const override { return "nccl"; }
  bool device_memory() const override { return true; }
};

// Gloo as a GPU's ranks use it: every buffer it is given must be host memory (the trainer
// stages device buffers through the host for it).
class HostOnlyCommunicator : public test::ForwardingCommunicator {
 public:
  using ForwardingCommunicator::ForwardingCommunicator;
  void allreduce(float* data, size_t count, ReduceOp op) override {
    host(data, "allreduce");
    ForwardingCommunicator::allreduce(data, count, op);
  }
  void allreduce(double* data, size_t count, ReduceOp op) override {
    host(data, "allreduce");
    ForwardingCommunicator::allreduce(data, count, op);
  }
  void allreduce(Half* data, size_t count, ReduceOp op) override {
    host(data, "allreduce");
    ForwardingCommunicator::allreduce(data, count, op);
  }
  void allreduce(BFloat16* data, size_t count, ReduceOp op) override {
    host(data, "allreduce");
    ForwardingCommunicator::allreduce(data, count, op);
  }
  std::unique_ptr<Request> isend(const void* data, size_t bytes, int peer, uint32_t tag) override {
    host(data, "isend");
    return ForwardingCommunicator::isend(data, bytes, peer, tag);
  }
  std::unique_ptr<Request> irecv(void* data, size_t bytes, int peer, uint32_t tag) override {
    host(data, "irecv");
    return ForwardingCommunicator::irecv(data, bytes, peer, tag);
  }
  int recv_any(void* data, size_t bytes, const std::vector<int>& peers, uint32_t tag) override {
    host(data, "recv_any");
    return ForwardingCommunicator::recv_any(data, bytes, peers, tag);
  }
  void broadcast(void* data, size_t bytes, int root) override {
    host(data, "broadcast");
    ForwardingCommunicator::broadcast(data, bytes, root);
  }
  void allgather(const void* in, size_t bytes_per_rank, void* out) override {
    host(in, "allgather");
    host(out, "allgather");
    ForwardingCommunicator::allgather(in, bytes_per_rank, out);
  }

 private:
  static void host(const void* p, const char* op) {
    test::DeviceMemory::instance().need_host(p, op, "Gloo's buffer");
  }
};

struct RankOutcome {
  TrainResult result;
  std::string error;
};

// Each rank's trainer options from its rank.
using OptionsFor = std::function<TrainerOptions(int rank)>;

std::vector<RankOutcome> train_ranks(const Recipe& recipe, int world, const OptionsFor& options_for,
                                     int corrupt_rank = -1, bool nccl_like = false,
                                     bool host_only = false) {
  TcpStoreServer server("127.0.0.1", 0);
  std::vector<std::future<RankOutcome>> futures;
  for (int r = 0; r < world; ++r) {
    futures.push_back(std::async(std::launch::async, [&, r] {
      RankOutcome out;
      try {
        TcpStoreClient client("127.0.0.1", server.port(), std::chrono::seconds(10));
        PrefixStore store("gen1", client);
        GlooOptions options;
        options.timeout = std::chrono::seconds(20);
        std::unique_ptr<Communicator> gloo = make_gloo_communicator(store, r, world, options);
        std::unique_ptr<Communicator> comm;
        if (nccl_like) {
          comm = std::make_unique<NcclLikeCommunicator>(std::move(gloo));
        } else if (host_only) {
          comm = std::make_unique<HostOnlyCommunicator>(std::move(gloo));
        } else {
          comm = std::make_unique<CorruptingCommunicator>(std::move(gloo), corrupt_rank);
        }
        const TrainerOptions topts = options_for(r);
        out.result = train(recipe, *comm, topts);
      } catch (const Error& e) {
        out.error = e.what();
      }
      return out;
    }));
  }
  std::vector<RankOutcome> outcomes;
  for (auto& f : futures)
    outcomes.push_back(f.get());
  return outcomes;
}

std::vector<RankOutcome> train_ranks(const Recipe& recipe, int world, const fs::path& run_dir,
                                     int corrupt_rank = -1, bool nccl_like = false) {
  return train_ranks(
      recipe, world,
      [&run_dir](int) {
        TrainerOptions o;
        o.run_dir = run_dir;
        return o;
      },
      corrupt_rank, nccl_like);
}

std::vector<float> final_params(const fs::path& run_dir, int64_t step) {
  return read_checkpoint(run_dir / "checkpoints" / checkpoint_name(step)).params;
}

double max_relative_difference(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double scale = std::max(1e-3, std::abs(static_cast<double>(a[i])));
    worst = std::max(worst, std::abs(static_cast<double>(a[i]) - b[i]) / scale);
  }
  return worst;
}

// Trains `r` on 2 ranks in fp32 on the CPU, then in bf16 and fp16 on the op tables `make_ops`
// gives (Gloo checked to see host memory only when `host_only`, and no "device" memory rule
// broken): both ranks agree and the held-out loss is fp32's within 5%. `check` adds its own.
void in_16_bits_like_fp32(
    const Recipe& r, const std::function<std::shared_ptr<Ops>()>& make_ops, bool host_only,
    const std::function<void(const std::string&, const std::vector<RankOutcome>&,
                             const TrainResult&, const fs::path&)>& check) {
  TempDir f32_dir;
  const auto f32 = train_ranks(r, 2, f32_dir.path());
  REQUIRE(f32[0].error.empty());
  for (const std::string precision : {"bf16", "fp16"}) {
    CAPTURE(precision);
    Recipe rp = r;
    rp.train.precision = precision;
    TempDir dir;
    test::DeviceMemory::instance().take_violations();
    const auto out = train_ranks(
        rp, 2,
        [&](int) {
          TrainerOptions o;
          o.run_dir = dir.path();
          o.ops = make_ops();
          return o;
        },
        -1, false, host_only);
    for (const auto& o : out)
      REQUIRE(o.error.empty());
    const std::vector<std::string> violations = test::DeviceMemory::instance().take_violations();
    INFO("first violation: " << (violations.empty() ? std::string("none") : violations.front()));
    CHECK(violations.empty());
    CHECK(out[0].result.params_checksum == out[1].result.params_checksum);
    MESSAGE(precision << ": held-out loss " << out[0].result.eval_loss << " (fp32 "
                      << f32[0].result.eval_loss << ")");
    CHECK(out[0].result.eval_loss == doctest::Approx(f32[0].result.eval_loss).epsilon(0.05));
    check(precision, out, f32[0].result, dir.path());
  }
}

}  // namespace

TEST_CASE("trainer: two ranks in threads agree and write result, metrics and a checkpoint") {
  TempDir tmp;
  const auto outcomes = train_ranks(tiny_recipe(), 2, tmp.path(), -1);
  REQUIRE(outcomes[0].error.empty());
  REQUIRE(outcomes[1].error.empty());
  CHECK(outcomes[0].result.params_checksum == outcomes[1].result.params_checksum);
  CHECK(outcomes[0].result.steps == 30);
  CHECK(fs::exists(tmp.path() / "result.json"));
  CHECK(fs::exists(tmp.path() / "metrics.jsonl"));
  CHECK(fs::exists(tmp.path() / "checkpoints/step-000030/params.bin"));
}

TEST_CASE("trainer: bf16 and fp16 on 16-bit storage (emulated on the CPU) train like fp32") {
  // The trainer's mixed-precision path (f32 master weights cast for every micro-batch, f32
  // gradients, fp16's loss scaling and its checkpointed state) without a GPU.
  Recipe r = tiny_recipe();
  r.train.steps = 60;
  r.eval.every = 60;
  r.checkpoint.every = 60;
  in_16_bits_like_fp32(
      r, [] { return std::make_shared<EmulatedHalfOps>(); }, false,
      [](const std::string& precision, const std::vector<RankOutcome>& out, const TrainResult& f32,
         const fs::path& dir) {
        CHECK(out[0].result.params_checksum != f32.params_checksum);  // 16 bits did round
        const CheckpointData ckpt = read_checkpoint(dir / "checkpoints" / checkpoint_name(60));
        if (precision == "fp16") {
          // Dynamic loss scaling: 2^16 at the start, halved on overflow, a power of two.
          CHECK(ckpt.position.loss_scale > 1);
          CHECK(ckpt.position.loss_scale <= 65536);
          CHECK(std::exp2(std::round(std::log2(ckpt.position.loss_scale))) ==
                ckpt.position.loss_scale);
        } else {
          CHECK(ckpt.position.loss_scale == 1);
        }
      });
}

TEST_CASE("trainer: ZeRO-1 by reduce-scatter (the NCCL path) trains like all-reduce, 1 rank too") {
  Recipe r = tiny_recipe();
  r.checkpoint.every = 30;
  for (int world : {1, 2}) {
    CAPTURE(world);
    TempDir plain, zero;
    REQUIRE(train_ranks(r, world, plain.path())[0].error.empty());
    Recipe rz = r;
    rz.distributed.zero = 1;
    const auto out = train_ranks(
        rz, world,
        [&](int) {
          TrainerOptions o;
          o.run_dir = zero.path();
          o.ops = std::make_shared<CpuOps>();  // NCCL needs the table it was made with
          return o;
        },
        -1, true);
    for (const auto& o : out)
      REQUIRE(o.error.empty());
    CHECK(max_relative_difference(final_params(plain.path(), 30), final_params(zero.path(), 30)) <
          1e-5);
  }
  // Without its op table an NCCL communicator would wait on a stream nobody uses.
  TempDir bare;
  const auto refused = train_ranks(r, 1, bare.path(), -1, true);
  CHECK(refused[0].error.find("an NCCL communicator needs the op table") != std::string::npos);
}

TEST_CASE("trainer: local SGD in fp16 (16-bit storage emulated) resumes bit-identically") {
  // Each rank's loss scaler judges its own local steps: the ranks agree on one scale whenever
  // they average, so the checkpoint holds every rank's.
  Recipe r = tiny_recipe();
  r.train.precision = "fp16";
  r.train.steps = 200;
  r.train.batch_per_rank = 1;  // small, noisy local steps at a high rate: some overflow
  r.optimizer.lr = 0.05;
  r.distributed.sync = "local_sgd";
  r.distributed.period = 4;
  r.checkpoint.every = 100;
  const auto emulated = [](const fs::path& dir, const fs::path& from) {
    return [dir, from](int) {
      TrainerOptions o;
      o.run_dir = dir;
      o.resume_from = from;
      o.ops = std::make_shared<EmulatedHalfOps>();
      return o;
    };
  };
  TempDir whole, resumed;
  const auto full = train_ranks(r, 2, emulated(whole.path(), {}));
  REQUIRE(full[0].error.empty());
  REQUIRE(full[1].error.empty());
  const auto again = train_ranks(
      r, 2, emulated(resumed.path(), whole.path() / "checkpoints" / checkpoint_name(100)));
  REQUIRE(again[0].error.empty());
  CHECK(again[0].result.params_checksum == full[0].result.params_checksum);
  const auto scale_at = [](const fs::path& dir, int64_t step) {
    return read_checkpoint(dir / "checkpoints" / checkpoint_name(step)).position.loss_scale;
  };
  CHECK(scale_at(whole.path(), 100) < 65536);  // the scaler did act
  CHECK(scale_at(resumed.path(), 200) == scale_at(whole.path(), 200));
}

TEST_CASE("trainer: a diverging run fails on every rank at its first non-finite step, unsaved") {
  Recipe r = tiny_recipe();
  r.optimizer.type = "sgd";
  r.optimizer.lr = 1e4;
  r.optimizer.momentum = 0.9;
  r.optimizer.clip_grad_norm = 0;
  r.checkpoint.every = 1;
  r.checkpoint.keep = 100;
  r.log.every = 1;
  TempDir tmp;
  const auto out = train_ranks(r, 2, tmp.path());
  const auto step_of = [](const std::string& e) {
    return std::stoll(e.substr(e.find(" at step ") + 9));
  };
  for (const auto& rank : out) {
    const std::string& e = rank.error;
    CAPTURE(e);
    REQUIRE(e.find("the training diverged at step") != std::string::npos);
    CHECK(e.find("gradient norm is nan") != std::string::npos);
    CHECK(e.find("/optimizer/lr") != std::string::npos);
    // The same step on both: the norm is the reduced gradients'.
    CHECK(step_of(e) == step_of(out[0].error));
  }
  const int64_t at = step_of(out[0].error);
  CHECK(at > 1);
  CHECK(at < 30);
  // Every step before it was checkpointed; not that one, whose parameters are not finite.
  CHECK(fs::exists(tmp.path() / "checkpoints" / checkpoint_name(at - 1)));
  CHECK_FALSE(fs::exists(tmp.path() / "checkpoints" / checkpoint_name(at)));
  for (const std::string line : {"\"loss\":null", "\"grad_norm\":null"})
    CHECK(read_file(tmp.path() / "metrics.jsonl").find(line) == std::string::npos);

  // fp16: overflows are skipped steps while the loss scale can shrink; at scale 1 it is
  // divergence too.
  r.train.precision = "fp16";
  r.checkpoint.every = 0;
  TempDir half;
  const auto fp16 = train_ranks(r, 2, [&](int) {
    TrainerOptions o;
    o.run_dir = half.path();
    o.ops = std::make_shared<EmulatedHalfOps>();
    return o;
  });
  REQUIRE(!fp16[0].error.empty());
  CHECK(fp16[0].error.find("the training diverged at step") != std::string::npos);
}

// Options for a rank writing to `run_dir` whose stop is asked for (as a SIGTERM would be) from
// step index `from` on.
TrainerOptions stopping_from(const fs::path& run_dir, int64_t from) {
  TrainerOptions o;
  o.run_dir = run_dir;
  auto step = std::make_shared<int64_t>(0);
  o.before_step = [step](int64_t s) { *step = s; };
  o.stop_requested = [step, from] { return *step >= from; };
  return o;
}

// Local SGD on tiny_recipe for 60 steps, averaging every `period` steps, with no checkpoint,
// evaluation or replica check between (a replica check averages first).
Recipe local_sgd_recipe(int64_t period) {
  Recipe r = tiny_recipe();
  r.train.steps = 60;
  r.distributed.sync = "local_sgd";
  r.distributed.period = period;
  r.checkpoint.every = 0;
  r.eval.every = 0;
  r.distributed.check_every = 0;
  return r;
}

TEST_CASE("trainer: a stop asked for during a long step is answered at that step's end") {
  // The request comes after the step read its flag for the gradient exchange (the second look
  // within step index 11): with steps long enough (stop_check_step_ms; 0 here, as the ranks'
  // mean step time agreed at the log step 10 is), the ranks still stop after that step, not
  // after one more; a log step takes it at its end whatever the steps' length (log.every 10:
  // step 10 is one). Short steps leave it to the next step's exchange (13, not 12).
  struct Case {
    int64_t asked_in;
    double check_ms;
    int64_t stops_after;
  };
  // Before the first log step the steps are not measured yet: each sums the stop (5 -> 6).
  for (const Case& c :
       {Case{11, 0, 12}, Case{9, 0, 10}, Case{9, 1e9, 10}, Case{11, 1e9, 13}, Case{5, 1e9, 6}}) {
    CAPTURE(c.asked_in);
    CAPTURE(c.check_ms);
    Recipe r = tiny_recipe();
    r.checkpoint.every = 0;
    TempDir dir;
    const auto out = train_ranks(r, 2, [&](int) {
      TrainerOptions o;
      o.run_dir = dir.path();
      o.stop_check_step_ms = c.check_ms;
      auto step = std::make_shared<int64_t>(0);
      auto looks = std::make_shared<int>(0);
      o.before_step = [step, looks](int64_t s) {
        *step = s;
        *looks = 0;
      };
      o.stop_requested = [step, looks, asked = c.asked_in] {
        return *step > asked || (*step == asked && ++*looks >= 2);
      };
      return o;
    });
    REQUIRE(out[0].error.empty());
    CHECK(out[0].result.stopped);
    CHECK(out[0].result.steps == c.stops_after);
    CHECK(fs::exists(dir.path() / "checkpoints" / checkpoint_name(c.stops_after)));
  }
}

TEST_CASE("trainer: parameter servers stop where the servers choose, asked on one rank alone") {
  // No log step, evaluation or checkpoint in the run: the stop asked for on one rank (a worker,
  // whose push carries it, or one of two servers, which tells the other as they sum the norm) is
  // taken by every rank at the step the servers choose, version + staleness + 1: at staleness 0
  // the step after the one the request came in (asked in step index 20: version 21, stop after
  // 22); above it within staleness + 2 steps of the request.
  for (const int64_t staleness : {0, 2}) {
    for (const int asker : {0, 3}) {
      CAPTURE(staleness);
      CAPTURE(asker);
      Recipe r = tiny_recipe();
      r.train.steps = 60;
      r.log.every = 1000;
      r.distributed.check_every = 0;
      r.distributed.sync = "ps";
      r.distributed.servers = 2;
      r.distributed.staleness = staleness;
      TempDir dir;
      const int64_t asked_in = 20;
      const auto out = train_ranks(r, 4, [&](int rank) {
        if (rank == asker) return stopping_from(dir.path(), asked_in);
        TrainerOptions o;
        o.run_dir = dir.path();
        return o;
      });
      for (const RankOutcome& rank : out) {
        REQUIRE(rank.error.empty());
        CHECK(rank.result.stopped);
        CHECK(rank.result.steps == out[0].result.steps);
      }
      if (staleness == 0) {
        CHECK(out[0].result.steps == asked_in + 2);
      } else {
        CHECK(out[0].result.steps > asked_in);
        CHECK(out[0].result.steps <= asked_in + staleness + 2);
      }
      CHECK(fs::exists(dir.path() / "checkpoints" / checkpoint_name(out[0].result.steps)));
    }
  }
}

TEST_CASE("trainer: the wait in the logged loss's all-reduce is exposed communication") {
  // Rank 1 sleeps 40 ms after each update, before the loss is summed (log.every 1): rank 0
  // waits for it there, in no gradient exchange. That wait is communication in its phases (it
  // was in none, and the phases fell short of the step time by it).
  Recipe r = tiny_recipe();
  r.log.every = 1;
  r.train.steps = 12;
  r.checkpoint.every = 0;
  TempDir dir;
  const auto out = train_ranks(r, 2, [&](int rank) {
    TrainerOptions o;
    o.run_dir = dir.path();
    if (rank == 1) o.debug_step_delay_ms = 40;
    return o;
  });
  REQUIRE(out[0].error.empty());
  REQUIRE(out[1].error.empty());
  CHECK(out[0].result.phases_ms[2] >= 35.0);
  // Each logged step's comm_ms likewise (the first, with the start's waits, aside).
  int logged = 0;
  std::ifstream metrics(dir.path() / "metrics.jsonl");
  for (std::string text; std::getline(metrics, text);) {
    const auto line = nlohmann::json::parse(text);
    if (!line.contains("comm_ms") || line["step"] == 1) continue;
    CHECK(line["comm_ms"].get<double>() >= 35.0);
    CHECK(line["step_ms"].get<double>() >= line["comm_ms"].get<double>());  // the wait is in it
    ++logged;
  }
  CHECK(logged == 11);
}

TEST_CASE("trainer: a stop agreed on at the last step completes the run") {
  // A SIGTERM during the last step is honoured after it: nothing is left to stop, and the
  // result is the complete run's, not a stop at the final step.
  for (const std::string sync : {"allreduce", "ps"}) {
    CAPTURE(sync);
    Recipe r = tiny_recipe();
    r.distributed.sync = sync;
    TempDir dir;
    const auto out =
        train_ranks(r, 2, [&](int) { return stopping_from(dir.path(), r.train.steps - 1); });
    REQUIRE(out[0].error.empty());
    CHECK_FALSE(out[0].result.stopped);
    CHECK(out[0].result.steps == r.train.steps);
    CHECK(std::isfinite(out[0].result.final_loss));
    CHECK(fs::exists(dir.path() / "result.json"));
  }
}

TEST_CASE("trainer: local SGD takes a stop at the next averaging, not at a log step between") {
  // Period 8, a log step at 30: a stop asked for at step 25 waits for the averaging after 32,
  // which comes well within TrainerOptions::local_stop_wait_ms (the resume stays bit-identical;
  // at 30 the replicas differ, and a checkpoint there would need an early averaging). Likewise
  // before the first log step (period 4, asked for at 2: stops after 4): the ranks' step times,
  // summed with the stop from the first step on, say the averaging is near.
  struct Case {
    int64_t period, asked_from, stops_after;
  };
  for (const Case& c : {Case{8, 25, 32}, Case{4, 2, 4}}) {
    CAPTURE(c.period);
    const Recipe r = local_sgd_recipe(c.period);
    TempDir dir;
    const auto out =
        train_ranks(r, 2, [&](int) { return stopping_from(dir.path(), c.asked_from); });
    REQUIRE(out[0].error.empty());
    CHECK(out[0].result.stopped);
    CHECK(out[0].result.steps == c.stops_after);
  }
}

TEST_CASE("trainer: local SGD whose next averaging is too far off for a stop averages at once") {
  // Period 8, a stop asked for at step 25: with no time to wait for the averaging after 32, the
  // ranks stop at the end of step 26, averaged there: the checkpoint is one model, and nothing
  // is lost. Long steps each sum the stop; short ones do every so many steps (as many as fit in
  // local_stop_wait_ms: every step here), not waiting for the log step at 30.
  const Recipe r = local_sgd_recipe(8);
  const int64_t stops_after = 26;
  for (const double check_ms : {1e9, 0.0}) {
    CAPTURE(check_ms);
    TempDir dir, resumed;
    const auto out = train_ranks(r, 2, [&](int) {
      TrainerOptions o = stopping_from(dir.path(), 25);
      o.local_stop_wait_ms = 0;
      o.stop_check_step_ms = check_ms;
      return o;
    });
    REQUIRE(out[0].error.empty());
    REQUIRE(out[1].error.empty());
    CHECK(out[0].result.stopped);
    CHECK(out[0].result.steps == stops_after);
    // The replicas agree (the stop's replica check passed on every rank).
    CHECK(out[0].result.params_checksum == out[1].result.params_checksum);
    REQUIRE(fs::exists(dir.path() / "checkpoints" / checkpoint_name(stops_after)));
    // The resume continues from it to the end.
    const auto again = train_ranks(r, 2, [&](int) {
      TrainerOptions o;
      o.run_dir = resumed.path();
      o.resume_from = dir.path() / "checkpoints" / checkpoint_name(stops_after);
      return o;
    });
    REQUIRE(again[0].error.empty());
    CHECK(again[0].result.steps == r.train.steps);
    CHECK(std::isfinite(again[0].result.final_loss));
  }
}

TEST_CASE("trainer: local SGD stopped between checkpoints resumes bit-identically") {
  // A stop (SIGTERM) writes a checkpoint the straight run does not: it must hold every replica's
  // optimizer state, not make the ranks share one, or the resumed run would go another way.
  const Recipe r = local_sgd_recipe(4);
  TempDir whole, stopped, resumed;
  const auto full = train_ranks(r, 2, whole.path());
  REQUIRE(full[0].error.empty());
  // Honoured at the averaging after step 24.
  const auto halted = train_ranks(r, 2, [&](int) { return stopping_from(stopped.path(), 21); });
  REQUIRE(halted[0].error.empty());
  REQUIRE(halted[0].result.stopped);
  CHECK(halted[0].result.steps == 24);
  const auto again = train_ranks(r, 2, [&](int) {
    TrainerOptions o;
    o.run_dir = resumed.path();
    o.resume_from = stopped.path() / "checkpoints" / checkpoint_name(24);
    return o;
  });
  REQUIRE(again[0].error.empty());
  CHECK(again[0].result.params_checksum == full[0].result.params_checksum);
  // The checkpoint holds both replicas' optimizer states, which differ.
  const CheckpointData ckpt = read_checkpoint(stopped.path() / "checkpoints" / checkpoint_name(24));
  REQUIRE(ckpt.comm_state.size() == 2 * ckpt.optimizer_state.size());
  const size_t half = ckpt.optimizer_state.size();
  CHECK(!std::equal(ckpt.comm_state.begin(), ckpt.comm_state.begin() + static_cast<long>(half),
                    ckpt.comm_state.begin() + static_cast<long>(half)));
  // On one rank the replicas' mean is what it starts from.
  TempDir one;
  const auto alone = train_ranks(r, 1, [&](int) {
    TrainerOptions o;
    o.run_dir = one.path();
    o.resume_from = stopped.path() / "checkpoints" / checkpoint_name(24);
    o.nominal_world = 2;
    return o;
  });
  REQUIRE(alone[0].error.empty());
  CHECK(alone[0].result.steps == 60);
}

TEST_CASE("trainer: on a GPU's op table, ops get device memory and Gloo host memory, every mode") {
  // The CPU posing as a GPU (DeviceCheckingOps): the trainer stages Gloo's collectives through
  // host memory as on a GPU, and the results are the CPU's.
  {
    test::DeviceMemory::instance().take_violations();
    test::DeviceCheckingOps ops(std::make_shared<CpuOps>());
    std::vector<float> host(4);
    Buffer device = ops.allocate(4 * sizeof(float));
    ops.axpy(4, 1.0f, host.data(), device.as<float>());  // the check notices host memory
    CHECK(test::DeviceMemory::instance().take_violations().size() == 1);
  }
  struct Mode {
    const char* name;
    std::function<void(Recipe&)> set;
    int world = 2;
    bool nccl_like = false;
  };
  const std::vector<Mode> modes = {
      {"allreduce", [](Recipe&) {}},
      {"int8", [](Recipe& r) { r.distributed.compression.type = "int8"; }},
      {"bf16 wire", [](Recipe& r) { r.distributed.compression.type = "bf16"; }},
      {"zero", [](Recipe& r) { r.distributed.zero = 1; }},
      {"zero over nccl", [](Recipe& r) { r.distributed.zero = 1; }, 2, true},
      {"local_sgd",
       [](Recipe& r) {
         r.distributed.sync = "local_sgd";
         r.distributed.period = 4;
       }},
      {"ps",
       [](Recipe& r) {
         r.distributed.sync = "ps";
         r.distributed.servers = 1;
       },
       3},
  };
  for (const Mode& mode : modes) {
    CAPTURE(mode.name);
    Recipe r = tiny_recipe();
    r.checkpoint.every = 30;
    mode.set(r);
    TempDir cpu_dir, gpu_dir;
    const auto cpu = train_ranks(r, mode.world, cpu_dir.path());
    REQUIRE(cpu[0].error.empty());
    test::DeviceMemory::instance().take_violations();
    const auto gpu = train_ranks(
        r, mode.world,
        [&](int) {
          TrainerOptions o;
          o.run_dir = gpu_dir.path();
          o.ops = std::make_shared<test::DeviceCheckingOps>(std::make_shared<CpuOps>());
          return o;
        },
        -1, mode.nccl_like, !mode.nccl_like);
    for (const auto& o : gpu)
      REQUIRE(o.error.empty());
    const std::vector<std::string> violations = test::DeviceMemory::instance().take_violations();
    INFO("first violation: " << (violations.empty() ? std::string("none") : violations.front()));
    CHECK(violations.empty());
    CHECK(max_relative_difference(final_params(cpu_dir.path(), 30),
                                  final_params(gpu_dir.path(), 30)) < 1e-5);
  }
}

TEST_CASE("trainer: the GPT on a GPU's op table in bf16 and fp16: device memory, f32's loss") {
  // Token windows of a repeating pattern the model can learn; the CPU posing as a GPU with
  // 16-bit activations (DeviceCheckingOps over EmulatedHalfOps), Gloo seeing host memory only.
  TempDir data;
  std::vector<int32_t> tokens(6000);
  for (size_t i = 0; i < tokens.size(); ++i)
    tokens[i] = static_cast<int32_t>((i * 7 + i / 13) % 16);
  write_token_file(data / "train.bin", 16, std::span(tokens).first(5000), 2);
  write_token_file(data / "val.bin", 16, std::span(tokens).subspan(5000), 2);
  Recipe r = tiny_recipe();
  r.model.type = "gpt";
  r.model.vocab = 16;
  r.model.context = 24;
  r.model.layers = 2;
  r.model.heads = 2;
  r.model.width = 32;
  r.data.type = "tokens";
  r.data.path = data.path().string();
  r.train.steps = 40;
  r.train.batch_per_rank = 4;
  r.eval.every = 40;
  r.checkpoint.every = 40;
  in_16_bits_like_fp32(
      r,
      [] { return std::make_shared<test::DeviceCheckingOps>(std::make_shared<EmulatedHalfOps>()); },
      true,
      [](const std::string&, const std::vector<RankOutcome>&, const TrainResult&, const fs::path&) {
      });
}

TEST_CASE("trainer: a rank whose parameters drift is caught at the next replica check") {
  TempDir tmp;
  const auto outcomes = train_ranks(tiny_recipe(), 2, tmp.path(), 1);
  for (const auto& o : outcomes) {
    CAPTURE(o.error);
    CHECK(o.error.find("rank 1 parameters diverged from rank 0 at step 5") != std::string::npos);
  }
  CHECK_FALSE(fs::exists(tmp.path() / "result.json"));
}

TEST_CASE("trainer: check_runnable refuses a split smaller than one global batch") {
  Recipe r = tiny_recipe();
  r.data.samples = 40;                  // 36 to train on
  CHECK_NOTHROW(check_runnable(r, 4));  // 4 x 8 = 32
  try {
    check_runnable(r, 5);  // 40 > 36
    FAIL("accepted");
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::recipe);
    CHECK(std::string(e.what()).find("40") != std::string::npos);
  }
}

TEST_CASE("trainer: check_runnable refuses a PowerSGD rank that compresses no matrix") {
  // 8-16-3: the 16 x 8 weight gains up to rank 5 (16 x 5 + 8 x 5 < 128), the 3 x 16 up to 2.
  Recipe r = tiny_recipe();
  r.distributed.compression.type = "powersgd";
  r.distributed.compression.rank = 5;
  CHECK_NOTHROW(check_runnable(r, 2));
  r.distributed.compression.rank = 6;
  try {
    check_runnable(r, 2);
    FAIL("accepted");
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::recipe);
    CHECK(std::string(e.what()) ==
          "/distributed/compression/rank: 6 compresses none of the model's weight matrices (as P "
          "and Q each would be no smaller); use at most 5");
  }
  // 1-0-2 (one input, no hidden layer): its 2 x 1 weight gains at no rank.
  r.model.input = 1;
  r.model.hidden.clear();
  r.model.classes = 2;
  r.distributed.compression.rank = 1;
  try {
    check_runnable(r, 2);
    FAIL("accepted");
  } catch (const Error& e) {
    CHECK(std::string(e.what()) ==
          "/distributed/compression/type: powersgd compresses none of the model's weight "
          "matrices at any rank (each is too small for P and Q to be smaller); use int8 or topk, "
          "or no compression");
  }
}

TEST_CASE("trainer: a 2-rank checkpoint resumed on 1 rank keeps the global batch and the result") {
  Recipe r = tiny_recipe();
  r.checkpoint.every = 10;
  TempDir two, one;
  const auto full = train_ranks(r, 2, two.path());
  REQUIRE(full[0].error.empty());
  // One survivor continues from step 10 with the job's nominal world of 2: two micro-batches a
  // step instead of one on each of two ranks, the same samples, the same global batch.
  const auto survivor = train_ranks(r, 1, [&](int) {
    TrainerOptions o;
    o.run_dir = one.path();
    o.resume_from = two.path() / "checkpoints" / checkpoint_name(10);
    o.nominal_world = 2;
    return o;
  });
  REQUIRE(survivor[0].error.empty());
  CHECK(survivor[0].result.steps == 30);
  CHECK(max_relative_difference(final_params(two.path(), 30), final_params(one.path(), 30)) < 1e-5);
  const CheckpointData ckpt = read_checkpoint(one.path() / "checkpoints" / checkpoint_name(30));
  CHECK(ckpt.position.global_batch == 16);
  CHECK(ckpt.position.world_size == 1);
}

TEST_CASE("trainer: a rank given no nominal world takes rank 0's") {
  Recipe r = tiny_recipe();
  r.checkpoint.every = 10;
  TempDir both, first_only;
  const auto given = [](const fs::path& dir, bool rank1_too) {
    return [dir, rank1_too](int rank) {
      TrainerOptions o;
      o.run_dir = dir;
      o.nominal_world = rank == 0 || rank1_too ? 4 : 0;
      return o;
    };
  };
  const auto told = train_ranks(r, 2, given(both.path(), true));
  REQUIRE(told[0].error.empty());
  // Rank 1 learns rank 0's 4 (not its world size of 2, which check_same_start would refuse): the
  // same global batch, the same training.
  const auto learned = train_ranks(r, 2, given(first_only.path(), false));
  REQUIRE(learned[0].error.empty());
  REQUIRE(learned[1].error.empty());
  const CheckpointData ckpt =
      read_checkpoint(first_only.path() / "checkpoints" / checkpoint_name(30));
  CHECK(ckpt.position.global_batch == 4 * r.train.batch_per_rank * r.train.grad_accum);
  CHECK(final_params(both.path(), 30) == final_params(first_only.path(), 30));
}

TEST_CASE("trainer: ranks loading their data say they are starting, not in a collective") {
  // The hang watch excuses a rank that loads a large dataset while its peers wait (phase
  // starting), not one that waits in a collective: after the nominal world's broadcast, the
  // ranks are starting again. A data file that is not there ends the load where it stands.
  Recipe r = tiny_recipe();
  r.data.type = "tokens";
  r.data.path = "/nonexistent/tokens";
  std::array<ProgressTracker, 2> trackers;
  TempDir dir;
  const auto out = train_ranks(r, 2, [&](int rank) {
    TrainerOptions o;
    o.run_dir = dir.path();
    o.progress = &trackers[static_cast<size_t>(rank)];
    return o;
  });
  for (size_t rank = 0; rank < 2; ++rank) {
    CAPTURE(rank);
    CHECK(out[rank].error.find("/nonexistent/tokens") != std::string::npos);
    const nlohmann::json beat = trackers[rank].snapshot();
    CHECK(beat["phase"] == "starting");
    CHECK(beat["seq"] == 1);
  }
}

TEST_CASE("trainer: slow steps between log steps send ticks, at most one a second") {
  Recipe r = tiny_recipe();
  r.train.steps = 5;
  r.log.every = 5;
  TempDir dir;
  using Clock = std::chrono::steady_clock;
  std::vector<std::pair<nlohmann::json, Clock::time_point>> events;
  const auto out = train_ranks(r, 1, [&](int) {
    TrainerOptions o;
    o.run_dir = dir.path();
    o.debug_step_delay_ms = 600;
    o.on_event = [&events](const nlohmann::json& e) { events.emplace_back(e, Clock::now()); };
    return o;
  });
  REQUIRE(out[0].error.empty());
  // 3 s of steps: at least one tick; each a second at least after the one before it (the first
  // after the ranks met), none at the log step (5).
  std::optional<Clock::time_point> before;
  int ticks = 0;
  for (const auto& [e, at] : events) {
    if (e["event"] == "rendezvous") before = at;
    if (e["event"] != "tick") continue;
    ++ticks;
    CAPTURE(e.dump());
    CHECK(e["steps"] == 5);
    CHECK(e["step"].get<int64_t>() < 5);
    CHECK(e["eta_s"].get<double>() > 0);
    REQUIRE(before.has_value());
    CHECK(at - *before >= std::chrono::milliseconds(990));
    before = at;
  }
  CHECK(ticks >= 1);
}

TEST_CASE("trainer: a checkpoint whose blobs do not fit the model names the file and both sizes") {
  Recipe r = tiny_recipe();
  r.checkpoint.every = 10;
  TempDir first;
  REQUIRE(train_ranks(r, 1, first.path())[0].error.empty());
  const CheckpointData good = read_checkpoint(first.path() / "checkpoints" / checkpoint_name(10));
  // Written (and checksummed) as a checkpoint: consistent in itself, not with the model.
  const auto resumed_from = [&](const std::vector<float>& params, const std::vector<float>& state) {
    TempDir other, again;
    const fs::path dir =
        write_checkpoint(other.path() / "checkpoints", good.position, params, state, 1);
    const auto resumed = train_ranks(r, 1, [&](int) {
      TrainerOptions o;
      o.run_dir = again.path();
      o.resume_from = dir;
      return o;
    });
    const std::string error = resumed[0].error;
    const size_t at = error.find(": ");
    return std::make_pair(error.substr(0, at), at == std::string::npos ? "" : error.substr(at + 2));
  };
  std::vector<float> short_state = good.optimizer_state;
  short_state.resize(short_state.size() - 7);
  const auto [state_dir, state_why] = resumed_from(good.params, short_state);
  CHECK(state_dir.ends_with(checkpoint_name(10)));
  CHECK(state_why == fmt::format("optimizer.bin holds {} values, the model's adamw optimizer "
                                 "needs {} (2 per parameter)",
                                 short_state.size(), good.optimizer_state.size()));
  std::vector<float> short_params = good.params;
  short_params.pop_back();
  CHECK(resumed_from(short_params, good.optimizer_state).second ==
        fmt::format("params.bin holds {} parameters, the model has {}", short_params.size(),
                    good.params.size()));
}

TEST_CASE("trainer: resumed from the final step's checkpoint, the result keeps its final loss") {
  // A launcher that dies after the last checkpoint but before the result: the resume runs no step.
  Recipe r = tiny_recipe();
  TempDir first, again;
  const auto full = train_ranks(r, 2, first.path());
  REQUIRE(full[0].error.empty());
  REQUIRE(std::isfinite(full[0].result.final_loss));
  const fs::path last = first.path() / "checkpoints" / checkpoint_name(r.train.steps);
  CHECK(read_checkpoint(last).position.loss == full[0].result.final_loss);
  const auto resumed = train_ranks(r, 2, [&](int) {
    TrainerOptions o;
    o.run_dir = again.path();
    o.resume_from = last;
    return o;
  });
  REQUIRE(resumed[0].error.empty());
  CHECK(resumed[0].result.steps == r.train.steps);
  CHECK(resumed[0].result.final_loss == full[0].result.final_loss);
  CHECK(resumed[0].result.eval_loss == full[0].result.eval_loss);
  // No step ran here to measure: no throughput, rather than 0 (a report then takes the logged).
  CHECK(std::isnan(resumed[0].result.samples_per_s));
  CHECK(resumed[0].result.to_json()["samples_per_s"].is_null());
}

TEST_CASE("trainer: scale_lr keeps micro-batches per rank and scales the learning rate") {
  Recipe r = tiny_recipe();
  r.distributed.resize = "scale_lr";
  r.optimizer.type = "sgd";
  r.optimizer.momentum = 0;
  r.optimizer.schedule.type = "constant";
  r.train.steps = 1;
  r.checkpoint.every = 0;
  r.distributed.check_every = 0;
  // One SGD step on 1 rank of a job sized for 2 takes a batch of 8 at half the learning rate;
  // the same step at full rate in a job sized for 1 moves the parameters twice as far.
  TempDir half, whole;
  const auto run = [&](const fs::path& dir, int nominal) {
    return train_ranks(r, 1, [&](int) {
      TrainerOptions o;
      o.run_dir = dir;
      o.nominal_world = nominal;
      return o;
    });
  };
  REQUIRE(run(half.path(), 2)[0].error.empty());
  REQUIRE(run(whole.path(), 1)[0].error.empty());
  CHECK(global_batch(r, 1, 2) == 8);
  // Both start from the same seeded parameters and see the same first batch.
  const auto a = final_params(half.path(), 1), b = final_params(whole.path(), 1);
  Recipe r0 = r;
  r0.optimizer.lr = 0;  // the initial parameters
  TempDir zero;
  REQUIRE(train_ranks(r0, 1, zero.path())[0].error.empty());
  const auto init = final_params(zero.path(), 1);
  double moved_half = 0, moved_whole = 0;
  for (size_t i = 0; i < init.size(); ++i) {
    moved_half += std::abs(double(a[i]) - init[i]);
    moved_whole += std::abs(double(b[i]) - init[i]);
  }
  REQUIRE(moved_whole > 0);
  CHECK(moved_half / moved_whole == doctest::Approx(0.5).epsilon(1e-3));
}

TEST_CASE("trainer: scale_lr with parameter servers scales by the workers, as the batch does") {
  Recipe r = tiny_recipe();
  r.distributed.resize = "scale_lr";
  r.distributed.sync = "ps";
  r.distributed.servers = 1;
  r.optimizer.schedule.type = "constant";
  r.train.steps = 2;
  r.log.every = 1;
  r.checkpoint.every = 0;
  // 3 ranks (2 workers) of a job sized for 4 (3 workers): the batch is 2/3 of it, so the rate.
  TempDir dir;
  const auto done = train_ranks(r, 3, [&](int) {
    TrainerOptions o;
    o.run_dir = dir.path();
    o.nominal_world = 4;
    return o;
  });
  REQUIRE(done[0].error.empty());
  CHECK(global_batch(r, 3, 4) == 2 * r.train.batch_per_rank);
  std::istringstream lines(read_file(dir.path() / "metrics.jsonl"));
  int logged = 0;
  for (std::string line; std::getline(lines, line);) {
    const auto m = nlohmann::json::parse(line);
    if (!m.contains("lr")) continue;
    ++logged;
    CHECK(m["lr"].get<double>() == doctest::Approx(r.optimizer.lr * 2.0 / 3.0));
  }
  CHECK(logged == 2);
}

TEST_CASE("trainer: \"newest\" resumes from the node leader that holds the newest checkpoint") {
  Recipe r = tiny_recipe();
  r.checkpoint.every = 10;
  TempDir source, rank0_dir, rank1_dir;
  REQUIRE(train_ranks(r, 2, source.path())[0].error.empty());
  // Rank 1's node holds step 20 and rank 0's node nothing: rank 1 reads it and broadcasts.
  fs::create_directories(rank1_dir.path() / "checkpoints");
  fs::copy(source.path() / "checkpoints" / checkpoint_name(20),
           rank1_dir.path() / "checkpoints" / checkpoint_name(20), fs::copy_options::recursive);
  // Two nodes of one rank each, with their own run directories.
  const auto two_nodes = [&r](const TempDir& dir0, const TempDir& dir1, const std::string& how) {
    return train_ranks(r, 2, [&](int rank) {
      TrainerOptions o;
      o.run_dir = rank == 0 ? dir0.path() : dir1.path();
      o.node_leader = true;
      o.resume_from = how;
      return o;
    });
  };
  const auto resumed = two_nodes(rank0_dir, rank1_dir, "newest");
  for (const auto& o : resumed) {
    CAPTURE(o.error);
    REQUIRE(o.error.empty());
  }
  CHECK(final_params(rank0_dir.path(), 30) == final_params(source.path(), 30));
  // Both node leaders wrote their own copy of the final checkpoint.
  CHECK(final_params(rank1_dir.path(), 30) == final_params(source.path(), 30));

  // Rank 0's node holds a damaged copy of step 20 (and a good step 10): rank 1's copy is the
  // one continued from, and the damaged one is set aside (a later search there skips nothing).
  TempDir damaged0, good1;
  for (const auto& [dir, steps] : {std::pair{&damaged0, std::vector<int64_t>{10, 20}},
                                   std::pair{&good1, std::vector<int64_t>{20}}}) {
    fs::create_directories(dir->path() / "checkpoints");
    for (const int64_t step : steps) {
      fs::copy(source.path() / "checkpoints" / checkpoint_name(step),
               dir->path() / "checkpoints" / checkpoint_name(step), fs::copy_options::recursive);
    }
  }
  const fs::path bad = damaged0.path() / "checkpoints" / checkpoint_name(20);
  fs::resize_file(bad / "params.bin", 12);
  point_latest_at(damaged0.path() / "checkpoints", bad);
  const auto skipped = two_nodes(damaged0, good1, "newest");
  for (const auto& o : skipped) {
    CAPTURE(o.error);
    REQUIRE(o.error.empty());
  }
  CHECK_FALSE(fs::exists(bad));
  CHECK(fs::exists(fs::path(bad.string() + ".corrupt")));
  CHECK(final_params(damaged0.path(), 30) == final_params(source.path(), 30));
  CHECK(latest_checkpoint(damaged0.path() / "checkpoints").filename() == checkpoint_name(30));

  // With none anywhere, "newest" is a checkpoint error and "newest-or-start" starts over.
  TempDir empty0, empty1;
  const auto none = two_nodes(empty0, empty1, "newest");
  // Where it looked is named: a mistyped workdir shows there.
  CHECK(none[0].error.find("no valid checkpoint on any node of this run (2 rank(s); rank 0 "
                           "looked in " +
                           (empty0.path() / "checkpoints").string() + ")") != std::string::npos);
  const auto fresh = two_nodes(empty0, empty1, "newest-or-start");
  REQUIRE(fresh[0].error.empty());
  CHECK(final_params(empty0.path(), 30) == final_params(source.path(), 30));
}
