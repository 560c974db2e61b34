// Recipe parsing: JSON -> typed Recipe, validated, every problem reported with its JSON pointer.
#include "core/recipe.hpp"

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <set>
#include <string_view>
#include <type_traits>
#include <utility>

#include <fmt/format.h>

#include "core/checkpoint.hpp"
#include "core/data/dataset.hpp"
#include "core/data/tokens.hpp"
#include "core/error.hpp"
#include "core/fs.hpp"
#include "core/json_error.hpp"
#include "core/suggest.hpp"

namespace dptrain {
namespace {

using nlohmann::json;

// A check returns what is wrong with a value (without the "got ..." part), or nothing.
using Verdict = std::optional<std::string>;

// ---- upper bounds (each documented in dptrain-recipe(5)) --------------------------------------
// Values past them are mistakes, and they keep what is computed from the values in range: the
// global batch (x world size, an int) and the parameter count in int64, deadlines in a steady
// clock's nanoseconds.

constexpr size_t kMaxNameLength = 100;
constexpr int64_t kMaxBatchPerRank = int64_t{1} << 24;  // 16,777,216
constexpr int64_t kMaxGradAccum = int64_t{1} << 20;     // 1,048,576
// batch_per_rank x grad_accum: times a world size below 2^31, the global batch stays below 2^62.
constexpr int64_t kMaxSamplesPerRankStep = int64_t{1} << 31;
constexpr int64_t kMaxThreadsPerRank = 256;
constexpr int64_t kMaxDimension = (int64_t{1} << 31) - 1;    // every model size field
constexpr uint64_t kMaxParameters = uint64_t{1} << 40;       // 1,099,511,627,776 (4 TiB in f32)
constexpr uint64_t kMaxSyntheticValues = uint64_t{1} << 40;  // data.samples x model.input
// Problems listed before the rest are counted: 80,000 wrong entries of a list are one mistake.
constexpr size_t kMostListed = 50;

// ---- problem collection ----------------------------------------------------------------------

class Problems {
 public:
  void add(const std::string& pointer, const std::string& what) {
    entries_.emplace_back(pointer, what);
  }
  bool any() const { return !entries_.empty(); }
  bool at(const std::string& pointer) const {
    return std::any_of(entries_.begin(), entries_.end(),
                       [&](const auto& entry) { return entry.first == pointer; });
  }
  // One line per problem, in the order found: a key holding a newline or an escape (a pointer,
  // or a message quoting it) is shown as \x0a, never splitting the line or reaching a terminal.
  // At most kMostListed of them, as for a CSV file's rows: 80,000 wrong entries of a list are
  // one mistake, not a screenful per second.
  // `under`: the pointer of the recipe in its file ("/recipe" in run.json), before each one.
  std::string report(const std::string& source, const std::string& under = "") const {
    std::string text;
    for (size_t i = 0; i < entries_.size() && i < kMostListed; ++i) {
      const auto& [pointer, what] = entries_[i];
      if (!text.empty()) text += '\n';
      const std::string where = under + pointer;
      text += printable(fmt::format("{}: {}: {}", source, where.empty() ? "/" : where, what));
    }
    if (entries_.size() > kMostListed) {
      text += fmt::format("\n{}: {} more problem(s), not listed", source,
                          entries_.size() - kMostListed);
    }
    return text;
  }

