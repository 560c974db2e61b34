// The 16-bit-storage CPU op table: widen, compute with CpuOps, round back.
#include "core/tensor/emulated_ops.hpp"

#include <vector>

namespace dptrain {

namespace {

// An input in f32: a 16-bit one widened into its own storage, an f32 one used in place.
class Wide {
 public:
  Wide(CpuOps& cpu, const void* data, DType dtype, int64_t n) {
    if (dtype == DType::f32 || data == nullptr) {
      data_ = static_cast<const float*>(data);
      return;
    }
    storage_.resize(static_cast<size_t>(n));
    cpu.cast(data, dtype, storage_.data(), DType::f32, n);
    data_ = storage_.data();
  }
  // A matrix with padded rows is widened gaps and all, and keeps its stride.
  Wide(CpuOps& cpu, ConstMatrix m) : Wide(cpu, m.data, m.dtype, m.span()) { shape_ = m; }
  const float* data() const { return data_; }
  ConstMatrix matrix() const {
    return {data_, shape_.rows, shape_.cols, DType::f32, shape_.stride};
  }

 private:
  std::vector<float> storage_;
  const float* data_ = nullptr;
  ConstMatrix shape_;
};

// An output in f32: for a 16-bit matrix, f32 scratch (holding its current values when the op
// reads them: accumulating outputs) rounded back into it by commit(); an f32 one in place. A
// matrix with padded rows keeps its stride; its gaps are read too, so that commit() writes them
// back unchanged (16 bits widen to f32 and round back exactly, a signalling NaN aside).
class Narrow {
 public:
  Narrow(CpuOps& cpu, Matrix m, bool read) : cpu_(cpu), target_(m) {
    if (m.dtype == DType::f32) {
      data_ = static_cast<float*>(m.data);
      return;
    }
    storage_.resize(static_cast<size_t>(m.span()));
    if (read || !m.contiguous()) cpu.cast(m.data, m.dtype, storage_.data(), DType::f32, m.span());
    data_ = storage_.data();
  }
  Matrix matrix() const { return {data_, target_.rows, target_.cols, DType::f32, target_.stride}; }
  void commit() {
    if (target_.dtype != DType::f32) {
      cpu_.cast(storage_.data(), DType::f32, target_.data, target_.dtype, target_.span());
    }
  }

