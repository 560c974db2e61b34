// Names of reduce operations, for messages and benchmark tables.
#include "core/comm/communicator.hpp"

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

}  // namespace dptrain
