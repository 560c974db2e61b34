// Tests of the synthetic and CSV datasets and the train/eval split, with real files in a temp dir.
#include "core/data/dataset.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <fstream>
#include <limits>
#include <numeric>
#include <set>

#include "core/data/sampler.hpp"
#include "core/error.hpp"
#include "core/model/model.hpp"
#include "core/optim/optimizer.hpp"
#include "core/tensor/cpu_ops.hpp"
#include "tests/temp_dir.hpp"

namespace dptrain {
namespace {

using test::TempDir;

struct Rows {
  std::vector<float> x;
  std::vector<int32_t> y;
};

Rows all_rows(const Dataset& dataset) {
  std::vector<int64_t> indices(static_cast<size_t>(dataset.size()));
  std::iota(indices.begin(), indices.end(), int64_t{0});
  Rows rows{std::vector<float>(indices.size() * static_cast<size_t>(dataset.features())),
            std::vector<int32_t>(indices.size())};
  dataset.gather(indices, rows.x.data(), rows.y.data());
  return rows;
}

DataSpec synthetic(int64_t samples, double eval_fraction) {
  DataSpec data;
  data.samples = samples;
  data.eval_fraction = eval_fraction;
  return data;
}

ModelSpec model_of(int64_t input, int64_t classes) {
  ModelSpec model;
  model.input = input;
  model.classes = classes;
  model.hidden = {};
  return model;
}

std::string csv_error(const std::string& contents, const std::string& header = "auto") {
  TempDir dir;
  const auto file = dir.write("data.csv", contents);
  try {
    read_csv_samples(file, header, 2, 3);
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::recipe);
    const std::string message = e.what();
    // Drop the temp path, which every file-and-line message starts with.
    return message.starts_with(file.string()) ? message.substr(file.string().size()) : message;
  }
  return "no error";
}

}  // namespace

TEST_CASE("synthetic data is deterministic from the seed, with labels in range") {
  const DataSpec data = synthetic(500, 0.1);
  const ModelSpec model = model_of(12, 4);
  const SampleTable a = make_synthetic_samples(data, model, 7);
  const SampleTable b = make_synthetic_samples(data, model, 7);
  const SampleTable c = make_synthetic_samples(data, model, 8);
  CHECK(a.size() == 500);
  CHECK(a.x.size() == 500 * 12);
  CHECK(a.x == b.x);
  CHECK(a.y == b.y);
  CHECK(a.x != c.x);
  CHECK(std::all_of(a.y.begin(), a.y.end(), [](int32_t y) { return y >= 0 && y < 4; }));
  CHECK(std::set<int32_t>(a.y.begin(), a.y.end()).size() == 4);
}

TEST_CASE("the split is a seeded partition: eval gets round(n * eval_fraction) rows") {
  auto table = std::make_shared<SampleTable>();
  table->features = 1;
  table->classes = 2;
  for (int i = 0; i < 1005; ++i) {  // row i holds the value i, so gathered rows reveal their origin
    table->x.push_back(static_cast<float>(i));
    table->y.push_back(i % 2);
  }
  const DataSplits splits = split_samples(table, 0.1, 3);
  CHECK(splits.eval->size() == 101);  // 100.5 rounds away from zero
  CHECK(splits.train->size() == 904);
  CHECK(splits.train->features() == 1);
  CHECK(splits.train->classes() == 2);

  const Rows train = all_rows(*splits.train);
  const Rows eval = all_rows(*splits.eval);
  std::vector<float> seen = train.x;
  seen.insert(seen.end(), eval.x.begin(), eval.x.end());
  std::vector<float> sorted = seen;
  std::sort(sorted.begin(), sorted.end());
  CHECK(sorted == table->x);  // every row exactly once
  CHECK(seen != table->x);    // and shuffled
  for (size_t i = 0; i < train.y.size(); ++i)
    CHECK(train.y[i] == int32_t(train.x[i]) % 2);

  CHECK(all_rows(*split_samples(table, 0.1, 3).eval).x == eval.x);
  CHECK(all_rows(*split_samples(table, 0.1, 4).eval).x != eval.x);
  CHECK(split_samples(table, 0.0, 3).eval->size() == 0);
  CHECK_THROWS_WITH_AS(split_samples(table, 1.0, 3),
                       doctest::Contains("/data/eval_fraction: must be in [0, 1), got 1"), Error);

  std::vector<float> x(1);
  std::vector<int32_t> y(1);
  const std::vector<int64_t> outside = {904};
  CHECK_THROWS_AS(splits.train->gather(outside, x.data(), y.data()), Error);
}