 private:
  std::vector<std::pair<std::string, std::string>> entries_;
};

std::string pointer_to(const std::string& parent, std::string_view key) {
  // RFC 6901 escaping, so a key containing '/' or '~' still yields an unambiguous pointer.
  std::string escaped;
  for (char c : key) {
    if (c == '~') {
      escaped += "~0";
    } else if (c == '/') {
      escaped += "~1";
    } else {
      escaped += c;
    }
  }
  return parent + "/" + escaped;
}

// How a JSON value is shown after "got": scalars verbatim, containers by kind.
std::string describe(const json& value) {
  if (value.is_object()) return "an object";
  if (value.is_array()) return "an array";
  std::string text = value.dump();
  constexpr size_t kMaxShown = 60;
  if (text.size() > kMaxShown) text = text.substr(0, kMaxShown) + "...";
  return text;
}

// ---- "did you mean" ------------------------------------------------------------------------

// ---- JSON -> C++ conversions: each returns what is wrong, or nothing -------------------------

Verdict convert(const json& value, std::string& out) {
  if (!value.is_string()) return "expected a string, got " + describe(value);
  out = value.get<std::string>();
  return std::nullopt;
}

Verdict convert(const json& value, bool& out) {
  if (!value.is_boolean()) return "expected true or false, got " + describe(value);
  out = value.get<bool>();
  return std::nullopt;
}

Verdict convert(const json& value, double& out) {
  // Booleans are not numbers here, even though some JSON libraries would convert them.
  if (!value.is_number()) return "expected a number, got " + describe(value);
  double number = value.get<double>();
  if (!std::isfinite(number)) return "expected a finite number, got " + describe(value);
  // -0.0 stays as written: the hash of a recipe holding it is the one its run's checkpoints
  // record (as 0 it would call them another recipe's).
  out = number;
  return std::nullopt;
}

// From 2^53 on, a number written with a fraction or an exponent need not be the integer written
// (9007199254740993.0 reads as 2^53): refused, not changed in silence.
Verdict inexact_integer(const json& value) {
  constexpr double kTwoTo53 = 9007199254740992.0;
  if (!value.is_number_float() || std::fabs(value.get<double>()) < kTwoTo53) {
    return std::nullopt;
  }
  return "an integer written with a fraction or an exponent is exact only below 2^53 (this one "
         "reads as " +
         describe(value) + "): write its digits alone";
}

// An integral float such as 1e4 counts as an integer (as in JSON Schema); 3.5 does not.
std::optional<double> integral_float(const json& value) {
  if (!value.is_number_float()) return std::nullopt;
  double number = value.get<double>();
  if (!std::isfinite(number) || std::floor(number) != number) return std::nullopt;
  return number;
}

// What an integer too large for its field's type is told, before the value.
constexpr const char* kBeyondInt64 = "out of range of a 64-bit integer (-2^63 to 2^63-1), got ";
constexpr const char* kBeyondUint64 =
    "out of range of an unsigned 64-bit integer (0 to 2^64-1), got ";

Verdict convert(const json& value, int64_t& out) {
  constexpr double kTwoTo63 = 9223372036854775808.0;
  if (value.is_number_unsigned()) {
    if (value.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return kBeyondInt64 + describe(value);
    }
    out = static_cast<int64_t>(value.get<uint64_t>());
  } else if (value.is_number_integer()) {
    out = value.get<int64_t>();
  } else if (auto number = integral_float(value)) {
    if (*number < -kTwoTo63 || *number >= kTwoTo63) return kBeyondInt64 + describe(value);
    if (auto inexact = inexact_integer(value)) return inexact;
    out = static_cast<int64_t>(*number);
  } else {
    return "expected an integer, got " + describe(value);
  }
  return std::nullopt;
}

Verdict convert(const json& value, uint64_t& out) {
  constexpr double kTwoTo64 = 18446744073709551616.0;
  if (value.is_number_unsigned()) {
    out = value.get<uint64_t>();
  } else if (value.is_number_integer()) {
    // nlohmann stores negatives as signed, and "-0" too: that one is 0.
    if (value.get<int64_t>() != 0) return "must be >= 0, got " + describe(value);
    out = 0;
  } else if (auto number = integral_float(value)) {
    if (*number < 0) return "must be >= 0, got " + describe(value);
    if (*number >= kTwoTo64) return kBeyondUint64 + describe(value);
    if (auto inexact = inexact_integer(value)) return inexact;
    out = static_cast<uint64_t>(*number);
  } else {
    return "expected an integer, got " + describe(value);
  }
  return std::nullopt;
}

// ---- checks ----------------------------------------------------------------------------------

constexpr auto no_check = [](const auto&) -> Verdict { return std::nullopt; };

auto at_least(auto min) {
  return [min](auto value) -> Verdict {
    if (value >= min) return std::nullopt;
    return fmt::format("must be >= {}", min);
  };
}

// `why` says what the limit protects, after the bound: "must be <= 256 (why)".
template <class T>
auto at_most(T max, std::string why) {
  return [max, why = std::move(why)](T value) -> Verdict {
    if (value <= max) return std::nullopt;
    // 1000000, not fmt's shortest "1e+06".
    if constexpr (std::is_floating_point_v<T>) {
      if (max == std::floor(max) && std::abs(max) < 1e15) {
        return fmt::format("must be <= {} ({})", static_cast<int64_t>(max), why);
      }
    }
    return fmt::format("must be <= {} ({})", max, why);
  };
}

// Both checks, the first one's verdict first.
template <class First, class Second>
auto both(First first, Second second) {
  return [first = std::move(first), second = std::move(second)](auto value) -> Verdict {
    if (auto wrong = first(value)) return wrong;
    return second(value);
  };
}

auto greater_than(double min) {
  return [min](double value) -> Verdict {
    if (value > min) return std::nullopt;
    return fmt::format("must be > {}", min);
  };
}

// [lo, hi) when `include_hi` is false, [lo, hi] when it is true.
auto in_range(double lo, double hi, bool include_hi) {
  return [=](double value) -> Verdict {
    if (value >= lo && (include_hi ? value <= hi : value < hi)) return std::nullopt;
    return fmt::format("must be in [{}, {}{}", lo, hi, include_hi ? "]" : ")");
  };
}

// (0, 1]: a share that must not be nothing.
Verdict positive_share(double value) {
  if (value > 0.0 && value <= 1.0) return std::nullopt;
  return "must be in (0, 1]";
}

// An integer in [lo, hi].
auto between(int64_t lo, int64_t hi) {
  return [=](int64_t value) -> Verdict {
    if (value >= lo && value <= hi) return std::nullopt;
    return fmt::format("must be in [{}, {}]", lo, hi);
  };
}

// A count of steps from `min` to kMaxSteps.
auto steps_from(int64_t min) {
  return both(at_least(min), at_most(kMaxSteps, "10^12 steps"));
}

// A duration in seconds: at most kMaxSeconds, so deadlines stay far inside a clock's range.
auto seconds_limit() {
  return at_most(kMaxSeconds, "about 11.6 days");
}

// "a", "b" or "c": how the allowed values of an enum field are listed in messages ('a' with
// `quote` '\'').
std::string quoted_alternatives(const std::vector<std::string>& words, char quote = '"') {
  std::string text;
  for (size_t i = 0; i < words.size(); ++i) {
    if (i > 0) text += i + 1 == words.size() ? " or " : ", ";
    text += quote + words[i] + quote;
  }
  return text;
}

// `gpu_only` names values that are valid in the GPU build but not in this one, so the message
// can say why rather than just "unknown".
auto one_of(std::vector<std::string> allowed) {
  return [allowed = std::move(allowed)](const std::string& value) -> Verdict {
    if (std::find(allowed.begin(), allowed.end(), value) != allowed.end()) return std::nullopt;
    return "must be " + quoted_alternatives(allowed);
  };
}

// The name becomes a directory name (runs/<name>-<time>), so it must be a safe path component
// short enough for the suffixes (a file name is at most 255 bytes).
Verdict valid_name(const std::string& name) {
  if (name.empty()) return "must not be empty";
  if (name.size() > kMaxNameLength) {
    return fmt::format(
        "must be at most {} characters long (it becomes a directory name, with the time after "
        "it), is {}",
        kMaxNameLength, name.size());
  }
  if (name == "." || name == "..") return "must not be \".\" or \"..\"";
  bool safe = std::all_of(name.begin(), name.end(), [](char c) {
    return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '.' ||
           c == '_' || c == '-';
  });
  if (!safe) return "may only contain A-Z a-z 0-9 . _ - (it becomes a directory name)";
  return std::nullopt;
}

// ---- fields that apply to one kind only ("momentum": sgd) ------------------------------------

// Whether a field applies, given the value of the field that picks its section's kind (read
// before it: visit_fields lists "type" first). A field that does not apply is refused in a user's
// recipe and left out of to_json.
struct Applies {
  bool yes = true;
  std::string governed_by;  // "/optimizer/type"
  std::string condition;    // "/optimizer/type is \"sgd\" (it is \"adamw\")"
};

Applies only_for(std::string governed_by, const std::string& actual,
                 std::vector<std::string> kinds) {
  Applies a;
  a.yes = std::find(kinds.begin(), kinds.end(), actual) != kinds.end();
  a.condition =
      fmt::format("{} is {} (it is \"{}\")", governed_by, quoted_alternatives(kinds), actual);
  a.governed_by = std::move(governed_by);
  return a;
}

// ---- visitors: the schema is written once (visit_fields) and walked by a reader or a writer ---

template <class T>
struct IsVector : std::false_type {};
template <class T>
struct IsVector<std::vector<T>> : std::true_type {};

// Reads one JSON object into a spec, collecting problems; `object` is null when the section is
// absent or not an object, in which case the reader only learns the known keys.
class Reader {
 public:
  // `schema`, when given: every field's pointer ("/optimizer/lr") is added to it as it is met.
  Reader(const json* object, std::string pointer, Problems& problems, RecipeOrigin origin,
         std::vector<std::string>* schema = nullptr)
      : object_(object),
        pointer_(std::move(pointer)),
        problems_(problems),
        origin_(origin),
        schema_(schema) {}

  template <class T, class Check>
  void field(const char* key, T& out, const Check& check, const Applies& applies = {}) {
    known_.emplace_back(key);
    if (schema_ != nullptr) schema_->push_back(pointer_to(pointer_, key));
    const json* value = find(key);
    if (value == nullptr) return;
    std::string pointer = pointer_to(pointer_, key);
    // A stored recipe (run.json of an earlier version) carries every field; a kind that is
    // itself wrong is reported once, at its own pointer.
    if (!applies.yes && origin_ == RecipeOrigin::user && !problems_.at(applies.governed_by)) {
      problems_.add(pointer, "applies only when " + applies.condition + "; remove it");
      return;
    }
    if constexpr (IsVector<T>::value) {
      read_array(*value, pointer, out, check);
    } else {
      read_value(*value, pointer, out, check);
    }
  }

  template <class Spec>
  void section(const char* key, Spec& spec) {
    known_.emplace_back(key);
    const json* value = find(key);
    std::string pointer = pointer_to(pointer_, key);
    if (value != nullptr && !value->is_object()) {
      problems_.add(pointer, "expected an object, got " + describe(*value));
      value = nullptr;
    }
    Reader nested(value, pointer, problems_, origin_, schema_);
    visit_fields(nested, spec);
    nested.reject_unknown_keys();
  }

  void reject_unknown_keys() const {
    if (object_ == nullptr) return;
    for (const auto& [key, value] : object_->items()) {
      if (std::find(known_.begin(), known_.end(), key) != known_.end()) continue;
      // A long key is shown cut, as a long value is (in the pointer too): a megabyte of key is
      // one mistake, not two megabytes of error line.
      constexpr size_t kMaxShown = 60;
      const std::string shown = key.size() > kMaxShown ? key.substr(0, kMaxShown) + "..." : key;
      std::string what = "unknown key '" + shown + "'";
      if (auto suggestion = suggest_key(key)) what += "; did you mean " + *suggestion + "?";
      problems_.add(pointer_to(pointer_, shown), what);
    }
  }

