// Gradient codecs with error feedback (int8, topk, powersgd): encode, exchange, decode, keep the
// rest.
#include "core/ddp/codec.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <vector>

#include "core/error.hpp"

namespace dptrain {
namespace {

// |value| as bits: for non-negative floats the integer order is the float order, with inf and
// then NaN above every finite value. An integer max over them vectorises (a float max that must
// honour NaN does not) and tells at once the largest magnitude and whether any is not finite.
uint32_t magnitude_bits(float value) {
  return std::bit_cast<uint32_t>(value) & 0x7fffffffu;
}
constexpr uint32_t kInfinityBits = 0x7f800000u;

bool all_finite(std::span<const float> values) {
  uint32_t max_bits = 0;
  for (float value : values)
    max_bits = std::max(max_bits, magnitude_bits(value));
  return max_bits < kInfinityBits;
}

void check_count(std::span<float> grads, size_t count, const std::string& codec) {
  if (grads.size() != count) {
    throw Error(ErrorKind::internal, codec + " codec built for " + std::to_string(count) +
                                         " values was given " + std::to_string(grads.size()));
  }
}

// Every codec keeps its new state aside until the summed result is known to be finite: a step
// whose result is not finite is skipped by the loss scaler, and its gradients must not leak into
// the residual (nor poison it for every later step). The result is the same on every rank, so
// every rank makes the same choice.

// Blockwise int8: each block of `block` values sends one f32 scale (max|x| / 127) and one int8
// per value, round(x / scale) in [-127, 127].
class Int8ErrorFeedbackCodec final : public GradientCodec {
 public:
  Int8ErrorFeedbackCodec(size_t count, size_t block)
      : count_(count),
        block_(block),
        blocks_(count / block + (count % block != 0)),
        residual_(count, 0.0f),
        next_residual_(count),
        payload_(payload_bytes()) {}

  std::string name() const override { return "int8"; }
  size_t payload_bytes() const override { return count_ + blocks_ * sizeof(float); }
  std::span<float> state() override { return residual_; }

  size_t reduce(std::span<float> grads, Communicator& comm) override {
    check_count(grads, count_, name());
    // Layout: the f32 block scales, then the int8 values.
    auto* values = reinterpret_cast<int8_t*>(payload_.data() + blocks_ * sizeof(float));
    float* x = next_residual_.data();
    for (size_t b = 0; b < blocks_; ++b) {
      const size_t begin = b * block_;
      const size_t end = std::min(begin + block_, count_);
      uint32_t max_bits = 0;
      for (size_t i = begin; i < end; ++i) {
        x[i] = grads[i] + residual_[i];
        max_bits = std::max(max_bits, magnitude_bits(x[i]));
      }
      const bool finite = max_bits < kInfinityBits;
      // A non-finite block sends a NaN scale, so the sum is not finite on every rank; a block
      // too small for a normal scale sends zeros and keeps its values in the residual.
      float scale = finite ? std::bit_cast<float>(max_bits) / 127.0f
                           : std::numeric_limits<float>::quiet_NaN();
      const bool usable = finite && scale >= std::numeric_limits<float>::min();
      if (finite && !usable) scale = 0.0f;
      std::memcpy(payload_.data() + b * sizeof(float), &scale, sizeof scale);
      if (!usable) {
        std::fill(values + begin, values + end, int8_t{0});
        continue;  // the residual keeps x
      }
      for (size_t i = begin; i < end; ++i) {
        // Round to nearest (ties to even, as std::nearbyint): adding and subtracting 1.5 * 2^23
        // does it for |v| < 2^22 (here |v| <= 127 and a rounding error) and, unlike
        // std::round, vectorises without SSE4.1. The clamp only guards that rounding error.
        float q = (x[i] / scale + 0x1.8p23f) - 0x1.8p23f;
        q = q < -127.0f ? -127.0f : q;
        q = q > 127.0f ? 127.0f : q;
        values[i] = static_cast<int8_t>(q);
        x[i] -= q * scale;  // x - decode(own payload), bit for bit
      }
    }

    const size_t bytes = payload_.size();
    gathered_.resize(bytes * static_cast<size_t>(comm.size()));
    comm.allgather(payload_.data(), bytes, gathered_.data());

    std::fill(grads.begin(), grads.end(), 0.0f);
    for (int rank = 0; rank < comm.size(); ++rank) {
      const uint8_t* payload = gathered_.data() + bytes * static_cast<size_t>(rank);
      const auto* rank_values = reinterpret_cast<const int8_t*>(payload + blocks_ * sizeof(float));
      for (size_t b = 0; b < blocks_; ++b) {
        const size_t begin = b * block_;
        const size_t end = std::min(begin + block_, count_);
        float scale = 0.0f;
        std::memcpy(&scale, payload + b * sizeof(float), sizeof scale);
        for (size_t i = begin; i < end; ++i)
          grads[i] += static_cast<float>(rank_values[i]) * scale;
      }
    }
    if (all_finite(grads))
      std::copy(next_residual_.begin(), next_residual_.end(), residual_.begin());
    return bytes;
  }

