// Tests for job secrets and the HMAC proofs of the store handshake.
#include "core/comm/auth.hpp"

#include <doctest/doctest.h>

#include <set>

namespace dptrain {
namespace {

std::string hex(std::string_view bytes) {
  std::string text;
  for (const char byte : bytes) {
    constexpr char kDigits[] = "0123456789abcdef";
    text.push_back(kDigits[static_cast<unsigned char>(byte) >> 4]);
    text.push_back(kDigits[static_cast<unsigned char>(byte) & 0x0f]);
  }
  return text;
}

TEST_CASE("auth: HMAC-SHA256 matches the RFC 4231 test vectors") {
  // Test case 2: a short key.
  CHECK(hex(hmac_sha256("Jefe", "what do ya want for nothing?")) ==
        "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
  // Test case 6: a key longer than the block size, which HMAC hashes first.
  CHECK(hex(hmac_sha256(std::string(131, '\xaa'),
                        "Test Using Larger Than Block-Size Key - Hash Key First")) ==
        "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54");
}

TEST_CASE("auth: job secrets are 64 hex digits and differ every time") {
  std::set<std::string> seen;
  for (int i = 0; i < 16; ++i) {
    const std::string secret = generate_job_secret();
    CHECK(secret.size() == 64);
    CHECK(secret.find_first_not_of("0123456789abcdef") == std::string::npos);
    seen.insert(secret);
  }
  CHECK(seen.size() == 16);
  CHECK(random_bytes(kAuthNonceBytes).size() == kAuthNonceBytes);
  CHECK(random_bytes(0).empty());
  CHECK(random_bytes(1000).size() == 1000);  // more than one getrandom() call may return
}

TEST_CASE("auth: constant-time comparison") {
  CHECK(equal_in_constant_time("", ""));
  CHECK(equal_in_constant_time("abc", "abc"));
  CHECK_FALSE(equal_in_constant_time("abc", "abd"));
  CHECK_FALSE(equal_in_constant_time("abc", "ab"));
  CHECK_FALSE(equal_in_constant_time("", "a"));
  CHECK(equal_in_constant_time(std::string("a\0b", 3), std::string("a\0b", 3)));
  CHECK_FALSE(equal_in_constant_time(std::string("a\0b", 3), std::string("a\0c", 3)));
}

TEST_CASE("auth: a proof verifies only with the same secret, role and nonces") {
  const std::string secret = generate_job_secret();
  const std::string challenge = random_bytes(kAuthNonceBytes);
  const std::string own = random_bytes(kAuthNonceBytes);
  const std::string proof = auth_proof(secret, AuthRole::client, challenge, own);
  CHECK(proof.size() == kAuthProofBytes);
  CHECK(auth_proof_matches(proof, secret, AuthRole::client, challenge, own));

  CHECK_FALSE(auth_proof_matches(proof, generate_job_secret(), AuthRole::client, challenge, own));
  CHECK_FALSE(auth_proof_matches(proof, "", AuthRole::client, challenge, own));
  // The server's proof over the same nonces is a different MAC: no reflecting one as the other.
  CHECK_FALSE(auth_proof_matches(proof, secret, AuthRole::server, challenge, own));
  CHECK_FALSE(auth_proof_matches(proof, secret, AuthRole::client, own, challenge));
  CHECK_FALSE(
      auth_proof_matches(proof, secret, AuthRole::client, random_bytes(kAuthNonceBytes), own));
  CHECK_FALSE(auth_proof_matches(proof.substr(0, 16), secret, AuthRole::client, challenge, own));
  CHECK_FALSE(auth_proof_matches("", secret, AuthRole::client, challenge, own));
  std::string flipped = proof;
  flipped.back() = static_cast<char>(flipped.back() ^ 1);
  CHECK_FALSE(auth_proof_matches(flipped, secret, AuthRole::client, challenge, own));
}

}  // namespace
}  // namespace dptrain