 private:
  // For an unknown key: this section's key spelled another way ("batchPerRank"), else the field
  // of that name in another section ("lr" at the top: '/optimizer/lr'; the commonest slip, which
  // the nearest spelling here would answer with 'log'; up to three of them, and never the run's
  // /name for a "name" in a section), else the nearest spelling here.
  std::optional<std::string> suggest_key(const std::string& key) const {
    const std::string plain = plain_key(key);
    for (const auto& known : known_) {
      if (plain_key(known) == plain) return "'" + known + "'";
    }
    std::vector<std::string> elsewhere;
    for (const auto& pointer : schema_pointers()) {
      const std::string last = pointer.substr(pointer.rfind('/') + 1);
      if (plain_key(last) == plain && pointer != pointer_to(pointer_, last) && pointer != "/name") {
        elsewhere.push_back(pointer);
      }
    }
    if (!elsewhere.empty() && elsewhere.size() <= 3) return quoted_alternatives(elsewhere, '\'');
    if (auto close = closest_match(key, known_)) return "'" + *close + "'";
    return std::nullopt;
  }

  // A key as compared for a suggestion: lower case, without '_' and '-'.
  static std::string plain_key(std::string_view key) {
    std::string plain;
    for (const char c : lowercase(key)) {
      if (c != '_' && c != '-') plain += c;
    }
    return plain;
  }

  static const std::vector<std::string>& schema_pointers();

  const json* find(const char* key) const {
    if (object_ == nullptr) return nullptr;
    auto it = object_->find(key);
    return it == object_->end() ? nullptr : &*it;
  }

  template <class T, class Check>
  bool read_value(const json& value, const std::string& pointer, T& out, const Check& check) {
    T converted{};
    if (auto wrong = convert(value, converted)) {
      problems_.add(pointer, *wrong);
      return false;
    }
    if (auto wrong = check(converted)) {
      problems_.add(pointer, *wrong + ", got " + describe(value));
      return false;
    }
    out = std::move(converted);
    return true;
  }

  // The check applies to each element, whose problems are reported at /.../key/<index>.
  template <class T, class Check>
  void read_array(const json& value, const std::string& pointer, std::vector<T>& out,
                  const Check& check) {
    if (!value.is_array()) {
      problems_.add(pointer, "expected an array, got " + describe(value));
      return;
    }
    std::vector<T> converted(value.size());
    bool all_good = true;
    for (size_t i = 0; i < value.size(); ++i) {
      all_good &= read_value(value[i], pointer + "/" + std::to_string(i), converted[i], check);
    }
    if (all_good) out = std::move(converted);
  }

  const json* object_;
  std::string pointer_;
  Problems& problems_;
  const RecipeOrigin origin_;
  std::vector<std::string>* schema_;
  std::vector<std::string> known_;
};

// Writes a spec as JSON: the fields that apply, or (`every_field`) all of them.
class Writer {
 public:
  explicit Writer(bool every_field) : every_field_(every_field) {}

  template <class T, class Check>
  void field(const char* key, const T& value, const Check&, const Applies& applies = {}) {
    if (applies.yes || every_field_) object_[key] = value;
  }

  template <class Spec>
  void section(const char* key, Spec& spec) {
    Writer nested(every_field_);
    visit_fields(nested, spec);
    object_[key] = std::move(nested.object_);
  }

  json take() { return std::move(object_); }

