// The collective benchmark: sizes, the sweep, bus bandwidth, the data check, the nccl-tests table.
#include "core/bench/comm_bench.hpp"

#include <algorithm>
#include <chrono>
#include <climits>
#include <cmath>
#include <limits>
#include <type_traits>

#include <fmt/format.h>

#include "core/error.hpp"
#include "core/heartbeat.hpp"
#include "core/suggest.hpp"
#include "core/tensor/ops.hpp"

namespace dptrain {

namespace {

using nlohmann::json;

constexpr Collective kAllCollectives[] = {Collective::allreduce, Collective::broadcast,
                                          Collective::reduce_scatter, Collective::allgather};
constexpr BenchDtype kAllDtypes[] = {BenchDtype::float32, BenchDtype::float16,
                                     BenchDtype::bfloat16};
constexpr ReduceOp kAllReduceOps[] = {ReduceOp::sum, ReduceOp::avg, ReduceOp::max, ReduceOp::min};

bool reduces(Collective op) {
  return op == Collective::allreduce || op == Collective::reduce_scatter;
}

std::string did_you_mean(const std::string& text, const std::vector<std::string>& known) {
  const auto match = closest_match(text, known);
  return match ? fmt::format("; did you mean '{}'?", *match) : std::string();
}

Collective collective_from_name(const std::string& text, const std::string& flag) {
  std::vector<std::string> known;
  for (Collective op : kAllCollectives) {
    if (text == collective_name(op)) return op;
    known.emplace_back(collective_name(op));
  }
  known.emplace_back("all");
  // nccl-tests' -o is the reduction: point its users at --redop.
  const bool reduction =
      text == "sum" || text == "avg" || text == "max" || text == "min" || text == "prod";
  throw Error(ErrorKind::usage,
              fmt::format("{}: unknown collective '{}' (use allreduce, broadcast, reduce_scatter, "
                          "allgather or all){}",
                          flag, text,
                          reduction ? std::string("; the reduction is --redop")
                                    : did_you_mean(text, known)));
}

// ---- the data pattern ----

// Small integers, so every partial sum is exact in the element type whatever the order Gloo adds
// in: |value| <= bound and ranks * bound <= 2^(mantissa bits + 1).
struct Pattern {
  int64_t bound = 0;  // 0: more ranks than exact integers; values are 0 or 1 on the first ranks
  int64_t exact = 0;  // the largest integer up to which every integer is exact
  double unit = 0;    // the element type's unit roundoff: 1 / exact

  Pattern(BenchDtype dtype, int ranks) {
    exact = dtype == BenchDtype::float32   ? int64_t{1} << 24
            : dtype == BenchDtype::float16 ? int64_t{1} << 11
                                           : int64_t{1} << 8;
    bound = std::min<int64_t>(100, exact / ranks);
    unit = 1.0 / static_cast<double>(exact);
  }
  uint64_t period() const { return static_cast<uint64_t>(2 * bound + 1); }
  // What a buffer holds where no rank's data belongs: outside the pattern's values.
  float sentinel() const { return static_cast<float>(-(bound + 1)); }
};

// Walks rank `rank`'s pattern from element `first` on: value(i) = ((7 i + 13 rank) mod P) - bound.
class PatternCursor {
 public:
  PatternCursor(const Pattern& pattern, int rank, uint64_t first)
      : pattern_(pattern), rank_(rank), index_(first) {
    if (pattern_.bound > 0) {
      const uint64_t p = pattern_.period();
      residue_ = ((first % p) * 7 + static_cast<uint64_t>(rank) * 13) % p;
      step_ = 7 % p;
    }
  }
  int64_t next() {
    if (pattern_.bound == 0) {
      const bool one = rank_ < pattern_.exact && ((index_++ + static_cast<uint64_t>(rank_)) & 1);
      return one ? 1 : 0;
    }
    const int64_t value = static_cast<int64_t>(residue_) - pattern_.bound;
    residue_ += step_;
    if (residue_ >= pattern_.period()) residue_ -= pattern_.period();
    return value;
  }

