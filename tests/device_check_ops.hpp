// An op table posing as a GPU's, for tests of the trainer's device paths on the CPU: it runs an
// inner CPU table (CpuOps, or EmulatedHalfOps for 16-bit activations), calls itself "cuda:0",
// and records a violation for every op argument that is not memory it allocated ("device"
// memory) and every host argument of upload/download that is. With it the trainer stages Gloo
// collectives through host memory as on a GPU, and a communicator wrapper can check that Gloo
// never gets "device" memory.
#pragma once

#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/tensor/ops.hpp"

namespace dptrain::test {

// Every "device" allocation of every DeviceCheckingOps (ranks run in threads), and the violations.
class DeviceMemory {
 public:
  static DeviceMemory& instance() {
    static DeviceMemory memory;
    return memory;
  }
  void add(const void* p, size_t bytes) {
    std::lock_guard lock(mutex_);
    ranges_[static_cast<const char*>(p)] = bytes;
  }
  void remove(const void* p) {
    std::lock_guard lock(mutex_);
    ranges_.erase(static_cast<const char*>(p));
  }
  // Inside an allocation (one past its end too: an empty span at the end).
  bool holds(const void* p) {
    std::lock_guard lock(mutex_);
    const auto* c = static_cast<const char*>(p);
    auto it = ranges_.upper_bound(c);
    if (it == ranges_.begin()) return false;
    --it;
    return c >= it->first && c <= it->first + it->second;
  }
  void need_device(const void* p, const char* op, const char* arg) {
    if (p != nullptr && !holds(p)) violation(std::string(op) + ": " + arg + " is host memory");
  }
  void need_host(const void* p, const char* op, const char* arg) {
    if (p != nullptr && holds(p)) violation(std::string(op) + ": " + arg + " is device memory");
  }
  void violation(const std::string& what) {
    std::lock_guard lock(mutex_);
    violations_.push_back(what);
  }
  std::vector<std::string> take_violations() {
    std::lock_guard lock(mutex_);
    return std::exchange(violations_, {});
  }

 private:
  std::mutex mutex_;
  std::map<const char*, size_t> ranges_;
  std::vector<std::string> violations_;
};

class DeviceCheckingOps : public Ops {
 public:
  explicit DeviceCheckingOps(std::shared_ptr<Ops> inner) : inner_(std::move(inner)) {}

