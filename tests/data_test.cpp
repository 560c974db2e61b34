// `dptrain data prepare`: counts, tokenizers, every refusal, --force, and a recipe that uses it.
#include <doctest/doctest.h>

#include <sys/wait.h>

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <sstream>

#include "core/data/tokens.hpp"
#include "tests/harness.hpp"
#include "tests/strings.hpp"
#include "tests/text_corpus.hpp"

using namespace dptrain::test;
namespace fs = std::filesystem;

namespace {

CommandResult prepare(const std::vector<std::string>& args) {
  std::vector<std::string> all = {"data", "prepare"};
  all.insert(all.end(), args.begin(), args.end());
  return run_dptrain(all);
}

nlohmann::json prepare_json(const std::vector<std::string>& args) {
  std::vector<std::string> all = args;
  all.push_back("--json");
  auto r = prepare(all);
  INFO(r.out, r.err);
  REQUIRE(r.exit_code == 0);
  CHECK(r.err.empty());
  const nlohmann::json out = parse_json(r.out);
  CHECK(out["status"] == "ok");
  CHECK(out["exit_code"] == 0);
  return out;
}

// A refusal: exit 2 and exactly one error line, which is returned.
std::string refusal(const std::vector<std::string>& args) {
  auto r = prepare(args);
  INFO(r.out, r.err);
  CHECK(r.exit_code == 2);
  CHECK(r.out.empty());
  std::istringstream lines(r.err);
  std::string first, more;
  std::getline(lines, first);
  CHECK_FALSE(std::getline(lines, more));
  CHECK(first.starts_with("dptrain: error: "));
  return first;
}

// The dataset's tokens, train then val, decoded with its own tokenizer.
std::string decoded(const fs::path& dir) {
  auto train = dptrain::read_token_file(dir / "train.bin");
  const auto val = dptrain::read_token_file(dir / "val.bin");
  train.tokens.insert(train.tokens.end(), val.tokens.begin(), val.tokens.end());
  return dptrain::Tokenizer::load(dir).decode(train.tokens);
}

// Nothing but OUT itself was left in its folder (no temporaries).
void check_no_leftovers(const fs::path& parent, size_t expected_entries) {
  size_t entries = 0;
  for (const auto& entry : fs::directory_iterator(parent)) {
    INFO(entry.path());
    CHECK_FALSE(contains(entry.path().filename().string(), ".tmp-"));
    CHECK_FALSE(contains(entry.path().filename().string(), ".old-"));
    ++entries;
  }
  CHECK(entries == expected_entries);
}

}  // namespace

TEST_CASE("data prepare --json: counts match the input, and the files hold the text in order") {
  TempDir tmp;
  const std::string a = synthetic_text(1, 3000), b = synthetic_text(2, 1001);
  write_text(tmp / "a.txt", a);
  write_text(tmp / "b.txt", b);
  const fs::path out = tmp / "out/ds";  // parents are made

  const auto j = prepare_json(
      {"--text", (tmp / "a.txt").string(), (tmp / "b.txt").string(), "--out", out.string()});
  CHECK(j["files"] == 2);
  CHECK(j["bytes"] == 4001);
  CHECK(j["tokens"] == 4001);
  CHECK(j["tokenizer"] == "byte");
  CHECK(j["vocab"] == 256);
  CHECK(j["val_tokens"] == 400);  // round(0.1 * 4001)
  CHECK(j["train_tokens"] == 3601);
  CHECK(j["dtype"] == "uint16");
  CHECK(j["path"] == out.string());

  const auto train = dptrain::read_token_file(out / "train.bin");
  CHECK(train.vocab == 256);
  CHECK(train.dtype_bytes == 2);
  CHECK(train.tokens.size() == 3601);
  CHECK(dptrain::read_token_file(out / "val.bin").tokens.size() == 400);
  CHECK(decoded(out) == a + b);
  CHECK(parse_json(read_text(out / "tokenizer.json")) == nlohmann::json{{"type", "byte"}});

  const auto meta = parse_json(read_text(out / "meta.json"));
  CHECK(meta["tokens"] == 4001);
  CHECK(meta["train_tokens"] == 3601);
  CHECK(meta["val_tokens"] == 400);
  CHECK(meta["dtype"] == "uint16");
  CHECK(meta["vocab"] == 256);
  CHECK(meta["tokenizer"] == "byte");
  REQUIRE(meta["sources"].size() == 2);
  CHECK(meta["sources"][0]["path"] == (tmp / "a.txt").string());
  CHECK(meta["sources"][1]["bytes"] == 1001);
  CHECK(meta["created_at"].get<std::string>().size() == 20);  // 2026-11-30T08:43:38Z
  check_no_leftovers(tmp / "out", 1);

  // The plain output: one line per count.
  auto plain = prepare({"--text", (tmp / "b.txt").string(), "--out", (tmp / "plain").string(),
                        "--val-fraction", "0.5"});
  INFO(plain.err);
  CHECK(plain.exit_code == 0);
  CHECK(contains(plain.out, "files         1\n"));
  CHECK(contains(plain.out, "tokens        1001\n"));
  CHECK(contains(plain.out, "vocab         256\n"));
  CHECK(contains(plain.out, "train tokens  500\n"));  // 500.5 rounds away from zero: val 501
  CHECK(contains(plain.out, "val tokens    501\n"));
  CHECK(contains(plain.out, "dtype         uint16\n"));
  CHECK(contains(plain.out, "path          " + (tmp / "plain").string() + "\n"));
}