 private:
  const Pattern& pattern_;
  int rank_;
  uint64_t index_;
  uint64_t residue_ = 0;
  uint64_t step_ = 0;
};

template <typename T>
T narrow(float value) {
  return Widened<T>::down(value);
}
template <typename T>
float widen(T value) {
  return Widened<T>::up(value);
}

template <typename T>
void fill_pattern(const Pattern& pattern, int rank, uint64_t first, T* out, uint64_t count) {
  PatternCursor cursor(pattern, rank, first);
  for (uint64_t i = 0; i < count; ++i)
    out[i] = narrow<T>(static_cast<float>(cursor.next()));
}

template <typename T>
void fill_sentinel(const Pattern& pattern, T* out, uint64_t count) {
  std::fill(out, out + count, narrow<T>(pattern.sentinel()));
}

// Counts the elements of `got` that differ from rank `rank`'s pattern from `first` on.
template <typename T>
uint64_t count_wrong_copy(const Pattern& pattern, int rank, uint64_t first, const T* got,
                          uint64_t count) {
  PatternCursor cursor(pattern, rank, first);
  uint64_t wrong = 0;
  for (uint64_t i = 0; i < count; ++i) {
    const float want = widen(narrow<T>(static_cast<float>(cursor.next())));
    wrong += widen(got[i]) != want;  // a NaN is wrong too
  }
  return wrong;
}

// Counts the elements of `got` that differ from the reduction over all ranks' patterns of
// elements [first, first + count), rounded as the communicator rounds (avg: the exact sum divided
// in float, then narrowed). With a `tolerance` (NCCL's avg, see run_comm_bench), an element is
// wrong when it is further than that from the exact average instead.
template <typename T>
uint64_t count_wrong_reduced(const Pattern& pattern, ReduceOp op, int ranks, uint64_t first,
                             const T* got, uint64_t count, double tolerance) {
  constexpr uint64_t kChunk = 1 << 16;
  std::vector<int64_t> acc;
  uint64_t wrong = 0;
  for (uint64_t start = 0; start < count; start += kChunk) {
    const auto n = static_cast<size_t>(std::min(kChunk, count - start));
    acc.assign(n, 0);
    for (int q = 0; q < ranks; ++q) {
      PatternCursor cursor(pattern, q, first + start);
      for (size_t i = 0; i < n; ++i) {
        const int64_t v = cursor.next();
        if (q == 0 || op == ReduceOp::sum || op == ReduceOp::avg) {
          acc[i] = q == 0 ? v : acc[i] + v;
        } else {
          acc[i] = op == ReduceOp::max ? std::max(acc[i], v) : std::min(acc[i], v);
        }
      }
    }
    for (size_t i = 0; i < n; ++i) {
      float want = static_cast<float>(acc[i]);
      if (op == ReduceOp::avg) want /= static_cast<float>(ranks);
      if (tolerance > 0) {
        const double error = std::fabs(static_cast<double>(widen(got[start + i])) -
                                       static_cast<double>(acc[i]) / ranks);
        wrong += !(error <= tolerance);  // a NaN is wrong too
      } else {
        wrong += widen(got[start + i]) != widen(narrow<T>(want));
      }
    }
  }
  return wrong;
}

// ---- running one collective at one size ----

// The buffers of one collective: host vectors, which are filled and checked, and with a device op
// table their copies in device memory, which the collective runs on.
template <typename T>
class CollectiveRun {
 public:
  CollectiveRun(Communicator& comm, const CommBenchOptions& options, Collective op,
                const CollectiveShape& shape, Ops* device)
      : comm_(comm),
        options_(options),
        op_(op),
        pattern_(options.dtype, comm.size()),
        device_(device) {
    const auto ranks = static_cast<uint64_t>(comm.size());
    count_ = shape.count;
    switch (op) {
      case Collective::allreduce:
      case Collective::broadcast:
        in_.resize(count_);
        break;
      case Collective::allgather:
        in_.resize(count_);
        out_.resize(count_ * ranks);
        break;
      case Collective::reduce_scatter:
        in_.resize(count_ * ranks);
        out_.resize(count_);
        break;
    }
    if (device_ != nullptr) {
      device_in_ = device_->allocate(in_.size() * sizeof(T));
      device_out_ = device_->allocate(out_.size() * sizeof(T));
    }
  }