TEST_CASE("synthetic data is learnable well above chance but not trivially") {
  // A 784-feature MLP trained briefly: > 80% held-out accuracy at noise 1 (chance is 10%).
  Recipe recipe;
  recipe.data.samples = 12000;
  recipe.model.hidden = {64};
  const DataSplits splits = load_data(recipe.data, recipe.model, 1);
  CpuOps cpu_ops;
  auto model = make_model(recipe.model);
  std::vector<float> params(model->num_params()), grads(params.size());
  model->init_params(params, 1);
  auto optimizer = make_optimizer(recipe.optimizer, params.size(), {}, cpu_ops);
  const int64_t batch = 64, steps = 300;
  const DistributedSampler sampler(splits.train->size(), batch, 1);
  std::vector<float> x(static_cast<size_t>(batch * 784));
  std::vector<int32_t> y(static_cast<size_t>(batch));
  for (int64_t step = 0; step < steps; ++step) {
    const auto indices = sampler.indices(step / sampler.steps_per_epoch(),
                                         step % sampler.steps_per_epoch(), 0, batch);
    splits.train->gather(indices, x.data(), y.data());
    std::fill(grads.begin(), grads.end(), 0.0f);
    model->forward_backward(params, Batch{x.data(), y.data(), batch}, grads, 1.0f);
    optimizer->step(params, grads, learning_rate(recipe.optimizer, step, steps));
  }
  const Rows eval = all_rows(*splits.eval);
  const EvalStats stats = model->evaluate(params, Batch{eval.x.data(), eval.y.data(), 1200});
  const double accuracy = double(stats.correct) / double(stats.count);
  CHECK(accuracy > 0.8);
  CHECK(accuracy < 0.995);
}

TEST_CASE("csv: header detection, blank lines, CRLF and whitespace") {
  TempDir dir;
  const auto with_header = dir.write("a.csv", "label,f1,f2\r\n1, 0.5 ,-2\r\n\r\n0,+3,1e-1\r\n");
  const SampleTable a = read_csv_samples(with_header, "auto", 2, 3);
  CHECK(a.y == std::vector<int32_t>{1, 0});
  CHECK(a.x == std::vector<float>{0.5f, -2.0f, 3.0f, 0.1f});

  const auto numeric = dir.write("b.csv", "2,1,1\n1,2,2\n");
  CHECK(read_csv_samples(numeric, "auto", 2, 3).size() == 2);
  CHECK(read_csv_samples(numeric, "no", 2, 3).size() == 2);
  CHECK(read_csv_samples(numeric, "yes", 2, 3).size() == 1);
  CHECK(read_csv_samples(dir.write("c.csv", "2.0,1,1\n"), "no", 2, 3).y[0] == 2);
  // A first data row with a NaN is a data row (refused as one), not a header dropped unsaid.
  CHECK(csv_error("0,1,nan\n1,2,2\n") == ":1: column 3 'nan' is not a finite number");
  CHECK(csv_error("0,inf,1\n1,2,2\n") == ":1: column 2 'inf' is not a finite number");

  // A byte order mark (a spreadsheet's export) is passed over: the first row stays a data row,
  // and a header after it is still one.
  const auto bom = dir.write("d.csv",
                             "\xEF\xBB\xBF"
                             "1,0.5,2\r\n0,1,1\r\n");
  for (const char* header : {"auto", "no"}) {
    CAPTURE(header);
    const SampleTable d = read_csv_samples(bom, header, 2, 3);
    CHECK(d.y == std::vector<int32_t>{1, 0});
  }
  // UTF-16 (a spreadsheet's "Unicode text"): named, not as fields that are not numbers.
  CHECK(csv_error(std::string("\xFF\xFE"
                              "1\0,\0"
                              "2\0\n\0",
                              10)) ==
        ":1: UTF-16 text (its byte order mark says so): a CSV file is read as UTF-8 (or ASCII); "
        "convert it, e.g. with iconv -f UTF-16 -t UTF-8");
  CHECK(csv_error(std::string("1\0,\0"
                              "2\0,\0"
                              "0\0\n\0",
                              12)) ==
        ":1: UTF-16 text (every other byte of its first line is a NUL): a CSV file is read as "
        "UTF-8 (or ASCII); convert it, e.g. with iconv -f UTF-16 -t UTF-8");
  // Quoted fields (a writer that quotes every one): their values, and a quoted header still one.
  const SampleTable quoted = read_csv_samples(
      dir.write("q.csv", "\"label\",\"a\",\"b\"\n\"1\",\" 0.5\",\"2\"\n"), "auto", 2, 3);
  CHECK(quoted.y == std::vector<int32_t>{1});
  CHECK(quoted.x == std::vector<float>{0.5f, 2.0f});
  CHECK(read_csv_samples(dir.write("e.csv",
                                   "\xEF\xBB\xBF"
                                   "label,a,b\n1,0.5,2\n"),
                         "auto", 2, 3)
            .size() == 1);
}

