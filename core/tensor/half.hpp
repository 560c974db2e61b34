// 16-bit floats on the host: IEEE binary16 ("half") and bfloat16, held as their bits, with
// round-to-nearest-even conversions. Collectives, the CPU op table's casts and benchmarks share
// them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace dptrain {

// 16-bit floats held as their bits: IEEE binary16 ("half") and bfloat16. Collectives reduce them
// the way GPUs do: convert to float, combine, round back to the nearest even.
struct Half {
  uint16_t bits = 0;
};
struct BFloat16 {
  uint16_t bits = 0;
};

inline float to_float(BFloat16 value) {
  const uint32_t bits = uint32_t{value.bits} << 16;
  float out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}

inline BFloat16 to_bfloat16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  const bool nan = (bits & 0x7fffffffu) > 0x7f800000u;
  // Round to nearest even; a carry out of the mantissa bumps the exponent, up to infinity.
  const uint32_t rounded = bits + 0x7fffu + ((bits >> 16) & 1u);
  // A NaN stays a (quiet) NaN: rounding could otherwise turn it into infinity.
  return {static_cast<uint16_t>(nan ? (bits >> 16) | 0x40u : rounded >> 16)};
}

inline float to_float(Half value) {
  const uint32_t sign = uint32_t{value.bits & 0x8000u} << 16;
  const uint32_t exponent = (value.bits >> 10) & 0x1fu;
  const uint32_t mantissa = value.bits & 0x3ffu;
  uint32_t bits;
  if (exponent == 0x1f) {  // infinity or NaN (quietened, as the CPU's F16C and GPUs do)
    bits = sign | 0x7f800000u | (mantissa << 13) | (mantissa != 0 ? 0x400000u : 0u);
  } else if (exponent != 0) {  // normal: rebias 15 -> 127
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else {  // zero or subnormal: mantissa * 2^-24, exact in float
    const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    return sign != 0 ? -magnitude : magnitude;
  }
  float out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}

inline Half to_half(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  const auto sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude > 0x7f800000u) {  // NaN: keep it quiet and keep the top of its payload
    return {static_cast<uint16_t>(sign | 0x7e00u | ((magnitude >> 13) & 0x3ffu))};
  }
  // 65520 and above round to infinity (65504 is the largest half; ties go to even).
  if (magnitude >= 0x477ff000u) return {static_cast<uint16_t>(sign | 0x7c00u)};
  if (magnitude >= 0x38800000u) {  // a normal half: rebias 127 -> 15, round 13 bits away
    uint32_t v = magnitude - 0x38000000u;
    v += 0xfffu + ((v >> 13) & 1u);
    return {static_cast<uint16_t>(sign | (v >> 13))};
  }
  if (magnitude <= 0x33000000u) return {sign};  // at most 2^-25: rounds to zero
  // A subnormal half: count units of 2^-24, rounding to nearest even.
  const uint32_t exponent = magnitude >> 23;
  const uint32_t mantissa = (magnitude & 0x7fffffu) | 0x800000u;
  const uint32_t shift = 126 - exponent;  // 14..24
  uint32_t units = mantissa >> shift;
  const uint32_t rest = mantissa & ((1u << shift) - 1);
  const uint32_t halfway = 1u << (shift - 1);
  if (rest > halfway || (rest == halfway && (units & 1u) != 0)) ++units;
  return {static_cast<uint16_t>(sign | units)};
}

// The type an element is computed in: itself, or float for the 16-bit formats. up() widens,
// down() rounds back (to nearest even). Reductions, benchmarks and tests convert through it.
template <typename T>
struct Widened {
  static T up(T value) { return value; }
  static T down(T value) { return value; }
};
template <>
struct Widened<Half> {
  static float up(Half value) { return to_float(value); }
  static Half down(float value) { return to_half(value); }
};
// Many halves at once, with the same rounding: the CPU's F16C instructions where it has them (a
// float16 cast would otherwise cost more than the collective it saves), else the functions above.
void to_float(const Half* in, float* out, size_t n);
void to_half(const float* in, Half* out, size_t n);

template <>
struct Widened<BFloat16> {
  static float up(BFloat16 value) { return to_float(value); }
  static BFloat16 down(float value) { return to_bfloat16(value); }
};

}  // namespace dptrain