 private:
  const bool every_field_;
  json object_ = json::object();
};

template <class Visitor>
void visit_fields(Visitor& v, ModelSpec& m) {
  v.field("type", m.type, one_of({"mlp", "gpt"}));
  const Applies mlp = only_for("/model/type", m.type, {"mlp"});
  const Applies gpt = only_for("/model/type", m.type, {"gpt"});
  // Each size at most 2^31 - 1 (BLAS takes int dimensions); the parameter count they give
  // together is checked later (check_model_size).
  const auto size = [](int64_t min) {
    return both(at_least(min), at_most(kMaxDimension, "2^31 - 1"));
  };
  v.field("input", m.input, size(1), mlp);
  v.field("hidden", m.hidden, size(1), mlp);
  v.field("classes", m.classes, size(2), mlp);
  v.field("activation", m.activation, one_of({"relu", "gelu"}), mlp);
  v.field("vocab", m.vocab, size(2), gpt);
  v.field("context", m.context, size(1), gpt);
  v.field("layers", m.layers, size(1), gpt);
  v.field("heads", m.heads, size(1), gpt);
  v.field("width", m.width, size(1), gpt);  // and a multiple of heads, checked later
  v.field("mlp_ratio", m.mlp_ratio, size(1), gpt);
  v.field(
      "dropout", m.dropout,
      [](double value) -> Verdict {
        if (value == 0.0) return std::nullopt;
        return "must be 0: the trainer has no dropout yet";
      },
      gpt);
}

template <class Visitor>
void visit_fields(Visitor& v, DataSpec& d) {
  v.field("type", d.type, one_of({"synthetic-classification", "csv", "tokens"}));
  const Applies synthetic = only_for("/data/type", d.type, {"synthetic-classification"});
  const Applies file = only_for("/data/type", d.type, {"csv", "tokens"});
  const Applies csv = only_for("/data/type", d.type, {"csv"});
  v.field("samples", d.samples, at_least(int64_t{2}), synthetic);
  // Bounded so that the generated features stay finite in f32 (above 3.4e38 every one was inf,
  // and the run failed as a divergence, blaming the learning rate).
  v.field("noise", d.noise, both(at_least(0.0), at_most(1e6, "10^6")), synthetic);
  // Required for them, checked once both are known; given, it names something.
  v.field(
      "path", d.path,
      [&d](const std::string& path) -> Verdict {
        // (A stored recipe of other data has "": nothing.)
        if (!path.empty() || (d.type != "csv" && d.type != "tokens")) return std::nullopt;
        return "must name the data (from the recipe's folder, or absolute)";
      },
      file);
  v.field("header", d.header, one_of({"auto", "yes", "no"}), csv);
  // Token data has its own validation file.
  v.field("eval_fraction", d.eval_fraction, in_range(0.0, 1.0, false),
          only_for("/data/type", d.type, {"synthetic-classification", "csv"}));
}

template <class Visitor>
void visit_fields(Visitor& v, TrainSpec& t) {
  v.field("steps", t.steps, steps_from(0));
  v.field("batch_per_rank", t.batch_per_rank,
          both(at_least(int64_t{1}), at_most(kMaxBatchPerRank, "2^24")));
  v.field("grad_accum", t.grad_accum, both(at_least(int64_t{1}), at_most(kMaxGradAccum, "2^20")));
  v.field("device", t.device, one_of({"cpu", "cuda"}));
  v.field("precision", t.precision, one_of({"fp32", "bf16", "fp16"}));
  v.field("threads_per_rank", t.threads_per_rank,
          both(at_least(int64_t{1}), at_most(kMaxThreadsPerRank, "BLAS threads per rank")));
}

template <class Visitor>
void visit_fields(Visitor& v, ScheduleSpec& s) {
  v.field("type", s.type, one_of({"constant", "cosine", "linear"}));
  v.field("warmup", s.warmup, steps_from(0));  // and <= /train/steps, checked later
  v.field("min_lr_ratio", s.min_lr_ratio, in_range(0.0, 1.0, true),
          only_for("/optimizer/schedule/type", s.type, {"cosine", "linear"}));
}

template <class Visitor>
void visit_fields(Visitor& v, OptimizerSpec& o) {
  v.field("type", o.type, one_of({"adamw", "sgd"}));
  v.field("lr", o.lr, greater_than(0.0));
  v.field("weight_decay", o.weight_decay, at_least(0.0));
  const Applies sgd = only_for("/optimizer/type", o.type, {"sgd"});
  const Applies adamw = only_for("/optimizer/type", o.type, {"adamw"});
  v.field("momentum", o.momentum, in_range(0.0, 1.0, false), sgd);
  v.field("nesterov", o.nesterov, no_check, sgd);
  v.field("beta1", o.beta1, in_range(0.0, 1.0, false), adamw);
  v.field("beta2", o.beta2, in_range(0.0, 1.0, false), adamw);
  v.field("eps", o.eps, greater_than(0.0), adamw);
  v.section("schedule", o.schedule);
  v.field("clip_grad_norm", o.clip_grad_norm, at_least(0.0));
}

template <class Visitor>
void visit_fields(Visitor& v, CompressionSpec& c) {
  v.field("type", c.type, one_of({"none", "fp16", "bf16", "int8", "topk", "powersgd"}));
  const std::string kind = "/distributed/compression/type";
  v.field("block", c.block, both(at_least(int64_t{1}), at_most(kMaxDimension, "2^31 - 1")),
          only_for(kind, c.type, {"int8"}));
  v.field("ratio", c.ratio, positive_share, only_for(kind, c.type, {"topk"}));
  v.field("rank", c.rank, both(at_least(int64_t{1}), at_most(kMaxDimension, "2^31 - 1")),
          only_for(kind, c.type, {"powersgd"}));
}

template <class Visitor>
void visit_fields(Visitor& v, DistributedSpec& d) {
  v.field("backend", d.backend, one_of({"auto", "gloo", "nccl"}));
  v.field("sync", d.sync, one_of({"allreduce", "local_sgd", "ps"}));
  const Applies local_sgd = only_for("/distributed/sync", d.sync, {"local_sgd"});
  const Applies ps = only_for("/distributed/sync", d.sync, {"ps"});
  v.field("period", d.period, steps_from(1), local_sgd);
  v.field("start", d.start, steps_from(0), local_sgd);
  v.field("servers", d.servers, both(at_least(int64_t{1}), at_most(kMaxDimension, "2^31 - 1")), ps);
  v.field("staleness", d.staleness, steps_from(0), ps);
  v.field("zero", d.zero, between(0, 1));
  v.field("bucket_mb", d.bucket_mb, both(greater_than(0.0), at_most(1048576.0, "1 TiB")));
  v.field("overlap", d.overlap, no_check);
  v.section("compression", d.compression);
  v.field("check_every", d.check_every, steps_from(0));
  // Whole milliseconds reach the waits: a shorter one would be none (and said as "0s").
  v.field("timeout_s", d.timeout_s, both(at_least(0.001), seconds_limit()));
  v.field("resize", d.resize, one_of({"keep_global_batch", "scale_lr"}));
}

template <class Visitor>
void visit_fields(Visitor& v, CheckpointSpec& c) {
  v.field("every", c.every, steps_from(0));
  v.field("keep", c.keep, at_least(int64_t{1}));
}

template <class Visitor>
void visit_fields(Visitor& v, EvalSpec& e) {
  v.field("every", e.every, steps_from(0));
  v.field("max_samples", e.max_samples, at_least(int64_t{0}));
}

template <class Visitor>
void visit_fields(Visitor& v, LogSpec& l) {
  v.field("every", l.every, steps_from(1));
}

template <class Visitor>
void visit_fields(Visitor& v, FaultToleranceSpec& f) {
  v.field(
      "max_restarts", f.max_restarts,
      both(at_least(int64_t{0}), at_most(int64_t{std::numeric_limits<int>::max()}, "2^31 - 1")));
  v.field("restart_backoff_s", f.restart_backoff_s, both(at_least(0.0), seconds_limit()));
  v.field("hang_timeout_s", f.hang_timeout_s, both(at_least(0.0), seconds_limit()));
  v.field("rejoin_timeout_s", f.rejoin_timeout_s, both(at_least(0.0), seconds_limit()));
}

template <class Visitor>
void visit_fields(Visitor& v, Recipe& r) {
  v.field("name", r.name, valid_name);
  v.field("seed", r.seed, no_check);
  v.section("model", r.model);
  v.section("data", r.data);
  v.section("train", r.train);
  v.section("optimizer", r.optimizer);
  v.section("distributed", r.distributed);
  v.section("checkpoint", r.checkpoint);
  v.section("eval", r.eval);
  v.section("log", r.log);
  v.section("fault_tolerance", r.fault_tolerance);
}

// ---- rules that involve more than one field --------------------------------------------------

void check_warmup(const Recipe& r, Problems& problems) {
  const std::string warmup = "/optimizer/schedule/warmup";
  if (problems.at(warmup) || problems.at("/train/steps")) return;
  if (r.optimizer.schedule.warmup > r.train.steps) {
    problems.add(warmup, fmt::format("must be <= /train/steps ({}), got {}", r.train.steps,
                                     r.optimizer.schedule.warmup));
  }
}

// A micro-batch times the micro-batches of a step, per rank: bounded so that the global batch
// (that times the world size) cannot overflow.
void check_batch(const Recipe& r, Problems& problems) {
  if (problems.at("/train/batch_per_rank") || problems.at("/train/grad_accum")) return;
  const int64_t per_rank = r.train.batch_per_rank * r.train.grad_accum;  // < 2^44: no overflow
  if (per_rank > kMaxSamplesPerRankStep) {
    problems.add(
        "/train/grad_accum",
        fmt::format("/train/batch_per_rank x /train/grad_accum must be <= {} (2^31 "
                    "samples per rank and step), got {} x {} = {}",
                    kMaxSamplesPerRankStep, r.train.batch_per_rank, r.train.grad_accum, per_rank));
  }
}

// 16-bit compute and NCCL need the GPU: the CPU op table computes in f32, Gloo moves host memory.
void check_device(const Recipe& r, Problems& problems) {
  if (problems.at("/train/device")) return;
  if (r.train.device == "cuda") {
    // The GPU attention kernels are compiled for these head sizes.
    const bool shapes_ok = !problems.at("/model/width") && !problems.at("/model/heads");
    if (r.model.type == "gpt" && shapes_ok && r.model.width % r.model.heads == 0) {
      const int64_t head = r.model.width / r.model.heads;
      if (head != 32 && head != 64 && head != 128) {
        problems.add("/model/heads",
                     fmt::format("on \"cuda\" the head size (width / heads) must be 32, 64 or "
                                 "128, got {} / {} = {}",
                                 r.model.width, r.model.heads, head));
      }
    }
    return;
  }
  if (!problems.at("/train/precision") && r.train.precision != "fp32") {
    problems.add("/train/precision",
                 fmt::format("\"{}\" needs /train/device \"cuda\" (the CPU computes in fp32)",
                             r.train.precision));
  }
  if (!problems.at("/distributed/backend") && r.distributed.backend == "nccl") {
    problems.add("/distributed/backend", "\"nccl\" needs /train/device \"cuda\"");
  }
}

// ZeRO-1 reduce-scatters f32 gradients and local SGD averages parameters: neither goes with the
// other, nor with a compressed gradient all-reduce.
void check_sync(const Recipe& r, Problems& problems) {
  const DistributedSpec& d = r.distributed;
  if (problems.at("/distributed/sync") || problems.at("/distributed/zero") ||
      problems.at("/distributed/compression/type")) {
    return;
  }
  if (d.zero == 1 && d.sync != "allreduce") {
    problems.add("/distributed/zero", fmt::format("1 needs /distributed/sync \"allreduce\", got "
                                                  "\"{}\"",
                                                  d.sync));
  }
  if (d.sync == "ps") {
    // Workers exchange messages with the servers: host memory through Gloo, in f32, with the
    // loss scale fixed (the servers would have to agree on overflows with every worker).
    if (!problems.at("/distributed/backend") && d.backend == "nccl") {
      problems.add("/distributed/backend",
                   "\"nccl\" cannot carry /distributed/sync \"ps\" "
                   "(its messages go through Gloo)");
    }
    if (!problems.at("/train/precision") && r.train.precision == "fp16") {
      problems.add("/train/precision",
                   "\"fp16\" is not supported with /distributed/sync "
                   "\"ps\" (use \"bf16\")");
    }
  }
  if (is_error_feedback_codec(d.compression.type) && !problems.at("/train/precision") &&
      r.train.precision == "fp16") {
    // A step the loss scaler skips would still leave its residuals in the codecs, and a change
    // of scale would leave them in the old one.
    problems.add("/distributed/compression/type",
                 fmt::format("\"{}\" (error feedback) is not supported with /train/precision "
                             "\"fp16\" (use \"bf16\", or the \"fp16\" or \"bf16\" wire format)",
                             d.compression.type));
  }
  if (d.compression.type != "none" && (d.zero == 1 || d.sync != "allreduce")) {
    // ZeRO-1 sums into shards (or, over Gloo, by the plain all-reduce its shards come from);
    // local SGD averages parameters, and its synchronous start is not worth a codec's state;
    // parameter servers exchange shards, not an all-reduce.
    problems.add(
        "/distributed/compression/type",
        fmt::format("\"{}\" is not supported with {} (compression applies to "
                    "/distributed/sync \"allreduce\" without /distributed/zero only)",
                    d.compression.type,
                    d.zero == 1 ? "/distributed/zero 1" : "/distributed/sync \"" + d.sync + "\""));
  }
}

// Opening the file (not just stat-ing it) catches permission problems before the ranks start.
Verdict unreadable(const std::filesystem::path& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) return "is a directory";
  std::ifstream file(path, std::ios::binary);
  if (!file) return std::strerror(errno);
  return std::nullopt;
}

// What no single field shows: a gpt's shapes, and a model that fits its data.
void check_model(const Recipe& r, Problems& problems) {
  if (problems.at("/model/type") || problems.at("/data/type")) return;
  const bool gpt = r.model.type == "gpt";
  if (gpt != (r.data.type == "tokens")) {
    problems.add(
        "/data/type",
        gpt ? fmt::format("the gpt model trains on \"tokens\" data, got \"{}\"", r.data.type)
            : fmt::format("\"tokens\" data needs the gpt model, got \"{}\"", r.model.type));
  }
  if (gpt && !problems.at("/model/width") && !problems.at("/model/heads") &&
      r.model.width % r.model.heads != 0) {
    problems.add("/model/width", fmt::format("must be a multiple of /model/heads ({}), got {}",
                                             r.model.heads, r.model.width));
  }
}

// Counts that say when they passed 2^64 - 1 instead of wrapping.
class CheckedCount {
 public:
  CheckedCount() = default;
  CheckedCount(int64_t n) : value_(static_cast<uint64_t>(n)) {}  // NOLINT: a size, >= 0

