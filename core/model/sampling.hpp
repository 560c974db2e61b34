// Drawing the next token from a language model's logits (dptrain sample).
#pragma once

#include <cstdint>
#include <random>
#include <vector>

namespace dptrain {

// Draws an id from softmax(logits / temperature) restricted to the top_k largest (0: all) of the
// first `vocab` logits: ids the model has but the tokenizer cannot decode (a model.vocab larger
// than the dataset's vocabulary) are never drawn. Temperature 0 takes the largest (the first on
// ties); so do ties at the K-th: exactly K ids are drawn among, the lower ids first.
int32_t draw_token(std::vector<float> logits, int64_t vocab, double temperature, int64_t top_k,
                   std::mt19937_64& rng);

}  // namespace dptrain