  void fill() {
    const int rank = comm_.rank();
    if (op_ == Collective::broadcast && rank != options_.root) {
      fill_sentinel(pattern_, in_.data(), in_.size());
    } else {
      fill_pattern(pattern_, rank, 0, in_.data(), in_.size());
    }
    fill_sentinel(pattern_, out_.data(), out_.size());
    if (device_ != nullptr) {
      upload(in_, device_in_);
      upload(out_, device_out_);
    }
  }

  void call() {
    T* in = device_ != nullptr ? device_in_.as<T>() : in_.data();
    T* out = device_ != nullptr ? device_out_.as<T>() : out_.data();
    switch (op_) {
      case Collective::allreduce:
        comm_.allreduce(in, count_, options_.redop);
        break;
      case Collective::broadcast:
        comm_.broadcast(in, count_ * sizeof(T), options_.root);
        break;
      case Collective::allgather:
        comm_.allgather(in, count_ * sizeof(T), out);
        break;
      case Collective::reduce_scatter:
        comm_.reduce_scatter(in, out, count_, options_.redop);
        break;
    }
  }

  // Brings the output to the host vectors the check reads (device buffers only).
  void fetch() {
    if (device_ == nullptr) return;
    if (out_.empty()) {
      download(device_in_, in_);
    } else {
      download(device_out_, out_);
    }
  }

  void spoil_one() {
    std::vector<T>& output = out_.empty() ? in_ : out_;
    if (!output.empty()) output.back() = narrow<T>(std::numeric_limits<float>::quiet_NaN());
  }

  // Every element of this rank's output against what it must hold.
  uint64_t wrong() const {
    const int ranks = comm_.size();
    const int rank = comm_.rank();
    switch (op_) {
      case Collective::allreduce:
        return count_wrong_reduced(pattern_, options_.redop, ranks, 0, in_.data(), count_,
                                   tolerance());
      case Collective::broadcast:
        return count_wrong_copy(pattern_, options_.root, 0, in_.data(), count_);
      case Collective::allgather: {
        uint64_t wrong = 0;
        for (int q = 0; q < ranks; ++q) {
          wrong += count_wrong_copy(pattern_, q, 0, out_.data() + static_cast<uint64_t>(q) * count_,
                                    count_);
        }
        return wrong;
      }
      case Collective::reduce_scatter:
        return count_wrong_reduced(pattern_, options_.redop, ranks,
                                   static_cast<uint64_t>(rank) * count_, out_.data(), count_,
                                   tolerance());
    }
    return 0;
  }

 private:
  // NCCL's avg multiplies every value by 1/ranks (rounded) before summing: exact when ranks is a
  // power of two, otherwise within (ranks + 1) roundoffs of the largest magnitude (the products'
  // and the sums' roundings); two more for the reciprocal and the margin.
  double tolerance() const {
    const int ranks = comm_.size();
    if (options_.redop != ReduceOp::avg || comm_.backend() != "nccl") return 0;
    if ((ranks & (ranks - 1)) == 0) return 0;
    const auto magnitude = static_cast<double>(std::max<int64_t>(pattern_.bound, 1));
    return (ranks + 3) * pattern_.unit * magnitude;
  }

  void upload(const std::vector<T>& host, const Buffer& device) {
    if (!host.empty()) device_->upload(host.data(), device.data(), host.size() * sizeof(T));
  }
  void download(const Buffer& device, std::vector<T>& host) {
    if (!host.empty()) device_->download(device.data(), host.data(), host.size() * sizeof(T));
  }

