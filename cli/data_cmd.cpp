// `dptrain data prepare --text FILE... --out DATASET`: text files -> a token dataset directory.
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <system_error>
#include <vector>

#include <fmt/chrono.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli/commands.hpp"
#include "core/data/tokens.hpp"
#include "core/error.hpp"
#include "core/fs.hpp"

namespace dptrain::cli {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

struct PrepareOptions {
  std::vector<std::string> text;
  std::string out;
  std::string tokenizer = "byte";
  double val_fraction = 0.1;
  std::string dtype = "auto";
  bool force = false;
  bool json = false;
};

struct Source {
  fs::path path;
  uint64_t bytes = 0;
};

// What was written, as printed.
struct PrepareSummary {
  fs::path path;
  std::vector<Source> sources;
  uint64_t bytes = 0;
  std::string tokenizer;
  int64_t vocab = 0;
  int64_t tokens = 0, train_tokens = 0, val_tokens = 0;
  int dtype_bytes = 2;
};

[[noreturn]] void refuse(const std::string& message) {
  throw Error(ErrorKind::usage, message);
}

void check_options(const PrepareOptions& o) {
  if (o.text.empty()) refuse("data prepare: no --text FILE given (the text to tokenize)");
  if (o.out.empty()) refuse("data prepare: no --out DATASET given (the directory to write)");
  if (o.tokenizer != "byte" && o.tokenizer != "char") {
    refuse(fmt::format("--tokenizer: must be byte or char, got '{}'", o.tokenizer));
  }
  if (!(o.val_fraction >= 0.0 && o.val_fraction < 1.0)) {
    refuse(fmt::format("--val-fraction: must be in [0, 1), got {}", o.val_fraction));
  }
  if (o.dtype != "auto" && o.dtype != "uint16" && o.dtype != "uint32") {
    refuse(fmt::format("--dtype: must be auto, uint16 or uint32, got '{}'", o.dtype));
  }
}

// OUT as an absolute path without a trailing slash, so that it has a parent to rename in.
fs::path output_path(const std::string& out) {
  fs::path path = fs::absolute(out).lexically_normal();
  if (path.filename().empty()) path = path.parent_path();
  if (path == path.root_path()) refuse(fmt::format("--out: cannot write a dataset to {}", out));
  return path;
}

bool looks_like_dataset(const fs::path& dir) {
  std::error_code ec;
  return fs::exists(dir / "meta.json", ec) || fs::exists(dir / "train.bin", ec);
}

// Before any text is read: OUT must be new, empty, or (with --force) a dataset to replace.
void check_output(const fs::path& out, bool force) {
  std::error_code ec;
  const fs::file_status status = fs::symlink_status(out, ec);
  if (!fs::exists(status)) return;
  if (fs::is_symlink(status)) {
    // The dataset would replace the link, not what it points to: name the real place instead.
    const fs::path target = fs::weakly_canonical(out, ec);
    refuse(fmt::format("{}: is a symbolic link{}; give the directory itself as --out", out.string(),
                       ec ? "" : " to " + target.string()));
  }
  if (!fs::is_directory(status))
    refuse(fmt::format("{}: exists and is not a directory", out.string()));
  if (fs::is_empty(out, ec)) return;
  if (!force) {
    refuse(fmt::format("{}: exists and is not empty (use --force to replace it)", out.string()));
  }
  if (!looks_like_dataset(out)) {
    refuse(
        fmt::format("{}: not a token dataset (no meta.json or train.bin); --force replaces "
                    "only a dataset",
                    out.string()));
  }
}

std::string read_text(const fs::path& path) {
  std::error_code ec;
  if (fs::is_directory(path, ec))
    refuse(fmt::format("{}: cannot read: is a directory", path.string()));
  std::ifstream in(path, std::ios::binary);
  if (!in) refuse(fmt::format("{}: cannot read: {}", path.string(), std::strerror(errno)));
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) refuse(fmt::format("{}: cannot read: {}", path.string(), std::strerror(errno)));
  return std::move(text).str();
}