TEST_CASE("data prepare reads a file given twice (a link and its target) once, and says so") {
  TempDir tmp;
  const std::string a = synthetic_text(3, 2000), b = synthetic_text(4, 500);
  write_text(tmp / "a.txt", a);
  write_text(tmp / "b.txt", b);
  fs::create_symlink(tmp / "a.txt", tmp / "link.txt");
  const fs::path out = tmp / "ds";
  const auto r = prepare({"--text", (tmp / "a.txt").string(), (tmp / "b.txt").string(),
                          (tmp / "link.txt").string(), (tmp / "b.txt").string(), "--out",
                          out.string(), "--json"});
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  const auto j = parse_json(r.out);
  // Read twice, the end held out (b's text) would also be in the training text.
  CHECK(j["files"] == 2);
  CHECK(j["bytes"] == 2500);
  CHECK(decoded(out) == a + b);
  REQUIRE(j["warnings"].size() == 2);
  CHECK(j["warnings"][0] == "--text " + (tmp / "link.txt").string() + ": the same file as " +
                                (tmp / "a.txt").string() + ", given before: read once");
  CHECK(j["warnings"][1] == "--text " + (tmp / "b.txt").string() + ": the same file as " +
                                (tmp / "b.txt").string() + ", given before: read once");
  CHECK(contains(r.err, "dptrain: warning: " + j["warnings"][0].get<std::string>() + "\n"));
  CHECK(parse_json(read_text(out / "meta.json"))["sources"].size() == 2);
  // A prepare that warned and then failed: its JSON error carries the warnings too.
  const auto failed =
      prepare({"--text", (tmp / "a.txt").string(), (tmp / "link.txt").string(), "--out",
               (tmp / "small").string(), "--val-fraction", "0.9999", "--json"});
  CHECK(failed.exit_code == 2);
  const auto e = parse_json(failed.out);
  CHECK(e["status"] == "error");
  REQUIRE(e["warnings"].size() == 1);
  CHECK(e["warnings"][0] == "--text " + (tmp / "link.txt").string() + ": the same file as " +
                                (tmp / "a.txt").string() + ", given before: read once");
}

