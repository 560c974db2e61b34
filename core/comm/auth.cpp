// Job secrets and HMAC-SHA256 proofs for the store handshake (see auth.hpp), over libcrypto.
#include "core/comm/auth.hpp"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <sys/random.h>

#include <cerrno>
#include <cstring>
#include <limits>

#include "core/error.hpp"

namespace dptrain {

namespace {

// Versioned so a future change of the proof can never verify against this one.
constexpr std::string_view kClientContext = "dptrain store auth v1: client";
constexpr std::string_view kServerContext = "dptrain store auth v1: server";

std::string to_hex(std::string_view bytes) {
  constexpr char kDigits[] = "0123456789abcdef";
  std::string hex;
  hex.reserve(bytes.size() * 2);
  for (const char byte : bytes) {
    const auto value = static_cast<unsigned char>(byte);
    hex.push_back(kDigits[value >> 4]);
    hex.push_back(kDigits[value & 0x0f]);
  }
  return hex;
}

}  // namespace

std::string random_bytes(size_t count) {
  std::string bytes(count, '\0');
  size_t filled = 0;
  while (filled < count) {
    const ssize_t got = getrandom(bytes.data() + filled, count - filled, 0);
    if (got > 0) {
      filled += static_cast<size_t>(got);
    } else if (got < 0 && errno != EINTR) {
      throw Error(ErrorKind::internal, std::string("getrandom failed: ") + std::strerror(errno));
    }
  }
  return bytes;
}

std::string generate_job_secret() {
  constexpr size_t kSecretBytes = 32;
  return to_hex(random_bytes(kSecretBytes));
}

std::string hmac_sha256(std::string_view key, std::string_view message) {
  if (key.size() > static_cast<size_t>(std::numeric_limits<int>::max())) {
    throw Error(ErrorKind::internal, "HMAC key too long");
  }
  unsigned char mac[EVP_MAX_MD_SIZE];
  unsigned int mac_length = 0;
  const auto* result = HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()),
                            reinterpret_cast<const unsigned char*>(message.data()), message.size(),
                            mac, &mac_length);
  if (result == nullptr) throw Error(ErrorKind::internal, "HMAC-SHA256 failed in libcrypto");
  return std::string(reinterpret_cast<const char*>(mac), mac_length);
}

bool equal_in_constant_time(std::string_view a, std::string_view b) {
  // Lengths are public (a MAC's length is fixed); only the contents must not leak through timing.
  return a.size() == b.size() && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

std::string auth_proof(std::string_view secret, AuthRole prover, std::string_view challenge,
                       std::string_view own_nonce) {
  std::string message;
  message.reserve(challenge.size() + own_nonce.size() + kClientContext.size());
  message.append(challenge);
  message.append(own_nonce);
  message.append(prover == AuthRole::client ? kClientContext : kServerContext);
  return hmac_sha256(secret, message);
}

bool auth_proof_matches(std::string_view proof, std::string_view secret, AuthRole prover,
                        std::string_view challenge, std::string_view own_nonce) {
  return equal_in_constant_time(proof, auth_proof(secret, prover, challenge, own_nonce));
}

}  // namespace dptrain