  CheckedCount operator+(CheckedCount other) const {
    CheckedCount sum;
    sum.overflow_ =
        overflow_ || other.overflow_ || __builtin_add_overflow(value_, other.value_, &sum.value_);
    return sum;
  }
  CheckedCount operator*(CheckedCount other) const {
    CheckedCount product;
    product.overflow_ = overflow_ || other.overflow_ ||
                        __builtin_mul_overflow(value_, other.value_, &product.value_);
    return product;
  }
  std::optional<uint64_t> value() const {
    return overflow_ ? std::nullopt : std::optional<uint64_t>(value_);
  }

 private:
  uint64_t value_ = 0;
  bool overflow_ = false;
};

std::string with_commas(uint64_t n) {
  std::string digits = std::to_string(n);
  for (auto i = static_cast<ptrdiff_t>(digits.size()) - 3; i > 0; i -= 3)
    digits.insert(static_cast<size_t>(i), ",");
  return digits;
}

std::string count_text(std::optional<uint64_t> count) {
  return count ? with_commas(*count)
               : "more than " + with_commas(std::numeric_limits<uint64_t>::max());
}

// The model's parameters, with the field that sets its largest part (where to make it smaller).
struct ModelSize {
  std::optional<uint64_t> parameters;
  std::string pointer;
};

ModelSize model_size(const ModelSpec& m) {
  ModelSize size;
  std::optional<uint64_t> largest_part = 0;
  // Parts are compared by their checked value; one past 2^64 is the largest there can be.
  const auto consider = [&](const CheckedCount& part, std::string pointer) {
    const auto value = part.value();
    if (largest_part && (!value || *value > *largest_part)) {
      largest_part = value;
      size.pointer = std::move(pointer);
    }
  };
  CheckedCount total;
  if (m.type == "gpt") {
    // gpt_layout (core/model/gpt.cpp): token and position embeddings, `layers` blocks (two
    // LayerNorms, qkv and projection, the MLP, with biases) and a final LayerNorm.
    const CheckedCount w = m.width;
    const CheckedCount hidden = CheckedCount(m.mlp_ratio) * w;
    const CheckedCount block =
        CheckedCount(4) * w * w + CheckedCount(2) * hidden * w + CheckedCount(9) * w + hidden;
    const CheckedCount embeddings = CheckedCount(m.vocab) * w;
    const CheckedCount positions = CheckedCount(m.context) * w;
    const CheckedCount blocks = CheckedCount(m.layers) * block;
    total = embeddings + positions + blocks + CheckedCount(2) * w;
    consider(embeddings, "/model/vocab");
    consider(positions, "/model/context");
    consider(blocks, m.layers > m.width ? "/model/layers" : "/model/width");
  } else {
    // A Linear layer (weights and bias) between each two widths: input, hidden..., classes.
    std::vector<std::pair<int64_t, std::string>> widths = {{m.input, "/model/input"}};
    for (size_t i = 0; i < m.hidden.size(); ++i)
      widths.emplace_back(m.hidden[i], "/model/hidden/" + std::to_string(i));
    widths.emplace_back(m.classes, "/model/classes");
    for (size_t i = 0; i + 1 < widths.size(); ++i) {
      const auto& [in, in_pointer] = widths[i];
      const auto& [out, out_pointer] = widths[i + 1];
      const CheckedCount layer = CheckedCount(in) * CheckedCount(out) + CheckedCount(out);
      total = total + layer;
      consider(layer, in >= out ? in_pointer : out_pointer);
    }
  }
  size.parameters = total.value();
  return size;
}

// What no single field shows: the parameter count of sizes that are each in range. It must fit
// the flat buffers (and memory) with room to spare.
void check_model_size(const Recipe& r, Problems& problems) {
  if (problems.at("/model/type")) return;
  for (const char* field : {"input", "hidden", "classes", "vocab", "context", "layers", "heads",
                            "width", "mlp_ratio"}) {
    // A bad size (or one of the array's) is reported on its own.
    const std::string pointer = std::string("/model/") + field;
    if (problems.at(pointer)) return;
  }
  for (size_t i = 0; i < r.model.hidden.size(); ++i) {
    if (problems.at("/model/hidden/" + std::to_string(i))) return;
  }
  if (r.model.type == "gpt" && r.model.mlp_ratio * r.model.width > kMaxDimension) {
    problems.add("/model/mlp_ratio",
                 fmt::format("the MLP's width, /model/mlp_ratio x /model/width = {} x {} = {}, "
                             "must be <= {} (2^31 - 1)",
                             r.model.mlp_ratio, r.model.width, r.model.mlp_ratio * r.model.width,
                             kMaxDimension));
    return;
  }
  const ModelSize size = model_size(r.model);
  if (size.parameters && *size.parameters <= kMaxParameters) return;
  problems.add(size.pointer,
               fmt::format("the {} would have {} parameters, more than the {} (2^40) allowed",
                           r.model.type, count_text(size.parameters), with_commas(kMaxParameters)));
}

// Synthetic data is generated in memory: data.samples x model.input floats.
void check_synthetic_size(const Recipe& r, Problems& problems) {
  if (r.data.type != "synthetic-classification" || r.model.type != "mlp" ||
      problems.at("/data/samples") || problems.at("/model/input")) {
    return;
  }
  const auto values = (CheckedCount(r.data.samples) * CheckedCount(r.model.input)).value();
  if (values && *values <= kMaxSyntheticValues) return;
  problems.add("/data/samples",
               fmt::format("/data/samples x /model/input = {} x {} = {} values, more than the {} "
                           "(2^40) synthetic data may hold",
                           r.data.samples, r.model.input, count_text(values),
                           with_commas(kMaxSyntheticValues)));
}

// The split of `samples` (the data's, `whose` says what they are): a held-out share that leaves
// no training sample, or fewer training samples than one rank's batch, is found here as the
// launch would find it.
void check_split(const Recipe& r, int64_t samples, const std::string& whose, Problems& problems) {
  if (problems.at("/data/eval_fraction") || problems.at("/train/batch_per_rank") ||
      problems.at("/train/grad_accum")) {
    return;
  }
  int64_t training = 0;
  try {
    training = samples - eval_split_size(samples, r.data.eval_fraction);
  } catch (const Error& e) {
    const std::string what = e.what();
    problems.add("/data/eval_fraction", what.substr(what.find(": ") + 2));
    return;
  }
  const auto per_rank = CheckedCount(r.train.batch_per_rank) * CheckedCount(r.train.grad_accum);
  if (const auto batch = per_rank.value(); !batch || static_cast<uint64_t>(training) < *batch) {
    problems.add("/train/batch_per_rank",
                 fmt::format("{} training samples ({} less the /data/eval_fraction share) are "
                             "fewer than one rank's batch ({} x {} train.grad_accum), even on one "
                             "rank",
                             training, whose, r.train.batch_per_rank, r.train.grad_accum));
  }
}

// Synthetic data's split is the recipe's alone.
void check_synthetic_split(const Recipe& r, Problems& problems) {
  if (r.data.type != "synthetic-classification" || problems.at("/data/samples")) return;
  check_split(r, r.data.samples, "/data/samples", problems);
}

// The CSV file's first data row against model.input: the row is the label and then the features.
// Only that row is read (a file can be large) unless `check` asks for every row, which is then
// checked by the code a launch loads it with (csv_problems), the labels' range too.
void check_csv_rows(const Recipe& r, DataCheck check, Problems& problems) {
  if (check == DataCheck::none || r.data.type != "csv" || r.model.type != "mlp" ||
      problems.at("/data/type") || problems.at("/data/path") || problems.at("/data/header") ||
      problems.at("/model/input")) {
    return;
  }
  std::optional<CsvRow> row;
  std::string empty_note;
  try {
    row = csv_first_row(r.data.path, r.data.header, &empty_note);
  } catch (const Error& e) {
    problems.add("/data/path", e.what());
    return;
  }
  if (!row) {
    problems.add("/data/path", fmt::format("\"{}\" has no data rows{}", r.data.path, empty_note));
    return;
  }
  const int64_t features = row->columns - 1;
  if (features != r.model.input) {
    problems.add("/model/input",
                 fmt::format("must match the {} feature column(s) of \"{}\" (line {} has {} "
                             "column(s): the label, then the features), got {}",
                             features, r.data.path, row->line, row->columns, r.model.input));
    return;  // every row would say so
  }
  if (check != DataCheck::every_row || problems.at("/model/classes")) return;
  int64_t data_rows = 0;
  try {
    for (const std::string& problem :
         csv_problems(r.data.path, r.data.header, r.model.input, r.model.classes, &data_rows))
      problems.add("/data/path", problem);
  } catch (const Error& e) {
    problems.add("/data/path", e.what());
  }
  // Every row right: its split, as a launch splits it.
  if (!problems.at("/data/path")) {
    check_split(r, data_rows, fmt::format("the {} data row(s) of \"{}\"", data_rows, r.data.path),
                problems);
  }
}

// A token dataset against the model, as a launch checks it first (check_token_data: its two
// files' headers, vocabulary and token counts; not every token, which a launch then reads),
// where `check` asks for every row (recipe validate) and the dataset's directory is there. A
// recipe is also validated where its dataset is yet to be made (or lives on the training
// hosts only): a missing one is the launch's to refuse.
void check_token_headers(const Recipe& r, DataCheck check, Problems& problems) {
  std::error_code ec;
  if (check != DataCheck::every_row || r.data.type != "tokens" || r.model.type != "gpt" ||
      problems.at("/data/type") || problems.at("/data/path") || problems.at("/model/vocab") ||
      problems.at("/model/context") || problems.at("/model/type") ||
      !std::filesystem::exists(r.data.path, ec)) {
    return;
  }
  try {
    check_token_data(r.data, r.model);
  } catch (const Error& e) {
    if (e.kind() != ErrorKind::recipe) throw;
    // "POINTER: what", as the data's errors name their field.
    const std::string what = e.what();
    const size_t colon = what.find(": ");
    if (what.starts_with('/') && colon != std::string::npos) {
      problems.add(what.substr(0, colon), what.substr(colon + 2));
    } else {
      problems.add("/data/path", what);
    }
  }
}

void check_data_path(DataSpec& data, const std::filesystem::path& base_dir, DataCheck check,
                     Problems& problems) {
  const std::string pointer = "/data/path";
  if (problems.at("/data/type") || problems.at(pointer)) return;
  if (data.type != "csv" && data.type != "tokens") {
    if (!data.path.empty()) {
      problems.add(pointer, fmt::format("not allowed when /data/type is \"{}\"", data.type));
    }
    return;
  }
  if (data.path.empty()) {
    problems.add(pointer, fmt::format("required when /data/type is \"{}\"", data.type));
    return;
  }
  // A control character (a NUL would cut the path short) is no part of a path to give.
  if (std::any_of(data.path.begin(), data.path.end(),
                  [](char c) { return static_cast<unsigned char>(c) < 0x20 || c == 0x7f; })) {
    problems.add(pointer,
                 fmt::format("\"{}\": a control character in a path", printable(data.path)));
    return;
  }
  // No shell expands it: "~/data" would be a folder named "~" beside the recipe.
  if (data.path == "~" || data.path.starts_with("~/")) {
    problems.add(pointer, fmt::format("\"{}\": a leading ~ is not expanded; give the path from "
                                      "the recipe's folder, or an absolute one",
                                      data.path));
    return;
  }
  if (check == DataCheck::none) {  // not even a stat: the path may be on a hung mount
    data.path = (base_dir / data.path).lexically_normal().string();
    return;
  }
  const std::filesystem::path resolved = resolved_path(base_dir / data.path);
  data.path = resolved.string();
  // The run's copy of the recipe (JSON, which the ranks read) holds UTF-8 only.
  if (!is_utf8(data.path)) {
    problems.add(pointer,
                 fmt::format("\"{}\" is not UTF-8 (a name in another encoding): a run's copy of "
                             "the recipe cannot hold it; rename it",
                             printable(data.path)));
    return;
  }
  if (data.type == "tokens") return;  // a dataset directory, checked when a run loads it
  if (auto why = unreadable(resolved)) {
    problems.add(pointer, fmt::format("cannot read \"{}\": {}", data.path, *why));
  }
}

// ---- file reading ----------------------------------------------------------------------------

std::string read_recipe_text(const std::filesystem::path& path) {
  // A recipe is a few KiB of JSON; /dev/zero or a log named by mistake would be read until
  // memory ran out.
  constexpr size_t kMaxRecipeBytes = size_t{16} << 20;
  std::string text;
  bool too_long = false;
  // A pipe (a recipe a script writes) is waited for as long as it takes, but a stop ends it.
  if (read_stoppable(path, kMaxRecipeBytes, text, too_long) != 0) {
    throw Error(ErrorKind::recipe,
                fmt::format("{}: cannot read: {}{}", printable(path.string()), std::strerror(errno),
                            path == "-" ? " (for standard input, give /dev/stdin)" : ""));
  }
  if (too_long) {
    throw Error(ErrorKind::recipe,
                fmt::format("{}: more than {} MiB; a recipe is a JSON file of a few KiB (is "
                            "this the recipe?)",
                            printable(path.string()), kMaxRecipeBytes >> 20));
  }
  return text;
}

uint64_t fnv1a_64(std::string_view bytes) {
  uint64_t hash = 14695981039346656037ULL;
  for (unsigned char byte : bytes) {
    hash ^= byte;
    hash *= 1099511628211ULL;
  }
  return hash;
}

}  // namespace