int resolve_dtype(const std::string& dtype, int64_t vocab, const std::string& tokenizer) {
  if (dtype == "uint32") return 4;
  const int64_t uint16_ids = dtype_capacity(2);
  if (vocab <= uint16_ids) return 2;
  if (dtype == "uint16") {
    refuse(
        fmt::format("--dtype uint16 holds {} ids, but the {} vocabulary has {} (use --dtype "
                    "uint32 or auto)",
                    uint16_ids, tokenizer, vocab));
  }
  if (vocab > dtype_capacity(4)) {
    refuse(fmt::format("the {} vocabulary has {} ids, more than uint32 holds", tokenizer, vocab));
  }
  return 4;
}

std::string utc_now() {
  return fmt::format("{:%Y-%m-%dT%H:%M:%SZ}", fmt::gmtime(std::time(nullptr)));
}

json meta_json(const PrepareSummary& s, double val_fraction) {
  json sources = json::array();
  for (const auto& src : s.sources)
    sources.push_back({{"path", src.path.string()}, {"bytes", src.bytes}});
  return {{"format", "dptrain-tokens"},
          {"version", kTokenFileVersion},
          {"created_at", utc_now()},
          {"created_by", "dptrain " DPTRAIN_VERSION},
          {"sources", sources},
          {"bytes", s.bytes},
          {"tokenizer", s.tokenizer},
          {"vocab", s.vocab},
          {"dtype", dtype_name(s.dtype_bytes)},
          {"tokens", s.tokens},
          {"train_tokens", s.train_tokens},
          {"val_tokens", s.val_tokens},
          {"val_fraction", val_fraction}};
}

// Writes everything into a temporary sibling of OUT, then renames it into place: a failure
// leaves OUT as it was and no temporary behind.
void write_dataset(const PrepareSummary& s, const Tokenizer& tokenizer,
                   const std::vector<int32_t>& tokens, double val_fraction) {
  const fs::path out = s.path;
  const fs::path parent = out.parent_path();
  std::error_code ec;
  if (!fs::create_directories(parent, ec) && ec) {
    throw Error(ErrorKind::io, fmt::format("{}: cannot create: {}", parent.string(), ec.message()));
  }
  const std::string stem = "." + out.filename().string();
  const fs::path tmp = parent / fmt::format("{}.tmp-{}", stem, ::getpid());
  const fs::path old = parent / fmt::format("{}.old-{}", stem, ::getpid());
  fs::remove_all(tmp, ec);
  bool moved_old = false;
  try {
    fs::create_directory(tmp);
    const std::span<const int32_t> all(tokens);
    const auto train = static_cast<size_t>(s.train_tokens);
    write_token_file(tmp / "train.bin", s.vocab, all.first(train), s.dtype_bytes);
    write_token_file(tmp / "val.bin", s.vocab, all.subspan(train), s.dtype_bytes);
    tokenizer.save(tmp);
    write_file_atomic(tmp / "meta.json", meta_json(s, val_fraction).dump(2) + "\n");
    fsync_directory(tmp);
    if (fs::exists(fs::symlink_status(out))) {
      fs::rename(out, old);
      moved_old = true;
    }
    fs::rename(tmp, out);
    fsync_directory(parent);
  } catch (...) {
    fs::remove_all(tmp, ec);
    if (moved_old && !fs::exists(out, ec)) fs::rename(old, out, ec);
    try {
      throw;
    } catch (const fs::filesystem_error& e) {
      throw Error(ErrorKind::io,
                  fmt::format("{}: cannot write the dataset, nothing was written: {}", out.string(),
                              e.code().message()));
    } catch (const Error& e) {
      if (e.kind() != ErrorKind::io) throw;
      throw Error(ErrorKind::io,
                  fmt::format("{}: cannot write the dataset, nothing was written: {}", out.string(),
                              e.what()));
    }
  }
  if (moved_old) fs::remove_all(old, ec);
}