TEST_CASE("data prepare: byte vs char vocabulary on UTF-8 text; uint32 on request") {
  TempDir tmp;
  const std::string text =
      "na\xc3\xafve caf\xc3\xa9 \xe2\x82\xac"
      "5 \xf0\x9f\x99\x82 na\xc3\xafve\n";
  write_text(tmp / "u.txt", text);

  const auto bytes = prepare_json({"--text", (tmp / "u.txt").string(), "--out",
                                   (tmp / "byte").string(), "--val-fraction", "0.2"});
  CHECK(bytes["tokens"] == text.size());
  CHECK(bytes["vocab"] == 256);

  const auto chars =
      prepare_json({"--text", (tmp / "u.txt").string(), "--out", (tmp / "char").string(),
                    "--tokenizer", "char", "--val-fraction", "0.2", "--dtype", "uint32"});
  const auto code_points = dptrain::decode_utf8(text);
  CHECK(chars["bytes"] == text.size());
  CHECK(chars["tokens"] == code_points.size());
  CHECK(chars["tokenizer"] == "char");
  // n a ï v e space c f é € 5 🙂 newline
  CHECK(chars["vocab"] == 13);
  CHECK(chars["dtype"] == "uint32");
  CHECK(dptrain::read_token_file(tmp / "char/train.bin").dtype_bytes == 4);
  CHECK(dptrain::read_token_file(tmp / "char/train.bin").vocab == 13);
  CHECK(decoded(tmp / "char") == text);
  CHECK(decoded(tmp / "byte") == text);
  const auto tokenizer = parse_json(read_text(tmp / "char/tokenizer.json"));
  CHECK(tokenizer["type"] == "char");
  CHECK(tokenizer["chars"].size() == 13);
  CHECK(tokenizer["chars"][0] == 10);  // ascending code points: newline first

  // A vocabulary past 65536 ids: auto picks uint32, uint16 is refused.
  std::string wide;
  for (char32_t cp = 0x4e00; cp < 0x4e00 + 65537; ++cp)
    dptrain::append_utf8(wide, cp >= 0xd800 && cp < 0xe000 ? cp + 0x10000 : cp);
  write_text(tmp / "wide.txt", wide);
  const auto big = prepare_json({"--text", (tmp / "wide.txt").string(), "--out",
                                 (tmp / "wide").string(), "--tokenizer", "char"});
  CHECK(big["vocab"] == 65537);
  CHECK(big["dtype"] == "uint32");
  CHECK(refusal({"--text", (tmp / "wide.txt").string(), "--out", (tmp / "wide16").string(),
                 "--tokenizer", "char", "--dtype", "uint16"}) ==
        "dptrain: error: --dtype uint16 holds 65536 ids, but the char vocabulary has 65537 (use "
        "--dtype uint32 or auto)");
  CHECK_FALSE(fs::exists(tmp / "wide16"));
}

