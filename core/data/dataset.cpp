// Classification datasets held in memory (synthetic clusters, CSV files) and their train/eval
// split.
#include "core/data/dataset.hpp"

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <string_view>
#include <type_traits>

#include <fmt/format.h>

#include "core/checksum.hpp"
#include "core/data/tokens.hpp"
#include "core/error.hpp"
#include "core/tensor/random.hpp"

namespace dptrain {
namespace {

constexpr uint64_t kSyntheticStream = 0xda7a;  // derive_seed streams of the data
constexpr uint64_t kSplitStream = 0x5b11;
// Distance scale of the class centres, in units of the noise, independent of the feature count:
// two centres are about kCentreSpread * sqrt(2) apart, so at noise 1 the nearest-centre error
// against one other class is about 0.7% and ten classes are ~95% separable by the best classifier.
constexpr double kCentreSpread = 3.5;

// A split of a shared table: row i of the split is row rows[i] of the table.
class TableDataset final : public Dataset {
 public:
  TableDataset(std::shared_ptr<const SampleTable> table, std::vector<int64_t> rows)
      : table_(std::move(table)), rows_(std::move(rows)) {}

  int64_t size() const override { return static_cast<int64_t>(rows_.size()); }
  int64_t features() const override { return table_->features; }
  int64_t classes() const override { return table_->classes; }

  void gather(std::span<const int64_t> indices, float* x, int32_t* y) const override {
    const auto width = static_cast<size_t>(table_->features);
    for (size_t i = 0; i < indices.size(); ++i) {
      const int64_t index = indices[i];
      if (index < 0 || index >= size()) {
        throw Error(ErrorKind::internal, "dataset gather: index " + std::to_string(index) +
                                             " outside [0, " + std::to_string(size()) + ")");
      }
      const auto row = static_cast<size_t>(rows_[static_cast<size_t>(index)]);
      std::memcpy(x + i * width, table_->x.data() + row * width, width * sizeof(float));
      y[i] = table_->y[row];
    }
  }

 private:
  std::shared_ptr<const SampleTable> table_;
  std::vector<int64_t> rows_;
};

void require_at_least(const char* field, int64_t value, int64_t minimum) {
  if (value < minimum) {
    throw Error(ErrorKind::recipe, std::string(field) + ": must be at least " +
                                       std::to_string(minimum) + ", got " + std::to_string(value));
  }
}

// ---- csv ----

std::string_view trim(std::string_view s) {
  const auto blank = [](char c) { return c == ' ' || c == '\t' || c == '\r'; };
  while (!s.empty() && blank(s.front()))
    s.remove_prefix(1);
  while (!s.empty() && blank(s.back()))
    s.remove_suffix(1);
  return s;
}

void split_fields(std::string_view line, std::vector<std::string_view>& fields) {
  fields.clear();
  for (;;) {
    const size_t comma = line.find(',');
    std::string_view field = trim(line.substr(0, comma));
    // A quoted field ("1.5", as a writer that quotes every field writes): its value inside.
    if (field.size() >= 2 && field.front() == '"' && field.back() == '"') {
      field = trim(field.substr(1, field.size() - 2));
    }
    fields.push_back(field);
    if (comma == std::string_view::npos) return;
    line.remove_prefix(comma + 1);
  }
}

template <typename T>
bool parse_number(std::string_view s, T& value) {
  if (!s.empty() && s.front() == '+') s.remove_prefix(1);  // from_chars rejects a leading '+'
  const char* last = s.data() + s.size();
  const auto [end, ec] = std::from_chars(s.data(), last, value);
  if constexpr (std::is_floating_point_v<T>) {
    // Nearer zero than T holds (1e-400): read as strtod reads it, zero or the nearest subnormal,
    // as numpy and pandas do. One beyond T's largest stays refused.
    if (ec == std::errc::result_out_of_range && end == last) {
      const long double wide = std::strtold(std::string(s).c_str(), nullptr);
      if (std::fabs(wide) < 1) {
        value = static_cast<T>(wide);
        return true;
      }
    }
  }
  return ec == std::errc() && end == last && !s.empty() && std::isfinite(value);
}

// Whether a first row is data rather than a header: every field reads as a number. A NaN or an
// infinity reads as one too: a data row that holds one is refused with its line, as on any other
// row, not dropped as a header without a word.
bool all_numeric(const std::vector<std::string_view>& fields) {
  return std::all_of(fields.begin(), fields.end(), [](std::string_view f) {
    if (!f.empty() && f.front() == '+') f.remove_prefix(1);
    double ignored = 0;
    const char* last = f.data() + f.size();
    const auto [end, ec] = std::from_chars(f.data(), last, ignored);
    return !f.empty() && end == last && (ec == std::errc() || ec == std::errc::result_out_of_range);
  });
}

bool parse_header_setting(const std::string& header, bool& auto_detect) {
  auto_detect = header == "auto";
  if (header == "auto" || header == "no") return false;
  if (header == "yes") return true;
  throw Error(ErrorKind::recipe, "data.header: must be auto, yes or no, got '" + header + "'");
}

// The data rows of a CSV file, split into trimmed fields: blank lines and (as `header` says) a
// header row skipped. Shared by read_csv_samples and csv_first_row, so validation and training
// see the same rows.
class CsvRows {
 public:
  CsvRows(const std::filesystem::path& path, const std::string& header)
      : path_(path), skip_first_(parse_header_setting(header, auto_detect_)), in_(path) {
    if (!in_) {
      throw Error(ErrorKind::recipe, path.string() + ": cannot open: " + std::strerror(errno));
    }
  }

