// Non-owning views of row-major matrices: what the op table reads and writes, on host or device.
#pragma once

#include <cstddef>
#include <cstdint>

namespace dptrain {

// A contiguous row-major [rows, cols] block. T is float or const float; the pointer may be device
// memory for a device op table, so views never dereference it themselves.
template <typename T>
struct MatrixView {
  T* data = nullptr;
  int64_t rows = 0;
  int64_t cols = 0;

  int64_t size() const { return rows * cols; }
  T* row(int64_t i) const { return data + i * cols; }
  // A mutable view converts to a read-only one, never the other way.
  operator MatrixView<const T>() const { return {data, rows, cols}; }
};

using Matrix = MatrixView<float>;
using ConstMatrix = MatrixView<const float>;

// A run of values in a flat buffer (parameters, gradients).
struct ParamRange {
  size_t offset = 0;
  size_t size = 0;
};

}  // namespace dptrain