TEST_CASE("csv: every bad row is a recipe error naming the file and line") {
  CHECK(csv_error("1,2,3\n0,1\n") ==
        ":2: 1 features, but model.input is 2 (expected the label "
        "then the features)");
  CHECK(csv_error("1,2,3\n0,1,x\n") == ":2: column 3 'x' is not a finite number");
  CHECK(csv_error("1,2,3\n\n3,1,1\n") == ":3: label 3 is outside [0, 3) (model.classes is 3)");
  CHECK(csv_error("-1,2,3\n") == ":1: label -1 is outside [0, 3) (model.classes is 3)");
  CHECK(csv_error("1.5,2,3\n") == ":1: label '1.5' is not an integer");
  CHECK(csv_error("a,b,c\n1,2,nan\n") == ":2: column 3 'nan' is not a finite number");
  // A NUL or another control byte in a field is shown, not allowed to cut the message short.
  CHECK(csv_error(std::string("1,2,3\n1,1\0,2\n", 13)) ==
        ":2: column 2 '1\\x00' is not a finite number");
  CHECK(csv_error("1,2,3\n1\x1b[31m,1,2\n") == ":2: label '1\\x1b[31m' is not a number");
  // Its one row taken for a header: said, with the setting that reads it as data.
  CHECK(csv_error("a,b,c\n", "auto") ==
        ": no data rows (its one row, line 1, was taken for a header row: not every field is a "
        "number; with data.header \"no\" it is read as data)");
  CHECK(csv_error("\n1,2,3\n", "yes") == ": no data rows (after the header row)");
  CHECK(csv_error("\n\n", "auto") == ": no data rows");
  CHECK(csv_error("a,b,c\n1,2,3\n", "no") == ":1: label 'a' is not a number");
  CHECK(csv_error("1,2,3\n", "maybe").find("data.header") != std::string::npos);
  // Lines ended by CR alone read as one: named as that, not as a header with no rows after it.
  CHECK(csv_error("a,b,c\r1,2,0\r0,1,1\r") ==
        ":1: a carriage return inside the line: its lines end in CR alone (classic Mac OS); "
        "convert them to LF or CRLF, e.g. with tr '\\r' '\\n'");
}

TEST_CASE("csv: a feature nearer zero than a float holds reads as zero; one too large is refused") {
  TempDir dir;
  const auto file = dir.write("tiny.csv", "1,1e-400,-2.5e-4000\n0,3,1e-45\n");
  const auto table = read_csv_samples(file, "no", 2, 3);
  REQUIRE(table.x.size() == 4);
  CHECK(table.x[0] == 0.0f);
  CHECK(table.x[1] == 0.0f);
  CHECK(table.x[2] == 3.0f);
  CHECK(table.x[3] >= 0.0f);
  CHECK(table.x[3] <= std::numeric_limits<float>::denorm_min());
  CHECK(csv_error("1,2,3\n0,1,1e400\n") == ":2: column 3 '1e400' is not a finite number");
  CHECK(csv_error("1,2,3\n0,1,-3e39\n") == ":2: column 3 '-3e39' is not a finite number");
}

TEST_CASE("csv: every wrong row is listed, the same by csv_problems and read_csv_samples") {
  TempDir dir;
  const auto file = dir.write("d.csv", "label,a,b\n1,2,3\n7,1,1\n1.5,x,1\n0,1\n2,1,inf\n");
  const std::vector<std::string> expected = {
      file.string() + ":3: label 7 is outside [0, 3) (model.classes is 3)",
      file.string() + ":4: label '1.5' is not an integer",  // the row's first wrong field
      file.string() + ":5: 1 features, but model.input is 2 (expected the label then the features)",
      file.string() + ":6: column 3 'inf' is not a finite number"};
  CHECK(csv_problems(file, "auto", 2, 3) == expected);
  std::string message;
  try {
    read_csv_samples(file, "auto", 2, 3);
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::recipe);
    message = e.what();
  }
  CHECK(message == expected[0] + "\n" + expected[1] + "\n" + expected[2] + "\n" + expected[3]);

  CHECK(csv_problems(dir.write("ok.csv", "1,2,3\n0,1,1\n"), "auto", 2, 3).empty());
  const auto none = dir.write("none.csv", "a,b,c\n");
  CHECK(csv_problems(none, "auto", 2, 3) ==
        std::vector<std::string>{none.string() +
                                 ": no data rows (its one row, line 1, was taken for a header "
                                 "row: not every field is a number; with data.header \"no\" it "
                                 "is read as data)"});

  // A file wrong throughout says how many rows it did not list.
  std::string many;
  for (int i = 0; i < 25; ++i)
    many += "9,1,1\n";
  const auto all_wrong = dir.write("many.csv", many);
  const auto listed = csv_problems(all_wrong, "no", 2, 3);
  REQUIRE(listed.size() == kMostCsvProblems + 1);
  CHECK(listed[kMostCsvProblems - 1].starts_with(all_wrong.string() + ":20: label 9"));
  CHECK(listed.back() == all_wrong.string() + ": 5 more row(s) with a problem, not listed");
  CHECK_THROWS_AS(csv_problems(none.parent_path() / "missing.csv", "auto", 2, 3), Error);
}

