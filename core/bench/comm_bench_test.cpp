// Tests for the collective benchmark: sizes, sweep, bus factors, nccl-tests' table, JSON, the
// data check, and whole sweeps on real Gloo ranks (threads over a TcpStoreServer on 127.0.0.1).
#include <doctest/doctest.h>

#include <cstdio>
#include <cstring>
#include <functional>
#include <mutex>
#include <sstream>
#include <thread>

#include "core/bench/comm_bench.hpp"
#include "core/comm/gloo_communicator.hpp"
#include "core/comm/tcp_store.hpp"
#include "core/error.hpp"
#include "core/tensor/cpu_ops.hpp"
#include "tests/gloo_ranks.hpp"

namespace dptrain {
namespace {

using namespace std::chrono_literals;
using test::run_ranks;

// Passes everything on, but rank `victim` gets one element of every allreduce and reduce_scatter
// result wrong and all of its broadcast, as a broken link or a buggy backend would.
class CorruptingCommunicator : public test::ForwardingCommunicator {
 public:
  CorruptingCommunicator(std::unique_ptr<Communicator> inner, int victim)
      : ForwardingCommunicator(std::move(inner)), victim_(victim) {}
  using ForwardingCommunicator::allreduce;
  using ForwardingCommunicator::reduce_scatter;
  void allreduce(float* data, size_t count, ReduceOp op) override {
    ForwardingCommunicator::allreduce(data, count, op);
    if (rank() == victim_ && count > 0) data[count - 1] += 1.0f;
  }
  void allreduce(Half* data, size_t count, ReduceOp op) override {
    ForwardingCommunicator::allreduce(data, count, op);
    if (rank() == victim_ && count > 0) data[0] = to_half(to_float(data[0]) + 1.0f);
  }
  void reduce_scatter(const float* in, float* out, size_t count, ReduceOp op) override {
    ForwardingCommunicator::reduce_scatter(in, out, count, op);
    if (rank() == victim_ && count > 1) out[1] = -out[1] + 0.5f;
  }
  void broadcast(void* data, size_t bytes, int root) override {
    ForwardingCommunicator::broadcast(data, bytes, root);
    if (rank() == victim_) std::memset(data, 0xff, bytes);  // NaN in every element
  }

 private:
  int victim_;
};

// Presents Gloo as a device-memory backend named `backend` whose avg is NCCL's: every value is
// multiplied by 1/size (rounded to the element type) and the products are summed.
class PremultiplyingAvgCommunicator : public test::ForwardingCommunicator {
 public:
  PremultiplyingAvgCommunicator(std::unique_ptr<Communicator> inner, std::string backend)
      : ForwardingCommunicator(std::move(inner)), backend_(std::move(backend)) {}
  using ForwardingCommunicator::allreduce;
  using ForwardingCommunicator::reduce_scatter;
  std::string backend() const override { return backend_; }
  bool device_memory() const override { return true; }
  void allreduce(float* data, size_t count, ReduceOp op) override {
    premultiplied(data, count, op);
  }
  void allreduce(Half* data, size_t count, ReduceOp op) override { premultiplied(data, count, op); }
  void allreduce(BFloat16* data, size_t count, ReduceOp op) override {
    premultiplied(data, count, op);
  }

 private:
  template <typename T>
  void premultiplied(T* data, size_t count, ReduceOp op) {
    if (op != ReduceOp::avg) {
      ForwardingCommunicator::allreduce(data, count, op);
      return;
    }
    using W = Widened<T>;
    const auto reciprocal = W::up(W::down(1.0f / static_cast<float>(size())));
    for (size_t i = 0; i < count; ++i)
      data[i] = W::down(W::up(data[i]) * reciprocal);
    ForwardingCommunicator::allreduce(data, count, ReduceOp::sum);
  }

