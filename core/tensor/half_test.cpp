// The batch half conversions (F16C where the CPU has it) against the scalar ones, bit for bit.
#include "core/tensor/half.hpp"

#include <doctest/doctest.h>

#include <cstring>
#include <random>
#include <vector>

namespace dptrain {

TEST_CASE("half: batch conversions equal the scalar ones for every half and many floats") {
  // Every half, widened in one batch (65,536 values: the vector loop and no tail).
  std::vector<Half> halves(65536);
  for (size_t i = 0; i < halves.size(); ++i)
    halves[i].bits = static_cast<uint16_t>(i);
  std::vector<float> widened(halves.size());
  to_float(halves.data(), widened.data(), halves.size());
  for (size_t i = 0; i < halves.size(); ++i) {
    const float scalar = to_float(halves[i]);
    REQUIRE(std::memcmp(&widened[i], &scalar, sizeof(float)) == 0);
  }

  // Floats around every rounding boundary: each half, the midpoints to its neighbours and just
  // off them, the overflow threshold, subnormals, zeros of both signs, infinities and NaNs; an
  // odd count so the scalar tail runs too.
  std::vector<float> floats;
  for (size_t i = 0; i + 1 < halves.size(); ++i) {
    const float here = widened[i];
    const float next = widened[i + 1];
    uint32_t bits;
    std::memcpy(&bits, &here, sizeof bits);
    floats.push_back(here);
    floats.push_back(0.5f * (here + next));
    for (const uint32_t delta : {1u, 4095u, 4096u, 4097u}) {
      uint32_t up = bits + delta;
      float nearby;
      std::memcpy(&nearby, &up, sizeof nearby);
      floats.push_back(nearby);
    }
  }
  std::mt19937 rng(3);
  for (int i = 0; i < 100001; ++i) {
    const uint32_t bits = static_cast<uint32_t>(rng());
    float value;
    std::memcpy(&value, &bits, sizeof value);
    floats.push_back(value);
  }
  std::vector<Half> narrowed(floats.size());
  to_half(floats.data(), narrowed.data(), floats.size());
  for (size_t i = 0; i < floats.size(); ++i) {
    CAPTURE(floats[i]);
    REQUIRE(narrowed[i].bits == to_half(floats[i]).bits);
  }
}

}  // namespace dptrain