 private:
  const size_t count_;
  const size_t block_;
  const size_t blocks_;
  std::vector<float> residual_;
  std::vector<float> next_residual_;  // x, then x - decode(own payload)
  std::vector<uint8_t> payload_;
  std::vector<uint8_t> gathered_;
};

// k = ceil(ratio * count), at least 1 and at most count. The product is nudged down by a relative
// 1e-12 first: 0.07 * 100 is 7.000000000000001 in doubles and must give 7, not 8.
size_t topk_count(double ratio, size_t count) {
  const double product = ratio * static_cast<double>(count);
  const auto k = static_cast<size_t>(std::ceil(product * (1.0 - 1e-12)));
  return std::clamp<size_t>(k, 1, count);
}

// Top-k: the k values of largest |x| (ties: the lower index), as (uint32 index, f32 value) pairs.
class TopkErrorFeedbackCodec final : public GradientCodec {
 public:
  TopkErrorFeedbackCodec(size_t count, double ratio)
      : count_(count),
        k_(topk_count(ratio, count)),
        residual_(count, 0.0f),
        next_residual_(count),
        keys_(count),
        payload_(payload_bytes()) {}

  std::string name() const override { return "topk"; }
  size_t payload_bytes() const override { return k_ * kPairBytes; }
  std::span<float> state() override { return residual_; }

  size_t reduce(std::span<float> grads, Communicator& comm) override {
    check_count(grads, count_, name());
    float* x = next_residual_.data();
    for (size_t i = 0; i < count_; ++i) {
      x[i] = grads[i] + residual_[i];
      keys_[i] = magnitude_bits(x[i]);
    }
    // The k-th largest magnitude by selection (O(count)), on the bits (see magnitude_bits: NaN
    // and inf rank first, so the sum shows them on every rank); then one pass in index order takes
    // every value above it and the first of those equal to it, so ties go to the lower index.
    std::nth_element(keys_.begin(), keys_.begin() + static_cast<std::ptrdiff_t>(k_ - 1),
                     keys_.end(), std::greater<uint32_t>());
    const uint32_t threshold = keys_[k_ - 1];
    const auto above = static_cast<size_t>(
        std::count_if(keys_.begin(), keys_.begin() + static_cast<std::ptrdiff_t>(k_ - 1),
                      [threshold](uint32_t key) { return key > threshold; }));
    size_t equal_left = k_ - above;
    uint8_t* out = payload_.data();
    for (size_t i = 0; i < count_; ++i) {
      const uint32_t key = magnitude_bits(x[i]);
      if (key < threshold) continue;
      if (key == threshold) {
        if (equal_left == 0) continue;
        --equal_left;
      }
      const auto index = static_cast<uint32_t>(i);
      std::memcpy(out, &index, sizeof index);
      std::memcpy(out + sizeof index, &x[i], sizeof(float));
      out += kPairBytes;
      x[i] = 0.0f;  // sent: nothing left of it
    }

    const size_t bytes = payload_.size();
    gathered_.resize(bytes * static_cast<size_t>(comm.size()));
    comm.allgather(payload_.data(), bytes, gathered_.data());

    std::fill(grads.begin(), grads.end(), 0.0f);
    for (const uint8_t* pair = gathered_.data(); pair != gathered_.data() + gathered_.size();
         pair += kPairBytes) {
      uint32_t index = 0;
      float value = 0.0f;
      std::memcpy(&index, pair, sizeof index);
      std::memcpy(&value, pair + sizeof index, sizeof value);
      if (index >= count_) {
        throw Error(ErrorKind::internal, "topk codec: a rank sent index " + std::to_string(index) +
                                             " for a bucket of " + std::to_string(count_) +
                                             " values (ranks disagree on the buckets)");
      }
      grads[index] += value;
    }
    if (all_finite(grads))
      std::copy(next_residual_.begin(), next_residual_.end(), residual_.begin());
    return bytes;
  }