const std::vector<std::string>& Reader::schema_pointers() {
  static const std::vector<std::string> pointers = [] {
    std::vector<std::string> all;
    Problems none;
    Reader walker(nullptr, "", none, RecipeOrigin::stored, &all);
    Recipe defaults;
    visit_fields(walker, defaults);
    return all;
  }();
  return pointers;
}

namespace {

Recipe parse_recipe_under(const json& j, const std::string& source, const std::string& under,
                          const std::filesystem::path& base_dir, RecipeOrigin origin,
                          DataCheck data) {
  Recipe recipe;
  Problems problems;
  if (!j.is_object()) {
    problems.add("", "the recipe must be a JSON object, got " + describe(j));
    throw Error(ErrorKind::recipe, problems.report(source, under));
  }
  Reader root(&j, "", problems, origin);
  visit_fields(root, recipe);
  root.reject_unknown_keys();
  check_warmup(recipe, problems);
  check_batch(recipe, problems);
  check_data_path(recipe.data, base_dir, data, problems);
  check_model(recipe, problems);
  check_model_size(recipe, problems);
  check_synthetic_size(recipe, problems);
  check_synthetic_split(recipe, problems);
  check_csv_rows(recipe, data, problems);
  check_token_headers(recipe, data, problems);
  check_device(recipe, problems);
  check_sync(recipe, problems);
  if (problems.any()) throw Error(ErrorKind::recipe, problems.report(source, under));
  return recipe;
}

}  // namespace