  Communicator& comm_;
  const CommBenchOptions& options_;
  Collective op_;
  Pattern pattern_;
  Ops* device_;
  uint64_t count_ = 0;
  std::vector<T> in_;
  std::vector<T> out_;
  Buffer device_in_;
  Buffer device_out_;
};

// Where this rank is, for hang attribution: each collective call by name, and the work between
// them; a no-op without a tracker.
class Whereabouts {
 public:
  explicit Whereabouts(ProgressTracker* progress) : progress_(progress) {}
  template <typename Call>
  void in(const char* what, Call&& call) {
    if (progress_ != nullptr) progress_->enter_collective(what);
    call();
    if (progress_ != nullptr) progress_->enter(Phase::measure);
  }

 private:
  ProgressTracker* progress_;
};

template <typename T>
CommBenchRow measure(Communicator& comm, const CommBenchOptions& options, Collective op,
                     uint64_t requested_bytes, Ops* device, Whereabouts& at) {
  const CollectiveShape shape = collective_shape(op, requested_bytes, sizeof(T), comm.size());
  CollectiveRun<T> run(comm, options, op, shape, device);
  const char* name = collective_name(op);
  run.fill();
  for (int i = 0; i < options.warmup; ++i)
    at.in(name, [&] { run.call(); });
  at.in("barrier", [&] { comm.barrier(); });
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < options.iters; ++i)
    at.in(name, [&] { run.call(); });
  const std::chrono::duration<double> elapsed = std::chrono::steady_clock::now() - start;
  double seconds = elapsed.count() / options.iters;
  run.fill();
  at.in(name, [&] { run.call(); });
  run.fetch();
  if (comm.rank() == options.corrupt_rank) run.spoil_one();
  double wrong = static_cast<double>(run.wrong());
  // The slowest rank's time; every rank's wrong elements.
  at.in("allreduce of the times", [&] { comm.allreduce(&seconds, 1, ReduceOp::max); });
  at.in("allreduce of the checks", [&] { comm.allreduce(&wrong, 1, ReduceOp::sum); });

  CommBenchRow row;
  row.op = op;
  row.size = shape.bytes;
  row.count = shape.count;
  row.type = dtype_table_name(options.dtype);
  row.redop = reduces(op) ? reduce_op_name(options.redop) : "none";
  row.root = op == Collective::broadcast ? options.root : -1;
  row.time_us = seconds * 1e6;
  row.algbw = seconds > 0 ? static_cast<double>(shape.bytes) / 1e9 / seconds : 0.0;
  row.busbw = row.algbw * bus_factor(op, comm.size());
  row.wrong = static_cast<uint64_t>(wrong);
  return row;
}

std::string format_time_us(double us) {
  // nccl-tests' widths: fewer decimals as the time grows, the column stays 7 wide.
  if (us >= 10000.0) return fmt::format("{:7.0f}", us);
  if (us >= 100.0) return fmt::format("{:7.1f}", us);
  return fmt::format("{:7.2f}", us);
}

// A bandwidth in the table's 6 columns: two decimals while they fit (nccl-tests' %6.2f), fewer
// from 1000 GB/s on (a 1-rank or shared-memory run), so the columns after it stay in place.
std::string format_bandwidth(double gbs) {
  for (int decimals = 2; decimals > 0; --decimals) {
    std::string text = fmt::format("{:6.{}f}", gbs, decimals);
    if (text.size() <= 6) return text;
  }
  return fmt::format("{:6.0f}", gbs);
}

}  // namespace

json row_to_json(const CommBenchRow& r) {
  return {{"op", collective_name(r.op)},
          {"size", r.size},
          {"count", r.count},
          {"type", r.type},
          {"redop", r.redop},
          {"root", r.root},
          {"time_us", r.time_us},
          {"algbw", r.algbw},
          {"busbw", r.busbw},
          {"wrong", r.wrong}};
}

CommBenchRow row_from_json(const json& j) {
  CommBenchRow r;
  r.op = collective_from_name(j.at("op").get<std::string>(), "op");
  r.size = j.at("size").get<uint64_t>();
  r.count = j.at("count").get<uint64_t>();
  r.type = j.at("type").get<std::string>();
  r.redop = j.at("redop").get<std::string>();
  r.root = j.at("root").get<int>();
  r.time_us = j.at("time_us").get<double>();
  r.algbw = j.at("algbw").get<double>();
  r.busbw = j.at("busbw").get<double>();
  r.wrong = j.at("wrong").get<uint64_t>();
  return r;
}

