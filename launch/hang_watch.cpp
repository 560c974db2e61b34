// The launcher's side of hang attribution.
#include "launch/hang_watch.hpp"

#include <algorithm>
#include <functional>
#include <limits>
#include <map>
#include <optional>
#include <vector>

#include <fmt/format.h>

#include "core/heartbeat.hpp"

namespace dptrain {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

HangWatch::HangWatch(Store& store, int world_size, std::chrono::milliseconds timeout,
                     RankName rank_name)
    : store_(store),
      world_size_(world_size),
      timeout_(timeout),
      rank_name_(std::move(rank_name)),
      next_read_(Clock::now()) {}

void HangWatch::started(const std::vector<int>& ranks) {
  const auto now = Clock::now();
  for (int r : ranks)
    note_started(r, now);
}

void HangWatch::note_started(int rank, Clock::time_point now) {
  if (rank < 0 || rank >= world_size_ || !started_.try_emplace(rank, now).second) return;
  if (static_cast<int>(started_.size()) == world_size_) assembled_ = now;
}

std::optional<std::string> HangWatch::check() {
  const auto now = Clock::now();
  if (now < next_read_) return std::nullopt;
  next_read_ = now + std::chrono::seconds(1);
  last_read_ = now;
  std::vector<std::optional<json>> heard;
  try {
    heard = read_heartbeats(store_, world_size_);  // one request for every rank's
  } catch (const std::exception&) {
    return std::nullopt;  // the store is the launcher's own; a hiccup is not a hang
  }
  for (int r = 0; r < world_size_; ++r) {
    try {
      if (!heard[static_cast<size_t>(r)]) continue;
      const json& beat = *heard[static_cast<size_t>(r)];
      if (!first_heard_) first_heard_ = now;
      note_started(r, now);  // (an agent that does not say it started its ranks)
      Seen& s = seen_[r];
      const int64_t progress = beat.value("progress", int64_t{-1});
      if (progress != s.progress) {
        s.progress = progress;
        s.since = now;
      }
      if (const int64_t beats = beat.value("beat", int64_t{-1}); beats != s.beats) {
        s.beats = beats;
        s.heard = now;
      }
      s.beat = beat;
    } catch (const std::exception&) {
      return std::nullopt;  // a beat whose fields do not read: not a hang either
    }
  }
  // A rank waiting in a collective is as stalled as the job: while another rank still makes
  // progress (the workers' eval chunks, which parameter servers wait out in the eval's
  // all-reduce), it is only waiting for it. A rank that is not in a collective (stuck in its
  // step) counts by its own clock, and so do ranks that all wait in collectives.
  // A rank still starting (loading its data) while another waits for it in a collective is not
  // hung as long as its heartbeat goes on: that wait is bounded by distributed.timeout_s, and a
  // large dataset may take longer to load than a step may take. Once its heartbeat stops
  // (frozen), it counts from then. Where no rank waits for it (one rank, or every rank starting),
  // nothing else bounds the start: it counts as any phase does.
  const bool someone_waits = std::any_of(seen_.begin(), seen_.end(), [](const auto& entry) {
    return entry.second.beat.value("phase", "") == "collective";
  });
  const auto since = [&](const Seen& s) {
    using std::chrono::duration_cast;
    using std::chrono::milliseconds;
    if (someone_waits && s.beats >= 0 && s.beat.value("phase", "") == "starting") {
      const auto quiet = duration_cast<milliseconds>(now - s.heard);
      return quiet > kSilentAfter ? quiet : milliseconds(0);
    }
    return duration_cast<milliseconds>(now - s.since);
  };
  std::optional<std::chrono::milliseconds> freshest;
  for (const auto& [rank, s] : seen_) {
    if (s.beat.value("phase", "") == "done") continue;
    freshest = freshest ? std::min(*freshest, since(s)) : since(s);
  }
  std::chrono::milliseconds stalled{0};
  for (const auto& [rank, s] : seen_) {
    if (s.beat.value("phase", "") == "done") continue;
    const bool waiting = s.beat.value("phase", "") == "collective";
    stalled = std::max(stalled, waiting ? std::min(since(s), *freshest) : since(s));
  }
  // Until every rank was started (a host still being reached) no rank can progress: the ranks
  // wait for the job to assemble, and their time without progress counts from when it did.
  stalled = assembled_
                ? std::min(stalled,
                           std::chrono::duration_cast<std::chrono::milliseconds>(now - *assembled_))
                : std::chrono::milliseconds(0);
  // A rank that never beat, since it was started and while another has, for longer than the
  // timeout: frozen, or unable to reach the store, before it joined (the others wait for it to
  // meet). One whose host has not started it yet is not counted.
  std::map<int, json> beats;
  if (first_heard_ && static_cast<int>(seen_.size()) < world_size_) {
    for (const auto& [r, start] : started_) {
      if (seen_.count(r)) continue;
      const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(
          now - std::max(*first_heard_, start));
      beats[r] = {{"never_ms", waited.count()}};
      stalled = std::max(stalled, waited);
    }
  }
  if (timeout_.count() <= 0 || stalled <= timeout_) return std::nullopt;
  for (const auto& [rank, s] : seen_)
    beats[rank] = s.beat;
  for (const auto& [rank, ms] : silent_at(now))
    beats[rank]["silent_ms"] = ms;
  return describe(beats, stalled, rank_name_);
}

std::map<int, int64_t> HangWatch::silent_at(Clock::time_point now) const {
  std::map<int, int64_t> out;
  for (const auto& [rank, s] : seen_) {
    // A heartbeat thread sends at least every second: silence well beyond that is a process
    // that is stopped (SIGSTOP, a debugger, swapping) or unreachable.
    const auto silent = std::chrono::duration_cast<std::chrono::milliseconds>(now - s.heard);
    if (s.beats >= 0 && silent > kSilentAfter) out[rank] = silent.count();
  }
  return out;
}

std::map<int, int64_t> HangWatch::silent() const {
  return silent_at(last_read_);
}

std::string HangWatch::describe(const std::map<int, json>& beats,
                                std::chrono::milliseconds stalled_for, const RankName& rank_name) {
  return fmt::format("hang: no progress for {}s; ",
                     std::chrono::duration_cast<std::chrono::seconds>(stalled_for).count()) +
         positions(beats, rank_name);
}

namespace {

// "#12 (allreduce of the loss)": a collective by number and, where the rank said, by name.
std::string collective(const json& beat) {
  const auto seq = beat.value("seq", int64_t{0});
  const std::string what = beat.value("collective", std::string());
  return what.empty() ? fmt::format("#{}", seq) : fmt::format("#{} ({})", seq, what);
}

}  // namespace

std::string HangWatch::position(const json& beat) {
  const std::string phase = beat.value("phase", std::string("?"));
  // Before the training loop a rank's step is not the run's (0 until a resume's checkpoint is
  // loaded): where it was in its start-up is what counts.
  if (!beat.value("stepping", true)) {
    return phase == "collective" ? fmt::format("start-up, in collective {}", collective(beat))
                                 : fmt::format("start-up, after collective {}", collective(beat));
  }
  const int64_t step = beat.value("step", int64_t{0});
  if (phase == "collective") return fmt::format("step {} in collective {}", step, collective(beat));
  return fmt::format("step {} in phase {} (after collective {})", step, phase, collective(beat));
}

std::string HangWatch::positions(const std::map<int, json>& beats, const RankName& rank_name) {
  const auto name = [&rank_name](int rank) {
    return rank_name ? rank_name(rank) : fmt::format("rank {}", rank);
  };
  // The ranks that entered the most collectives wait in the last one; the others are behind.
  int64_t max_seq = -1;
  for (const auto& [rank, beat] : beats)
    max_seq = std::max(max_seq, beat.value("seq", int64_t{0}));
  const bool unjoined = std::any_of(beats.begin(), beats.end(),
                                    [](const auto& b) { return b.second.contains("never_ms"); });
  // A rank that is frozen or gone holds up every collective it has not finished: a live rank
  // waiting in an earlier collective than the last one (the ones the silent rank's peers in a
  // ring could not finish) waits for it too, and is not stuck itself. Not one in a collective
  // before the silent rank's last word, which that rank has left (its heartbeat may lag what it
  // did, never lead): it is held up by something else. A rank that never joined holds up all.
  int64_t silent_from = std::numeric_limits<int64_t>::max();
  for (const auto& [rank, beat] : beats) {
    if (beat.contains("never_ms")) silent_from = std::min<int64_t>(silent_from, 0);
    if (beat.contains("silent_ms"))
      silent_from = std::min(silent_from, beat.value("seq", int64_t{0}));
  }
  std::vector<std::string> behind, joining;
  // Live ranks waiting in a collective, by its number (the latest first): its name, and theirs.
  std::map<int64_t, std::pair<std::string, std::vector<std::string>>, std::greater<>> waiting;
  for (const auto& [rank, beat] : beats) {
    const int64_t seq = beat.value("seq", int64_t{0});
    const std::string phase = beat.value("phase", std::string("?"));
    const int64_t step = beat.value("step", int64_t{0});
    if (beat.contains("never_ms")) {
      behind.push_back(
          fmt::format("{} (no heartbeat in the {}s the others waited: frozen, or "
                      "unable to reach the store, before it joined)",
                      name(rank), beat["never_ms"].get<int64_t>() / 1000));
    } else if (beat.contains("silent_ms")) {
      // Frozen or gone: its last word may be a collective or two behind what it really did.
      behind.push_back(fmt::format(
          "{} (its heartbeat stopped {}s ago: frozen or unreachable; it last said {})", name(rank),
          beat["silent_ms"].get<int64_t>() / 1000,
          !beat.value("stepping", true) ? position(beat)
          : phase == "collective" ? fmt::format("step {}, in collective {}", step, collective(beat))
                                  : fmt::format("step {}, phase {} after collective {}", step,
                                                phase, collective(beat))));
    } else if (unjoined && phase == "starting") {
      joining.push_back(name(rank));
    } else if (phase == "collective" && (seq == max_seq || seq >= silent_from)) {
      auto& group = waiting[seq];
      if (group.second.empty()) group.first = collective(beat);
      group.second.push_back(name(rank));
    } else {
      behind.push_back(fmt::format("{} at {}", name(rank), position(beat)));
    }
  }
  if (behind.empty()) {
    return fmt::format(
        "every rank waits in collective {} (a network or transport problem?)",
        waiting.empty() ? fmt::format("#{}", max_seq) : waiting.begin()->second.first);
  }
  const char* them = behind.size() == 1 ? "it" : "them";
  std::string text = fmt::format("stuck: {}", fmt::join(behind, ", "));
  for (const auto& [seq, group] : waiting) {
    const std::string names = fmt::format("{}", fmt::join(group.second, ", "));
    text += seq == waiting.begin()->first
                ? fmt::format("; waiting for {} in collective {}: {}", them, group.first, names)
                : fmt::format("; and in collective {}: {}", group.first, names);
  }
  if (!joining.empty())
    text += fmt::format("; waiting for {} to join: {}", them, fmt::join(joining, ", "));
  return text;
}

}  // namespace dptrain