  std::string backend_;
};

TEST_CASE("parse_size: bytes with K, M, G, T suffixes; every bad size names the flag") {
  CHECK(parse_size("8", "-b") == 8);
  CHECK(parse_size("1K", "-b") == 1024);
  CHECK(parse_size("1k", "-b") == 1024);
  CHECK(parse_size("256M", "-e") == 256ull << 20);
  CHECK(parse_size("64m", "-e") == 64ull << 20);
  CHECK(parse_size("2G", "-e") == 2ull << 30);
  CHECK(parse_size("3T", "-e") == 3ull << 40);
  CHECK(parse_size("1000", "-e") == 1000);
  for (const char* bad : {"", "K", "1.5M", "1KB", "-1", "0", "0K", "5P", "1 K", " 1",
                          "99999999999999999999", "4194305T"}) {
    CAPTURE(std::string(bad));
    try {
      parse_size(bad, "-e/--maxbytes");
      FAIL("accepted");
    } catch (const Error& e) {
      CHECK(e.kind() == ErrorKind::usage);
      const std::string message = e.what();
      CHECK_MESSAGE(message.rfind("-e/--maxbytes: ", 0) == 0, message);
      CHECK_MESSAGE(message.find(std::string("'") + bad + "'") != std::string::npos, message);
    }
  }
  // Digits past 2^64 are too large, not wrapped around to a small size (2^64 + 1024 is not 1K).
  for (const char* huge : {"18446744073709552640", "18446744073709551616", "4611686018427387905",
                           "184467440737095516160K"}) {
    CAPTURE(std::string(huge));
    CHECK_THROWS_WITH_AS(parse_size(huge, "-e"), doctest::Contains("-e: too large:"), Error);
  }
  CHECK(parse_size("4611686018427387904", "-e") == uint64_t{1} << 62);
}

TEST_CASE("sweep_sizes: min, min*f, ... up to max, without overflow") {
  const auto defaults = sweep_sizes(8, 64ull << 20, 2);
  REQUIRE(defaults.size() == 24);
  CHECK(defaults.front() == 8);
  CHECK(defaults[1] == 16);
  CHECK(defaults.back() == 64ull << 20);
  CHECK(sweep_sizes(1024, 65536, 4) == std::vector<uint64_t>{1024, 4096, 16384, 65536});
  CHECK(sweep_sizes(3, 100, 10) == std::vector<uint64_t>{3, 30});
  CHECK(sweep_sizes(5, 5, 2) == std::vector<uint64_t>{5});
  CHECK(sweep_sizes(uint64_t{1} << 62, ~uint64_t{0}, 4) ==
        std::vector<uint64_t>{uint64_t{1} << 62});
  CHECK(sweep_sizes(8, 4, 2).empty());
}

TEST_CASE("bus_factor: nccl-tests' definitions") {
  CHECK(bus_factor(Collective::allreduce, 1) == 0.0);
  CHECK(bus_factor(Collective::allreduce, 2) == 1.0);
  CHECK(bus_factor(Collective::allreduce, 4) == 1.5);
  CHECK(bus_factor(Collective::allreduce, 8) == 1.75);
  CHECK(bus_factor(Collective::reduce_scatter, 4) == 0.75);
  CHECK(bus_factor(Collective::allgather, 2) == 0.5);
  CHECK(bus_factor(Collective::allgather, 1) == 0.0);
  CHECK(bus_factor(Collective::broadcast, 1) == 0.0);  // nothing leaves the one rank
  CHECK(bus_factor(Collective::broadcast, 2) == 1.0);
  CHECK(bus_factor(Collective::broadcast, 7) == 1.0);
}

TEST_CASE("collective_shape: the whole buffer's bytes, the per-call count") {
  auto shape = collective_shape(Collective::allreduce, 1024, 4, 3);
  CHECK(shape.bytes == 1024);
  CHECK(shape.count == 256);
  shape = collective_shape(Collective::broadcast, 9, 4, 2);  // rounded down to whole elements
  CHECK(shape.bytes == 8);
  CHECK(shape.count == 2);
  shape = collective_shape(Collective::allgather, 1024, 4, 3);  // 85 floats per rank
  CHECK(shape.count == 85);
  CHECK(shape.bytes == 85 * 3 * 4);
  shape = collective_shape(Collective::reduce_scatter, 1024, 2, 4);
  CHECK(shape.count == 128);
  CHECK(shape.bytes == 1024);
  shape = collective_shape(Collective::reduce_scatter, 8, 4, 4);  // less than one per rank
  CHECK(shape.count == 0);
  CHECK(shape.bytes == 0);
}

TEST_CASE("names: collectives, element types, reductions; unknown ones name the flag") {
  CHECK(parse_collectives("all", "-o").size() == 4);
  CHECK(parse_collectives("broadcast,all", "-o").size() == 4);
  CHECK(parse_collectives("broadcast,all", "-o").front() == Collective::broadcast);
  CHECK(parse_collectives("allgather", "-o") == std::vector<Collective>{Collective::allgather});
  CHECK(parse_collectives("reduce_scatter,allreduce,reduce_scatter", "-o") ==
        std::vector<Collective>{Collective::reduce_scatter, Collective::allreduce});
  CHECK_THROWS_WITH_AS(parse_collectives("allreduc", "-o/--op"),
                       doctest::Contains("-o/--op: unknown collective 'allreduc'"), Error);
  CHECK_THROWS_WITH_AS(parse_collectives("allreduc", "-o/--op"),
                       doctest::Contains("did you mean 'allreduce'"), Error);
  CHECK_THROWS_WITH_AS(parse_collectives("max", "-o/--op"),
                       doctest::Contains("'max' (use allreduce, broadcast, reduce_scatter, "
                                         "allgather or all); the reduction is --redop"),
                       Error);
  CHECK_THROWS_WITH_AS(parse_collectives("allreduce,", "-o/--op"),
                       doctest::Contains("unknown collective ''"), Error);
  CHECK(parse_dtype("bf16", "-d") == BenchDtype::bfloat16);
  CHECK(parse_dtype("half", "-d") == BenchDtype::float16);
  // nccl-tests' and the recipes' names of the same types.
  CHECK(parse_dtype("bfloat16", "-d") == BenchDtype::bfloat16);
  CHECK(parse_dtype("fp16", "-d") == BenchDtype::float16);
  CHECK(parse_dtype("float16", "-d") == BenchDtype::float16);
  CHECK(parse_dtype("fp32", "-d") == BenchDtype::float32);
  CHECK(parse_dtype("float32", "-d") == BenchDtype::float32);
  CHECK_THROWS_WITH_AS(parse_dtype("fb16", "-d"), doctest::Contains("did you mean 'fp16'?"), Error);
  CHECK(std::string(dtype_table_name(BenchDtype::bfloat16)) == "bfloat16");
  CHECK(std::string(dtype_table_name(BenchDtype::float16)) == "half");
  CHECK(dtype_size(BenchDtype::float32) == 4);
  CHECK_THROWS_WITH_AS(parse_dtype("fp8", "-d/--dtype"),
                       doctest::Contains("-d/--dtype: unknown element type 'fp8'"), Error);
  CHECK(parse_reduce_op("max", "--redop") == ReduceOp::max);
  CHECK_THROWS_WITH_AS(parse_reduce_op("prod", "--redop"),
                       doctest::Contains("--redop: unknown reduction 'prod'"), Error);
  CHECK_THROWS_WITH_AS(parse_reduce_op("mean", "--redop"), doctest::Contains("did you mean 'avg'?"),
                       Error);
  CHECK_THROWS_WITH_AS(parse_reduce_op("SUM", "--redop"), doctest::Contains("did you mean 'sum'?"),
                       Error);
  CHECK_THROWS_WITH_AS(parse_dtype("FP16", "-d"), doctest::Contains("did you mean 'fp16'?"), Error);
}

TEST_CASE("options: validation names the flag; JSON round trip") {
  CommBenchOptions o;
  CHECK_NOTHROW(o.validate(2));
  auto fails_with = [](CommBenchOptions bad, int ranks, const char* text) {
    CHECK_THROWS_WITH_AS(bad.validate(ranks), doctest::Contains(text), Error);
  };
  CommBenchOptions bad = o;
  bad.max_bytes = 4;
  fails_with(bad, 2, "-e/--maxbytes: 4 is below -b/--minbytes 8");
  bad = o;
  bad.step_factor = 1;
  fails_with(bad, 2, "-f/--stepfactor");
  bad = o;
  bad.iters = 0;
  fails_with(bad, 2, "-n/--iters");
  bad = o;
  bad.warmup = -1;
  fails_with(bad, 2, "-w/--warmup");
  bad = o;
  bad.root = 2;
  fails_with(bad, 2, "--root: 2 is not a rank (0..1)");
  bad = o;
  bad.ops = {Collective::reduce_scatter};
  bad.max_bytes = uint64_t{4} << 30;
  fails_with(bad, 2, "-e/--maxbytes");
  CHECK_NOTHROW(bad.validate(2, "nccl"));  // Gloo's limit only

  o.ops = {Collective::allgather, Collective::broadcast};
  o.min_bytes = 3;
  o.max_bytes = 1 << 20;
  o.step_factor = 3;
  o.dtype = BenchDtype::float16;
  o.redop = ReduceOp::min;
  o.root = 1;
  o.warmup = 0;
  o.iters = 7;
  const auto back = CommBenchOptions::from_json(o.to_json());
  CHECK(back.to_json() == o.to_json());
  CHECK(back.ops == o.ops);
  CHECK(back.dtype == BenchDtype::float16);
  CHECK_THROWS_AS(CommBenchOptions::from_json(nlohmann::json{{"ops", {"allreduce"}}}), Error);
}

CommBenchResult sample_result() {
  CommBenchResult r;
  r.ranks = 2;
  r.hosts = 1;
  r.options.ops = {Collective::allreduce, Collective::broadcast};
  r.options.min_bytes = 1024;
  r.options.max_bytes = 1 << 20;
  r.options.step_factor = 1024;
  const auto row = [](Collective op, uint64_t size, double time_us, uint64_t wrong) {
    CommBenchRow x;
    x.op = op;
    x.size = size;
    x.count = size / 4;
    x.type = "float";
    x.redop = op == Collective::allreduce ? "sum" : "none";
    x.root = op == Collective::allreduce ? -1 : 0;
    x.time_us = time_us;
    x.algbw = static_cast<double>(size) / 1e3 / time_us;
    x.busbw = x.algbw * bus_factor(op, 2);
    x.wrong = wrong;
    return x;
  };
  r.rows = {
      row(Collective::allreduce, 1024, 42.123, 0), row(Collective::allreduce, 1 << 20, 12345.6, 3),
      row(Collective::broadcast, 1024, 99.5, 0), row(Collective::broadcast, 1 << 20, 250.25, 0)};
  return r;
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line))
    lines.push_back(line);
  return lines;
}

