// GPU tests of kernels/nn_kernels.cu: bias, activations, softmax cross-entropy, LayerNorm and
// embeddings against the CPU op table in f32, bf16 and f16, with aliasing, accumulation, odd
// shapes, input errors and run-to-run determinism.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/tensor/cpu_ops.hpp"
#include "tests/gpu/gpu_test.hpp"

namespace dptrain::gputest {
namespace {

constexpr DType kDtypes[] = {DType::f32, DType::bf16, DType::f16};

struct Shape {
  int64_t rows;
  int64_t cols;
};

// Odd sizes (rows 1, 3, 17; cols 7, 50257) around the sizes a GPT-2 step uses.
constexpr Shape kShapes[] = {{1, 7}, {3, 7}, {17, 13}, {3, 768}, {17, 50257}, {64, 3072}};

std::string label(const char* op, DType dtype, Shape s) {
  return std::string(op) + " " + dtype_name(dtype) + " [" + std::to_string(s.rows) + ", " +
         std::to_string(s.cols) + "]";
}

size_t count(Shape s) {
  return static_cast<size_t>(s.rows * s.cols);
}

// A device copy of host values as `dtype`, viewed as a [rows, cols] matrix.
struct DeviceMatrix {
  Buffer buffer;
  Matrix m;
};

DeviceMatrix device_matrix(const std::vector<float>& host, Shape s, DType dtype) {
  DeviceMatrix d{to_device(host, dtype), {}};
  d.m = Matrix{d.buffer.data(), s.rows, s.cols, dtype};
  return d;
}

std::vector<float> download(ConstMatrix m) {
  return to_host(m.data, static_cast<size_t>(m.size()), m.dtype);
}

Matrix host_matrix(std::vector<float>& v, Shape s) {
  return Matrix{v.data(), s.rows, s.cols};
}

std::vector<int32_t> random_ints(size_t n, int32_t limit, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int32_t> dist(0, limit - 1);
  std::vector<int32_t> out(n);
  for (int32_t& v : out)
    v = dist(rng);
  return out;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Runs f, which must throw Error(kind) whose message contains `needle`.
template <typename F>
void check_error(F&& f, ErrorKind kind, const std::string& needle, const std::string& what) {
  try {
    f();
    FAIL_CHECK(what << ": no error was thrown");
  } catch (const Error& e) {
    CHECK_MESSAGE(e.kind() == kind, what << ": wrong kind for '" << e.what() << "'");
    CHECK_MESSAGE(std::string(e.what()).find(needle) != std::string::npos,
                  what << ": '" << e.what() << "' does not name " << needle);
  }
}

TEST_CASE("nn_kernels: add_bias_rows") {
  CpuOps cpu_table;
  Ops& cpu = cpu_table;
  for (DType dtype : kDtypes) {
    for (Shape s : kShapes) {
      const std::vector<float> x = random_vector(count(s), 1, 2.0f);
      const std::vector<float> bias = random_vector(static_cast<size_t>(s.cols), 2);
      DeviceMatrix dx = device_matrix(x, s, dtype);
      const Buffer dbias = to_device(bias, dtype);
      gpu().add_bias_rows(dx.m, dbias.data());
      std::vector<float> want = rounded(x, dtype);
      std::vector<float> want_bias = rounded(bias, dtype);
      cpu.add_bias_rows(host_matrix(want, s), want_bias.data());
      check_close(download(dx.m), want, tolerance(dtype), label("add_bias_rows", dtype, s));
    }
  }
}

TEST_CASE("nn_kernels: bias_grad accumulates, deterministically") {
  CpuOps cpu_table;
  Ops& cpu = cpu_table;
  // {1000, 768} splits the rows into chunks (partial sums, then a second pass).
  constexpr Shape kGradShapes[] = {{1, 7}, {3, 7}, {17, 50257}, {1000, 768}, {4099, 13}};
  for (DType dtype : kDtypes) {
    for (Shape s : kGradShapes) {
      const std::vector<float> dy = random_vector(count(s), 3);
      const std::vector<float> prior = random_vector(static_cast<size_t>(s.cols), 4);
      const DeviceMatrix ddy = device_matrix(dy, s, dtype);
      const Buffer grad = to_device(prior);
      gpu().bias_grad(ddy.m, grad.as<float>());
      const std::vector<float> got = to_host(grad.data(), prior.size());
      std::vector<float> want = prior;
      std::vector<float> dy_rounded = rounded(dy, dtype);
      cpu.bias_grad(host_matrix(dy_rounded, s), want.data());
      // The inputs are identical and both sum in f32: only the order differs.
      check_close(got, want, tolerance(DType::f32), label("bias_grad", dtype, s));

      const Buffer again = to_device(prior);
      gpu().bias_grad(ddy.m, again.as<float>());
      CHECK_MESSAGE(same_bits(to_host(again.data(), prior.size()), got),
                    label("bias_grad", dtype, s) << ": two runs differ");
    }
  }
}

TEST_CASE("nn_kernels: relu and gelu, forward and backward, in place and misaligned") {
  CpuOps cpu_table;
  Ops& cpu = cpu_table;
  for (Activation activation : {Activation::relu, Activation::gelu}) {
    for (DType dtype : kDtypes) {
      for (Shape s : kShapes) {
        const std::string what = label(activation == Activation::relu ? "relu" : "gelu", dtype, s);
        const std::vector<float> pre = random_vector(count(s), 5, 4.0f);
        const std::vector<float> dout = random_vector(count(s), 6);
        std::vector<float> pre_r = rounded(pre, dtype);
        std::vector<float> dout_r = rounded(dout, dtype);
        std::vector<float> want_out(count(s)), want_dpre(count(s));
        cpu.activation_forward(activation, host_matrix(pre_r, s), host_matrix(want_out, s));
        cpu.activation_backward(activation, host_matrix(pre_r, s), host_matrix(dout_r, s),
                                host_matrix(want_dpre, s));

        const DeviceMatrix dpre_in = device_matrix(pre, s, dtype);
        const DeviceMatrix ddout = device_matrix(dout, s, dtype);
        const Buffer out = gpu().allocate(dpre_in.m.bytes());
        const Matrix out_m{out.data(), s.rows, s.cols, dtype};
        gpu().activation_forward(activation, dpre_in.m, out_m);
        check_close(download(out_m), want_out, tolerance(dtype), what + " forward");
        const Buffer dpre = gpu().allocate(dpre_in.m.bytes());
        const Matrix dpre_m{dpre.data(), s.rows, s.cols, dtype};
        gpu().activation_backward(activation, dpre_in.m, ddout.m, dpre_m);
        check_close(download(dpre_m), want_dpre, tolerance(dtype), what + " backward");

        // out aliasing pre, dpre aliasing dout.
        const DeviceMatrix in_place = device_matrix(pre, s, dtype);
        gpu().activation_forward(activation, in_place.m, in_place.m);
        check_close(download(in_place.m), want_out, tolerance(dtype), what + " forward in place");
        const DeviceMatrix grad_in_place = device_matrix(dout, s, dtype);
        gpu().activation_backward(activation, dpre_in.m, grad_in_place.m, grad_in_place.m);
        check_close(download(grad_in_place.m), want_dpre, tolerance(dtype),
                    what + " backward in place");
      }
    }
  }
  // Views starting one element into a buffer: the same shift (the vector path after a scalar
  // head) and different shifts (the scalar path).
  for (DType dtype : kDtypes) {
    const Shape s{5, 131};
    const std::vector<float> pre = random_vector(count(s) + 1, 7, 4.0f);
    std::vector<float> pre_r = rounded(pre, dtype);
    std::vector<float> want(count(s));
    cpu.activation_forward(Activation::gelu, Matrix{pre_r.data() + 1, s.rows, s.cols},
                           host_matrix(want, s));
    const Buffer d = to_device(pre, dtype);
    const ConstMatrix shifted{static_cast<const char*>(d.data()) + dtype_size(dtype), s.rows,
                              s.cols, dtype};
    const Buffer out = gpu().allocate((count(s) + 1) * dtype_size(dtype));
    const Matrix out_shifted{static_cast<char*>(out.data()) + dtype_size(dtype), s.rows, s.cols,
                             dtype};
    const Matrix out_aligned{out.data(), s.rows, s.cols, dtype};
    gpu().activation_forward(Activation::gelu, shifted, out_shifted);
    check_close(download(out_shifted), want, tolerance(dtype),
                std::string("gelu shifted views ") + dtype_name(dtype));
    gpu().activation_forward(Activation::gelu, shifted, out_aligned);
    check_close(download(out_aligned), want, tolerance(dtype),
                std::string("gelu differently shifted views ") + dtype_name(dtype));
  }
}

TEST_CASE("nn_kernels: softmax cross-entropy forward and backward") {
  CpuOps cpu_table;
  Ops& cpu = cpu_table;
  for (DType dtype : kDtypes) {
    for (Shape s : kShapes) {
      const std::string what = label("softmax_cross_entropy", dtype, s);
      const std::vector<float> logits = random_vector(count(s), 8, 6.0f);
      const std::vector<int32_t> labels =
          random_ints(static_cast<size_t>(s.rows), static_cast<int32_t>(s.cols), 9);
      std::vector<float> logits_r = rounded(logits, dtype);
      std::vector<float> want_probs(count(s));
      const double want_loss = cpu.softmax_cross_entropy_forward(
          host_matrix(logits_r, s), labels.data(), host_matrix(want_probs, s));
      const Buffer dlabels = to_device(labels);

      const DeviceMatrix dlogits = device_matrix(logits, s, dtype);
      const Buffer probs = gpu().allocate(dlogits.m.bytes());
      const Matrix probs_m{probs.data(), s.rows, s.cols, dtype};
      const double loss =
          gpu().softmax_cross_entropy_forward(dlogits.m, dlabels.as<int32_t>(), probs_m);
      // The logits are the same values; the loss is computed in f32 with a different order.
      CHECK_MESSAGE(std::fabs(loss - want_loss) <= 1e-4 * std::max(1.0, std::fabs(want_loss)),
                    what << ": loss " << loss << ", the CPU's " << want_loss);
      // A wide row's probabilities are all far below 1 (at most about 2.5e-4 over 50257
      // classes): the allowance scales with the largest of them, so zeros fail.
      check_close(download(probs_m), want_probs, tolerance(dtype), what + " probs");
      const double again =
          gpu().softmax_cross_entropy_forward(dlogits.m, dlabels.as<int32_t>(), probs_m);
      CHECK_MESSAGE(std::memcmp(&again, &loss, sizeof loss) == 0, what << ": two runs differ");

      // probs aliasing logits.
      const DeviceMatrix in_place = device_matrix(logits, s, dtype);
      const double loss_in_place =
          gpu().softmax_cross_entropy_forward(in_place.m, dlabels.as<int32_t>(), in_place.m);
      CHECK_MESSAGE(std::memcmp(&loss_in_place, &loss, sizeof loss) == 0,
                    what << ": in place, loss " << loss_in_place << " instead of " << loss);
      check_close(download(in_place.m), want_probs, tolerance(dtype), what + " probs in place");

      // Backward from the CPU's probabilities; scale = 2 rows makes the gradients O(1).
      const float scale = 2.0f * static_cast<float>(s.rows);
      std::vector<float> probs_r = rounded(want_probs, dtype);
      std::vector<float> want_grad(count(s));
      cpu.softmax_cross_entropy_backward(host_matrix(probs_r, s), labels.data(),
                                         host_matrix(want_grad, s), scale);
      const DeviceMatrix dprobs = device_matrix(want_probs, s, dtype);
      const Buffer grad = gpu().allocate(dprobs.m.bytes());
      const Matrix grad_m{grad.data(), s.rows, s.cols, dtype};
      gpu().softmax_cross_entropy_backward(dprobs.m, dlabels.as<int32_t>(), grad_m, scale);
      check_close(download(grad_m), want_grad, tolerance(dtype), what + " backward");
      // dlogits aliasing probs.
      gpu().softmax_cross_entropy_backward(dprobs.m, dlabels.as<int32_t>(), dprobs.m, scale);
      check_close(download(dprobs.m), want_grad, tolerance(dtype), what + " backward in place");
    }
  }
}

TEST_CASE("nn_kernels: the fused softmax cross-entropy, and padded rows") {
  CpuOps cpu_table;
  Ops& cpu = cpu_table;
  constexpr float kGap = 768.0f;  // exact in every dtype; far above every logit, were it read
  for (DType dtype : kDtypes) {
    for (Shape s : kShapes) {
      const std::string what = label("softmax_cross_entropy (fused)", dtype, s);
      const std::vector<float> logits = random_vector(count(s), 31, 6.0f);
      const std::vector<int32_t> labels =
          random_ints(static_cast<size_t>(s.rows), static_cast<int32_t>(s.cols), 32);
      const Buffer dlabels = to_device(labels);
      // The CPU's forward then backward, from the logits the device sees.
      std::vector<float> logits_r = rounded(logits, dtype);
      const float scale = 2.0f * static_cast<float>(s.rows);
      std::vector<float> want_grad(count(s));
      const double want_loss = cpu.softmax_cross_entropy_forward(
          host_matrix(logits_r, s), labels.data(), host_matrix(want_grad, s));
      cpu.softmax_cross_entropy_backward(host_matrix(want_grad, s), labels.data(),
                                         host_matrix(want_grad, s), scale);
      const auto close_loss = [&](double loss, const std::string& how) {
        CHECK_MESSAGE(std::fabs(loss - want_loss) <= 1e-4 * std::max(1.0, std::fabs(want_loss)),
                      what << " " << how << ": loss " << loss << ", the CPU's " << want_loss);
      };

      // Contiguous, into another buffer and in place; the same bits on every run.
      const DeviceMatrix dlogits = device_matrix(logits, s, dtype);
      const Buffer grad = gpu().allocate(dlogits.m.bytes());
      const Matrix grad_m{grad.data(), s.rows, s.cols, dtype};
      const double loss =
          gpu().softmax_cross_entropy(dlogits.m, dlabels.as<int32_t>(), grad_m, scale);
      close_loss(loss, "contiguous");
      check_close(download(grad_m), want_grad, tolerance(dtype), what + " gradient");
      const double again =
          gpu().softmax_cross_entropy(dlogits.m, dlabels.as<int32_t>(), grad_m, scale);
      CHECK_MESSAGE(std::memcmp(&again, &loss, sizeof loss) == 0, what << ": two runs differ");
      const DeviceMatrix in_place = device_matrix(logits, s, dtype);
      CHECK(gpu().softmax_cross_entropy(in_place.m, dlabels.as<int32_t>(), in_place.m, scale) ==
            loss);
      check_close(download(in_place.m), want_grad, tolerance(dtype), what + " in place");

      // Rows padded to a multiple of 128 (at least one gap element), holding kGap: the fused op,
      // the forward, the backward and count_correct read and write each row's columns only.
      const int64_t stride = (s.cols / 128 + 1) * 128;
      std::vector<float> host_padded(static_cast<size_t>(s.rows * stride), kGap);
      for (int64_t i = 0; i < s.rows; ++i) {
        std::copy_n(logits.begin() + i * s.cols, s.cols, host_padded.begin() + i * stride);
      }
      const auto unpad = [&](const Buffer& buffer, size_t& gaps_changed) {
        const std::vector<float> all = to_host(buffer.data(), host_padded.size(), dtype);
        std::vector<float> values;
        for (size_t i = 0; i < all.size(); ++i) {
          if (static_cast<int64_t>(i) % stride < s.cols) {
            values.push_back(all[i]);
          } else {
            gaps_changed += all[i] != kGap;
          }
        }
        return values;
      };
      size_t gaps_changed = 0;
      const Buffer padded = to_device(host_padded, dtype);
      const Matrix pm{padded.data(), s.rows, s.cols, dtype, stride};
      std::vector<float> logits_cpu = logits_r;
      CHECK_MESSAGE(gpu().count_correct(pm, dlabels.as<int32_t>()) ==
                        cpu.count_correct(host_matrix(logits_cpu, s), labels.data()),
                    what << ": count_correct on padded rows");
      const Buffer probs_padded = to_device(host_padded, dtype);
      const Matrix ppm{probs_padded.data(), s.rows, s.cols, dtype, stride};
      close_loss(gpu().softmax_cross_entropy_forward(pm, dlabels.as<int32_t>(), ppm), "padded");
      std::vector<float> want_probs(count(s));
      cpu.softmax_cross_entropy_forward(host_matrix(logits_cpu, s), labels.data(),
                                        host_matrix(want_probs, s));
      check_close(unpad(probs_padded, gaps_changed), want_probs, tolerance(dtype),
                  what + " padded probs");
      gpu().softmax_cross_entropy_backward(ppm, dlabels.as<int32_t>(), ppm, scale);
      check_close(unpad(probs_padded, gaps_changed), want_grad, tolerance(dtype),
                  what + " padded backward");
      close_loss(gpu().softmax_cross_entropy(pm, dlabels.as<int32_t>(), pm, scale), "padded fused");
      check_close(unpad(padded, gaps_changed), want_grad, tolerance(dtype),
                  what + " padded fused gradient");
      CHECK_MESSAGE(gaps_changed == 0, what << ": " << gaps_changed << " gap element(s) written");
    }
  }
  // A NaN logit makes the loss NaN, as on the CPU (the online max/sum must not pass over it),
  // wherever it is in its row; -inf logits are zero probabilities.
  for (DType dtype : kDtypes) {
    for (int64_t at : {0, 5, 3000}) {
      const Shape s{2, 4000};
      std::vector<float> logits = random_vector(count(s), 34);
      logits[static_cast<size_t>(s.cols + at)] = NAN;  // row 1
      const DeviceMatrix z = device_matrix(logits, s, dtype);
      const Buffer labels = to_device(std::vector<int32_t>{1, 2});
      const std::string what = label("softmax_cross_entropy NaN", dtype, s);
      CHECK_MESSAGE(std::isnan(gpu().softmax_cross_entropy(z.m, labels.as<int32_t>(), z.m, 1.0f)),
                    what << " at column " << at);
      const DeviceMatrix z2 = device_matrix(logits, s, dtype);
      CHECK_MESSAGE(
          std::isnan(gpu().softmax_cross_entropy_forward(z2.m, labels.as<int32_t>(), z2.m)),
          what << " (forward) at column " << at);
      std::vector<float> with_inf = random_vector(count(s), 35);
      with_inf[static_cast<size_t>(at)] = -INFINITY;  // row 0, not its label's column 1
      const DeviceMatrix z3 = device_matrix(with_inf, s, dtype);
      CHECK_MESSAGE(
          std::isfinite(gpu().softmax_cross_entropy(z3.m, labels.as<int32_t>(), z3.m, 1.0f)),
          what << ": -inf at column " << at);
      CHECK_MESSAGE(download(z3.m)[static_cast<size_t>(at)] == 0.0f, what << ": -inf's gradient");
    }
    // A NaN among -inf: whole packs of -inf (threads with nothing) and one thread whose values
    // are a NaN and -inf only: combining the threads' parts must keep the NaN. And a lone +inf
    // (not the label) makes the loss NaN, as exp(inf - inf) does on the CPU.
    const Shape s{2, 4000};
    const Buffer labels = to_device(std::vector<int32_t>{1, 2});
    std::vector<float> logits = random_vector(count(s), 36);
    for (int64_t j = 4; j < 128; ++j)
      logits[static_cast<size_t>(s.cols + j)] = -INFINITY;
    logits[static_cast<size_t>(s.cols + 70)] = NAN;
    const DeviceMatrix z = device_matrix(logits, s, dtype);
    CHECK_MESSAGE(std::isnan(gpu().softmax_cross_entropy(z.m, labels.as<int32_t>(), z.m, 1.0f)),
                  label("softmax_cross_entropy NaN among -inf", dtype, s));
    std::vector<float> with_inf = random_vector(count(s), 37);
    with_inf[static_cast<size_t>(s.cols + 9)] = INFINITY;
    const DeviceMatrix zi = device_matrix(with_inf, s, dtype);
    CHECK_MESSAGE(std::isnan(gpu().softmax_cross_entropy(zi.m, labels.as<int32_t>(), zi.m, 1.0f)),
                  label("softmax_cross_entropy +inf", dtype, s));
  }
  // A label outside the classes: a recipe error, as for the forward.
  const Shape s{3, 7};
  const DeviceMatrix logits = device_matrix(random_vector(count(s), 33), s, DType::bf16);
  const Buffer bad = to_device(std::vector<int32_t>{1, 9, 0});
  check_error([&] { gpu().softmax_cross_entropy(logits.m, bad.as<int32_t>(), logits.m, 1.0f); },
              ErrorKind::recipe, "label 9", "fused");
  // Ops that take contiguous matrices only say so for a padded one.
  const Matrix padded{logits.m.data, 2, 7, DType::bf16, 10};
  check_error([&] { gpu().activation_forward(Activation::gelu, padded, padded); },
              ErrorKind::internal,
              "activation_forward: pre has padded rows (10 elements apart for 7 columns)",
              "padded activation");
}

TEST_CASE("nn_kernels: a label outside the classes is a recipe error naming it") {
  const Shape s{3, 7};
  for (DType dtype : kDtypes) {
    const DeviceMatrix logits = device_matrix(random_vector(count(s), 10), s, dtype);
    const Buffer bad = to_device(std::vector<int32_t>{1, 12, 0});
    check_error([&] { gpu().softmax_cross_entropy_forward(logits.m, bad.as<int32_t>(), logits.m); },
                ErrorKind::recipe, "label 12", "forward");
    const Buffer negative = to_device(std::vector<int32_t>{1, 2, -3});
    gpu().softmax_cross_entropy_backward(logits.m, negative.as<int32_t>(), logits.m, 1.0f);
    check_error([&] { gpu().synchronize(); }, ErrorKind::recipe, "label -3", "backward");
    // The record is cleared: valid labels work again.
    const Buffer good = to_device(std::vector<int32_t>{1, 2, 6});
    const double loss = gpu().softmax_cross_entropy_forward(logits.m, good.as<int32_t>(), logits.m);
    CHECK(std::isfinite(loss));
  }
}

TEST_CASE("nn_kernels: count_correct takes the first of tied maxima") {
  CpuOps cpu_table;
  Ops& cpu = cpu_table;
  for (DType dtype : kDtypes) {
    for (Shape s : kShapes) {
      std::vector<float> scores = random_vector(count(s), 11);
      std::vector<int32_t> labels =
          random_ints(static_cast<size_t>(s.rows), static_cast<int32_t>(s.cols), 12);
      // Every other row: a tie of two maxima, the label on the first (correct) or the second
      // (wrong); the rest keep random labels, now and then right.
      for (int64_t i = 0; i < s.rows; ++i) {
        if (i % 2 != 0 || s.cols < 3) continue;
        const int64_t first = (i * 7) % (s.cols - 1);
        scores[static_cast<size_t>(i * s.cols + first)] = 2.0f;
        scores[static_cast<size_t>(i * s.cols + s.cols - 1)] = 2.0f;
        labels[static_cast<size_t>(i)] = static_cast<int32_t>(i % 4 == 0 ? first : s.cols - 1);
      }
      std::vector<float> scores_r = rounded(scores, dtype);
      const int64_t want = cpu.count_correct(host_matrix(scores_r, s), labels.data());
      const DeviceMatrix dscores = device_matrix(scores, s, dtype);
      const Buffer dlabels = to_device(labels);
      CHECK_MESSAGE(gpu().count_correct(dscores.m, dlabels.as<int32_t>()) == want,
                    label("count_correct", dtype, s));
    }
  }
}

TEST_CASE("nn_kernels: LayerNorm forward and backward") {
  CpuOps cpu_table;
  Ops& cpu = cpu_table;
  // Up to the 8192-wide rows a large model has; {1000, 768} takes the chunked dgamma path.
  constexpr Shape kNormShapes[] = {{1, 7}, {3, 7}, {17, 13}, {3, 768}, {1000, 768}, {17, 8192}};
  for (DType dtype : kDtypes) {
    for (Shape s : kNormShapes) {
      const std::string what = label("layernorm", dtype, s);
      const size_t n = count(s);
      const size_t width = static_cast<size_t>(s.cols);
      // Rows away from 0: the mean correction matters.
      std::vector<float> x = random_vector(n, 13);
      for (float& v : x)
        v += 3.0f;
      const std::vector<float> gamma = random_vector(width, 14, 2.0f);
      const std::vector<float> beta = random_vector(width, 15);
      const std::vector<float> dout = random_vector(n, 16);
      std::vector<float> x_r = rounded(x, dtype);
      std::vector<float> gamma_r = rounded(gamma, dtype);
      std::vector<float> beta_r = rounded(beta, dtype);
      std::vector<float> dout_r = rounded(dout, dtype);
      std::vector<float> want_out(n), want_mean(static_cast<size_t>(s.rows)),
          want_rstd(static_cast<size_t>(s.rows));
      cpu.layernorm_forward(host_matrix(x_r, s), gamma_r.data(), beta_r.data(),
                            host_matrix(want_out, s), want_mean.data(), want_rstd.data());

      const DeviceMatrix dx_in = device_matrix(x, s, dtype);
      const Buffer dgamma_w = to_device(gamma, dtype);
      const Buffer dbeta_w = to_device(beta, dtype);
      const Buffer out = gpu().allocate(dx_in.m.bytes());
      const Matrix out_m{out.data(), s.rows, s.cols, dtype};
      const Buffer mean = gpu().allocate(want_mean.size() * sizeof(float));
      const Buffer rstd = gpu().allocate(want_rstd.size() * sizeof(float));
      gpu().layernorm_forward(dx_in.m, dgamma_w.data(), dbeta_w.data(), out_m, mean.as<float>(),
                              rstd.as<float>());
      check_close(download(out_m), want_out, tolerance(dtype), what + " out");
      check_close(to_host(mean.data(), want_mean.size()), want_mean, tolerance(DType::f32),
                  what + " mean");
      check_close(to_host(rstd.data(), want_rstd.size()), want_rstd, tolerance(DType::f32),
                  what + " rstd");

      // Backward from the CPU's statistics, into gradients that already hold values.
      const std::vector<float> prior_gamma = random_vector(width, 17);
      const std::vector<float> prior_beta = random_vector(width, 18);
      std::vector<float> want_dx(n), want_dgamma = prior_gamma, want_dbeta = prior_beta;
      cpu.layernorm_backward(host_matrix(x_r, s), gamma_r.data(), want_mean.data(),
                             want_rstd.data(), host_matrix(dout_r, s), host_matrix(want_dx, s),
                             want_dgamma.data(), want_dbeta.data());
      const Buffer cpu_mean = to_device(want_mean);
      const Buffer cpu_rstd = to_device(want_rstd);
      const DeviceMatrix ddout = device_matrix(dout, s, dtype);
      const auto backward = [&](std::vector<float>& dx, std::vector<float>& dgamma,
                                std::vector<float>& dbeta) {
        const Buffer d_dx = gpu().allocate(dx_in.m.bytes());
        const Matrix dx_m{d_dx.data(), s.rows, s.cols, dtype};
        const Buffer d_dgamma = to_device(prior_gamma);
        const Buffer d_dbeta = to_device(prior_beta);
        gpu().layernorm_backward(dx_in.m, dgamma_w.data(), cpu_mean.as<float>(),
                                 cpu_rstd.as<float>(), ddout.m, dx_m, d_dgamma.as<float>(),
                                 d_dbeta.as<float>());
        dx = download(dx_m);
        dgamma = to_host(d_dgamma.data(), width);
        dbeta = to_host(d_dbeta.data(), width);
      };
      std::vector<float> dx, dgamma, dbeta;
      backward(dx, dgamma, dbeta);
      // dx mixes row sums with the rounded dout: the dtype's tolerance.
      check_close(dx, want_dx, tolerance(dtype), what + " dx");
      check_close(dgamma, want_dgamma, tolerance(DType::f32), what + " dgamma");
      check_close(dbeta, want_dbeta, tolerance(DType::f32), what + " dbeta");
      std::vector<float> dx2, dgamma2, dbeta2;
      backward(dx2, dgamma2, dbeta2);
      CHECK_MESSAGE(same_bits(dx, dx2), what << ": dx differs between two runs");
      CHECK_MESSAGE(same_bits(dgamma, dgamma2), what << ": dgamma differs between two runs");
      CHECK_MESSAGE(same_bits(dbeta, dbeta2), what << ": dbeta differs between two runs");
    }
  }
}

TEST_CASE("nn_kernels: embeddings forward and backward") {
  CpuOps cpu_table;
  Ops& cpu = cpu_table;
  struct Case {
    int64_t batch, seq, vocab, width;
  };
  // A GPT-2 sized step, a tiny vocabulary (long runs of one token) and odd widths.
  constexpr Case kCases[] = {
      {1, 1, 1, 7}, {3, 4, 50, 7}, {3, 5, 3, 13}, {4, 16, 7, 768}, {2, 1024, 4099, 768}};
  for (DType dtype : kDtypes) {
    for (const Case& c : kCases) {
      const Shape s{c.batch * c.seq, c.width};
      const std::string what = label("embedding", dtype, s) + " vocab " + std::to_string(c.vocab);
      const size_t n = count(s);
      const std::vector<float> wte = random_vector(static_cast<size_t>(c.vocab * c.width), 19);
      const std::vector<float> wpe = random_vector(static_cast<size_t>(c.seq * c.width), 20);
      const std::vector<int32_t> tokens =
          random_ints(static_cast<size_t>(s.rows), static_cast<int32_t>(c.vocab), 21);
      std::vector<float> wte_r = rounded(wte, dtype);
      std::vector<float> wpe_r = rounded(wpe, dtype);
      std::vector<float> want(n);
      cpu.embedding_forward(tokens.data(), c.seq, c.vocab, wte_r.data(), wpe_r.data(),
                            host_matrix(want, s));
      const Buffer dtokens = to_device(tokens);
      const Buffer dwte_w = to_device(wte, dtype);
      const Buffer dwpe_w = to_device(wpe, dtype);
      const Buffer out = gpu().allocate(n * dtype_size(dtype));
      const Matrix out_m{out.data(), s.rows, s.cols, dtype};
      gpu().embedding_forward(dtokens.as<int32_t>(), c.seq, c.vocab, dwte_w.data(), dwpe_w.data(),
                              out_m);
      check_close(download(out_m), want, tolerance(dtype), what + " forward");

      // Backward into gradients that already hold values. Each gradient element gets the CPU's
      // additions in the CPU's order: the results are the CPU's bits.
      const std::vector<float> dout = random_vector(n, 22);
      const std::vector<float> prior_wte = random_vector(wte.size(), 23);
      const std::vector<float> prior_wpe = random_vector(wpe.size(), 24);
      std::vector<float> dout_r = rounded(dout, dtype);
      std::vector<float> want_wte = prior_wte, want_wpe = prior_wpe;
      cpu.embedding_backward(tokens.data(), c.seq, host_matrix(dout_r, s), want_wte.data(),
                             want_wpe.data());
      const DeviceMatrix ddout = device_matrix(dout, s, dtype);
      const auto backward = [&](std::vector<float>& grad_wte, std::vector<float>& grad_wpe) {
        const Buffer d_wte = to_device(prior_wte);
        const Buffer d_wpe = to_device(prior_wpe);
        gpu().embedding_backward(dtokens.as<int32_t>(), c.seq, ddout.m, d_wte.as<float>(),
                                 d_wpe.as<float>());
        grad_wte = to_host(d_wte.data(), prior_wte.size());
        grad_wpe = to_host(d_wpe.data(), prior_wpe.size());
      };
      std::vector<float> grad_wte, grad_wpe, grad_wte2, grad_wpe2;
      backward(grad_wte, grad_wpe);
      check_close(grad_wte, want_wte, 0.0, what + " dwte");
      check_close(grad_wpe, want_wpe, 0.0, what + " dwpe");
      backward(grad_wte2, grad_wpe2);
      CHECK_MESSAGE(same_bits(grad_wte, grad_wte2), what << ": dwte differs between two runs");
      CHECK_MESSAGE(same_bits(grad_wpe, grad_wpe2), what << ": dwpe differs between two runs");
    }
  }
}

TEST_CASE("nn_kernels: a token outside the vocabulary is a recipe error at the next synchronise") {
  const int64_t seq = 4, vocab = 50, width = 7;
  for (DType dtype : kDtypes) {
    const Buffer wte = to_device(random_vector(static_cast<size_t>(vocab * width), 25), dtype);
    const Buffer wpe = to_device(random_vector(static_cast<size_t>(seq * width), 26), dtype);
    const Buffer tokens = to_device(std::vector<int32_t>{1, 2, 3, 4, 5, 53, 7, 8});
    const Buffer out = gpu().allocate(static_cast<size_t>(8 * width) * dtype_size(dtype));
    const Matrix out_m{out.data(), 8, width, dtype};
    // Made before the forward: to_device synchronises (a cast to bf16 or fp16), which would
    // surface the error there.
    const Buffer dout = to_device(random_vector(static_cast<size_t>(8 * width), 27), dtype);
    const Buffer dwte = gpu().allocate(static_cast<size_t>(vocab * width) * sizeof(float));
    const Buffer dwpe = gpu().allocate(static_cast<size_t>(seq * width) * sizeof(float));
    gpu().embedding_forward(tokens.as<int32_t>(), seq, vocab, wte.data(), wpe.data(), out_m);
    // The backward of the same tokens must not write outside dwte before the error surfaces.
    gpu().embedding_backward(tokens.as<int32_t>(), seq, ConstMatrix{dout.data(), 8, width, dtype},
                             dwte.as<float>(), dwpe.as<float>());
    check_error([&] { gpu().synchronize(); }, ErrorKind::recipe, "token 53",
                std::string("embedding ") + dtype_name(dtype));
    const std::vector<float> rows = download(out_m);
    for (int64_t j = 0; j < width; ++j)
      CHECK(rows[static_cast<size_t>(5 * width + j)] == 0.0f);
    gpu().synchronize();  // the record was cleared
  }
}

}  // namespace
}  // namespace dptrain::gputest