const char* collective_name(Collective op) {
  switch (op) {
    case Collective::allreduce:
      return "allreduce";
    case Collective::broadcast:
      return "broadcast";
    case Collective::reduce_scatter:
      return "reduce_scatter";
    case Collective::allgather:
      return "allgather";
  }
  return "unknown";
}

std::vector<Collective> parse_collectives(const std::string& text, const std::string& flag) {
  std::vector<Collective> ops;
  size_t start = 0;
  while (true) {
    const size_t comma = text.find(',', start);
    const std::string name = text.substr(start, comma - start);
    // "all" in a list ("all,broadcast") is every collective, as alone.
    const std::vector<Collective> named =
        name == "all"
            ? std::vector<Collective>(std::begin(kAllCollectives), std::end(kAllCollectives))
            : std::vector<Collective>{collective_from_name(name, flag)};
    for (Collective op : named) {
      if (std::find(ops.begin(), ops.end(), op) == ops.end()) ops.push_back(op);
    }
    if (comma == std::string::npos) return ops;
    start = comma + 1;
  }
}

const char* dtype_name(BenchDtype dtype) {
  switch (dtype) {
    case BenchDtype::float32:
      return "float";
    case BenchDtype::float16:
      return "half";
    case BenchDtype::bfloat16:
      return "bf16";
  }
  return "unknown";
}

const char* dtype_table_name(BenchDtype dtype) {
  return dtype == BenchDtype::bfloat16 ? "bfloat16" : dtype_name(dtype);
}

size_t dtype_size(BenchDtype dtype) {
  return dtype == BenchDtype::float32 ? 4 : 2;
}

BenchDtype parse_dtype(const std::string& text, const std::string& flag) {
  // nccl-tests' names (float, half, bfloat16) and a recipe's precisions (fp32, fp16, bf16) too.
  struct Alias {
    const char* name;
    BenchDtype dtype;
  };
  static constexpr Alias kAliases[] = {{"float32", BenchDtype::float32},
                                       {"fp32", BenchDtype::float32},
                                       {"float16", BenchDtype::float16},
                                       {"fp16", BenchDtype::float16},
                                       {"bfloat16", BenchDtype::bfloat16}};
  std::vector<std::string> known;
  for (BenchDtype dtype : kAllDtypes) {
    if (text == dtype_name(dtype)) return dtype;
    known.emplace_back(dtype_name(dtype));
  }
  for (const Alias& alias : kAliases) {
    if (text == alias.name) return alias.dtype;
    known.emplace_back(alias.name);
  }
  throw Error(ErrorKind::usage,
              fmt::format("{}: unknown element type '{}' (use float, half or bf16){}", flag, text,
                          did_you_mean(text, known)));
}

ReduceOp parse_reduce_op(const std::string& text, const std::string& flag) {
  std::vector<std::string> known;
  for (ReduceOp op : kAllReduceOps) {
    if (text == reduce_op_name(op)) return op;
    known.emplace_back(reduce_op_name(op));
  }
  // A mean is what avg takes (as nccl-tests and PyTorch name it).
  throw Error(ErrorKind::usage,
              fmt::format("{}: unknown reduction '{}' (use sum, avg, max or min){}", flag, text,
                          lowercase(text) == "mean" ? std::string("; did you mean 'avg'?")
                                                    : did_you_mean(text, known)));
}