 private:
  static constexpr size_t kPairBytes = sizeof(uint32_t) + sizeof(float);
  const size_t count_;
  const size_t k_;
  std::vector<float> residual_;
  std::vector<float> next_residual_;  // x, with the sent values zeroed
  std::vector<uint32_t> keys_;        // |x| as bits, reordered by the selection
  std::vector<uint8_t> payload_;
  std::vector<uint8_t> gathered_;
};

// PowerSGD (Vogels et al., 2019): each weight matrix M of the bucket approximated by P Q^T of
// rank r with one power iteration per call, warm-started from the last call's Q. Vectors (biases,
// norms), and matrices too small to gain, are summed as they are. Every matrix's P goes in one
// all-reduce (with the vectors), every Q in a second.
class PowerSgdCodec final : public GradientCodec {
 public:
  PowerSgdCodec(size_t count, size_t rank, uint64_t seed, std::span<const ParamTensor> tensors)
      : count_(count) {
    if (tensors.empty()) {
      // No shapes: the bucket as one near-square matrix, cols = ceil(sqrt(count)), zero-padded.
      const size_t cols = ceil_sqrt(count);
      add_matrix(0, count, (count + cols - 1) / cols, cols, rank);
    } else {
      for (const ParamTensor& t : tensors) {
        if (const size_t r = powersgd_rank_for(t, rank); r > 0) {
          add_matrix(t.offset, t.size(), t.rows, t.cols, r);
        } else {
          vectors_.push_back({t.offset, t.size(), p_size_});
          p_size_ += t.size();
        }
      }
    }
    state_.assign(count_ + q_size_, 0.0f);
    initial_q_.resize(q_size_);
    // mt19937_64 is specified exactly by the standard (std::normal_distribution is not): the
    // same Q on every rank and with every standard library. Uniform in [-1, 1).
    std::mt19937_64 generator(seed);
    for (float& value : initial_q_) {
      const double unit = static_cast<double>(generator() >> 11) * 0x1.0p-53;
      value = static_cast<float>(2.0 * unit - 1.0);
    }
    std::copy(initial_q_.begin(), initial_q_.end(),
              state_.begin() + static_cast<std::ptrdiff_t>(count_));
    p_.resize(p_size_);
    q_local_.resize(q_size_);
    q_sum_.resize(q_size_);
  }

  std::string name() const override { return "powersgd"; }
  size_t payload_bytes() const override { return (p_size_ + q_size_) * sizeof(float); }
  std::span<float> state() override { return state_; }

  size_t reduce(std::span<float> grads, Communicator& comm) override {
    check_count(grads, count_, name());
    const float* residual = state_.data();
    // M = grads + residual, per matrix (zero-padded past its values).
    for (const Matrix& m : matrices_) {
      for (size_t i = 0; i < m.count; ++i)
        m_[m.m_at + i] = grads[m.offset + i] + residual[m.offset + i];
    }
    // P = M Q for every matrix, and the vectors as they are: one all-reduce.
    for (const Matrix& m : matrices_)
      multiply(m);
    for (const Vector& v : vectors_) {
      std::copy_n(grads.begin() + static_cast<std::ptrdiff_t>(v.offset), v.count,
                  p_.begin() + static_cast<std::ptrdiff_t>(v.p_at));
    }
    comm.allreduce(p_.data(), p_.size(), ReduceOp::sum);
    for (const Matrix& m : matrices_)
      orthonormalize_p(m);
    // Q_local = M^T P: this rank's share. Q = sum over ranks = (sum M)^T P.
    std::fill(q_local_.begin(), q_local_.end(), 0.0f);
    for (const Matrix& m : matrices_)
      multiply_transposed(m);
    std::copy(q_local_.begin(), q_local_.end(), q_sum_.begin());
    comm.allreduce(q_sum_.data(), q_sum_.size(), ReduceOp::sum);

    // The new residual (in m_, M - P Q_local^T: what this rank did not send) and the result
    // (P Q^T, the same on every rank since P and Q are).
    for (const Matrix& m : matrices_)
      expand(m, grads);
    for (const Vector& v : vectors_) {
      std::copy_n(p_.begin() + static_cast<std::ptrdiff_t>(v.p_at), v.count,
                  grads.begin() + static_cast<std::ptrdiff_t>(v.offset));
    }

    if (all_finite(grads)) {
      float* q = state_.data() + count_;
      for (const Matrix& m : matrices_) {
        std::copy_n(m_.begin() + static_cast<std::ptrdiff_t>(m.m_at), m.count,
                    state_.begin() + static_cast<std::ptrdiff_t>(m.offset));
        // A zero column of Q (all-zero gradients, or a column P had to drop) would stay zero
        // forever: restart it from the initial Q. Q is the same on every rank, so is the choice.
        for (size_t j = 0; j < m.rank; ++j) {
          bool zero = true;
          for (size_t c = 0; c < m.cols; ++c)
            zero &= q_sum_[m.q_at + c * m.rank + j] == 0.0f;
          for (size_t c = 0; c < m.cols; ++c) {
            const size_t at = m.q_at + c * m.rank + j;
            q[at] = zero ? initial_q_[at] : q_sum_[at];
          }
        }
      }
    }
    return payload_bytes();
  }