TEST_CASE("data prepare refuses bad input with exit 2 and one line, writing nothing") {
  TempDir tmp;
  write_text(tmp / "t.txt", synthetic_text(3, 500));
  write_text(tmp / "empty.txt", "");
  write_text(tmp / "tiny.txt", "abcd");
  const std::string t = (tmp / "t.txt").string(), out = (tmp / "out").string();

  CHECK(refusal({"--out", out}) ==
        "dptrain: error: data prepare: no --text FILE given (the text to tokenize)");
  CHECK(refusal({"--text", t}) ==
        "dptrain: error: data prepare: no --out DATASET given (the directory to write)");
  CHECK(refusal({"--text", t, (tmp / "missing.txt").string(), "--out", out}) ==
        "dptrain: error: " + (tmp / "missing.txt").string() +
            ": cannot read: No such file or directory");
  CHECK(refusal({"--text", t, "", "--out", out}) ==
        "dptrain: error: --text '': an empty file name (give the text's path)");
  CHECK(refusal({"--text", tmp.path().string(), "--out", out}) ==
        "dptrain: error: " + tmp.path().string() + ": cannot read: is a directory");
  // A prepared dataset's token file given as text (a slip: data.path takes the dataset).
  REQUIRE(run_dptrain({"data", "prepare", "--text", t, "--out", (tmp / "ds").string()}).exit_code ==
          0);
  const std::string tokens = (tmp / "ds/train.bin").string();
  CHECK(refusal({"--text", t, tokens, "--out", out}) ==
        "dptrain: error: " + tokens +
            ": a dptrain token file (it starts with DPTOKENS), not text: give the text files it "
            "was prepared from (a prepared dataset is used as it is, as data.path)");
  fs::remove_all(tmp / "ds");
  write_text(tmp / "empty2.txt", "");
  CHECK(refusal({"--text", (tmp / "empty.txt").string(), (tmp / "empty2.txt").string(), "--out",
                 out}) == "dptrain: error: no text in " + (tmp / "empty.txt").string() + ", " +
                              (tmp / "empty2.txt").string());
  CHECK(refusal({"--text", (tmp / "tiny.txt").string(), "--out", out}) ==
        "dptrain: error: --val-fraction 0.1 of 4 tokens leaves 4 for training and 0 for "
        "validation; each needs at least 2 (give more text, or --val-fraction 0 for no "
        "validation)");
  CHECK(contains(
      refusal({"--text", (tmp / "tiny.txt").string(), "--out", out, "--val-fraction", "0.9"}),
      "leaves 0 for training and 4 for validation"));
  CHECK(refusal({"--text", t, "--out", out, "--val-fraction", "1"}) ==
        "dptrain: error: --val-fraction: must be in [0, 1), got 1");
  for (const char* value : {"-0.5", "0x0.1", " 0.1", "1e999"}) {
    CAPTURE(value);
    const std::string said = refusal({"--text", t, "--out", out, "--val-fraction", value});
    CHECK(said.starts_with(std::string("dptrain: error: --val-fraction: '") + value + "' "));
    CHECK(said.ends_with("(see 'dptrain data prepare --help')"));
  }
  CHECK(refusal({"--text", t, "--out", out, "--tokenizer", "bpe"}) ==
        "dptrain: error: --tokenizer: must be byte or char, got 'bpe'");
  CHECK(refusal({"--text", t, "--out", out, "--dtype", "int8"}) ==
        "dptrain: error: --dtype: must be auto, uint16 or uint32, got 'int8'");
  write_text(tmp / "latin1.txt", "caf\xe9 au lait");
  CHECK(
      refusal({"--text", t, (tmp / "latin1.txt").string(), "--out", out, "--tokenizer", "char"}) ==
      "dptrain: error: " + (tmp / "latin1.txt").string() +
          ": invalid UTF-8 at byte offset 3 (byte 0xe9: the sequence is cut short) "
          "(--tokenizer char needs UTF-8 text)");
  CHECK(refusal({"--text", t, "--out", t}) ==
        "dptrain: error: " + t + ": exists and is not a directory");
  CHECK(refusal({"--text", t, "--out", t + "/sub/ds"}) ==
        "dptrain: error: --out " + t + "/sub/ds: " + t + " is not a directory");
  // The directory the command runs in (or one holding it) would be renamed away under it.
  const std::string here = fs::current_path().string();
  CHECK(refusal({"--text", t, "--out", here, "--force"}) ==
        "dptrain: error: --out " + here +
            ": is the current directory (the dataset replaces its directory): give the name of a "
            "directory to create, as --out DATASET");
  const std::string above = fs::current_path().parent_path().string() + "/";
  CHECK(refusal({"--text", t, "--out", above}) ==
        "dptrain: error: --out " + above +
            ": holds the current directory (the dataset replaces its directory): give the name "
            "of a directory to create, as --out DATASET");
  CHECK_FALSE(fs::exists(out));
  check_no_leftovers(tmp.path(), 5);  // the inputs: nothing else

  // With --json an error is one JSON object on stdout as well.
  auto r = prepare({"--text", (tmp / "empty.txt").string(), "--out", out, "--json"});
  CHECK(r.exit_code == 2);
  const auto j = parse_json(r.out);
  CHECK(j["status"] == "error");
  CHECK(j["exit_code"] == 2);
  CHECK(j["errors"][0] == "no text in " + (tmp / "empty.txt").string());

  // --val-fraction 0: everything trains, val.bin is empty.
  const auto all =
      prepare_json({"--text", (tmp / "tiny.txt").string(), "--out", out, "--val-fraction", "0"});
  CHECK(all["train_tokens"] == 4);
  CHECK(all["val_tokens"] == 0);
  CHECK(dptrain::read_token_file(tmp / "out/val.bin").tokens.empty());
}