uint64_t parse_size(const std::string& text, const std::string& flag) {
  const auto bad = [&](const char* why) {
    return Error(ErrorKind::usage,
                 fmt::format("{}: {} '{}' (bytes, optionally with K, M, G or T: 8, 1K, 256M)", flag,
                             why, text));
  };
  size_t digits = 0;
  while (digits < text.size() && text[digits] >= '0' && text[digits] <= '9')
    ++digits;
  if (digits == 0 || text.size() > digits + 1) throw bad("not a size:");
  int shift = 0;
  if (digits < text.size()) {
    switch (text[digits]) {
      case 'k':
      case 'K':
        shift = 10;
        break;
      case 'm':
      case 'M':
        shift = 20;
        break;
      case 'g':
      case 'G':
        shift = 30;
        break;
      case 't':
      case 'T':
        shift = 40;
        break;
      default:
        throw bad("not a size:");
    }
  }
  constexpr uint64_t kMax = uint64_t{1} << 62;
  uint64_t number = 0;
  for (size_t i = 0; i < digits; ++i) {
    const auto digit = static_cast<uint64_t>(text[i] - '0');
    if (number > (kMax - digit) / 10) throw bad("too large:");  // before it could wrap
    number = number * 10 + digit;
  }
  if (number > (kMax >> shift)) throw bad("too large:");
  if (number == 0) throw bad("must be at least 1 byte, got");
  return number << shift;
}

std::vector<uint64_t> sweep_sizes(uint64_t min_bytes, uint64_t max_bytes, uint64_t factor) {
  std::vector<uint64_t> sizes;
  if (min_bytes == 0 || factor < 2) return sizes;
  for (uint64_t size = min_bytes; size <= max_bytes; size *= factor) {
    sizes.push_back(size);
    if (size > max_bytes / factor) break;  // the next one would pass max (or overflow)
  }
  return sizes;
}

double bus_factor(Collective op, int ranks) {
  const double n = ranks;
  switch (op) {
    case Collective::allreduce:
      return 2.0 * (n - 1) / n;
    case Collective::reduce_scatter:
    case Collective::allgather:
      return (n - 1) / n;
    case Collective::broadcast:
      // nccl-tests' 1, but for one rank: nothing leaves it (an in-place broadcast of one rank
      // does nothing at all), so 1 would show the call's overhead as bandwidth.
      return ranks > 1 ? 1.0 : 0.0;
  }
  return 0.0;
}

CollectiveShape collective_shape(Collective op, uint64_t requested_bytes, size_t element_size,
                                 int ranks) {
  const uint64_t elements = requested_bytes / element_size;
  CollectiveShape shape;
  if (op == Collective::allgather || op == Collective::reduce_scatter) {
    shape.count = elements / static_cast<uint64_t>(ranks);
    shape.bytes = shape.count * static_cast<uint64_t>(ranks) * element_size;
  } else {
    shape.count = elements;
    shape.bytes = elements * element_size;
  }
  return shape;
}

std::vector<uint64_t> CommBenchOptions::sizes() const {
  return sweep_sizes(min_bytes, max_bytes, step_factor);
}

void CommBenchOptions::validate(int ranks, const std::string& backend) const {
  if (ops.empty()) throw Error(ErrorKind::usage, "-o/--op: no collective given");
  if (min_bytes < 1) {
    throw Error(ErrorKind::usage, "-b/--minbytes: must be at least 1 byte");
  }
  if (max_bytes < min_bytes) {
    throw Error(ErrorKind::usage,
                fmt::format("-e/--maxbytes: {} is below -b/--minbytes {}", max_bytes, min_bytes));
  }
  if (step_factor < 2) {
    throw Error(ErrorKind::usage,
                fmt::format("-f/--stepfactor: must be at least 2, got {}", step_factor));
  }
  if (warmup < 0) {
    throw Error(ErrorKind::usage, fmt::format("-w/--warmup: must be >= 0, got {}", warmup));
  }
  if (iters < 1)
    throw Error(ErrorKind::usage, fmt::format("-n/--iters: must be >= 1, got {}", iters));
  if (root < 0 || (ranks > 0 && root >= ranks)) {
    throw Error(ErrorKind::usage,
                ranks > 0 ? fmt::format("--root: {} is not a rank (0..{})", root, ranks - 1)
                          : fmt::format("--root: {} is not a rank", root));
  }
  // Gloo's reduce-scatter counts the whole buffer's bytes in an int.
  const bool has_reduce_scatter =
      std::find(ops.begin(), ops.end(), Collective::reduce_scatter) != ops.end();
  if (backend == "gloo" && has_reduce_scatter && max_bytes > static_cast<uint64_t>(INT_MAX)) {
    throw Error(ErrorKind::usage,
                fmt::format("-e/--maxbytes: {} is more than reduce_scatter takes over gloo "
                            "(at most {} bytes in all)",
                            max_bytes, INT_MAX));
  }
}