 private:
  // A matrix of the bucket: `count` values from `offset` (at most rows x cols; the rest of the
  // view is zero padding). Its M in m_ from m_at, its P in p_ from p_at (rows x rank), its Q in
  // Q's buffers (and the state after the residual) from q_at (cols x rank), row-major.
  struct Matrix {
    size_t offset, count, rows, cols, rank, m_at, p_at, q_at;
  };
  // Values summed as they are: `count` from `offset`, in p_ from p_at.
  struct Vector {
    size_t offset, count, p_at;
  };

  void add_matrix(size_t offset, size_t count, size_t rows, size_t cols, size_t rank) {
    const size_t r = std::min({rank, rows, cols});
    matrices_.push_back({offset, count, rows, cols, r, m_.size(), p_size_, q_size_});
    m_.resize(m_.size() + rows * cols, 0.0f);
    p_size_ += rows * r;
    q_size_ += cols * r;
  }

  // P = M Q.
  void multiply(const Matrix& m) {
    const size_t r = m.rank;
    const float* q = state_.data() + count_ + m.q_at;
    row_.resize(r);
    for (size_t i = 0; i < m.rows; ++i) {
      std::fill(row_.begin(), row_.end(), 0.0f);
      const float* m_row = m_.data() + m.m_at + i * m.cols;
      for (size_t c = 0; c < m.cols; ++c) {
        const float value = m_row[c];
        const float* q_row = q + c * r;
        for (size_t j = 0; j < r; ++j)
          row_[j] += value * q_row[j];
      }
      std::copy(row_.begin(), row_.end(), p_.begin() + static_cast<std::ptrdiff_t>(m.p_at + i * r));
    }
  }

  // Q_local = M^T P.
  void multiply_transposed(const Matrix& m) {
    const size_t r = m.rank;
    for (size_t i = 0; i < m.rows; ++i) {
      const float* m_row = m_.data() + m.m_at + i * m.cols;
      const float* p_row = p_.data() + m.p_at + i * r;
      for (size_t c = 0; c < m.cols; ++c) {
        const float value = m_row[c];
        float* q_row = q_local_.data() + m.q_at + c * r;
        for (size_t j = 0; j < r; ++j)
          q_row[j] += value * p_row[j];
      }
    }
  }

  // grads = P Q^T over the matrix's values; m_ -= P Q_local^T (the new residual).
  void expand(const Matrix& m, std::span<float> grads) {
    const size_t r = m.rank;
    for (size_t i = 0; i < m.rows && i * m.cols < m.count; ++i) {
      const float* p_row = p_.data() + m.p_at + i * r;
      const size_t row_end = std::min(m.cols, m.count - i * m.cols);
      for (size_t c = 0; c < row_end; ++c) {
        const float* local_row = q_local_.data() + m.q_at + c * r;
        const float* sum_row = q_sum_.data() + m.q_at + c * r;
        float sent = 0.0f;
        float total = 0.0f;
        for (size_t j = 0; j < r; ++j) {
          sent += p_row[j] * local_row[j];
          total += p_row[j] * sum_row[j];
        }
        m_[m.m_at + i * m.cols + c] -= sent;
        grads[m.offset + i * m.cols + c] = total;
      }
    }
  }

  // The smallest c with c * c >= count, in integers (a double sqrt can be one off).
  static size_t ceil_sqrt(size_t count) {
    auto c = static_cast<size_t>(std::sqrt(static_cast<double>(count)));
    while (c * c < count)
      ++c;
    while (c > 1 && (c - 1) * (c - 1) >= count)
      --c;
    return std::max<size_t>(c, 1);
  }

