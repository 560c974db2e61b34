// Synthetic English-like text for token-model tests: a small seeded grammar with agreement, so a
// small model can learn it far below its unigram entropy.
#pragma once

#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace dptrain::test {

namespace text_corpus_detail {

// SplitMix64: platform-stable, unlike the standard distributions.
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }
  bool chance(double p) { return static_cast<double>(next() >> 11) * 0x1.0p-53 < p; }
  template <class T, size_t N>
  const T& pick(const std::array<T, N>& items) {
    return items[next() % N];
  }

 private:
  uint64_t state_;
};

struct Noun {
  const char* one;
  const char* many;
};
struct Verb {
  const char* third;  // "the dog sees"
  const char* base;   // "the dogs see", "does the dog see"
};

// Animate nouns are subjects and the objects of verbs of living things; things are not subjects.
inline constexpr std::array<Noun, 7> kAnimals = {{{"dog", "dogs"},
                                                  {"cat", "cats"},
                                                  {"bird", "birds"},
                                                  {"child", "children"},
                                                  {"man", "men"},
                                                  {"woman", "women"},
                                                  {"fox", "foxes"}}};
inline constexpr std::array<Noun, 7> kThings = {{{"ball", "balls"},
                                                 {"tree", "trees"},
                                                 {"house", "houses"},
                                                 {"car", "cars"},
                                                 {"book", "books"},
                                                 {"box", "boxes"},
                                                 {"apple", "apples"}}};
inline constexpr std::array<const char*, 5> kAnimalAdjectives = {"small", "big", "old", "happy",
                                                                 "young"};
inline constexpr std::array<const char*, 6> kThingAdjectives = {"small", "big",   "old",
                                                                "red",   "green", "heavy"};
inline constexpr std::array<Verb, 3> kSeesAnything = {
    {{"sees", "see"}, {"likes", "like"}, {"watches", "watch"}}};
inline constexpr std::array<Verb, 2> kAnimalVerbs = {{{"chases", "chase"}, {"follows", "follow"}}};
inline constexpr std::array<Verb, 3> kThingVerbs = {
    {{"finds", "find"}, {"carries", "carry"}, {"wants", "want"}}};
inline constexpr std::array<Verb, 4> kIntransitive = {
    {{"runs", "run"}, {"sleeps", "sleep"}, {"sings", "sing"}, {"jumps", "jump"}}};
inline constexpr std::array<const char*, 3> kAdverbs = {"quickly", "slowly", "today"};
inline constexpr std::array<const char*, 3> kPrepositions = {"near", "under", "behind"};

inline bool starts_with_vowel(std::string_view word) {
  return !word.empty() && std::string_view("aeiou").find(word.front()) != std::string_view::npos;
}

class Grammar {
 public:
  explicit Grammar(uint64_t seed) : rng_(seed ^ 0x7e47c0de5eedULL) {}

  // One sentence, ending in " ." or " ?" and a newline.
  void sentence(std::string& out) {
    if (rng_.chance(0.15)) {
      question(out);
      return;
    }
    clause(out);
    if (rng_.chance(0.2)) {
      out += " and ";
      clause(out);
    }
    out += " .\n";
  }

 private:
  void word(std::string& out, std::string_view w) {
    if (!out.empty() && out.back() != '\n' && out.back() != ' ') out += ' ';
    out += w;
  }

  // Determiner, optional adjective and noun, agreeing in number ("a"/"an", "this"/"these").
  void noun_phrase(std::string& out, bool animate, bool plural) {
    const Noun& noun = animate ? rng_.pick(kAnimals) : rng_.pick(kThings);
    const char* adjective = nullptr;
    if (rng_.chance(0.4)) {
      adjective = animate ? rng_.pick(kAnimalAdjectives) : rng_.pick(kThingAdjectives);
    }
    const std::string_view next = adjective ? adjective : noun.one;
    const uint64_t d = rng_.next() % 4;
    if (plural) {
      word(out, std::array<const char*, 4>{"the", "some", "these", "two"}[d]);
    } else {
      word(out, d == 0                    ? "the"
                : d == 1                  ? "this"
                : d == 2                  ? "my"
                : starts_with_vowel(next) ? "an"
                                          : "a");
    }
    if (adjective) word(out, adjective);
    word(out, plural ? noun.many : noun.one);
  }

  // A verb and what it takes: living things are chased, things carried, anything seen.
  void predicate(std::string& out, bool third_person, bool base_form) {
    const uint64_t kind = rng_.next() % 4;
    const auto say = [&](const Verb& v) {
      word(out, base_form || !third_person ? v.base : v.third);
    };
    if (kind == 0) {
      say(rng_.pick(kIntransitive));
      if (rng_.chance(0.5)) word(out, rng_.pick(kAdverbs));
      return;
    }
    bool animate_object = false;
    if (kind == 1) {
      say(rng_.pick(kSeesAnything));
      animate_object = rng_.chance(0.5);
    } else if (kind == 2) {
      say(rng_.pick(kAnimalVerbs));
      animate_object = true;
    } else {
      say(rng_.pick(kThingVerbs));
    }
    noun_phrase(out, animate_object, rng_.chance(0.3));
    if (rng_.chance(0.25)) {
      word(out, rng_.pick(kPrepositions));
      noun_phrase(out, false, rng_.chance(0.3));
    }
  }

  void clause(std::string& out) {
    const bool plural = rng_.chance(0.35);
    noun_phrase(out, true, plural);
    predicate(out, !plural, false);
  }

  void question(std::string& out) {
    const bool plural = rng_.chance(0.35);
    word(out, plural ? "do" : "does");
    noun_phrase(out, true, plural);
    predicate(out, !plural, true);
    out += " ?\n";
  }

  Rng rng_;
};

}  // namespace text_corpus_detail

// Exactly `bytes` bytes of lower-case ASCII sentences, one per line ("the small dog sees a red
// ball ."); the same seed gives the same text.
inline std::string synthetic_text(uint64_t seed, size_t bytes) {
  text_corpus_detail::Grammar grammar(seed);
  std::string out;
  out.reserve(bytes + 128);
  while (out.size() < bytes)
    grammar.sentence(out);
  out.resize(bytes);
  return out;
}

// Entropy of the byte frequencies of text, in BITS per byte (0 for empty text).
inline double unigram_entropy_bits(std::string_view text) {
  if (text.empty()) return 0.0;
  std::array<double, 256> counts{};
  for (char c : text)
    counts[static_cast<unsigned char>(c)] += 1.0;
  double bits = 0.0;
  const auto n = static_cast<double>(text.size());
  for (double count : counts) {
    if (count > 0) bits -= count / n * std::log2(count / n);
  }
  return bits;
}

}  // namespace dptrain::test