json CommBenchOptions::to_json() const {
  json names = json::array();
  for (Collective op : ops)
    names.push_back(collective_name(op));
  return {{"ops", names},
          {"min_bytes", min_bytes},
          {"max_bytes", max_bytes},
          {"step_factor", step_factor},
          {"dtype", dtype_name(dtype)},
          {"redop", reduce_op_name(redop)},
          {"root", root},
          {"warmup", warmup},
          {"iters", iters}};
}

CommBenchOptions CommBenchOptions::from_json(const json& j) {
  try {
    CommBenchOptions o;
    o.ops.clear();
    for (const auto& name : j.at("ops"))
      o.ops.push_back(collective_from_name(name.get<std::string>(), "ops"));
    o.min_bytes = j.at("min_bytes").get<uint64_t>();
    o.max_bytes = j.at("max_bytes").get<uint64_t>();
    o.step_factor = j.at("step_factor").get<uint64_t>();
    o.dtype = parse_dtype(j.at("dtype").get<std::string>(), "dtype");
    o.redop = parse_reduce_op(j.at("redop").get<std::string>(), "redop");
    o.root = j.at("root").get<int>();
    o.warmup = j.at("warmup").get<int>();
    o.iters = j.at("iters").get<int>();
    return o;
  } catch (const json::exception& e) {
    throw Error(ErrorKind::usage, fmt::format("bench comm options: {}", e.what()));
  }
}

double CommBenchResult::avg_busbw(std::optional<Collective> op) const {
  double sum = 0;
  int n = 0;
  for (const auto& row : rows) {
    if (op && row.op != *op) continue;
    sum += row.busbw;
    ++n;
  }
  return n > 0 ? sum / n : 0.0;
}

uint64_t CommBenchResult::wrong() const {
  uint64_t total = 0;
  for (const auto& row : rows)
    total += row.wrong;
  return total;
}

json CommBenchResult::to_json() const {
  json j = {{"benchmark", "comm"}, {"ranks", ranks}, {"hosts", hosts}, {"backend", backend}};
  j.update(options.to_json());
  j["type"] = dtype_table_name(options.dtype);
  json rows_json = json::array();
  for (const auto& row : rows)
    rows_json.push_back(row_to_json(row));
  j["rows"] = rows_json;
  j["avg_busbw"] = avg_busbw();
  json by_op = json::object();
  for (Collective op : options.ops)
    by_op[collective_name(op)] = avg_busbw(op);
  j["avg_busbw_by_op"] = by_op;
  j["wrong"] = wrong();
  return j;
}

CommBenchResult CommBenchResult::from_json(const json& j) {
  try {
    CommBenchResult r;
    r.ranks = j.at("ranks").get<int>();
    r.hosts = j.value("hosts", 1);
    r.backend = j.at("backend").get<std::string>();
    r.options = CommBenchOptions::from_json(j);
    for (const auto& row : j.at("rows"))
      r.rows.push_back(row_from_json(row));
    return r;
  } catch (const json::exception& e) {
    throw Error(ErrorKind::usage, fmt::format("bench comm result: {}", e.what()));
  }
}