  // Modified Gram-Schmidt over P's columns, each projection done twice so that a column nearly
  // in the span of the earlier ones still comes out orthogonal to them; sums in double. A zero
  // column stays zero (it then carries nothing); a NaN stays NaN so the result shows it.
  void orthonormalize_p(const Matrix& m) {
    const size_t r = m.rank;
    float* p = p_.data() + m.p_at;
    for (size_t j = 0; j < r; ++j) {
      for (int pass = 0; pass < 2; ++pass) {
        for (size_t k = 0; k < j; ++k) {
          double dot = 0.0;
          for (size_t i = 0; i < m.rows; ++i)
            dot += static_cast<double>(p[i * r + k]) * p[i * r + j];
          for (size_t i = 0; i < m.rows; ++i)
            p[i * r + j] = static_cast<float>(p[i * r + j] - dot * p[i * r + k]);
        }
      }
      double norm = 0.0;
      for (size_t i = 0; i < m.rows; ++i)
        norm += static_cast<double>(p[i * r + j]) * p[i * r + j];
      norm = std::sqrt(norm);
      const double inverse = norm == 0.0 ? 0.0 : 1.0 / norm;
      for (size_t i = 0; i < m.rows; ++i)
        p[i * r + j] = static_cast<float>(p[i * r + j] * inverse);
    }
  }

  const size_t count_;
  std::vector<Matrix> matrices_;
  std::vector<Vector> vectors_;
  size_t p_size_ = 0;             // every matrix's P, then the vectors
  size_t q_size_ = 0;             // every matrix's Q
  std::vector<float> state_;      // the residual (count_), then every Q
  std::vector<float> initial_q_;  // Q at construction, to restart a column that died
  std::vector<float> m_;          // every M (rows x cols each), then the new residuals
  std::vector<float> p_;
  std::vector<float> q_local_;  // M^T P on this rank
  std::vector<float> q_sum_;    // its sum over ranks
  std::vector<float> row_;      // one row of M Q
};

}  // namespace

size_t powersgd_rank_for(const ParamTensor& t, size_t rank) {
  const size_t r = std::min({rank, t.rows, t.cols});
  return t.rows > 1 && t.cols > 1 && (t.rows + t.cols) * r < t.rows * t.cols ? r : 0;
}

std::unique_ptr<GradientCodec> make_codec(const CompressionSpec& spec, size_t count, uint64_t seed,
                                          std::span<const ParamTensor> tensors) {
  if (!is_error_feedback_codec(spec.type)) {
    throw Error(ErrorKind::internal,
                "no error-feedback codec named '" + spec.type + "' (int8, topk, powersgd)");
  }
  if (count == 0) throw Error(ErrorKind::internal, spec.type + " codec for an empty bucket");
  if (spec.type == "int8") {
    if (spec.block < 1) {
      throw Error(ErrorKind::internal,
                  "int8 codec: block must be at least 1, not " + std::to_string(spec.block));
    }
    return std::make_unique<Int8ErrorFeedbackCodec>(count, static_cast<size_t>(spec.block));
  }
  if (spec.type == "topk") {
    if (!(spec.ratio > 0.0 && spec.ratio <= 1.0)) {
      throw Error(ErrorKind::internal,
                  "topk codec: ratio must be in (0, 1], not " + std::to_string(spec.ratio));
    }
    if (count > std::numeric_limits<uint32_t>::max()) {
      throw Error(ErrorKind::internal, "topk codec: a bucket of " + std::to_string(count) +
                                           " values does not fit its 32-bit indices");
    }
    return std::make_unique<TopkErrorFeedbackCodec>(count, spec.ratio);
  }
  if (spec.rank < 1) {
    throw Error(ErrorKind::internal,
                "powersgd codec: rank must be at least 1, not " + std::to_string(spec.rank));
  }
  size_t covered = 0;
  for (const ParamTensor& t : tensors) {
    if (t.offset != covered) break;
    covered += t.size();
  }
  if (!tensors.empty() && covered != count) {
    throw Error(ErrorKind::internal, "powersgd codec: its tensors do not tile the " +
                                         std::to_string(count) + " values of the bucket");
  }
  return std::make_unique<PowerSgdCodec>(count, static_cast<size_t>(spec.rank), seed, tensors);
}

}  // namespace dptrain
