// "Did you mean ...?" for unknown keys and attributes.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace dptrain {

size_t edit_distance(std::string_view a, std::string_view b);

// `text` in lower case (ASCII): names compared regardless of case.
std::string lowercase(std::string_view text);

// The known word closest to `given` if it is a plausible typo of it, regardless of case: the
// shortest one that `given` (two characters or more besides leading dashes) starts, else one at
// most two edits away, or one that is a prefix of the other.
std::optional<std::string> closest_match(std::string_view given,
                                         const std::vector<std::string>& known_words);

}  // namespace dptrain
