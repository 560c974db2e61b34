// Classification datasets held in memory (synthetic clusters, CSV files) and their train/eval
// split.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "core/recipe.hpp"

namespace dptrain {

class Dataset {
 public:
  virtual ~Dataset() = default;
  virtual int64_t size() const = 0;
  virtual int64_t features() const = 0;
  virtual int64_t classes() const = 0;
  // Labels per sample: 1 for classification; a token dataset's samples are windows of
  // context + 1 tokens (features() is 0 and x unused: the model reads inputs and next-token
  // targets from the window).
  virtual int64_t labels_per_sample() const { return 1; }
  // Copies the rows at indices, in the given order, to x [indices.size(), features] and y
  // [indices.size(), labels_per_sample]. An index outside [0, size) is Error(internal).
  virtual void gather(std::span<const int64_t> indices, float* x, int32_t* y) const = 0;
};

struct DataSplits {
  std::shared_ptr<const Dataset> train, eval;
  // What the data holds, for a resume to find that it changed: the token files' checksums
  // ("train.bin 0123456789abcdef val.bin ..."), or a checksum of a table's values ("values ...").
  std::string fingerprint;
};

// Every sample of a source, before the split: features in one row-major vector.
struct SampleTable {
  int64_t features = 0;
  int64_t classes = 0;
  std::vector<float> x;    // [size, features]
  std::vector<int32_t> y;  // [size]
  int64_t size() const { return static_cast<int64_t>(y.size()); }
};

// Error(recipe) when `now` (this data's DataSplits::fingerprint) is not `recorded` (a checkpoint's,
// at `checkpoint`; empty in older ones: no check): the checkpoint was written while training on
// other data, and `consequence` ends the message: what going on would mean, and what to do.
void require_same_data(const std::filesystem::path& checkpoint, const std::string& recorded,
                       const std::string& now, const DataSpec& data,
                       const std::string& consequence);

// Loads the data the spec names, for a model with model.input features and model.classes classes,
// and splits it. Errors are Error(recipe) naming the file and line (csv) or the field.
DataSplits load_data(const DataSpec& data, const ModelSpec& model, uint64_t seed);
// Size of the training split, validating the data on the way: synthetic data is not generated,
// a CSV file is read whole (every row checked).
int64_t training_samples(const DataSpec& data, const ModelSpec& model, uint64_t seed);
// How many of `size` samples the held-out split gets; Error(recipe) if none are left to train.
int64_t eval_split_size(int64_t size, double eval_fraction);

// data.samples points around one centre per class: centre + data.noise * N(0, 1) per feature. The
// centres are spread so that the task is learnable but not trivial at noise 1.
SampleTable make_synthetic_samples(const DataSpec& data, const ModelSpec& model, uint64_t seed);

// Rows "label,feature,...". header: "yes" | "no" | "auto" (a first row with anything
// non-numeric is a header). Error(recipe) listing what csv_problems finds, one line each.
SampleTable read_csv_samples(const std::filesystem::path& path, const std::string& header,
                             int64_t features, int64_t classes);

// The problems read_csv_samples refuses a file for, found the same way without keeping its rows:
// one line per wrong row, "PATH:LINE: what" naming the row's first wrong field (a label that is
// not a number, not an integer, or outside [0, classes); a feature that is not a finite number;
// a row of another column count), the first kMostCsvProblems of them, then
// "PATH: N more row(s) with a problem, not listed"; or "PATH: no data rows". Empty when every row
// is right; Error(recipe) naming the file when it cannot be read. `data_rows`, when given, gets
// how many data rows the file has.
inline constexpr size_t kMostCsvProblems = 20;
inline constexpr std::string_view kUnlistedCsvProblems = " more row(s) with a problem, not listed";
std::vector<std::string> csv_problems(const std::filesystem::path& path, const std::string& header,
                                      int64_t features, int64_t classes,
                                      int64_t* data_rows = nullptr);

// The first data row of a CSV file as read_csv_samples sees it (blank lines and, as `header`
// says, a header row skipped): its column count (the label and the features) and 1-based line.
// Nothing when the file has no data rows; Error(recipe) naming the file when it cannot be read.
// Reads only up to that row, so recipe validation can compare the columns with model.input
// cheaply.
struct CsvRow {
  int64_t columns = 0;
  int64_t line = 0;
};
// Where there is none, `empty_note` (when given) says what was skipped as a header row, as the
// "no data rows" problem does: "" or " (after the header row)" or, for header auto, why its one
// row was taken for a header.
std::optional<CsvRow> csv_first_row(const std::filesystem::path& path, const std::string& header,
                                    std::string* empty_note = nullptr);

// A seeded shuffle of the table's rows: the last round(size * eval_fraction) are the eval split,
// the rest the train split. Both share the table; nothing is copied.
DataSplits split_samples(std::shared_ptr<const SampleTable> samples, double eval_fraction,
                         uint64_t seed);

}  // namespace dptrain