// A row as nccl-tests' printf formats print it.
std::string nccl_tests_row(const CommBenchRow& r) {
  char time[32];
  if (r.time_us >= 10000.0) {
    std::snprintf(time, sizeof time, "%7.0f", r.time_us);
  } else if (r.time_us >= 100.0) {
    std::snprintf(time, sizeof time, "%7.1f", r.time_us);
  } else {
    std::snprintf(time, sizeof time, "%7.2f", r.time_us);
  }
  char line[256];
  std::snprintf(line, sizeof line, "%12lu  %12lu  %8s  %6s  %6i  %7s  %6.2f  %6.2f  %5g",
                static_cast<unsigned long>(r.size), static_cast<unsigned long>(r.count),
                r.type.c_str(), r.redop.c_str(), r.root, time, r.algbw, r.busbw,
                static_cast<double>(r.wrong));
  return line;
}

TEST_CASE("format_comm_table: nccl-tests' column headers, rows and summary lines") {
  const CommBenchResult r = sample_result();
  const auto lines = lines_of(format_comm_table(r));
  REQUIRE(lines.size() == 2 * 11);
  CHECK(lines[0] == "# dptrain bench comm: allreduce");
  CHECK(lines[1] == "# ranks 2  hosts 1  backend gloo  dtype float  redop sum");
  CHECK(lines[2] ==
        "# minBytes 1024 maxBytes 1048576 step: 1024(factor) warmup iters: 5 iters: 20 "
        "validation: 1");
  CHECK(lines[3] == "#");
  CHECK(lines[4] ==
        "#       size         count      type   redop    root     time   algbw   busbw #wrong");
  CHECK(lines[5] ==
        "#        (B)    (elements)                               (us)  (GB/s)  (GB/s)");
  CHECK(lines[6] == nccl_tests_row(r.rows[0]));
  CHECK(lines[6] ==
        "        1024           256     float     sum      -1    42.12    0.02    0.02      0");
  CHECK(lines[7] == nccl_tests_row(r.rows[1]));
  CHECK(lines[7].find("  12346  ") != std::string::npos);  // no decimals from 10 ms on
  CHECK(lines[8] == "# Out of bounds values : 3 FAILED");
  char avg[64];
  std::snprintf(avg, sizeof avg, "# Avg bus bandwidth    : %g",
                (r.rows[0].busbw + r.rows[1].busbw) / 2);
  CHECK(lines[9] == avg);
  CHECK(lines[10] == "#");
  CHECK(lines[11] == "# dptrain bench comm: broadcast");
  CHECK(lines[12] == "# ranks 2  hosts 1  backend gloo  dtype float  root 0");
  CHECK(lines[15] == lines[4]);
  CHECK(lines[16] == lines[5]);
  CHECK(lines[17] == nccl_tests_row(r.rows[2]));
  CHECK(lines[17].find("none       0") != std::string::npos);
  CHECK(lines[18] == nccl_tests_row(r.rows[3]));
  CHECK(lines[18].find("  250.2  ") != std::string::npos);  // one decimal from 100 us on
  CHECK(lines[19] == "# Out of bounds values : 0 OK");
  CHECK(lines[21] == "#");
  // From 1000 GB/s on (one rank, shared memory) fewer decimals keep the columns in place.
  CommBenchResult fast = r;
  fast.rows[0].algbw = 1024.004;
  fast.rows[0].busbw = 12345.6;
  const auto fast_lines = lines_of(format_comm_table(fast));
  CHECK(fast_lines[6].size() == lines[6].size());
  CHECK_MESSAGE(fast_lines[6].ends_with("    42.12  1024.0   12346      0"), fast_lines[6]);
}