  // The next data row's fields and 1-based line number; false at the end of the file.
  bool next(std::vector<std::string_view>& fields, int64_t& line_number) {
    while (std::getline(in_, line_)) {
      ++line_number_;
      // A byte order mark (what spreadsheets write) is not part of the first field: read as one,
      // it made a first data row look like a header, dropped without a word.
      if (line_number_ == 1 && line_.starts_with("\xEF\xBB\xBF")) line_.erase(0, 3);
      // UTF-16 text (a spreadsheet's "Unicode text" export): every other byte a NUL, which read
      // as UTF-8 made every field "not a number". Named, with the way to convert it.
      if (line_number_ == 1) {
        const bool mark = line_.starts_with("\xFF\xFE") || line_.starts_with("\xFE\xFF");
        if (mark || (line_.size() >= 2 && (line_[0] == '\0') != (line_[1] == '\0'))) {
          throw Error(ErrorKind::recipe,
                      fmt::format("{}:1: UTF-16 text ({}): a CSV file is read as UTF-8 (or "
                                  "ASCII); convert it, e.g. with iconv -f UTF-16 -t UTF-8",
                                  path_.string(),
                                  mark ? "its byte order mark says so"
                                       : "every other byte of its first line is a NUL"));
        }
      }
      const std::string_view content = trim(line_);
      if (content.empty()) continue;
      // A carriage return inside a line: the file's lines end in CR alone (classic Mac OS), and
      // it reads as one line; named, not "no data rows" or a field that is not a number.
      if (content.find('\r') != std::string_view::npos) {
        throw Error(ErrorKind::recipe,
                    fmt::format("{}:{}: a carriage return inside the line: its lines end in CR "
                                "alone (classic Mac OS); convert them to LF or CRLF, e.g. with "
                                "tr '\\r' '\\n'",
                                path_.string(), line_number_));
      }
      split_fields(line_, fields);
      if (first_row_) {
        first_row_ = false;
        if (skip_first_ || (auto_detect_ && !all_numeric(fields))) {
          header_line_ = line_number_;
          continue;
        }
      }
      line_number = line_number_;
      return true;
    }
    if (in_.bad()) {
      throw Error(ErrorKind::recipe, path_.string() + ": read failed: " + std::strerror(errno));
    }
    return false;
  }

  // Where no data row came: what was skipped as the header, if a row was (" (after the header
  // row)"; for data.header auto, that it was taken for one and why), else "".
  std::string empty_note() const {
    if (header_line_ == 0) return {};
    if (!auto_detect_) return " (after the header row)";
    return fmt::format(
        " (its one row, line {}, was taken for a header row: not every field is a number; with "
        "data.header \"no\" it is read as data)",
        header_line_);
  }

 private:
  std::filesystem::path path_;
  bool auto_detect_ = false;
  bool skip_first_;
  std::ifstream in_;
  std::string line_;  // the fields point into it until the next call
  int64_t line_number_ = 0;
  int64_t header_line_ = 0;  // the line skipped as the header row, 0 for none
  bool first_row_ = true;
};

// Checks data rows for a model of `features` inputs and `classes` classes and appends the right
// ones to a table. Shared by read_csv_samples and csv_problems: what a launch refuses is what
// `recipe validate` reports.
class CsvRowParser {
 public:
  CsvRowParser(int64_t features, int64_t classes) : features_(features), classes_(classes) {}

  // What is wrong with the row (its first wrong field), or nothing; a right row is appended to
  // `table` when there is one.
  std::optional<std::string> take(const std::vector<std::string_view>& fields, SampleTable* table) {
    const auto columns = static_cast<int64_t>(fields.size());
    if (columns != features_ + 1) {
      return std::to_string(columns - 1) + " features, but model.input is " +
             std::to_string(features_) + " (expected the label then the features)";
    }
    int32_t label = 0;
    if (auto problem = parse_label(fields[0], label)) return problem;
    row_.resize(static_cast<size_t>(features_));
    for (int64_t c = 1; c < columns; ++c) {
      const std::string_view field = fields[static_cast<size_t>(c)];
      if (!parse_number(field, row_[static_cast<size_t>(c - 1)])) {
        return "column " + std::to_string(c + 1) + " '" + printable_excerpt(field) +
               "' is not a finite number";
      }
    }
    if (table != nullptr) {
      table->y.push_back(label);
      table->x.insert(table->x.end(), row_.begin(), row_.end());
    }
    return std::nullopt;
  }

