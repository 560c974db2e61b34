// Model FLOPs of one training step (forward + backward) per token or per sample, for MFU.
#pragma once

#include <string>

#include "core/recipe.hpp"

namespace dptrain {

// The conventions (MFU counts the model's arithmetic, not what an implementation happens to do:
// recomputation, padding and non-matmul work are not counted; a multiply-add is 2 FLOPs, and the
// backward pass costs twice the forward):
//
// gpt, per token: 6 N + 6 L C T, where
//   N = every parameter, the embeddings included (gpt_layout(...).total, what `describe` prints;
//       GPT-2 small: 124,439,808). The tied token embedding is also the LM head, a real
//       2 V C-FLOP matmul per token, so it belongs in N; the position embedding (T C) is only a
//       lookup and adds 6 T C, +0.6% for GPT-2 small. nanoGPT's estimate_mfu leaves the
//       position embedding out (get_num_params(non_embedding=True)).
//   L = layers, C = width, T = context. 6 L C T is attention's score and weighted-sum matmuls
//       (4 C T FLOPs a token and layer forward over the full T x T square, x 3 with backward)
//       over the causal half only: PaLM and nanoGPT count the full square, 12 L C T.
//   GPT-2 small at T = 1024: 6 x 124,439,808 + 6 x 12 x 768 x 1024 = 803,261,952 FLOPs a token.
//
// mlp, per sample: 6 x the weights of its Linear layers (sum of in x out; biases and
// activations are element-wise, left out as in 6N). There are no tokens.

// FLOPs of one token's forward and backward pass. gpt only: Error(internal) for a model without
// tokens (use training_flops_per_sample).
double training_flops_per_token(const ModelSpec& spec);

// FLOPs of one sample's forward and backward pass: gpt, a window of `context` tokens
// (training_flops_per_token x context); mlp, 6 x its weights. Error(internal) for another type.
double training_flops_per_sample(const ModelSpec& spec);

// A one-line description of the formula with the spec's numbers filled in, e.g.
// "6N + 6LCT per token (N 124,439,808, L 12, C 768, T 1024): 0.8033 GFLOP per token".
std::string training_flops_formula(const ModelSpec& spec);

}  // namespace dptrain