TEST_CASE("result JSON: the same rows, averages and wrong count; round trip") {
  const CommBenchResult r = sample_result();
  const auto j = r.to_json();
  CHECK(j["ranks"] == 2);
  CHECK(j["backend"] == "gloo");
  CHECK(j["dtype"] == "float");
  CHECK(j["ops"] == nlohmann::json({"allreduce", "broadcast"}));
  REQUIRE(j["rows"].size() == 4);
  CHECK(j["rows"][1]["op"] == "allreduce");
  CHECK(j["rows"][1]["size"] == 1 << 20);
  CHECK(j["rows"][1]["count"] == 1 << 18);
  CHECK(j["rows"][1]["wrong"] == 3);
  CHECK(j["rows"][2]["redop"] == "none");
  CHECK(j["rows"][2]["root"] == 0);
  CHECK(j["wrong"] == 3);
  CHECK(j["avg_busbw"].get<double>() == doctest::Approx(r.avg_busbw()));
  CHECK(j["avg_busbw_by_op"]["broadcast"].get<double>() ==
        doctest::Approx((r.rows[2].busbw + r.rows[3].busbw) / 2));
  const auto back = CommBenchResult::from_json(j);
  CHECK(back.to_json() == j);
  CHECK(format_comm_table(back) == format_comm_table(r));
  CHECK_THROWS_AS(CommBenchResult::from_json(nlohmann::json{{"ranks", 2}}), Error);
}

