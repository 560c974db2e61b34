// Gradient codecs with error feedback: int8, topk and powersgd reduce a bucket of gradients in
// fewer bytes than an f32 all-reduce, keeping what they did not send for the next step.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "core/comm/communicator.hpp"
#include "core/recipe.hpp"
#include "core/tensor/tensor.hpp"

namespace dptrain {

// One bucket's codec on one rank; every rank holds one per bucket, built with the same spec and
// count. Host memory only (a GPU run stages the bucket through the host).
class GradientCodec {
 public:
  virtual ~GradientCodec() = default;
  // "int8", "topk", "powersgd".
  virtual std::string name() const = 0;
  // `grads` holds this rank's contribution (count values, the count given at construction). Adds
  // the residual kept from the last call (error feedback), encodes, exchanges with every rank,
  // and replaces `grads` by the sum over all ranks of what they transmitted, decoded. What this
  // rank could not transmit becomes its new residual. The result is bit-identical on every rank
  // (decoded payloads are summed in rank order). Every rank calls it with the same count.
  // A result that is not finite (an overflow on any rank: the loss scaler skips the step) leaves
  // the state as it was, on every rank.
  // Returns the bytes this rank put on the wire (its own payload; see payload_bytes).
  virtual size_t reduce(std::span<float> grads, Communicator& comm) = 0;
  // This rank's payload per call for this bucket, in bytes (what metrics report as grad_bytes).
  virtual size_t payload_bytes() const = 0;
  // The state a checkpoint keeps, as floats of a fixed size: the residual (count values), then
  // whatever else the codec carries between calls (powersgd: its warm-start Q). Writable, so a
  // resume restores it in place. All zeros (and a fresh Q) at construction.
  virtual std::span<float> state() = 0;
};

// spec.type must be "int8", "topk" or "powersgd" (others: Error(internal)). `count` values per
// call; `seed` makes powersgd's initial Q (identical on every rank for the same seed). `tensors`
// (offsets relative to the bucket, tiling its count values) give powersgd each weight matrix's
// shape: it factorises each matrix and sums vectors as they are; without them it views the whole
// bucket as one near-square matrix. int8 and topk ignore them.
std::unique_ptr<GradientCodec> make_codec(const CompressionSpec& spec, size_t count, uint64_t seed,
                                          std::span<const ParamTensor> tensors = {});

// powersgd: the rank tensor `t` is factorised at for a requested `rank` (at most its smaller
// side), or 0 when it is sent whole: a vector, or a matrix whose P and Q would be no smaller.
size_t powersgd_rank_for(const ParamTensor& t, size_t rank);

}  // namespace dptrain