Recipe parse_recipe(const json& j, const std::string& source, const std::filesystem::path& base_dir,
                    RecipeOrigin origin, DataCheck data) {
  return parse_recipe_under(j, source, "", base_dir, origin, data);
}

std::string RecipeSource::place(const std::string& problems) const {
  if (file.empty()) return problems;
  return prefix_lines(problems, [&](std::string_view line) {
    return file + ": " + (line.starts_with("/") ? under : std::string());
  });
}

RecipeSource recorded_recipe_source(const std::filesystem::path& run_dir) {
  return {(run_dir / "run.json").string(), "/recipe"};
}

Recipe parse_recorded_recipe(const json& info, const std::filesystem::path& run_dir,
                             DataCheck data) {
  const auto recorded = info.find("recipe");
  const RecipeSource source = recorded_recipe_source(run_dir);
  return parse_recipe_under(recorded == info.end() ? json() : *recorded, source.file, source.under,
                            run_dir, RecipeOrigin::stored, data);
}

namespace {

// Every field of `copy`, those that do not apply to its kinds too, as written.
json every_field(Recipe copy) {
  Writer writer(true);
  visit_fields(writer, copy);
  return writer.take();
}

// Whether `pointer` names an integer field in `fields` (every_field's): an array's elements past
// those it holds are of its first one's type.
bool integer_field(const json& fields, const std::string& pointer) {
  try {
    const json::json_pointer at(pointer);
    if (fields.contains(at)) return fields.at(at).is_number_integer();
    if (at.empty()) return false;
    const json::json_pointer parent = at.parent_pointer();
    return fields.contains(parent) && fields.at(parent).is_array() && !fields.at(parent).empty() &&
           fields.at(parent).front().is_number_integer();
  } catch (const json::exception&) {
    return false;  // an index past any array's (a pointer no recipe field has)
  }
}

// Whether `pointer` in the document `j` still holds `number`: a key given twice keeps its last
// value, which may be another.
bool holds(const json& j, const std::string& pointer, double number) {
  try {
    const json& value = j.at(json::json_pointer(pointer));
    return value.is_number_float() && value.get<double>() == number;
  } catch (const json::exception&) {
    return false;
  }
}

// Whether a JSON number's text is an integer: every digit from the decimal point on (the point
// moved by the exponent) is 0. "1.5e1" is; "4503599627370495.2" is not, though its double is.
bool integer_text(std::string_view text) {
  if (text.starts_with('-')) text.remove_prefix(1);
  const size_t e = std::min(text.find_first_of("eE"), text.size());
  std::string digits;
  size_t point = std::string_view::npos;
  for (char c : text.substr(0, e)) {
    if (c == '.') {
      point = digits.size();
    } else {
      digits += c;
    }
  }
  if (point == std::string_view::npos) point = digits.size();
  // An exponent beyond any text's length moves the point past every digit, or before them all.
  int64_t exponent = 0;
  if (e < text.size()) {
    std::string_view written = text.substr(e + 1);
    const bool negative = written.starts_with('-');
    if (negative || written.starts_with('+')) written.remove_prefix(1);
    const auto [end, ec] =
        std::from_chars(written.data(), written.data() + written.size(), exponent);
    if (ec == std::errc::result_out_of_range) exponent = std::numeric_limits<int32_t>::max();
    exponent = std::min<int64_t>(exponent, std::numeric_limits<int32_t>::max());
    if (negative) exponent = -exponent;
  }
  const int64_t fraction_from = std::max<int64_t>(0, static_cast<int64_t>(point) + exponent);
  return std::all_of(digits.begin() + std::min<int64_t>(fraction_from, digits.size()), digits.end(),
                     [](char c) { return c == '0'; });
}

// What the recipe's text tells that its document no longer can. JSON allows an object to name a
// key twice and nlohmann keeps the last one: in a recipe that is an edit gone wrong. And a number
// such as 4503599627370495.2 reads as a double that is an integer: for an integer field the
// fraction would be lost in silence. A SAX pass over the text, before the document is built,
// collects "POINTER: duplicate key ..." for each repeat and the pointers of such numbers, and
// stops at nesting no recipe has (its pointers would cost time and memory quadratic in depth).
// A handler of its own, not json::parse's callback: that one's end_object scans the whole
// enclosing array (nlohmann 3.11), so a recipe holding many objects took minutes.
class RecipeText {
 public:
  static constexpr size_t kMaxNesting = 64;

  // A number whose fraction its double lost: where, as written, and as read.
  struct LostFraction {
    std::string pointer;
    std::string text;
    double number;
  };

  explicit RecipeText(std::string source) : source_(std::move(source)) {}