TEST_CASE("busbw_shortfalls: the largest size of each collective against the threshold") {
  CommBenchResult r = sample_result();
  // allreduce at 1 MiB: 1048576 B / 12345.6 us = 0.0849 GB/s; broadcast: 4.19 GB/s.
  CHECK(busbw_shortfalls(r, 0.05).empty());
  auto lines = busbw_shortfalls(r, 1.0);
  REQUIRE(lines.size() == 1);
  CHECK(lines[0] == "allreduce at 1048576 bytes: busbw 0.0849 GB/s is below --min-busbw 1 GB/s");
  lines = busbw_shortfalls(r, 1e9);
  REQUIRE(lines.size() == 2);
  CHECK(lines[1].rfind("broadcast at 1048576 bytes: busbw 4.19 GB/s", 0) == 0);
  // The largest size, not the last row.
  std::swap(r.rows[0], r.rows[1]);
  CHECK(busbw_shortfalls(r, 1.0).size() == 1);
  // Three significant digits, trailing zeros kept (0.000820, not 0.00082).
  for (auto& row : r.rows) {
    if (row.op == Collective::allreduce && row.size == 1048576) row.busbw = 0.00082;
  }
  CHECK(busbw_shortfalls(r, 1.0)[0] ==
        "allreduce at 1048576 bytes: busbw 0.000820 GB/s is below --min-busbw 1 GB/s");
}

