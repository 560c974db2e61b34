// Views of row-major matrices and owned buffers: what the op table reads and writes, on host or
// device.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>

#include "core/error.hpp"

namespace dptrain {

// Element types of activations. Parameters, gradients and optimizer state are always f32; a
// bf16/f16 model computes in a 16-bit copy of its parameters (mixed precision).
enum class DType : uint8_t { f32, bf16, f16 };

constexpr size_t dtype_size(DType t) {
  return t == DType::f32 ? 4 : 2;
}
constexpr const char* dtype_name(DType t) {
  return t == DType::f32 ? "f32" : t == DType::bf16 ? "bf16" : "f16";
}

// A typed row-major [rows, cols] block; T is float or const float. Rows are `stride` elements
// apart (0: cols, contiguous). The pointer may be device memory, so views never dereference it
// themselves.
template <typename T>
struct MatrixView {
  T* data = nullptr;
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t stride = 0;

  int64_t size() const { return rows * cols; }
  int64_t row_stride() const { return stride != 0 ? stride : cols; }
  T* row(int64_t i) const { return data + i * row_stride(); }
  // A mutable view converts to a read-only one, never the other way.
  template <typename U = T, typename = std::enable_if_t<!std::is_const_v<U>>>
  operator MatrixView<const U>() const {
    return {data, rows, cols, stride};
  }
};

// What the op table takes: a row-major [rows, cols] block of `dtype` elements on the op table's
// device. Void is void or const void. Rows are `stride` elements apart, 0 meaning cols: a
// contiguous block. A wider stride pads each row (the LM head's logits: rows that start aligned
// let cuBLASLt use its fastest kernels); only the ops that say so take such a matrix.
template <typename Void>
struct BasicMatrix {
  Void* data = nullptr;
  int64_t rows = 0;
  int64_t cols = 0;
  DType dtype = DType::f32;
  int64_t stride = 0;

  int64_t size() const { return rows * cols; }
  // The elements' bytes: of the whole block when it is contiguous.
  size_t bytes() const { return static_cast<size_t>(size()) * dtype_size(dtype); }
  int64_t row_stride() const { return stride != 0 ? stride : cols; }
  bool contiguous() const { return row_stride() == cols || rows <= 1; }
  // Elements from the first one to the end of the last row (gaps included).
  int64_t span() const { return rows == 0 ? 0 : (rows - 1) * row_stride() + cols; }
  // The first element of row i.
  Void* row(int64_t i) const {
    using Byte = std::conditional_t<std::is_const_v<Void>, const char, char>;
    return static_cast<Byte*>(data) + static_cast<size_t>(i * row_stride()) * dtype_size(dtype);
  }
  template <typename U = Void, typename = std::enable_if_t<!std::is_const_v<U>>>
  operator BasicMatrix<const void>() const {
    return {data, rows, cols, dtype, stride};
  }
};

using Matrix = BasicMatrix<void>;
using ConstMatrix = BasicMatrix<const void>;

// The float view of an f32 matrix (host code, the CPU op table), keeping its stride. Another
// dtype is Error(internal): a CPU op table computes in f32 only.
template <typename Void>
auto f32_strided(BasicMatrix<Void> m) {
  using Float = std::conditional_t<std::is_const_v<Void>, const float, float>;
  if (m.dtype != DType::f32) {
    throw Error(ErrorKind::internal,
                std::string("an f32 matrix was expected, got ") + dtype_name(m.dtype));
  }
  if (m.row_stride() < m.cols) {
    throw Error(ErrorKind::internal, "a matrix has rows " + std::to_string(m.row_stride()) +
                                         " elements apart for " + std::to_string(m.cols) +
                                         " columns");
  }
  return MatrixView<Float>{static_cast<Float*>(m.data), m.rows, m.cols, m.stride};
}

// The same for the ops that need a contiguous matrix: a padded one is Error(internal).
template <typename Void>
auto f32(BasicMatrix<Void> m) {
  if (!m.contiguous()) {
    throw Error(ErrorKind::internal, "a contiguous matrix was expected, got rows " +
                                         std::to_string(m.stride) + " elements apart for " +
                                         std::to_string(m.cols) + " columns");
  }
  auto view = f32_strided(m);
  view.stride = 0;
  return view;
}

// A run of values in a flat buffer (parameters, gradients).
struct ParamRange {
  size_t offset = 0;
  size_t size = 0;
};

// One parameter tensor of a flat buffer: rows x cols values from `offset`, row-major (a vector
// has one row). Gradient codecs that factorise matrices (PowerSGD) need the shapes; weight decay
// needs to know a vector from a matrix of one row (a layer one unit wide).
struct ParamTensor {
  size_t offset = 0;
  size_t rows = 1;
  size_t cols = 0;
  // One-dimensional: a bias, a LayerNorm gain or shift. Weight decay skips it (Model::no_decay).
  bool is_vector = false;
  size_t size() const { return rows * cols; }
  bool operator==(const ParamTensor&) const = default;

  static ParamTensor vector(size_t offset, size_t size) { return {offset, 1, size, true}; }
};

// Memory an op table allocated (host or device), freed with it. Move-only.
class Buffer {
 public:
  using Release = void (*)(void*);
  Buffer() = default;
  Buffer(void* data, size_t bytes, Release release)
      : data_(data), bytes_(bytes), release_(release) {}
  Buffer(Buffer&& other) noexcept { swap(other); }
  Buffer& operator=(Buffer&& other) noexcept {
    Buffer(std::move(other)).swap(*this);
    return *this;
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() {
    if (data_ != nullptr && release_ != nullptr) release_(data_);
  }

  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }
  void swap(Buffer& other) noexcept {
    std::swap(data_, other.data_);
    std::swap(bytes_, other.bytes_);
    std::swap(release_, other.release_);
  }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
  Release release_ = nullptr;
};

}  // namespace dptrain