void print_summary(const PrepareSummary& s, bool as_json) {
  if (as_json) {
    const json out = {{"path", s.path.string()},
                      {"files", s.sources.size()},
                      {"bytes", s.bytes},
                      {"tokens", s.tokens},
                      {"tokenizer", s.tokenizer},
                      {"vocab", s.vocab},
                      {"train_tokens", s.train_tokens},
                      {"val_tokens", s.val_tokens},
                      {"dtype", dtype_name(s.dtype_bytes)}};
    std::printf("%s\n", out.dump().c_str());
    return;
  }
  std::printf("%s",
              fmt::format("files         {}\n"
                          "bytes         {}\n"
                          "tokens        {}\n"
                          "tokenizer     {}\n"
                          "vocab         {}\n"
                          "train tokens  {}\n"
                          "val tokens    {}\n"
                          "dtype         {}\n"
                          "path          {}\n",
                          s.sources.size(), s.bytes, s.tokens, s.tokenizer, s.vocab, s.train_tokens,
                          s.val_tokens, dtype_name(s.dtype_bytes), s.path.string())
                  .c_str());
}

int run_prepare(const PrepareOptions& o) {
  check_options(o);
  PrepareSummary s;
  s.path = output_path(o.out);
  check_output(s.path, o.force);

  std::string text;
  for (const auto& name : o.text) {
    const fs::path path = name;
    std::string part = read_text(path);
    if (o.tokenizer == "char") {
      try {
        Tokenizer::chars_of(part);  // validates without a copy of the text
      } catch (const Error& e) {
        refuse(fmt::format("{}: {} (--tokenizer char needs UTF-8 text)", name, e.what()));
      }
    }
    s.sources.push_back({fs::absolute(path).lexically_normal(), part.size()});
    text += part;
  }
  s.bytes = text.size();
  if (text.empty()) refuse(fmt::format("no text in {}", fmt::join(o.text, ", ")));

  const Tokenizer tokenizer = o.tokenizer == "char" ? Tokenizer::chars_of(text) : Tokenizer::byte();
  const std::vector<int32_t> tokens = tokenizer.encode(text);
  s.tokenizer = tokenizer.type();
  s.vocab = tokenizer.vocab();
  s.dtype_bytes = resolve_dtype(o.dtype, s.vocab, s.tokenizer);
  s.tokens = static_cast<int64_t>(tokens.size());
  s.val_tokens = static_cast<int64_t>(std::llround(o.val_fraction * static_cast<double>(s.tokens)));
  s.train_tokens = s.tokens - s.val_tokens;
  if (s.train_tokens < 2 || (o.val_fraction > 0 && s.val_tokens < 2)) {
    refuse(
        fmt::format("--val-fraction {} of {} tokens leaves {} for training and {} for "
                    "validation; each needs at least 2 (give more text{})",
                    o.val_fraction, s.tokens, s.train_tokens, s.val_tokens,
                    o.val_fraction > 0 ? ", or --val-fraction 0 for no validation" : ""));
  }
  write_dataset(s, tokenizer, tokens, o.val_fraction);
  print_summary(s, o.json);
  return 0;
}

}  // namespace

void setup_data(CLI::App& app, Outcome& outcome) {
  app.require_subcommand(1);
  auto o = std::make_shared<PrepareOptions>();
  CLI::App* prepare = app.add_subcommand(
      "prepare", "Tokenize text files into a dataset directory (train.bin, val.bin, tokenizer)");
  prepare->add_option("--text", o->text, "Text files, concatenated in this order")
      ->type_name("FILE");
  prepare
      ->add_option("--out", o->out,
                   "Dataset directory to write (a recipe's data.path); must be new or empty")
      ->type_name("DATASET");
  prepare
      ->add_option("--tokenizer", o->tokenizer,
                   "byte: one id per byte (vocab 256); char: one id per distinct Unicode "
                   "character of the text (UTF-8)")
      ->type_name("byte|char")
      ->capture_default_str();
  prepare
      ->add_option("--val-fraction", o->val_fraction,
                   "Share of the tokens, at the end of the text, held out as val.bin; in [0, 1)")
      ->type_name("F")
      ->capture_default_str();
  prepare
      ->add_option("--dtype", o->dtype,
                   "Token width on disk: auto (uint16 when the vocabulary fits 65536 ids), "
                   "uint16 or uint32")
      ->type_name("auto|uint16|uint32")
      ->capture_default_str();
  prepare->add_flag("--force", o->force, "Replace DATASET if it already holds a dataset");
  prepare->add_flag("--json", o->json, "Print one JSON object with the counts on stdout");
  prepare->callback([o, &outcome] {
    outcome.json = o->json;
    outcome.exit_code = run_prepare(*o);
  });
}

}  // namespace dptrain::cli