void check_sweep(const CommBenchResult& result, const CommBenchOptions& options, int ranks) {
  const auto sizes = sweep_sizes(options.min_bytes, options.max_bytes, options.step_factor);
  REQUIRE(result.rows.size() == sizes.size() * options.ops.size());
  CHECK(result.ranks == ranks);
  CHECK(result.backend == "gloo");
  CHECK(result.wrong() == 0);
  size_t i = 0;
  for (Collective op : options.ops) {
    for (uint64_t size : sizes) {
      const CommBenchRow& row = result.rows[i++];
      CAPTURE(collective_name(op));
      CAPTURE(size);
      const auto shape = collective_shape(op, size, dtype_size(options.dtype), ranks);
      CHECK(row.op == op);
      CHECK(row.size == shape.bytes);
      CHECK(row.count == shape.count);
      CHECK(row.type == dtype_table_name(options.dtype));
      CHECK(row.wrong == 0);
      CHECK(row.time_us >= 0);
      if (row.size > 0) CHECK(row.time_us > 0);
      CHECK(row.algbw == doctest::Approx(static_cast<double>(row.size) / 1e3 / row.time_us));
      CHECK(row.busbw == doctest::Approx(row.algbw * bus_factor(op, ranks)));
    }
  }
}

TEST_CASE("run_comm_bench: every collective, type and reduction, checked, on 1..3 ranks") {
  const std::vector<std::pair<BenchDtype, ReduceOp>> cases = {
      {BenchDtype::float32, ReduceOp::sum},  {BenchDtype::float16, ReduceOp::avg},
      {BenchDtype::bfloat16, ReduceOp::max}, {BenchDtype::float32, ReduceOp::min},
      {BenchDtype::bfloat16, ReduceOp::sum},
  };
  for (int ranks = 1; ranks <= 3; ++ranks) {
    CAPTURE(ranks);
    run_ranks(ranks, [&](Communicator& comm) {
      for (const auto& [dtype, redop] : cases) {
        CAPTURE(dtype_name(dtype));
        CAPTURE(reduce_op_name(redop));
        CommBenchOptions options;
        options.ops = parse_collectives("all", "-o");
        options.min_bytes = 2;  // from less than one element per rank on
        options.max_bytes = 40000;
        options.step_factor = 13;
        options.dtype = dtype;
        options.redop = redop;
        options.root = ranks - 1;
        options.warmup = 1;
        options.iters = 2;
        std::vector<Collective> started;
        const auto result =
            run_comm_bench(comm, options, [&](Collective op) { started.push_back(op); });
        check_sweep(result, options, ranks);
        CHECK(started == options.ops);
      }
    });
  }
}

TEST_CASE("run_comm_bench: the data check counts wrong elements over every rank") {
  run_ranks(
      3,
      [](Communicator& comm) {
        CommBenchOptions options;
        options.ops = parse_collectives("all", "-o");
        options.min_bytes = 64;
        options.max_bytes = 4096;
        options.step_factor = 8;
        options.warmup = 0;
        options.iters = 1;
        auto result = run_comm_bench(comm, options);
        REQUIRE(result.rows.size() == 3 * 4);
        for (const auto& row : result.rows) {
          CAPTURE(collective_name(row.op));
          CAPTURE(row.size);
          switch (row.op) {
            case Collective::allreduce:  // one element on one rank
            case Collective::reduce_scatter:
              CHECK(row.wrong == 1);
              break;
            case Collective::broadcast:  // the whole buffer of the rank that missed it
              CHECK(row.wrong == row.count);
              break;
            case Collective::allgather:
              CHECK(row.wrong == 0);
              break;
          }
        }
        CHECK(result.wrong() == 3 + 3 + (16 + 128 + 1024));
        const std::string table = format_comm_table(result);
        CHECK(table.find("# Out of bounds values : 3 FAILED") != std::string::npos);
        CHECK(table.find("# Out of bounds values : 1168 FAILED") != std::string::npos);
        CHECK(table.find("# Out of bounds values : 0 OK") != std::string::npos);
        options.dtype = BenchDtype::float16;
        options.ops = {Collective::allreduce};
        result = run_comm_bench(comm, options);
        for (const auto& row : result.rows)
          CHECK(row.wrong == 1);
      },
      [](std::unique_ptr<Communicator> inner) -> std::unique_ptr<Communicator> {
        return std::make_unique<CorruptingCommunicator>(std::move(inner), 1);
      });
}

