// The ranks' agreement to start (world size, every rank able to, NCCL or Gloo), through the store.
#include "core/comm/start_agreement.hpp"

#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string_view>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "core/comm/communicator.hpp"
#include "core/comm/net.hpp"
#include "core/error.hpp"

namespace dptrain {

namespace {

constexpr const char* kChoiceKey = "backend/choice";

// Each rank's answer: "W ok", "W no WHY" (it cannot use NCCL) or "W refused KIND MESSAGE" (it
// cannot start), W its world size.
std::string answer_key(int rank) {
  return fmt::format("backend/nccl/{}", rank);
}

// The ranks 1..end-1 that have not posted their answer yet (one store request). Throws the
// store's error.
std::vector<int> unanswered(Store& store, int end) {
  std::vector<int> silent;
  const auto answers = store.peek(rank_keys(answer_key, 1, end));
  for (int r = 1; r < end; ++r) {
    if (!answers[static_cast<size_t>(r - 1)]) silent.push_back(r);
  }
  return silent;
}

// Posted by each rank other than 0 once it read the choice or refused: rank 0, serving the store,
// keeps it up until then (wait_until_told).
std::string told_key(int rank) {
  return fmt::format("backend/told/{}", rank);
}

// The leading number of "N rest" and the rest; -1 when there is none.
std::pair<int, std::string> split_number(const std::string& text) {
  const size_t space = text.find(' ');
  const char* const end = text.data() + (space == std::string::npos ? text.size() : space);
  int number = -1;
  if (const auto [ptr, ec] = std::from_chars(text.data(), end, number);
      ec != std::errc() || ptr != end) {
    number = -1;
  }
  return {number, space == std::string::npos ? std::string() : text.substr(space + 1)};
}

// A kind as a refusal carries it: its name, one word ("usage_error").
std::string kind_word(ErrorKind kind) {
  std::string word = kind_name(kind);
  std::replace(word.begin(), word.end(), ' ', '_');
  return word;
}

// "KIND MESSAGE" of a refusal, as the Error it stands for, told to `rank` about rank `other`
// ("rank R: rank P cannot start: MESSAGE"); a kind this build does not know is a communication
// error. With `failed`, a failure after the start: "failed", and a communication error.
Error refusal_error(int rank, int other, const std::string& text, bool failed = false) {
  const size_t space = text.find(' ');
  const std::string word = text.substr(0, space);
  ErrorKind kind = ErrorKind::comm;
  std::string message = text;
  for (int k = 0; k <= static_cast<int>(ErrorKind::terminated); ++k) {
    if (kind_word(static_cast<ErrorKind>(k)) == word) {
      kind = static_cast<ErrorKind>(k);
      message = space == std::string::npos ? std::string() : text.substr(space + 1);
    }
  }
  // A peer stopped by a signal (it posts that where no launcher stops the others with it): the
  // stop, with its exit code, whenever it came.
  if (kind == ErrorKind::terminated || kind == ErrorKind::interrupted) {
    return Error(kind, fmt::format("rank {}: rank {} {}", rank, other, message));
  }
  return Error(failed ? ErrorKind::comm : kind,
               fmt::format("rank {}: rank {} {}: {}", rank, other,
                           failed ? "failed" : "cannot start", message));
}

// "KIND MESSAGE" of `error`, without the leading "rank R: " of its text.
std::string posted_error(int rank, const Error& error) {
  std::string message = error.what();
  if (const std::string own = fmt::format("rank {}: ", rank); message.starts_with(own)) {
    message.erase(0, own.size());
  }
  return fmt::format("{} {}", kind_word(error.kind()), message);
}

std::string failed_key(int rank) {
  return fmt::format("failed/{}", rank);
}

std::string heard_key(int rank) {
  return fmt::format("heard/{}", rank);
}

Error other_size(int rank, int world, int other, int given, const char* whose) {
  return Error(
      ErrorKind::usage,
      fmt::format("rank {}: {}", rank, world_size_mismatch(other, whose, world, given, "answer")));
}

// What `waited_for` posted under `key`, waiting up to `timeout` (`said`, in the message, is the
// wait the reader was promised); its absence then is a KeyTimeout naming it. Other failures (a
// store that is gone, a refused secret) say themselves.
std::string read_posted(Store& store, const std::string& key, int rank,
                        const std::string& waited_for, std::chrono::milliseconds timeout,
                        std::chrono::milliseconds said) {
  try {
    return store.get(key, timeout);
  } catch (const KeyTimeout&) {
    throw KeyTimeout(fmt::format("rank {}: {} within {} (nothing from it at {}); {}", rank,
                                 waited_for, format_timeout(said), store.describe(),
                                 join_hint(said, store.join_advice())));
  }
}

std::string read_posted(Store& store, const std::string& key, int rank,
                        const std::string& waited_for, std::chrono::milliseconds timeout) {
  return read_posted(store, key, rank, waited_for, timeout, timeout);
}

// This process as the kernel tells it from any other on the machine: its pid namespace, pid and
// start time (in clock ticks since boot; a pid reused later starts later). Empty when /proc does
// not say.
std::string process_identity(pid_t pid) {
  std::error_code ec;
  const auto ns = std::filesystem::read_symlink(fmt::format("/proc/{}/ns/pid", pid), ec);
  std::ifstream stat(fmt::format("/proc/{}/stat", pid));
  std::string text;
  std::getline(stat, text);
  // The fields after the command's name, which may hold spaces and parentheses: state is the
  // first, the start time the twentieth.
  const size_t close = text.rfind(')');
  if (ec || close == std::string::npos) return {};
  std::istringstream fields(text.substr(close + 1));
  std::string field, state, start;
  for (int i = 1; fields >> field && i <= 20; ++i) {
    if (i == 1) state = field;
    if (i == 20) start = field;
  }
  if (start.empty() || state == "Z" || state == "X") return {};  // gone, or a zombie
  return fmt::format("{} {} {}", ns.string(), pid, start);
}

// A second process given the rank of one still waiting to start on this machine (a script's
// slip, two started where one was meant): Error(usage) naming it, at once. Each process that
// joins as `rank` claims a number (the store's counter) and posts "HOST IDENTITY" under it; an
// earlier claim of this machine whose process still lives is the duplicate's reason. One that
// is gone is no reason (this may be its start again), nor is one on another machine: its pid
// says nothing here (a duplicate there is refused once the first runs the job: backend/met).
// This machine in a claim: its name and boot id ("HOST|BOOT"), so that a clone of it under the
// same name (a copied VM) is another machine.
std::string claim_machine() {
  std::string boot;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> boot;
  return this_host() + "|" + boot;
}

// A claim, "MACHINE IDENTITY" (claim_machine, process_identity), as this machine can tell it.
struct Claim {
  enum class Is { elsewhere, alive, gone } is = Is::elsewhere;  // elsewhere: cannot be told
  pid_t pid = 0;
  std::string host;
};
Claim read_claim(const std::string& claim, const std::string& host) {
  Claim out;
  const size_t space = claim.find(' ');
  const std::string machine = claim.substr(0, space);
  out.host = machine.substr(0, machine.find('|'));  // its name, for messages
  if (space == std::string::npos || machine != host) return out;
  const std::string identity = claim.substr(space + 1);
  // "NS PID START": the same process, if it still lives, reads the same now. One of another pid
  // namespace (a container sharing this host's name) cannot be looked at from here.
  std::istringstream parts(identity);
  std::string ns;
  if (!(parts >> ns >> out.pid) || out.pid <= 0) return out;
  std::istringstream mine(process_identity(::getpid()));
  std::string my_ns;
  if (!(mine >> my_ns) || my_ns != ns) return out;
  out.is = process_identity(out.pid) == identity ? Claim::Is::alive : Claim::Is::gone;
  return out;
}

void refuse_duplicate_start(Store& store, int rank) {
  const std::string host = claim_machine();
  const std::string me = process_identity(::getpid());
  if (me.empty()) return;
  const std::string base = fmt::format("backend/claim/{}", rank);
  const int64_t number = store.add(base, 1);
  store.set(fmt::format("{}/{}", base, number), host + " " + me);
  for (int64_t earlier = 1; earlier < number; ++earlier) {
    const std::string key = fmt::format("{}/{}", base, earlier);
    // Posted a moment after its number: one that never posts it died in between.
    std::string text;
    try {
      text = store.get(key, std::chrono::seconds(2));
    } catch (const Error&) {
      continue;
    }
    if (text == host + " " + me) continue;
    const Claim claim = read_claim(text, host);
    if (claim.is != Claim::Is::alive) continue;
    const pid_t pid = claim.pid;
    throw Error(
        ErrorKind::usage,
        fmt::format("rank {}: another process (pid {} on {}) is joining this job as rank {} "
                    "already (at {}): give each process its own rank",
                    rank, pid, claim.host, rank, store.describe()));
  }
}

}  // namespace

namespace {

// Set by a rank as it joins the job (its process, which a second one given the rank is told).
std::string met_key(int rank) {
  return fmt::format("backend/met/{}", rank);
}

}  // namespace

bool rank_met(Store& store, int rank) {
  return store.check({met_key(rank)});
}

// The ranks rank 0 looks at for JoinWait: beyond them, a request of a million keys every 10 s
// would cost more than the words are worth.
constexpr int kJoinLooked = 1024;

BackendChoice agree_to_start(Store& store, int rank, int world, bool required,
                             const std::string& why_not, std::chrono::milliseconds timeout,
                             const std::function<void(const JoinWait&)>& waiting,
                             std::chrono::milliseconds every) {
  // A second process given a rank that one running the job has (a script's slip): told at
  // once, rather than left in Gloo's rendezvous for a peer that paired with the first. One that
  // came before and still waits is a reason where it runs on this machine
  // (refuse_duplicate_start); one that is gone is none: it may be this one's earlier start.
  // The one that ran it and is gone (killed, say, and started again by hand or by a scheduler):
  // the job has failed with it, since a started job takes no rank back; its ranks all start
  // again. A communication error, as the rank's own failure was.
  const std::string met = met_key(rank);
  const std::string host = claim_machine();
  if (store.check({met})) {
    const Claim earlier = read_claim(store.get(met, std::chrono::seconds(2)), host);
    if (earlier.is == Claim::Is::gone) {
      throw Error(ErrorKind::comm,
                  fmt::format("rank {}: this job (at {}) started already, and its rank {} (pid "
                              "{}) is gone: a started job takes no rank back, so it has failed; "
                              "start every rank again (with --resume newest to continue from "
                              "the last checkpoint)",
                              rank, store.describe(), rank, earlier.pid));
    }
    throw Error(ErrorKind::usage,
                fmt::format("rank {}: another process {}joined this job as rank {} already and "
                            "runs it (at {}): give each process its own rank{}",
                            rank,
                            earlier.is == Claim::Is::alive
                                ? fmt::format("(pid {} on {}) ", earlier.pid, earlier.host)
                                : std::string(),
                            rank, store.describe(),
                            earlier.is == Claim::Is::alive
                                ? std::string()
                                : " (or, if that process is gone, start every rank again: a "
                                  "started job takes no rank back)"));
  }
  refuse_duplicate_start(store, rank);
  const std::string me = process_identity(::getpid());
  const auto agreed = [&](BackendChoice choice) {
    store.set(met, me.empty() ? std::string("1") : host + " " + me);
    return choice;
  };
  store.set(answer_key(rank),
            fmt::format("{} {}", world, why_not.empty() ? "ok" : "no " + why_not));
  if (required && !why_not.empty()) {
    // Rank 0's is the choice too: the others learn it at once.
    if (rank == 0) store.set(kChoiceKey, "fail 0 " + why_not);
    throw Error(ErrorKind::comm, fmt::format("rank {}: backend nccl: {}", rank, why_not));
  }
  std::string choice;
  if (rank == 0) {
    // For the first rank with a problem: "size R W" (it was given world size W) or "refused R
    // KIND MESSAGE" (it cannot start); else "gloo R WHY" / "fail R WHY" for the first rank that
    // cannot use NCCL, else "nccl".
    std::string refusal = why_not.empty() ? std::string() : "0 " + why_not;
    // One deadline for every answer: the others wait for the choice about as long as rank 0
    // waits for all of them, not for each in turn.
    const auto start = std::chrono::steady_clock::now();
    const auto deadline = start + timeout;
    // Who has not joined yet, of the first kJoinLooked ranks, for `waiting` (one request). Only
    // words: a store that does not answer it fails the wait that follows, if it is gone.
    const auto tell_waiting = [&] {
      JoinWait wait;
      wait.looked = std::min(world, kJoinLooked);
      try {
        const auto silent = unanswered(store, wait.looked);
        wait.missing_count = static_cast<int>(silent.size());
        wait.joined = wait.looked - wait.missing_count;
        wait.missing.assign(silent.begin(),
                            silent.begin() + std::min<ptrdiff_t>(8, wait.missing_count));
        wait.waited = std::chrono::duration_cast<std::chrono::milliseconds>(
            std::chrono::steady_clock::now() - start);
        waiting(wait);
      } catch (const Error&) {
      }
    };
    const bool tell = waiting && every > std::chrono::milliseconds(0);
    auto next_word = start + every;
    for (int r = 1; r < world && choice.empty(); ++r) {
      std::string answer;
      for (;;) {
        const auto now = std::chrono::steady_clock::now();
        const auto until = tell ? std::min(deadline, next_word) : deadline;
        try {
          answer = read_posted(
              store, answer_key(r), rank, fmt::format("rank {} of {} did not join", r, world),
              std::max(std::chrono::duration_cast<std::chrono::milliseconds>(until - now),
                       std::chrono::milliseconds(1)),
              timeout);
          break;
        } catch (const KeyTimeout&) {
          if (until < deadline) {
            next_word += every;
            tell_waiting();
            continue;
          }
          // The others learn which rank never came, rather than blame rank 0. (A store that
          // failed otherwise, gone or refusing, is not a rank's absence: that error stands.)
          try {
            store.set(kChoiceKey, fmt::format("absent {}", r));
          } catch (const Error&) {
          }
          throw;
        }
      }
      const auto [given, status] = split_number(answer);
      if (given != world) {
        choice = fmt::format("size {} {}", r, given);
      } else if (status.starts_with("refused ")) {
        choice = fmt::format("refused {} {}", r, status.substr(8));
      } else if (status != "ok" && refusal.empty()) {
        refusal = fmt::format("{} {}", r, status.starts_with("no ") ? status.substr(3) : status);
      }
    }
    if (choice.empty()) {
      choice = refusal.empty() ? "nccl" : (required ? "fail " : "gloo ") + refusal;
    }
    store.set(kChoiceKey, choice);
  } else {
    const int given =
        split_number(read_posted(store, answer_key(0), rank,
                                 fmt::format("rank 0 of {} did not join", world), timeout))
            .first;
    if (given != world) {
      try {
        store.set(told_key(rank), "1");  // rank 0 need not wait for it to read the choice
      } catch (const Error&) {
      }
      throw other_size(rank, world, 0, given, "this rank's");
    }
    // Longer than rank 0 waits for any one rank: it posts which one never came.
    choice =
        read_posted(store, kChoiceKey, rank, "rank 0 posted no choice of backend", 2 * timeout);
    try {
      store.set(told_key(rank), "1");
    } catch (const Error&) {
    }
  }
  if (choice == "nccl") return agreed({"nccl", -1, {}});
  const size_t space = choice.find(' ');
  const std::string kind = choice.substr(0, space);
  const auto [other, rest] =
      split_number(space == std::string::npos ? std::string() : choice.substr(space + 1));
  if (kind == "size") {
    throw other_size(rank, world, other, split_number(rest).first,
                     rank == 0 ? "this rank's" : "rank 0's");
  }
  if (kind == "refused") throw refusal_error(rank, other, rest);
  if (kind == "absent") {
    throw Error(ErrorKind::comm,
                fmt::format("rank {}: rank {} of {} did not join within {} (rank 0 waited for it "
                            "at {}); {}",
                            rank, other, world, format_timeout(timeout), store.describe(),
                            join_hint(timeout, store.join_advice())));
  }
  if (kind == "fail") {
    throw Error(ErrorKind::comm, fmt::format("rank {}: backend nccl: rank {} cannot use NCCL: {}",
                                             rank, other, rest));
  }
  if (kind == "gloo") return agreed({"gloo", other, rest});
  throw Error(ErrorKind::comm,
              fmt::format("rank {}: the store's '{}' is not a choice of backend: '{}'", rank,
                          kChoiceKey, choice));
}

void refuse_to_start(Store& store, int rank, int world, const Error& error) {
  const std::string refusal = posted_error(rank, error);
  store.set(answer_key(rank), fmt::format("{} refused {}", world, refusal));
  if (rank == 0) {
    store.set(kChoiceKey, "refused 0 " + refusal);
  } else {
    store.set(told_key(rank), "1");
  }
}

void report_failure(Store& store, int rank, const Error& error) {
  store.set(failed_key(rank), posted_error(rank, error));
  store.set(heard_key(rank), "1");  // nothing to look for: rank 0 need not wait for it
}

std::optional<Error> peer_failure(Store& store, int rank, int world, bool stepping) {
  std::optional<Error> found;
  try {
    const auto posted = store.peek(rank_keys(failed_key, 0, world));
    for (int r = 0; r < world && !found; ++r) {
      if (r != rank && posted[static_cast<size_t>(r)]) {
        found = refusal_error(rank, r, *posted[static_cast<size_t>(r)], stepping);
      }
    }
    store.set(heard_key(rank), "1");
  } catch (const Error&) {
    // The store is gone too: nothing to learn there.
  }
  return found;
}

namespace {

// Waits up to `bound` for every rank but 0 to post its key(rank); those that have not by then
// come too late to learn anything.
void wait_for_others(Store& store, int world, std::string (*key)(int),
                     std::chrono::milliseconds bound, const std::vector<int>& gone = {}) {
  std::vector<std::string> keys;
  for (int r = 1; r < world; ++r) {
    if (std::find(gone.begin(), gone.end(), r) == gone.end()) keys.push_back(key(r));
  }
  try {
    if (!keys.empty()) store.wait(keys, bound);
  } catch (const Error&) {
  }
}

}  // namespace

void wait_until_heard(Store& store, int world, std::chrono::milliseconds bound,
                      const std::vector<int>& gone) {
  wait_for_others(store, world, heard_key, bound, gone);
}

void wait_until_told(Store& store, int world, std::chrono::milliseconds bound, bool answered_only) {
  std::vector<int> silent;
  if (answered_only) {
    try {
      silent = unanswered(store, world);
    } catch (const Error&) {
    }
  }
  wait_for_others(store, world, told_key, bound, silent);
}

namespace {

std::string generation_key(int rank) {
  return fmt::format("generation/{}", rank);
}
constexpr const char* kAnyGenerationKey = "generation/any";

// What a generation key says ("RANK GENERATION"), where it is another rank's and another
// generation.
std::optional<OtherGeneration> posted_generation(const std::optional<std::string>& said, int rank,
                                                 int generation) {
  if (!said) return std::nullopt;
  const auto [other, rest] = split_number(*said);
  const int theirs = split_number(rest).first;
  if (other < 0 || theirs < 1 || other == rank || theirs == generation) return std::nullopt;
  return OtherGeneration{other, theirs};
}

}  // namespace

void say_generation(Store& root, int rank, int generation) {
  const std::string said = fmt::format("{} {}", rank, generation);
  root.set(generation_key(rank), said);
  if (rank != 0) root.set(kAnyGenerationKey, said);
}

std::optional<OtherGeneration> other_generation(Store& root, int rank, int world, int generation,
                                                bool waited_out) {
  constexpr int kMaxLooked = 1024;
  std::vector<std::string> keys;
  if (rank == 0 || waited_out) {
    keys = rank_keys(generation_key, 0, std::min(world, kMaxLooked));
    keys.push_back(kAnyGenerationKey);
  } else {
    keys.push_back(generation_key(0));
  }
  for (const auto& said : root.peek(keys)) {
    const auto other = posted_generation(said, rank, generation);
    if (other && (waited_out || other->generation > generation)) return other;
  }
  return std::nullopt;
}

Error refuse_other_generation(Store& root, int rank, int world, int generation,
                              const std::string& generation_from, const OtherGeneration& other,
                              bool serves_store) {
  const Error refusal(ErrorKind::usage,
                      fmt::format("rank {} was started with generation {}, rank {} with {} (from "
                                  "{}): start every rank with the same generation",
                                  other.rank, other.generation, rank, generation, generation_from));
  std::vector<int> generations = {generation};
  if (serves_store || other.generation < generation) generations.push_back(other.generation);
  for (const int g : generations) {
    try {
      PrefixStore store(generation_prefix(g), root);
      refuse_to_start(store, rank, world, refusal);
    } catch (const Error&) {
      // The store went meanwhile: nobody is left to tell there.
    }
  }
  return refusal;
}

}  // namespace dptrain