 private:
  std::optional<std::string> parse_label(std::string_view field, int32_t& out) const {
    double label = 0;
    if (!parse_number(field, label))
      return "label '" + printable_excerpt(field) + "' is not a number";
    if (label != std::floor(label)) {
      return "label '" + printable_excerpt(field) + "' is not an integer";
    }
    if (label < 0 || label >= static_cast<double>(classes_)) {
      return "label " + printable_excerpt(field) + " is outside [0, " + std::to_string(classes_) +
             ") (model.classes is " + std::to_string(classes_) + ")";
    }
    out = static_cast<int32_t>(label);
    return std::nullopt;
  }

  int64_t features_;
  int64_t classes_;
  std::vector<float> row_;  // the features of the row being checked
};

// Every data row of a CSV file through CsvRowParser, the right ones into `table` (when not null);
// returns the problems as csv_problems words them.
std::vector<std::string> scan_csv(const std::filesystem::path& path, const std::string& header,
                                  int64_t features, int64_t classes, SampleTable* table,
                                  int64_t* data_rows = nullptr) {
  CsvRows rows(path, header);
  CsvRowParser parser(features, classes);
  std::vector<std::string> problems;
  int64_t rows_read = 0;
  int64_t unlisted = 0;
  std::vector<std::string_view> fields;
  for (int64_t number = 0; rows.next(fields, number); ++rows_read) {
    const auto problem = parser.take(fields, table);
    if (!problem) continue;
    if (problems.size() < kMostCsvProblems) {
      problems.push_back(path.string() + ":" + std::to_string(number) + ": " + *problem);
    } else {
      ++unlisted;
    }
  }
  if (unlisted > 0) {
    problems.push_back(path.string() + ": " + std::to_string(unlisted) +
                       std::string(kUnlistedCsvProblems));
  }
  if (rows_read == 0) problems.push_back(path.string() + ": no data rows" + rows.empty_note());
  if (data_rows != nullptr) *data_rows = rows_read;
  return problems;
}

}  // namespace

SampleTable make_synthetic_samples(const DataSpec& data, const ModelSpec& model, uint64_t seed) {
  require_at_least("data.samples", data.samples, 1);
  require_at_least("model.input", model.input, 1);
  require_at_least("model.classes", model.classes, 2);
  if (!(data.noise >= 0) || !std::isfinite(data.noise)) {
    throw Error(ErrorKind::recipe, "data.noise: must be a finite number >= 0");
  }
  const auto features = static_cast<size_t>(model.input);
  const auto classes = static_cast<size_t>(model.classes);
  // The recipe bounds samples x input far below this; a caller that skipped it must not get a
  // wrapped size (a short table written past its end).
  const size_t most_rows = std::numeric_limits<size_t>::max() / sizeof(float) / features;
  if (static_cast<size_t>(data.samples) > most_rows || classes > most_rows) {
    throw Error(ErrorKind::recipe, "data.samples: " + std::to_string(data.samples) +
                                       " samples of " + std::to_string(model.input) +
                                       " features do not fit in memory");
  }
  std::mt19937_64 rng(derive_seed(seed, kSyntheticStream));

  std::vector<float> centres(classes * features);
  fill_standard_normal(rng, centres);
  const auto centre_scale =
      static_cast<float>(kCentreSpread / std::sqrt(static_cast<double>(features)));
  for (float& c : centres)
    c *= centre_scale;

  SampleTable table;
  table.features = model.input;
  table.classes = model.classes;
  const auto samples = static_cast<size_t>(data.samples);
  table.x.resize(samples * features);
  table.y.resize(samples);
  const auto noise_scale = static_cast<float>(data.noise);
  std::vector<float> noise(features);
  for (size_t i = 0; i < samples; ++i) {
    const auto label = static_cast<size_t>(uniform_below(rng, classes));
    table.y[i] = static_cast<int32_t>(label);
    fill_standard_normal(rng, noise);
    const float* centre = centres.data() + label * features;
    float* x = table.x.data() + i * features;
    for (size_t f = 0; f < features; ++f)
      x[f] = centre[f] + noise_scale * noise[f];
  }
  return table;
}

SampleTable read_csv_samples(const std::filesystem::path& path, const std::string& header,
                             int64_t features, int64_t classes) {
  SampleTable table;
  table.features = features;
  table.classes = classes;
  const std::vector<std::string> problems = scan_csv(path, header, features, classes, &table);
  if (!problems.empty()) {
    std::string report;
    for (const std::string& problem : problems)
      report += (report.empty() ? "" : "\n") + problem;
    throw Error(ErrorKind::recipe, report);
  }
  return table;
}

std::vector<std::string> csv_problems(const std::filesystem::path& path, const std::string& header,
                                      int64_t features, int64_t classes, int64_t* data_rows) {
  return scan_csv(path, header, features, classes, nullptr, data_rows);
}

std::optional<CsvRow> csv_first_row(const std::filesystem::path& path, const std::string& header,
                                    std::string* empty_note) {
  CsvRows rows(path, header);
  std::vector<std::string_view> fields;
  int64_t number = 0;
  if (!rows.next(fields, number)) {
    if (empty_note != nullptr) *empty_note = rows.empty_note();
    return std::nullopt;
  }
  return CsvRow{static_cast<int64_t>(fields.size()), number};
}

int64_t eval_split_size(int64_t size, double eval_fraction) {
  if (!(eval_fraction >= 0.0 && eval_fraction < 1.0)) {
    throw Error(ErrorKind::recipe,
                fmt::format("/data/eval_fraction: must be in [0, 1), got {:g}", eval_fraction));
  }
  const auto eval_size =
      static_cast<int64_t>(std::llround(static_cast<double>(size) * eval_fraction));
  if (eval_size >= size) {
    throw Error(ErrorKind::recipe,
                fmt::format("/data/eval_fraction: {:g} of {} samples leaves none for training",
                            eval_fraction, size));
  }
  return eval_size;
}

DataSplits split_samples(std::shared_ptr<const SampleTable> samples, double eval_fraction,
                         uint64_t seed) {
  const int64_t size = samples->size();
  const int64_t eval_size = eval_split_size(size, eval_fraction);
  std::vector<int64_t> order(static_cast<size_t>(size));
  std::iota(order.begin(), order.end(), int64_t{0});
  std::mt19937_64 rng(derive_seed(seed, kSplitStream));
  shuffle(rng, std::span<int64_t>(order));
  const auto train_end = order.begin() + (size - eval_size);
  const uint64_t values =
      checksum64(samples->y.data(), samples->y.size() * sizeof(int32_t),
                 checksum64(samples->x.data(), samples->x.size() * sizeof(float)));
  return {std::make_shared<TableDataset>(samples, std::vector<int64_t>(order.begin(), train_end)),
          std::make_shared<TableDataset>(samples, std::vector<int64_t>(train_end, order.end())),
          "values " + checksum_hex(values)};
}

int64_t training_samples(const DataSpec& data, const ModelSpec& model, uint64_t seed) {
  if (data.type == "tokens") return token_training_samples(data, model);
  if (data.type == "synthetic-classification") {
    return data.samples - eval_split_size(data.samples, data.eval_fraction);
  }
  return load_data(data, model, seed).train->size();
}

void require_same_data(const std::filesystem::path& checkpoint, const std::string& recorded,
                       const std::string& now, const DataSpec& data,
                       const std::string& consequence) {
  if (recorded.empty() || recorded == now) return;
  throw Error(ErrorKind::recipe,
              fmt::format("{}: written while training on other data: {} then, {} now ({}): {}",
                          checkpoint.string(), recorded, now,
                          data.path.empty() ? "data.type " + data.type : "data.path " + data.path,
                          consequence));
}

DataSplits load_data(const DataSpec& data, const ModelSpec& model, uint64_t seed) {
  // Token data is split when it is prepared (train.bin, val.bin), not here: no seed.
  if (data.type == "tokens") return load_token_data(data, model);
  if (data.type == "synthetic-classification") {
    DataSplits splits =
        split_samples(std::make_shared<SampleTable>(make_synthetic_samples(data, model, seed)),
                      data.eval_fraction, seed);
    // No fingerprint: the recipe (its hash) determines the data, and a build whose floating point
    // rounds otherwise must not read as other data.
    splits.fingerprint.clear();
    return splits;
  }
  if (data.type != "csv") {
    throw Error(ErrorKind::recipe, "data.type: unknown data '" + data.type +
                                       "' (expected synthetic-classification, csv or tokens)");
  }
  if (data.path.empty()) throw Error(ErrorKind::recipe, "data.path: required for csv data");
  require_at_least("model.input", model.input, 1);
  require_at_least("model.classes", model.classes, 2);
  return split_samples(std::make_shared<SampleTable>(
                           read_csv_samples(data.path, data.header, model.input, model.classes)),
                       data.eval_fraction, seed);
}

}  // namespace dptrain
