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

// What a Gloo failure's cause means, said after it: " (a peer rank has exited ...)" for a
// connection a peer closed or reset, " (this machine ran out of ephemeral ports ...)" for a
// listen that found no free port ("Address already in use") or a connect that found no local one
// ("Cannot assign requested address"); "" otherwise. `world_size`: the job's ranks.
std::string gloo_cause_note(const std::string& cause, int world_size);

// Makes an exception that escapes one of Gloo's own threads (its transport's event loop, where
// nothing can catch it) end the process as a communication failure of `rank`: one
// "dptrain: error: rank N: gloo communication failed ..." line on stderr and exit 3, not
// std::terminate's SIGABRT. Other uncaught exceptions terminate as before. Every Gloo
// communicator installs it; idempotent.
void install_gloo_terminate_handler(int rank);

}  // namespace dptrain
