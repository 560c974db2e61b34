// The launcher's side of hang attribution: reads every rank's heartbeat from the store and,
// when progress stops for longer than the timeout, names who is behind and who waits for them.
#pragma once

#include <chrono>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/comm/store.hpp"

namespace dptrain {

class HangWatch {
 public:
  // How a rank is named in messages: "rank 3", or "rank 3 on node2" in a multi-host job.
  using RankName = std::function<std::string(int)>;

  // `store` is the generation's prefix store (the launcher's own client). A timeout of 0 only
  // watches: check() never finds a hang, and silent() says who had stopped beating.
  HangWatch(Store& store, int world_size, std::chrono::milliseconds timeout,
            RankName rank_name = {});

  // These ranks were started now (the launcher started its own; a host's agent said it started
  // its): they beat before they meet, so one that never beats for longer than the timeout, both
  // since it was started and since another rank first beat, is named as never having joined.
  // A rank not said to be started is not waited for (its host may still be being reached), and
  // until every rank was started no rank's lack of progress counts (none can progress).
  void started(const std::vector<int>& ranks);

  // Call often; reads the store at most once a second. A message naming the stuck rank(s), their
  // step and phase, and the ranks waiting for them, once some rank made no progress for longer
  // than the timeout; nothing otherwise.
  std::optional<std::string> check();

  // The ranks whose heartbeat had stopped (for longer than kSilentAfter) when check() last read
  // the store, and for how many milliseconds: what a failure that came then is told about a
  // frozen rank, since its last heartbeat alone does not show it.
  std::map<int, int64_t> silent() const;

  // A rank whose heartbeat has not changed for this long is named as frozen or unreachable (its
  // sender writes every second).
  static constexpr std::chrono::milliseconds kSilentAfter{3000};

  // The verdict from heartbeats as they are (exposed for tests). A beat with "silent_ms" is from a
  // rank whose heartbeat stopped that long ago (frozen or gone): what it says may be stale.
  static std::string describe(const std::map<int, nlohmann::json>& beats,
                              std::chrono::milliseconds stalled_for,
                              const RankName& rank_name = {});
  // Its part after "hang: no progress for Ns; ": who is behind, and who waits for them in which
  // collective ("stuck: rank 1 at step 15 in phase data (after collective #31); waiting for
  // it in collective #32: rank 0"), or that every rank waits in one collective.
  static std::string positions(const std::map<int, nlohmann::json>& beats,
                               const RankName& rank_name = {});
  // Where one rank's heartbeat says it is: "step 15 in phase data (after collective #31)" or
  // "step 15 in collective #32 (allreduce of the loss)".
  static std::string position(const nlohmann::json& beat);
  // Whether a rank's error says a collective (or a wait) timed out (Gloo's "Timed out", ours
  // "timed out"): then it names the rank that gave up waiting, and positions() the one waited
  // for.
  static bool timed_out(std::string_view error) {
    return error.find("timed out") != std::string_view::npos ||
           error.find("Timed out") != std::string_view::npos;
  }

 private:
  struct Seen {
    int64_t progress = -1;
    std::chrono::steady_clock::time_point since;  // when progress last changed
    int64_t beats = -1;
    std::chrono::steady_clock::time_point heard;  // when its heartbeat last changed at all
    nlohmann::json beat;
  };
  Store& store_;
  int world_size_;
  std::chrono::milliseconds timeout_;
  RankName rank_name_;
  // The ranks whose heartbeat had stopped at `now`, and for how many milliseconds.
  std::map<int, int64_t> silent_at(std::chrono::steady_clock::time_point now) const;

  void note_started(int rank, std::chrono::steady_clock::time_point now);
  // When each rank was started (started(), or its first beat), and when the last one was.
  std::map<int, std::chrono::steady_clock::time_point> started_;
  std::optional<std::chrono::steady_clock::time_point> assembled_;
  std::optional<std::chrono::steady_clock::time_point> first_heard_;  // any rank's first beat
  std::chrono::steady_clock::time_point next_read_;
  std::chrono::steady_clock::time_point last_read_;
  std::map<int, Seen> seen_;
};

}  // namespace dptrain