TEST_CASE("run_comm_bench: buffers on an op table's device, filled and checked through it") {
  // The CPU op table's "device" is host memory, but the path is the one NCCL takes: allocate,
  // upload the patterns, run on the device buffers, download the outputs and check them.
  for (int ranks : {1, 3}) {
    CAPTURE(ranks);
    run_ranks(ranks, [&](Communicator& comm) {
      CpuOps device;
      for (const auto& [dtype, redop] : {std::pair{BenchDtype::float32, ReduceOp::sum},
                                         std::pair{BenchDtype::float16, ReduceOp::max},
                                         std::pair{BenchDtype::bfloat16, ReduceOp::min}}) {
        CAPTURE(dtype_name(dtype));
        CommBenchOptions options;
        options.ops = parse_collectives("all", "-o");
        options.min_bytes = 2;
        options.max_bytes = 40000;
        options.step_factor = 13;
        options.dtype = dtype;
        options.redop = redop;
        options.root = ranks - 1;
        options.warmup = 1;
        options.iters = 2;
        check_sweep(run_comm_bench(comm, options, {}, &device), options, ranks);
      }
    });
  }
  // A wrong element in device memory is found after the download, as on the host.
  run_ranks(
      3,
      [](Communicator& comm) {
        CpuOps device;
        CommBenchOptions options;
        options.ops = {Collective::allreduce, Collective::broadcast};
        options.min_bytes = 64;
        options.max_bytes = 4096;
        options.step_factor = 8;
        options.warmup = 0;
        options.iters = 1;
        const auto result = run_comm_bench(comm, options, {}, &device);
        REQUIRE(result.rows.size() == 2 * 3);
        for (const auto& row : result.rows)
          CHECK(row.wrong == (row.op == Collective::allreduce ? 1 : row.count));
      },
      [](std::unique_ptr<Communicator> inner) -> std::unique_ptr<Communicator> {
        return std::make_unique<CorruptingCommunicator>(std::move(inner), 1);
      });
}

TEST_CASE("run_comm_bench: NCCL's avg (multiply by 1/n, then sum) passes within its bound") {
  const auto sweep = [](Communicator& comm, BenchDtype dtype) {
    CommBenchOptions options;
    options.ops = {Collective::allreduce};
    options.min_bytes = 1 << 14;
    options.max_bytes = 1 << 14;
    options.dtype = dtype;
    options.redop = ReduceOp::avg;
    options.warmup = 0;
    options.iters = 1;
    return run_comm_bench(comm, options).wrong();
  };
  for (const char* backend : {"nccl", "gloo"}) {
    CAPTURE(backend);
    run_ranks(
        3,
        [&](Communicator& comm) {
          for (BenchDtype dtype :
               {BenchDtype::float32, BenchDtype::float16, BenchDtype::bfloat16}) {
            CAPTURE(dtype_name(dtype));
            const uint64_t wrong = sweep(comm, dtype);
            if (std::string(backend) == "nccl") {
              CHECK(wrong == 0);
            } else if (dtype != BenchDtype::float32) {
              CHECK(wrong > 0);  // the exact check would fail such a backend
            }
          }
        },
        [&](std::unique_ptr<Communicator> inner) -> std::unique_ptr<Communicator> {
          return std::make_unique<PremultiplyingAvgCommunicator>(std::move(inner), backend);
        });
  }
  // A power of two of ranks: the products are exact, and so is the check.
  run_ranks(
      2, [&](Communicator& comm) { CHECK(sweep(comm, BenchDtype::bfloat16) == 0); },
      [](std::unique_ptr<Communicator> inner) -> std::unique_ptr<Communicator> {
        return std::make_unique<PremultiplyingAvgCommunicator>(std::move(inner), "gloo");
      });
}

}  // namespace
}  // namespace dptrain