  bool null() { return element_done(); }
  bool boolean(bool) { return element_done(); }
  bool number_integer(json::number_integer_t) { return element_done(); }
  bool number_unsigned(json::number_unsigned_t) { return element_done(); }
  bool number_float(json::number_float_t number, const json::string_t& text) {
    if (std::isfinite(number) && std::floor(number) == number && !integer_text(text))
      lost_fractions_.push_back({child_pointer(), text, number});
    return element_done();
  }
  bool string(json::string_t&) { return element_done(); }
  bool binary(json::binary_t&) { return element_done(); }
  bool start_object(size_t) { return open(false); }
  bool start_array(size_t) { return open(true); }
  bool end_object() { return close(); }
  bool end_array() { return close(); }
  bool key(json::string_t& key) {
    Frame& top = frames_.back();
    top.key = key;
    if (!top.keys.insert(top.key).second) {
      problems_.push_back(printable(fmt::format("{}: duplicate key '{}': the object sets it twice",
                                                pointer_to(top.pointer, top.key), top.key)));
    }
    return true;
  }
  template <typename Exception>
  bool parse_error(size_t, const std::string&, const Exception& e) {
    throw e;  // the caller's json::exception handler names the line and column
  }

  const std::vector<std::string>& duplicates() const { return problems_; }
  const std::vector<LostFraction>& lost_fractions() const { return lost_fractions_; }

 private:
  struct Frame {
    bool array;
    int64_t index;
    std::set<std::string> keys;
    std::string pointer;
    std::string key;
  };
  bool open(bool array) {
    if (frames_.size() >= kMaxNesting) {
      throw Error(ErrorKind::recipe,
                  fmt::format("{}: nested more than {} levels deep (at {}); a recipe is a "
                              "few levels of objects",
                              source_, kMaxNesting, printable_excerpt(child_pointer(), 40)));
    }
    frames_.push_back({array, 0, {}, child_pointer(), {}});
    return true;
  }
  bool close() {
    frames_.pop_back();
    return element_done();
  }
  std::string child_pointer() const {
    if (frames_.empty()) return "";
    const Frame& top = frames_.back();
    return top.array ? top.pointer + "/" + std::to_string(top.index)
                     : pointer_to(top.pointer, top.key);
  }
  bool element_done() {
    if (!frames_.empty() && frames_.back().array) ++frames_.back().index;
    return true;
  }

  std::string source_;
  std::vector<Frame> frames_;
  std::vector<std::string> problems_;
  std::vector<LostFraction> lost_fractions_;
};

// Where a recipe's relative data paths start: its folder, unless it has none of its own (a
// recipe from process substitution, <(...) as /dev/fd/63, or /dev/stdin): then the current
// directory, where the user who wrote the paths stands.
std::filesystem::path recipe_folder(const std::filesystem::path& path) {
  const std::string parent = path.parent_path().lexically_normal().string();
  const bool proc_fd = parent.starts_with("/proc/") && parent.ends_with("/fd") &&
                       std::count(parent.begin(), parent.end(), '/') == 3;
  if (parent == "/dev" || parent == "/dev/fd" || proc_fd) {
    std::error_code ec;
    const std::filesystem::path cwd = std::filesystem::current_path(ec);
    if (!ec) return cwd;
  }
  return path.parent_path();
}

}  // namespace

Recipe load_recipe(const std::filesystem::path& path, DataCheck data) {
  std::string text = read_recipe_text(path);
  json j;
  const std::string source = printable(path.string());
  RecipeText checked(source);
  try {
    refuse_nul_byte(text);
    json::sax_parse(text, &checked);
    j = json::parse(text);
  } catch (const json::exception& e) {
    throw Error(ErrorKind::recipe, json_parse_problem(source, text, e));
  }
  // Every problem at once, as for any recipe: the repeats (as many as Problems::report lists,
  // then how many more), then what the fields (each with its last value) have wrong.
  std::string report;
  const auto& repeats = checked.duplicates();
  for (size_t i = 0; i < repeats.size() && i < kMostListed; ++i)
    report += (report.empty() ? "" : "\n") + source + ": " + repeats[i];
  if (repeats.size() > kMostListed) {
    report += fmt::format("\n{}: {} more duplicate key(s), not listed", source,
                          repeats.size() - kMostListed);
  }
  Recipe recipe;
  std::optional<Error> fields_wrong;
  try {
    recipe = parse_recipe(j, source, recipe_folder(path), RecipeOrigin::user, data);
  } catch (const Error& e) {
    if (e.kind() != ErrorKind::recipe) throw;
    fields_wrong = e;
  }
  // A lost fraction matters where the field is an integer (the recipe as read, or where its
  // fields have other problems a default one, says which are), and the value is still the one
  // read (not replaced by a repeat of its key). A field the other problems name is theirs; as
  // many as Problems::report lists, then how many more.
  if (!checked.lost_fractions().empty()) {
    const json fields = every_field(fields_wrong ? Recipe() : recipe);
    const std::string other = fields_wrong ? fields_wrong->what() : std::string();
    size_t lost = 0;
    for (const auto& [pointer, written, number] : checked.lost_fractions()) {
      if (!integer_field(fields, pointer) || !holds(j, pointer, number) ||
          other.find(source + ": " + pointer + ": ") != std::string::npos) {
        continue;
      }
      if (++lost > kMostListed) continue;
      report += (report.empty() ? "" : "\n") +
                printable(fmt::format("{}: {}: expected an integer, got {} (a fraction that would "
                                      "be lost: it reads as {:.0f})",
                                      source, pointer, written, number));
    }
    if (lost > kMostListed) {
      report += fmt::format("\n{}: {} more integer(s) with a lost fraction, not listed", source,
                            lost - kMostListed);
    }
  }
  if (fields_wrong) {
    if (report.empty()) throw *fields_wrong;
    throw Error(ErrorKind::recipe, report + "\n" + fields_wrong->what());
  }
  if (!report.empty()) throw Error(ErrorKind::recipe, report);
  return recipe;
}

json to_json(const Recipe& r) {
  // The visitors take mutable specs so one schema serves reading and writing; a copy keeps r
  // intact.
  Recipe copy = r;
  Writer writer(false);
  visit_fields(writer, copy);
  return writer.take();
}

namespace {

// Over every field, those that do not apply too: checkpoints written before to_json left those
// out keep their hash. json objects keep keys sorted, so dump() is a canonical form independent
// of the input order.
std::string hash_of_fields(Recipe copy) {
  return fmt::format("{:016x}", fnv1a_64(every_field(std::move(copy)).dump()));
}

}  // namespace

std::string recipe_hash(const Recipe& r) {
  Recipe copy = r;
  copy.data.path.clear();
  return hash_of_fields(std::move(copy));
}

std::string recipe_mismatch(const Recipe& r, const std::string& recorded) {
  const std::string hash = recipe_hash(r);
  // Checkpoints of earlier builds hashed data.path too.
  if (recorded == hash || (!r.data.path.empty() && recorded == hash_of_fields(r))) return {};
  return fmt::format("written by a different recipe (hash {}, this run's {})",
                     recorded.empty() ? "none" : recorded, hash);
}

std::function<std::string(const TrainingPosition&)> written_by(const Recipe& r) {
  return [r](const TrainingPosition& p) { return recipe_mismatch(r, p.recipe_hash); };
}

std::optional<uint64_t> parameter_count(const ModelSpec& model) {
  return model_size(model).parameters;
}

bool is_error_feedback_codec(const std::string& type) {
  return type == "int8" || type == "topk" || type == "powersgd";
}

int server_ranks(const Recipe& r) {
  return r.distributed.sync == "ps" ? static_cast<int>(r.distributed.servers) : 0;
}

void check_has_workers(const Recipe& r, int world_size) {
  if (server_ranks(r) >= world_size) {
    throw Error(ErrorKind::recipe,
                fmt::format("/distributed/servers: {} parameter server(s) leave no worker among "
                            "{} rank(s); the servers are the last ranks, the workers the others",
                            r.distributed.servers, world_size));
  }
}

}  // namespace dptrain
