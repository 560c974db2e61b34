// The per-job secret that store connections prove with HMAC-SHA256, so a stranger on the network
// can neither use the store nor pose as it.
//
// The handshake (see store_protocol.hpp) is challenge-response in both directions: each side sends
// a fresh random nonce and the other answers with auth_proof(secret, its role, the challenger's
// nonce, its own nonce). The secret itself never crosses the wire, never appears in an error
// message, and a recorded proof is useless against the next connection's fresh nonce.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace dptrain {

// The launcher hands the secret to agents and ranks in this variable (never on a command line).
constexpr const char* kStoreSecretEnv = "DPTRAIN_STORE_SECRET";

constexpr size_t kAuthNonceBytes = 32;
constexpr size_t kAuthProofBytes = 32;  // one SHA-256 MAC

// A fresh secret for one job: 32 bytes from getrandom(), as 64 lowercase hex digits.
std::string generate_job_secret();

// `count` bytes from the kernel's random source. Throws Error(internal) if it fails.
std::string random_bytes(size_t count);

// HMAC-SHA256(key, message): 32 raw bytes.
std::string hmac_sha256(std::string_view key, std::string_view message);

// Whether a and b are equal, taking the same time wherever they differ (for MACs).
bool equal_in_constant_time(std::string_view a, std::string_view b);

// Which side of a store connection proves it holds the secret. Each role MACs its own context
// string, so a proof made by one side can never be replayed as the other's.
enum class AuthRole { client, server };

// The proof that `prover` holds `secret`: HMAC-SHA256(secret, challenge || own_nonce || context).
// `challenge` is the nonce the verifier sent; `own_nonce` the prover's, which binds both proofs of
// one connection together.
std::string auth_proof(std::string_view secret, AuthRole prover, std::string_view challenge,
                       std::string_view own_nonce);

// Whether `proof` is what auth_proof gives for these inputs, compared in constant time.
bool auth_proof_matches(std::string_view proof, std::string_view secret, AuthRole prover,
                        std::string_view challenge, std::string_view own_nonce);

}  // namespace dptrain
