// "Did you mean ...?" for unknown keys and attributes.
#include "core/suggest.hpp"

#include <algorithm>
#include <cctype>
#include <limits>

namespace dptrain {

std::string lowercase(std::string_view text) {
  std::string result(text);
  for (char& c : result)
    c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return result;
}

size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j)
    row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

std::optional<std::string> closest_match(std::string_view given,
                                         const std::vector<std::string>& known_words) {
  constexpr size_t kMaxTypoDistance = 2;
  // Regardless of case ("FP16" is fp16, not bf16 two edits away); the known word as it is
  // spelt.
  const std::string unknown = lowercase(given);
  std::vector<std::string> known;
  for (const auto& word : known_words)
    known.push_back(lowercase(word));
  const auto one_prefixes_other = [](std::string_view a, std::string_view b) {
    return !a.empty() && !b.empty() && (a.starts_with(b) || b.starts_with(a));
  };
  std::optional<std::string> best;
  size_t best_distance = std::numeric_limits<size_t>::max();
  // The start of a name ("--temp" for "--temperature", "lr_sch" for "lr_schedule") is what was
  // meant before a short name a couple of edits away ("--help"): the shortest such name wins.
  if (unknown.find_first_not_of('-') != std::string_view::npos &&
      unknown.size() - unknown.find_first_not_of('-') >= 2) {
    for (size_t i = 0; i < known.size(); ++i) {
      const std::string& candidate = known[i];
      if (candidate.size() > unknown.size() && candidate.starts_with(unknown) &&
          candidate.size() < best_distance) {
        best = known_words[i];
        best_distance = candidate.size();
      }
    }
    if (best) return best;
  }
  for (size_t i = 0; i < known.size(); ++i) {
    const size_t distance = edit_distance(unknown, known[i]);
    const bool close = distance <= kMaxTypoDistance || one_prefixes_other(unknown, known[i]);
    if (close && distance < best_distance) {
      best = known_words[i];
      best_distance = distance;
    }
  }
  return best;
}

}  // namespace dptrain
