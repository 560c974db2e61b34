// The CPU Communicator over Gloo's TCP transport, with rendezvous through our Store.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "core/comm/communicator.hpp"
#include "core/comm/store.hpp"

namespace dptrain {

struct GlooOptions {
  std::string hostname = "127.0.0.1";         // address this rank's transport binds to
  std::chrono::milliseconds timeout{300000};  // rendezvous and every collective
};

// Rendezvous through `store` (the caller passes a PrefixStore per generation; the store must
// outlive only this call). Errors -> Error(comm) naming this rank, the operation and the cause.
std::unique_ptr<Communicator> make_gloo_communicator(Store& store, int rank, int size,
                                                     const GlooOptions& options);

}  // namespace dptrain