 private:
  CpuOps& cpu_;
  Matrix target_;
  std::vector<float> storage_;
  float* data_ = nullptr;
};

}  // namespace

std::string EmulatedHalfOps::device() const {
  return cpu_.device();
}
Buffer EmulatedHalfOps::allocate(size_t bytes) {
  return cpu_.allocate(bytes);
}
void EmulatedHalfOps::upload(const void* host, void* device, size_t bytes) {
  cpu_.upload(host, device, bytes);
}
void EmulatedHalfOps::download(const void* device, void* host, size_t bytes) {
  cpu_.download(device, host, bytes);
}
void EmulatedHalfOps::copy(const void* src, void* dst, size_t bytes) {
  cpu_.copy(src, dst, bytes);
}
void EmulatedHalfOps::fill_zero(void* data, size_t bytes) {
  cpu_.fill_zero(data, bytes);
}
void EmulatedHalfOps::synchronize() {
  cpu_.synchronize();
}
void EmulatedHalfOps::cast(const void* src, DType from, void* dst, DType to, int64_t n) {
  cpu_.cast(src, from, dst, to, n);
}

void EmulatedHalfOps::gemm(ConstMatrix a, Transpose transpose_a, ConstMatrix b,
                           Transpose transpose_b, Matrix c, float alpha, float beta) {
  const Wide wa(cpu_, a), wb(cpu_, b);
  Narrow nc(cpu_, c, beta != 0.0f);
  cpu_.gemm(wa.matrix(), transpose_a, wb.matrix(), transpose_b, nc.matrix(), alpha, beta);
  nc.commit();
}

void EmulatedHalfOps::add_bias_rows(Matrix x, const void* bias) {
  const Wide wbias(cpu_, bias, x.dtype, x.cols);
  Narrow nx(cpu_, x, true);
  cpu_.add_bias_rows(nx.matrix(), wbias.data());
  nx.commit();
}

void EmulatedHalfOps::bias_grad(ConstMatrix dy, float* bias_grad) {
  cpu_.bias_grad(Wide(cpu_, dy).matrix(), bias_grad);
}

void EmulatedHalfOps::activation_forward(Activation activation, ConstMatrix pre, Matrix out) {
  const Wide wpre(cpu_, pre);
  Narrow nout(cpu_, out, false);
  cpu_.activation_forward(activation, wpre.matrix(), nout.matrix());
  nout.commit();
}

void EmulatedHalfOps::activation_backward(Activation activation, ConstMatrix pre, ConstMatrix dout,
                                          Matrix dpre) {
  const Wide wpre(cpu_, pre), wdout(cpu_, dout);
  Narrow ndpre(cpu_, dpre, false);
  cpu_.activation_backward(activation, wpre.matrix(), wdout.matrix(), ndpre.matrix());
  ndpre.commit();
}

double EmulatedHalfOps::softmax_cross_entropy_forward(ConstMatrix logits, const int32_t* labels,
                                                      Matrix probs) {
  const Wide wlogits(cpu_, logits);
  Narrow nprobs(cpu_, probs, false);
  const double loss = cpu_.softmax_cross_entropy_forward(wlogits.matrix(), labels, nprobs.matrix());
  nprobs.commit();
  return loss;
}

void EmulatedHalfOps::softmax_cross_entropy_backward(ConstMatrix probs, const int32_t* labels,
                                                     Matrix dlogits, float scale) {
  const Wide wprobs(cpu_, probs);
  Narrow nd(cpu_, dlogits, false);
  cpu_.softmax_cross_entropy_backward(wprobs.matrix(), labels, nd.matrix(), scale);
  nd.commit();
}

int64_t EmulatedHalfOps::count_correct(ConstMatrix scores, const int32_t* labels) {
  return cpu_.count_correct(Wide(cpu_, scores).matrix(), labels);
}

void EmulatedHalfOps::add(ConstMatrix x, Matrix y) {
  const Wide wx(cpu_, x);
  Narrow ny(cpu_, y, true);
  cpu_.add(wx.matrix(), ny.matrix());
  ny.commit();
}

void EmulatedHalfOps::axpy(int64_t n, float alpha, const float* x, float* y) {
  cpu_.axpy(n, alpha, x, y);
}
void EmulatedHalfOps::scale(int64_t n, float alpha, float* x) {
  cpu_.scale(n, alpha, x);
}
double EmulatedHalfOps::sum_squares(const float* x, int64_t n) {
  return cpu_.sum_squares(x, n);
}
void EmulatedHalfOps::adamw_update(float* params, const float* grads, float* m, float* v, int64_t n,
                                   const AdamWCoefficients& k) {
  cpu_.adamw_update(params, grads, m, v, n, k);
}
void EmulatedHalfOps::sgd_update(float* params, const float* grads, float* velocity, int64_t n,
                                 float momentum, float decay, float rate, bool nesterov) {
  cpu_.sgd_update(params, grads, velocity, n, momentum, decay, rate, nesterov);
}

void EmulatedHalfOps::layernorm_forward(ConstMatrix x, const void* gamma, const void* beta,
                                        Matrix out, float* mean, float* rstd) {
  const Wide wx(cpu_, x), wgamma(cpu_, gamma, x.dtype, x.cols), wbeta(cpu_, beta, x.dtype, x.cols);
  Narrow nout(cpu_, out, false);
  cpu_.layernorm_forward(wx.matrix(), wgamma.data(), wbeta.data(), nout.matrix(), mean, rstd);
  nout.commit();
}

void EmulatedHalfOps::layernorm_backward(ConstMatrix x, const void* gamma, const float* mean,
                                         const float* rstd, ConstMatrix dout, Matrix dx,
                                         float* dgamma, float* dbeta) {
  const Wide wx(cpu_, x), wgamma(cpu_, gamma, x.dtype, x.cols), wdout(cpu_, dout);
  Narrow ndx(cpu_, dx, false);
  cpu_.layernorm_backward(wx.matrix(), wgamma.data(), mean, rstd, wdout.matrix(), ndx.matrix(),
                          dgamma, dbeta);
  ndx.commit();
}

size_t EmulatedHalfOps::attention_state_floats(int64_t batch, int64_t seq, int64_t heads) const {
  return cpu_.attention_state_floats(batch, seq, heads);
}

void EmulatedHalfOps::attention_forward(ConstMatrix qkv, int64_t batch, int64_t seq, int64_t heads,
                                        Matrix out, float* state) {
  const Wide wqkv(cpu_, qkv);
  Narrow nout(cpu_, out, false);
  cpu_.attention_forward(wqkv.matrix(), batch, seq, heads, nout.matrix(), state);
  nout.commit();
}

void EmulatedHalfOps::attention_backward(ConstMatrix qkv, ConstMatrix out, const float* state,
                                         ConstMatrix dout, int64_t batch, int64_t seq,
                                         int64_t heads, Matrix dqkv) {
  const Wide wqkv(cpu_, qkv), wout(cpu_, out), wdout(cpu_, dout);
  Narrow nd(cpu_, dqkv, false);
  cpu_.attention_backward(wqkv.matrix(), wout.matrix(), state, wdout.matrix(), batch, seq, heads,
                          nd.matrix());
  nd.commit();
}

void EmulatedHalfOps::embedding_forward(const int32_t* tokens, int64_t seq, int64_t vocab,
                                        const void* wte, const void* wpe, Matrix out) {
  // Only positions [0, seq) of wpe are read.
  const Wide wwte(cpu_, wte, out.dtype, vocab * out.cols),
      wwpe(cpu_, wpe, out.dtype, seq * out.cols);
  Narrow nout(cpu_, out, false);
  cpu_.embedding_forward(tokens, seq, vocab, wwte.data(), wwpe.data(), nout.matrix());
  nout.commit();
}

void EmulatedHalfOps::embedding_backward(const int32_t* tokens, int64_t seq, ConstMatrix dout,
                                         float* dwte, float* dwpe) {
  cpu_.embedding_backward(tokens, seq, Wide(cpu_, dout).matrix(), dwte, dwpe);
}

}  // namespace dptrain