TEST_CASE("data prepare refuses more text than the memory holds, before it runs out") {
  TempDir tmp;
  // 50 MiB available: at most 8.3 MiB of text (int32 tokens, then 2-byte token files, a byte).
  write_text(tmp / "meminfo", "MemTotal: 1000000 kB\nMemAvailable: 51200 kB\n");
  const Env env = {{"DPTRAIN_TEST_MEMINFO", (tmp / "meminfo").string()}};
  const std::string out = (tmp / "out").string();
  const std::string limits =
      ": a prepare holds the text and its tokens in memory (6 bytes a byte of text), and 50.0 "
      "MiB is available (MemAvailable): at most 8.3 MiB of text; prepare less text, or free "
      "memory\n";
  // Files whose sizes add up to too much: refused before any is read.
  write_text(tmp / "a.txt", std::string(6 << 20, 'a'));
  write_text(tmp / "b.txt", std::string(6 << 20, 'b'));
  const std::string a = (tmp / "a.txt").string(), b = (tmp / "b.txt").string();
  auto sized = run_dptrain({"data", "prepare", "--text", a, b, "--out", out}, env);
  CHECK(sized.exit_code == 2);
  CHECK(sized.err == "dptrain: error: " + a + ", " + b + ": 12.0 MiB of text" + limits);
  // A source with no size (a device, a pipe): refused as the text passes the limit, not read on
  // until the memory runs out.
  auto endless = run_dptrain({"data", "prepare", "--text", a, "/dev/zero", "--out", out}, env);
  CHECK(endless.exit_code == 2);
  CHECK(endless.err.starts_with("dptrain: error: /dev/zero: the text passes 8.3 MiB ("));
  CHECK(endless.err.ends_with(" of this file read)" + limits));
  CHECK_FALSE(fs::exists(out));
  check_no_leftovers(tmp.path(), 3);  // meminfo, a.txt, b.txt
  // Within the limit it is prepared; 4-byte tokens (a char vocabulary may need them) halve it.
  write_text(tmp / "c.txt", std::string(7 << 20, 'c'));
  CHECK(contains(run_dptrain({"data", "prepare", "--text", (tmp / "c.txt").string(), "--out", out,
                              "--tokenizer", "char"},
                             env)
                     .err,
                 ": 7.0 MiB of text: a prepare holds the text and its tokens in memory (8 bytes a "
                 "byte of text), and 50.0 MiB is available (MemAvailable): at most 6.2 MiB"));
  CHECK(run_dptrain({"data", "prepare", "--text", a, "--out", out}, env).exit_code == 0);
  // A file whose size says nothing (/proc's) is read as it is, not taken as changed.
  CHECK(run_dptrain({"data", "prepare", "--text", "/proc/self/status", "--out",
                     (tmp / "proc").string(), "--val-fraction", "0"})
            .exit_code == 0);
}

TEST_CASE("data prepare keeps an existing dataset unless --force, and --force only replaces one") {
  TempDir tmp;
  write_text(tmp / "one.txt", synthetic_text(4, 600));
  write_text(tmp / "two.txt", synthetic_text(5, 900));
  const fs::path out = tmp / "ds";
  prepare_json({"--text", (tmp / "one.txt").string(), "--out", out.string()});
  const std::string before = read_text(out / "train.bin");

  CHECK(refusal({"--text", (tmp / "two.txt").string(), "--out", out.string()}) ==
        "dptrain: error: " + out.string() +
            ": exists and is not empty (use --force to replace it)");
  CHECK(read_text(out / "train.bin") == before);

  const auto j =
      prepare_json({"--text", (tmp / "two.txt").string(), "--out", out.string() + "/", "--force"});
  CHECK(j["tokens"] == 900);
  CHECK(j["path"] == out.string());
  CHECK(decoded(out) == synthetic_text(5, 900));
  check_no_leftovers(tmp.path(), 3);

  // An empty directory is fine without --force; a folder of something else is never replaced.
  fs::create_directories(tmp / "empty");
  prepare_json({"--text", (tmp / "one.txt").string(), "--out", (tmp / "empty").string()});
  CHECK(fs::exists(tmp / "empty/train.bin"));
  fs::create_directories(tmp / "notes");
  write_text(tmp / "notes/todo.txt", "keep me");
  CHECK(refusal(
            {"--text", (tmp / "one.txt").string(), "--out", (tmp / "notes").string(), "--force"}) ==
        "dptrain: error: " + (tmp / "notes").string() +
            ": not a token dataset (no meta.json or train.bin); --force replaces only a dataset");
  CHECK(read_text(tmp / "notes/todo.txt") == "keep me");
  // A link to a dataset: replacing it would replace the link, so the message names its target.
  fs::create_directory_symlink(out, tmp / "link");
  CHECK(refusal({"--text", (tmp / "one.txt").string(), "--out", (tmp / "link").string(),
                 "--force"}) == "dptrain: error: " + (tmp / "link").string() +
                                    ": is a symbolic link to " + fs::canonical(out).string() +
                                    "; give the directory itself as --out");
  fs::create_directory_symlink("nowhere", tmp / "dangling");
  CHECK(refusal({"--text", (tmp / "one.txt").string(), "--out", (tmp / "dangling").string()}) ==
        "dptrain: error: " + (tmp / "dangling").string() + ": is a symbolic link to " +
            (tmp / "nowhere").string() +
            " (which does not exist); give the directory itself as --out");
  CHECK(decoded(out) == synthetic_text(5, 900));
  // A dataset directory that also holds a file of the user's: --force would delete it too.
  write_text(out / "notes.txt", "keep me");
  CHECK(refusal({"--text", (tmp / "one.txt").string(), "--out", out.string(), "--force"}) ==
        "dptrain: error: " + out.string() +
            ": holds notes.txt, which is not part of a token dataset; --force replaces only a "
            "dataset's own files: move it away first");
  CHECK(read_text(out / "notes.txt") == "keep me");
  CHECK(decoded(out) == synthetic_text(5, 900));
  fs::remove(out / "notes.txt");
  // A directory of a dataset file's name is the user's, with what it holds.
  fs::remove(out / "val.bin");
  fs::create_directories(out / "val.bin/deep");
  write_text(out / "val.bin/deep/precious.txt", "keep me");
  CHECK(refusal({"--text", (tmp / "one.txt").string(), "--out", out.string(), "--force"}) ==
        "dptrain: error: " + out.string() +
            ": holds val.bin (a directory), which is not part of a token dataset; --force "
            "replaces only a dataset's own files: move it away first");
  CHECK(read_text(out / "val.bin/deep/precious.txt") == "keep me");
}