  std::string device() const override { return "cuda:0"; }
  Buffer allocate(size_t bytes) override {
    if (bytes == 0) return Buffer();
    void* p = std::calloc(bytes, 1);
    mem().add(p, bytes);
    return Buffer(p, bytes, [](void* q) {
      DeviceMemory::instance().remove(q);
      std::free(q);
    });
  }
  void upload(const void* host, void* device, size_t bytes) override {
    if (bytes == 0) return;
    mem().need_host(host, "upload", "host");
    mem().need_device(device, "upload", "device");
    inner_->upload(host, device, bytes);
  }
  void download(const void* device, void* host, size_t bytes) override {
    if (bytes == 0) return;
    mem().need_device(device, "download", "device");
    mem().need_host(host, "download", "host");
    inner_->download(device, host, bytes);
  }
  void copy(const void* src, void* dst, size_t bytes) override {
    dev(src, "copy", "src");
    dev(dst, "copy", "dst");
    inner_->copy(src, dst, bytes);
  }
  void fill_zero(void* data, size_t bytes) override {
    if (bytes > 0) dev(data, "fill_zero", "data");
    inner_->fill_zero(data, bytes);
  }
  void synchronize() override { inner_->synchronize(); }
  void cast(const void* src, DType from, void* dst, DType to, int64_t n) override {
    if (n > 0) {
      dev(src, "cast", "src");
      dev(dst, "cast", "dst");
    }
    inner_->cast(src, from, dst, to, n);
  }
  void gemm(ConstMatrix a, Transpose ta, ConstMatrix b, Transpose tb, Matrix c, float alpha,
            float beta) override {
    dev(a.data, "gemm", "a");
    dev(b.data, "gemm", "b");
    dev(c.data, "gemm", "c");
    inner_->gemm(a, ta, b, tb, c, alpha, beta);
  }
  void add_bias_rows(Matrix x, const void* bias) override {
    dev(x.data, "add_bias_rows", "x");
    dev(bias, "add_bias_rows", "bias");
    inner_->add_bias_rows(x, bias);
  }
  void bias_grad(ConstMatrix dy, float* bias_grad) override {
    dev(dy.data, "bias_grad", "dy");
    dev(bias_grad, "bias_grad", "bias_grad");
    inner_->bias_grad(dy, bias_grad);
  }
  void activation_forward(Activation a, ConstMatrix pre, Matrix out) override {
    dev(pre.data, "activation_forward", "pre");
    dev(out.data, "activation_forward", "out");
    inner_->activation_forward(a, pre, out);
  }
  void activation_backward(Activation a, ConstMatrix pre, ConstMatrix dout, Matrix dpre) override {
    dev(pre.data, "activation_backward", "pre");
    dev(dout.data, "activation_backward", "dout");
    dev(dpre.data, "activation_backward", "dpre");
    inner_->activation_backward(a, pre, dout, dpre);
  }
  double softmax_cross_entropy_forward(ConstMatrix logits, const int32_t* labels,
                                       Matrix probs) override {
    dev(logits.data, "softmax_cross_entropy_forward", "logits");
    dev(labels, "softmax_cross_entropy_forward", "labels");
    dev(probs.data, "softmax_cross_entropy_forward", "probs");
    return inner_->softmax_cross_entropy_forward(logits, labels, probs);
  }
  void softmax_cross_entropy_backward(ConstMatrix probs, const int32_t* labels, Matrix dlogits,
                                      float scale) override {
    dev(probs.data, "softmax_cross_entropy_backward", "probs");
    dev(labels, "softmax_cross_entropy_backward", "labels");
    dev(dlogits.data, "softmax_cross_entropy_backward", "dlogits");
    inner_->softmax_cross_entropy_backward(probs, labels, dlogits, scale);
  }
  double softmax_cross_entropy(ConstMatrix logits, const int32_t* labels, Matrix dlogits,
                               float scale) override {
    dev(logits.data, "softmax_cross_entropy", "logits");
    dev(labels, "softmax_cross_entropy", "labels");
    dev(dlogits.data, "softmax_cross_entropy", "dlogits");
    return inner_->softmax_cross_entropy(logits, labels, dlogits, scale);
  }
  int64_t count_correct(ConstMatrix scores, const int32_t* labels) override {
    dev(scores.data, "count_correct", "scores");
    dev(labels, "count_correct", "labels");
    return inner_->count_correct(scores, labels);
  }
  void add(ConstMatrix x, Matrix y) override {
    dev(x.data, "add", "x");
    dev(y.data, "add", "y");
    inner_->add(x, y);
  }
  void axpy(int64_t n, float alpha, const float* x, float* y) override {
    if (n > 0) {
      dev(x, "axpy", "x");
      dev(y, "axpy", "y");
    }
    inner_->axpy(n, alpha, x, y);
  }
  void scale(int64_t n, float alpha, float* x) override {
    if (n > 0) dev(x, "scale", "x");
    inner_->scale(n, alpha, x);
  }
  double sum_squares(const float* x, int64_t n) override {
    if (n > 0) dev(x, "sum_squares", "x");
    return inner_->sum_squares(x, n);
  }
  void adamw_update(float* params, const float* grads, float* m, float* v, int64_t n,
                    const AdamWCoefficients& k) override {
    if (n > 0) {
      dev(params, "adamw_update", "params");
      dev(grads, "adamw_update", "grads");
      dev(m, "adamw_update", "m");
      dev(v, "adamw_update", "v");
    }
    inner_->adamw_update(params, grads, m, v, n, k);
  }
  void sgd_update(float* params, const float* grads, float* velocity, int64_t n, float momentum,
                  float decay, float rate, bool nesterov) override {
    if (n > 0) {
      dev(params, "sgd_update", "params");
      dev(grads, "sgd_update", "grads");
      dev(velocity, "sgd_update", "velocity");
    }
    inner_->sgd_update(params, grads, velocity, n, momentum, decay, rate, nesterov);
  }
  void layernorm_forward(ConstMatrix x, const void* gamma, const void* beta, Matrix out,
                         float* mean, float* rstd) override {
    for (const void* p : {x.data, gamma, beta, static_cast<const void*>(out.data),
                          static_cast<const void*>(mean), static_cast<const void*>(rstd)})
      dev(p, "layernorm_forward", "an argument");
    inner_->layernorm_forward(x, gamma, beta, out, mean, rstd);
  }
  void layernorm_backward(ConstMatrix x, const void* gamma, const float* mean, const float* rstd,
                          ConstMatrix dout, Matrix dx, float* dgamma, float* dbeta) override {
    for (const void* p :
         {x.data, gamma, static_cast<const void*>(mean), static_cast<const void*>(rstd), dout.data,
          static_cast<const void*>(dx.data), static_cast<const void*>(dgamma),
          static_cast<const void*>(dbeta)})
      dev(p, "layernorm_backward", "an argument");
    inner_->layernorm_backward(x, gamma, mean, rstd, dout, dx, dgamma, dbeta);
  }
  size_t attention_state_floats(int64_t batch, int64_t seq, int64_t heads) const override {
    return inner_->attention_state_floats(batch, seq, heads);
  }
  void attention_forward(ConstMatrix qkv, int64_t batch, int64_t seq, int64_t heads, Matrix out,
                         float* state) override {
    dev(qkv.data, "attention_forward", "qkv");
    dev(out.data, "attention_forward", "out");
    dev(state, "attention_forward", "state");
    inner_->attention_forward(qkv, batch, seq, heads, out, state);
  }
  void attention_backward(ConstMatrix qkv, ConstMatrix out, const float* state, ConstMatrix dout,
                          int64_t batch, int64_t seq, int64_t heads, Matrix dqkv) override {
    for (const void* p : {qkv.data, out.data, static_cast<const void*>(state), dout.data,
                          static_cast<const void*>(dqkv.data)})
      dev(p, "attention_backward", "an argument");
    inner_->attention_backward(qkv, out, state, dout, batch, seq, heads, dqkv);
  }
  void embedding_forward(const int32_t* tokens, int64_t seq, int64_t vocab, const void* wte,
                         const void* wpe, Matrix out) override {
    for (const void* p :
         {static_cast<const void*>(tokens), wte, wpe, static_cast<const void*>(out.data)})
      dev(p, "embedding_forward", "an argument");
    inner_->embedding_forward(tokens, seq, vocab, wte, wpe, out);
  }
  void embedding_backward(const int32_t* tokens, int64_t seq, ConstMatrix dout, float* dwte,
                          float* dwpe) override {
    for (const void* p : {static_cast<const void*>(tokens), dout.data,
                          static_cast<const void*>(dwte), static_cast<const void*>(dwpe)})
      dev(p, "embedding_backward", "an argument");
    inner_->embedding_backward(tokens, seq, dout, dwte, dwpe);
  }

 private:
  static DeviceMemory& mem() { return DeviceMemory::instance(); }
  static void dev(const void* p, const char* op, const char* arg) { mem().need_device(p, op, arg); }

  std::shared_ptr<Ops> inner_;
};

}  // namespace dptrain::test
