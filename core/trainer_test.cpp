// The training loop over real Gloo communicators in threads: replicas agree, divergence is caught.
#include "core/trainer.hpp"

#include <doctest/doctest.h>
#include <unistd.h>

#include <future>
#include <thread>

#include "core/comm/gloo_communicator.hpp"
#include "core/comm/tcp_store.hpp"
#include "core/error.hpp"
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
class CorruptingCommunicator : public Communicator {
 public:
  CorruptingCommunicator(std::unique_ptr<Communicator> inner, int victim)
      : inner_(std::move(inner)), victim_(victim) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  std::string backend() const override { return inner_->backend(); }
  void allreduce(float* data, size_t count, ReduceOp op) override {
    inner_->allreduce(data, count, op);
    if (rank() == victim_ && count > 0) data[0] += 1e-3f;
  }
  void allreduce(double* data, size_t count, ReduceOp op) override {
    inner_->allreduce(data, count, op);
  }
  void broadcast(void* data, size_t bytes, int root) override {
    inner_->broadcast(data, bytes, root);
  }
  void allgather(const void* in, size_t bytes, void* out) override {
    inner_->allgather(in, bytes, out);
  }
  void barrier() override { inner_->barrier(); }

 private:
  std::unique_ptr<Communicator> inner_;
  int victim_;
};

struct RankOutcome {
  TrainResult result;
  std::string error;
};

std::vector<RankOutcome> train_ranks(const Recipe& recipe, int world, const fs::path& run_dir,
                                     int corrupt_rank) {
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
        auto comm = std::make_unique<CorruptingCommunicator>(
            make_gloo_communicator(store, r, world, options), corrupt_rank);
        TrainerOptions topts;
        topts.run_dir = run_dir;
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