// Runs inside `unshare -Urm` (a user + mount namespace: no real root needed, nothing left mounted):
// a 64 KiB tmpfs holds a small dataset but not a large one.
constexpr const char* kDiskFullScript = R"(set -u
bin=$1 small=$2 big=$3 out=$4
mnt=$out/mnt
mount -t tmpfs -o size=64k dptrain-data-full "$mnt" || exit 90
"$bin" data prepare --text "$small" --out "$mnt/ds" >"$out/small.out" 2>"$out/small.err"
echo $? >"$out/small.rc"
cp "$mnt/ds/train.bin" "$out/small-train.bin"
"$bin" data prepare --text "$big" --out "$mnt/ds" --force >"$out/force.out" 2>"$out/force.err"
echo $? >"$out/force.rc"
"$bin" data prepare --text "$big" --out "$mnt/new" >"$out/new.out" 2>"$out/new.err"
echo $? >"$out/new.rc"
ls -A "$mnt" >"$out/mnt.txt"
cp "$mnt/ds/train.bin" "$out/after-train.bin"
exit 0
)";

TEST_CASE("two data prepares racing to one new --out: one wins, the other is refused") {
  TempDir tmp;
  // Large enough that both pass the first check before either renames its dataset into place.
  const std::vector<std::string> texts = {synthetic_text(6, 400000), synthetic_text(7, 500000)};
  for (int round = 0; round < 2; ++round) {
    CAPTURE(round);
    const fs::path out = tmp / ("ds" + std::to_string(round));
    if (round == 1) fs::create_directory(out);  // round 0: absent; round 1: empty, as allowed
    std::vector<std::unique_ptr<Background>> jobs;
    for (size_t i = 0; i < texts.size(); ++i) {
      const fs::path text = tmp / ("t" + std::to_string(i) + ".txt");
      if (round == 0) write_text(text, texts[i]);
      jobs.push_back(std::make_unique<Background>(std::vector<std::string>{
          "data", "prepare", "--text", text.string(), "--out", out.string()}));
    }
    std::vector<int> codes;
    for (auto& job : jobs)
      codes.push_back(job->wait());
    INFO(jobs[0]->err(), jobs[1]->err());
    std::sort(codes.begin(), codes.end());
    CHECK(codes == std::vector<int>{0, 2});
    const size_t winner = jobs[0]->err().find("dptrain: error:") == std::string::npos ? 0 : 1;
    const std::string loser = jobs[1 - winner]->err();
    CHECK((loser.find("another process wrote a dataset there meanwhile") != std::string::npos ||
           loser.find("exists and is not empty") != std::string::npos));
    CHECK(decoded(out) == texts[winner]);  // the dataset the winner reported, whole
  }
  for (const auto& e : fs::directory_iterator(tmp.path()))  // no temporary left
    CHECK(e.path().filename().string().rfind(".ds", 0) != 0);
}