TEST_CASE("csv_first_row: the first data row as read_csv_samples sees it") {
  TempDir dir;
  const auto with_header = dir.write("a.csv", "\r\n  \nlabel,f1,f2\r\n1, 0.5 ,-2\r\n0,1\n");
  const auto first = csv_first_row(with_header, "auto");
  REQUIRE(first.has_value());
  CHECK(first->columns == 3);
  CHECK(first->line == 4);
  // The columns are what read_csv_samples takes for the label and model.input features: with
  // two features it reads the first row and stops at the short one on line 5.
  CHECK(csv_error("\r\n  \nlabel,f1,f2\r\n1, 0.5 ,-2\r\n0,1\n") ==
        ":5: 1 features, but model.input is 2 (expected the label then the features)");

  const auto yes = csv_first_row(with_header, "yes");
  REQUIRE(yes.has_value());
  CHECK(yes->line == 4);
  const auto no = csv_first_row(with_header, "no");
  REQUIRE(no.has_value());
  CHECK(no->line == 3);  // the header is a row like any other
  CHECK(no->columns == 3);

  const auto numeric = dir.write("b.csv", "2,1,1,4\n1,2\n");
  CHECK(csv_first_row(numeric, "auto")->columns == 4);
  CHECK(csv_first_row(numeric, "auto")->line == 1);
  CHECK(csv_first_row(numeric, "yes")->columns == 2);
  CHECK(csv_first_row(numeric, "yes")->line == 2);

  CHECK_FALSE(csv_first_row(dir.write("c.csv", ""), "no").has_value());
  CHECK_FALSE(csv_first_row(dir.write("d.csv", "label,a\n\n"), "auto").has_value());
  CHECK_FALSE(csv_first_row(dir.write("e.csv", "1,2\n"), "yes").has_value());
  CHECK_THROWS_WITH_AS(csv_first_row(dir.write("f.csv", "1,2\n"), "maybe"),
                       doctest::Contains("data.header"), Error);
  const auto missing = dir / "dptrain-no-such-file.csv";
  CHECK_THROWS_WITH_AS(csv_first_row(missing, "auto"),
                       doctest::Contains("dptrain-no-such-file.csv: cannot open"), Error);
}

TEST_CASE("synthetic data too large to index is refused, not wrapped") {
  DataSpec data = synthetic(int64_t{1} << 62, 0.1);
  CHECK_THROWS_WITH_AS(make_synthetic_samples(data, model_of(784, 10), 1),
                       doctest::Contains("data.samples"), Error);
}

TEST_CASE("load_data: csv through the spec, missing files and unknown types") {
  TempDir dir;
  std::string contents = "y,a,b\n";
  for (int i = 0; i < 20; ++i)
    contents += std::to_string(i % 3) + "," + std::to_string(i) + ",1\n";
  DataSpec data;
  data.type = "csv";
  data.path = dir.write("d.csv", contents).string();
  data.eval_fraction = 0.25;
  const DataSplits splits = load_data(data, model_of(2, 3), 1);
  CHECK(splits.train->size() == 15);
  CHECK(splits.eval->size() == 5);

  data.path = (dir / "dptrain-no-such-file.csv").string();
  CHECK_THROWS_WITH_AS(load_data(data, model_of(2, 3), 1),
                       doctest::Contains("dptrain-no-such-file.csv: cannot open"), Error);
  data.path.clear();
  CHECK_THROWS_WITH_AS(load_data(data, model_of(2, 3), 1), doctest::Contains("data.path"), Error);
  data.type = "parquet";
  CHECK_THROWS_WITH_AS(load_data(data, model_of(2, 3), 1), doctest::Contains("data.type"), Error);
  CHECK_THROWS_WITH_AS(load_data(synthetic(0, 0.1), model_of(2, 3), 1),
                       doctest::Contains("data.samples"), Error);
}

}  // namespace dptrain