CommBenchResult run_comm_bench(Communicator& comm, const CommBenchOptions& options,
                               const std::function<void(Collective)>& on_collective, Ops* device,
                               const CommRowCallback& on_row, ProgressTracker* progress) {
  options.validate(comm.size(), comm.backend());
  Whereabouts at(progress);
  // A step is one measurement: the next one's number as soon as one is done, so that a rank
  // held up between two says which it has yet to begin.
  int64_t measured = 0;
  if (progress != nullptr) {
    progress->set_step(measured);
    progress->enter(Phase::measure);
  }
  CommBenchResult result;
  result.ranks = comm.size();
  result.backend = comm.backend();
  result.options = options;
  const auto sizes = options.sizes();
  for (Collective op : options.ops) {
    if (on_collective) on_collective(op);
    for (size_t i = 0; i < sizes.size(); ++i) {
      const uint64_t size = sizes[i];
      switch (options.dtype) {
        case BenchDtype::float32:
          result.rows.push_back(measure<float>(comm, options, op, size, device, at));
          break;
        case BenchDtype::float16:
          result.rows.push_back(measure<Half>(comm, options, op, size, device, at));
          break;
        case BenchDtype::bfloat16:
          result.rows.push_back(measure<BFloat16>(comm, options, op, size, device, at));
          break;
      }
      if (progress != nullptr) progress->set_step(++measured);
      if (on_row) on_row(result.rows.back(), i + 1, sizes.size());
    }
  }
  if (progress != nullptr) progress->enter(Phase::done);
  return result;
}

std::string format_comm_table(const CommBenchResult& r) {
  const CommBenchOptions& o = r.options;
  std::string out;
  for (Collective op : o.ops) {
    std::string what = fmt::format("# ranks {}  hosts {}  backend {}  dtype {}", r.ranks, r.hosts,
                                   r.backend, dtype_name(o.dtype));
    if (reduces(op)) what += fmt::format("  redop {}", reduce_op_name(o.redop));
    if (op == Collective::broadcast) what += fmt::format("  root {}", o.root);
    out += fmt::format("# dptrain bench comm: {}\n{}\n", collective_name(op), what);
    out += fmt::format(
        "# minBytes {} maxBytes {} step: {}(factor) warmup iters: {} iters: {} validation: 1\n",
        o.min_bytes, o.max_bytes, o.step_factor, o.warmup, o.iters);
    out += "#\n";
    out += fmt::format("# {:>10}  {:>12}  {:>8}  {:>6}  {:>6}  {:>7}  {:>6}  {:>6} {:>6}\n", "size",
                       "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong");
    out += fmt::format("# {:>10}  {:>12}  {:>8}  {:>6}  {:>6}  {:>7}  {:>6}  {:>6}\n", "(B)",
                       "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)");
    uint64_t wrong = 0;
    for (const auto& row : r.rows) {
      if (row.op != op) continue;
      wrong += row.wrong;
      out +=
          fmt::format("{:>12}  {:>12}  {:>8}  {:>6}  {:>6}  {:>7}  {:>6}  {:>6}  {:>5}\n", row.size,
                      row.count, row.type, row.redop, row.root, format_time_us(row.time_us),
                      format_bandwidth(row.algbw), format_bandwidth(row.busbw), row.wrong);
    }
    out += fmt::format("# Out of bounds values : {} {}\n", wrong, wrong == 0 ? "OK" : "FAILED");
    out += fmt::format("# Avg bus bandwidth    : {:g}\n", r.avg_busbw(op));
    out += "#\n";
  }
  return out;
}

std::vector<std::string> busbw_shortfalls(const CommBenchResult& result, double min_busbw) {
  std::vector<std::string> lines;
  for (Collective op : result.options.ops) {
    const CommBenchRow* largest = nullptr;
    // A size that rounds down to nothing moves nothing: not one to judge.
    for (const auto& row : result.rows) {
      if (row.op == op && row.count > 0 && (largest == nullptr || row.size >= largest->size)) {
        largest = &row;
      }
    }
    // Three significant digits: a threshold below 0.01 GB/s is compared with what it can see.
    if (largest != nullptr && largest->busbw < min_busbw) {
      lines.push_back(fmt::format("{} at {} bytes: busbw {:#.3g} GB/s is below --min-busbw {} GB/s",
                                  collective_name(op), largest->size, largest->busbw, min_busbw));
    }
  }
  return lines;
}

}  // namespace dptrain