TEST_CASE("data prepare on a full disk: exit 1, one line, no partial dataset, the old one kept") {
  TempDir tmp;
  const fs::path out = tmp / "out";
  fs::create_directories(out / "mnt");
  write_text(tmp / "small.txt", synthetic_text(7, 4000));
  write_text(tmp / "big.txt", synthetic_text(8, 200000));  // 400 KB of uint16 tokens
  write_text(tmp / "full.sh", kDiskFullScript);
  const std::string command = "timeout -s KILL 120 unshare -Urm bash '" +
                              (tmp / "full.sh").string() + "' '" + binary() + "' '" +
                              (tmp / "small.txt").string() + "' '" + (tmp / "big.txt").string() +
                              "' '" + out.string() + "' >'" + (tmp / "log").string() + "' 2>&1";
  const int status = std::system(command.c_str());
  INFO("script: ", read_text(tmp / "log"));
  // Namespaces unavailable is a broken test machine, said plainly, not a silent pass.
  REQUIRE_MESSAGE((WIFEXITED(status) && WEXITSTATUS(status) == 0),
                  "this test needs user namespaces (unshare -Urm) and tmpfs");

  INFO("small: ", read_text(out / "small.err"));
  REQUIRE(read_text(out / "small.rc") == "0\n");
  for (const char* attempt : {"force", "new"}) {
    CAPTURE(attempt);
    const std::string err = read_text(out / (std::string(attempt) + ".err"));
    INFO(err);
    CHECK(read_text(out / (std::string(attempt) + ".rc")) == "1\n");
    CHECK(err.starts_with("dptrain: error: "));
    CHECK(contains(err, "cannot write the dataset, nothing was written"));
    CHECK(contains(err, "No space left on device"));
    CHECK(std::count(err.begin(), err.end(), '\n') == 1);
  }
  // No temporaries and no half dataset: only the small one, unchanged.
  CHECK(read_text(out / "mnt.txt") == "ds\n");
  CHECK(read_text(out / "after-train.bin") == read_text(out / "small-train.bin"));
}

TEST_CASE("data prepare where nothing can be made: exit 2 naming --out, before the text is read") {
  TempDir tmp;
  write_text(tmp / "in.txt", synthetic_text(3, 2000));
  // /proc takes no new directories (not even root's): the caller's to fix, said before a large
  // corpus would be read, as for a file in the way; nested deeper, the place that exists.
  for (const std::string out : {"/proc/no-dataset-here", "/proc/no/dataset/here"}) {
    CAPTURE(out);
    const auto r =
        run_dptrain({"data", "prepare", "--text", (tmp / "in.txt").string(), "--out", out});
    CHECK(r.exit_code == 2);
    CHECK(r.err == "dptrain: error: --out " + out +
                       ": cannot make a directory in /proc: No such file or directory\n");
  }
  // The text is not read at all: a missing one is not what is said.
  const auto r = run_dptrain(
      {"data", "prepare", "--text", (tmp / "absent.txt").string(), "--out", "/proc/x", "--json"});
  CHECK(r.exit_code == 2);
  CHECK(contains(parse_json(r.out)["error"].get<std::string>(), "--out /proc/x: cannot make"));
  // A name the filesystem takes, but not with the temporary's ".NAME.tmp-PID" around it: said
  // before the text is read too (a missing one is not what is said), and nothing is made.
  const std::string name(250, 'd');
  const auto long_name = run_dptrain(
      {"data", "prepare", "--text", (tmp / "absent.txt").string(), "--out", (tmp / name).string()});
  CHECK(long_name.exit_code == 2);
  CHECK(contains(long_name.err, "dptrain: error: --out " + (tmp / name).string() +
                                    ": a name of 250 bytes is too long: the dataset is written "
                                    "beside it first as .NAME.tmp-PID ("));
  CHECK(contains(long_name.err, "bytes), and names in " + tmp.path().string() +
                                    " are at most 255 bytes; give a shorter name\n"));
  CHECK(std::distance(fs::directory_iterator(tmp.path()), fs::directory_iterator()) == 1);
}

TEST_CASE("data --help and data prepare --help") {
  auto top = run_dptrain({"--help"});
  CHECK(top.exit_code == 0);
  CHECK(contains(top.out, "data"));
  auto data = run_dptrain({"data", "--help"});
  CHECK(data.exit_code == 0);
  CHECK(contains(data.out, "prepare"));
  auto help = run_dptrain({"data", "prepare", "--help"});
  CHECK(help.exit_code == 0);
  for (const char* option :
       {"--text", "--out", "--tokenizer", "--val-fraction", "--dtype", "--force", "--json"})
    CHECK(contains(help.out, option));
  CHECK(run_dptrain({"data"}).exit_code == 2);  // a subcommand is required
}

