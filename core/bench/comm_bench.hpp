// The collective benchmark behind `dptrain bench comm`: sizes, the sweep, bus bandwidth, the data
// check, and the nccl-tests table and JSON made from the same rows.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/comm/communicator.hpp"

namespace dptrain {

class Ops;
class ProgressTracker;

enum class Collective { allreduce, broadcast, reduce_scatter, allgather };
enum class BenchDtype { float32, float16, bfloat16 };

const char* collective_name(Collective op);  // "allreduce", "broadcast", ...
// A name, names separated by commas, or "all" (every collective, in the order above).
// Error(usage) naming `flag`.
std::vector<Collective> parse_collectives(const std::string& text, const std::string& flag);

const char* dtype_name(BenchDtype dtype);        // as the flag spells it: float, half, bf16
const char* dtype_table_name(BenchDtype dtype);  // as nccl-tests prints it: float, half, bfloat16
size_t dtype_size(BenchDtype dtype);
BenchDtype parse_dtype(const std::string& text, const std::string& flag);
ReduceOp parse_reduce_op(const std::string& text, const std::string& flag);

// "8", "1K", "256M", "2G": bytes, the suffixes K, M, G and T being powers of 1024 in either case.
// Error(usage) naming `flag` for anything else, zero, or more than 2^62.
uint64_t parse_size(const std::string& text, const std::string& flag);

// min, min * factor, ... while <= max (nccl-tests' -b/-e/-f).
std::vector<uint64_t> sweep_sizes(uint64_t min_bytes, uint64_t max_bytes, uint64_t factor);

// busbw = algbw * factor: what each rank's links carry, comparable across collectives and world
// sizes (nccl-tests' definitions): allreduce 2(n-1)/n, reduce_scatter and allgather (n-1)/n,
// broadcast 1.
double bus_factor(Collective op, int ranks);

// What a requested size becomes, following nccl-tests: `bytes` is the whole buffer (allgather's
// output, reduce_scatter's input) and `count` the elements the collective is called with
// (allgather's and reduce_scatter's per rank). A size that does not divide evenly is rounded down.
struct CollectiveShape {
  uint64_t bytes = 0;
  uint64_t count = 0;
};
CollectiveShape collective_shape(Collective op, uint64_t requested_bytes, size_t element_size,
                                 int ranks);

struct CommBenchOptions {
  std::vector<Collective> ops{Collective::allreduce};
  uint64_t min_bytes = 8;
  uint64_t max_bytes = uint64_t{64} << 20;
  uint64_t step_factor = 2;
  BenchDtype dtype = BenchDtype::float32;
  ReduceOp redop = ReduceOp::sum;
  int root = 0;  // broadcast's
  int warmup = 5;
  int iters = 20;
  // For tests of the check itself: this rank spoils one element of its output (NaN) after each
  // checked call, before it is checked. -1: none. Not part of the JSON.
  int corrupt_rank = -1;

  // The sizes run (sweep_sizes of -b, -e, -f), and the measurements the sweep makes: each size
  // of each collective.
  std::vector<uint64_t> sizes() const;
  size_t measurements() const { return ops.size() * sizes().size(); }

  // Error(usage) naming the flag (-b, -e, -f, -w, -n, --root); `ranks` < 1: not known yet.
  // `backend`'s limits too (gloo: reduce_scatter of at most INT_MAX bytes).
  void validate(int ranks, const std::string& backend = "gloo") const;
  nlohmann::json to_json() const;
  static CommBenchOptions from_json(const nlohmann::json& j);  // Error(usage) when malformed
};

struct CommBenchRow {
  Collective op = Collective::allreduce;
  uint64_t size = 0;   // bytes (see CollectiveShape)
  uint64_t count = 0;  // elements
  std::string type;    // nccl-tests' name of the element type
  std::string redop;   // "none" for broadcast and allgather
  int root = -1;       // broadcast's root; -1 for the others
  double time_us = 0;  // mean per iteration over the timed iterations, the slowest rank's
  double algbw = 0;    // GB/s (1e9 bytes): size / time
  double busbw = 0;    // GB/s: algbw * bus_factor
  uint64_t wrong = 0;  // elements that differ from the expected result, summed over ranks
};

// A row as the result's JSON holds it, and back (json::exception when malformed).
nlohmann::json row_to_json(const CommBenchRow& row);
CommBenchRow row_from_json(const nlohmann::json& j);

struct CommBenchResult {
  int ranks = 1;
  int hosts = 1;
  std::string backend = "gloo";
  CommBenchOptions options;
  std::vector<CommBenchRow> rows;

  // The mean busbw of the rows (of one collective), as nccl-tests' "Avg bus bandwidth".
  double avg_busbw(std::optional<Collective> op = std::nullopt) const;
  uint64_t wrong() const;
  nlohmann::json to_json() const;
  static CommBenchResult from_json(const nlohmann::json& j);  // Error(usage) when malformed
};

// Runs the sweep: every rank calls it with the same options. For each collective and size: the
// warm-up iterations, a barrier, the timed iterations, then one more call on freshly filled
// buffers whose every output element is checked. `on_collective` is told when each collective
// starts. Throws what the communicator throws (Error(comm)).
//
// The buffers are host memory, or with `device` (the op table of this rank's GPU, for a
// communicator that takes device memory: NCCL) device memory allocated on it, filled by uploading
// the same patterns and checked by downloading the outputs. Each timed call includes what the
// communicator does until it returns (NCCL: the host waits for the collective to finish).
//
// The check is exact, except for avg over NCCL with a number of ranks that is not a power of two:
// NCCL multiplies each value by 1/ranks before summing, so an element may differ from the exact
// average by a few units in the last place; there it must lie within (ranks + 3) units of
// roundoff of the pattern's largest magnitude.
// `on_row` is told each row as it is measured, with how many of the collective's sizes are done
// and how many there are (progress on a terminal).
using CommRowCallback = std::function<void(const CommBenchRow&, size_t done, size_t sizes)>;
// With `progress`, the rank says where it is for hang attribution (a HeartbeatSender publishes
// it): a step is one measurement, and each collective call is entered by name.
CommBenchResult run_comm_bench(Communicator& comm, const CommBenchOptions& options,
                               const std::function<void(Collective)>& on_collective = {},
                               Ops* device = nullptr, const CommRowCallback& on_row = {},
                               ProgressTracker* progress = nullptr);

// The nccl-tests table: for each collective a '#' header block, the two column header lines, one
// row per size, and the "Out of bounds values" and "Avg bus bandwidth" lines.
std::string format_comm_table(const CommBenchResult& result);

// One line per collective whose busbw at its largest size is below `min_busbw` GB/s.
std::vector<std::string> busbw_shortfalls(const CommBenchResult& result, double min_busbw);

}  // namespace dptrain
