// Names of reduce operations, for messages and benchmark tables; the world-size mismatch message.
#include "core/comm/communicator.hpp"

#include <fmt/format.h>

namespace dptrain {

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
      return "sum";
    case ReduceOp::avg:
      return "avg";
    case ReduceOp::max:
      return "max";
    case ReduceOp::min:
      return "min";
  }
  return "unknown";
}

std::string world_size_mismatch(int other, const char* whose, int world, int64_t given,
                                const char* posted) {
  if (given < 0) {
    return fmt::format(
        "rank {} runs another version of dptrain (its {} carries no world size): "
        "run the same dptrain on every rank",
        other, posted);
  }
  return fmt::format(
      "rank {} was started with another world size than {} {} (it was given "
      "{}): start every rank with the same world size",
      other, whose, world, given);
}

}  // namespace dptrain