TEST_CASE("a gpt recipe pointing at a prepared dataset validates") {
  TempDir tmp;
  const auto recipe = write_recipe(tmp.path(), nlohmann::json::parse(R"({
    "model": {"type": "gpt", "vocab": 256, "context": 32, "layers": 1, "heads": 2, "width": 16},
    "data": {"type": "tokens", "path": "ds"}
  })"));
  // Before the dataset is made: valid (it may live on the training hosts only), with a warning
  // naming the path, on stderr and in --json.
  const std::string missing_warning =
      recipe.string() + ": /data/path: \"" + (tmp / "ds").string() + "\" is not there";
  auto before = run_dptrain({"recipe", "validate", recipe.string()});
  CHECK(before.exit_code == 0);
  CHECK(contains(before.out, ": ok (recipe"));
  CHECK(lines_of(before.err).size() == 1);
  CHECK(contains(before.err, "dptrain: warning: " + missing_warning));
  CHECK(contains(before.err, "dptrain data prepare"));
  auto before_json = run_dptrain({"recipe", "validate", recipe.string(), "--json"});
  CHECK(before_json.exit_code == 0);
  const auto before_out = parse_json(before_json.out);
  CHECK(before_out["valid"] == true);
  REQUIRE(before_out["warnings"].size() == 1);
  CHECK(contains(before_out["warnings"][0].get<std::string>(), missing_warning));
  // show says it as validate does: on stderr, and in its --json.
  auto shown_before = run_dptrain({"recipe", "show", recipe.string(), "--json"});
  CHECK(shown_before.exit_code == 0);
  CHECK(parse_json(shown_before.out)["warnings"] == before_out["warnings"]);
  CHECK(contains(shown_before.err, "dptrain: warning: " + missing_warning));

  write_text(tmp / "corpus.txt", synthetic_text(6, 5000));
  prepare_json({"--text", (tmp / "corpus.txt").string(), "--out", (tmp / "ds").string()});
  auto r = run_dptrain({"recipe", "validate", recipe.string(), "--json"});
  INFO(r.out, r.err);
  CHECK(r.exit_code == 0);
  CHECK(parse_json(r.out)["valid"] == true);
  CHECK(parse_json(r.out)["warnings"].empty());
  CHECK(r.err.empty());
  // A model whose vocabulary the dataset's passes, or whose window its validation split cannot
  // fill: refused by validate as a launch refuses it, from the headers.
  write_text(tmp / "small.txt", synthetic_text(7, 300));
  prepare_json({"--text", (tmp / "small.txt").string(), "--out", (tmp / "small").string(),
                "--tokenizer", "char"});
  fs::create_directory(tmp / "other");
  const auto small_vocab = write_recipe(tmp / "other", nlohmann::json::parse(R"({
    "model": {"type": "gpt", "vocab": 8, "context": 64, "layers": 1, "heads": 2, "width": 16},
    "data": {"type": "tokens", "path": "../small"}
  })"));
  auto refused = run_dptrain({"recipe", "validate", small_vocab.string()});
  CHECK(refused.exit_code == 2);
  CHECK(contains(refused.err, small_vocab.string() +
                                  ": /model/vocab: 8 is smaller than the "
                                  "vocabulary of " +
                                  (tmp / "small/train.bin").string()));
  auto shown = run_dptrain({"recipe", "show", recipe.string()});
  REQUIRE(shown.exit_code == 0);
  // The relative path resolves against the recipe's folder to the dataset just written.
  const auto resolved = parse_json(shown.out);
  CHECK(resolved["data"]["path"] == (tmp / "ds").string());

  // And the library reads it as the run would.
  dptrain::DataSpec data;
  data.type = "tokens";
  data.path = resolved["data"]["path"];
  dptrain::ModelSpec model;
  model.type = "gpt";
  model.vocab = 256;
  model.context = 32;
  const auto splits = dptrain::load_token_data(data, model);
  CHECK(splits.train->size() == 4500 - 32);
  CHECK(splits.eval->size() == (500 - 1) / 32);
}
