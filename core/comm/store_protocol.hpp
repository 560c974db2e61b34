// The TCP store's wire format: length-prefixed binary frames, shared by client and server.
//
// A frame is a u32 payload length followed by the payload. A request payload starts with an Op
// byte, a reply payload with a Status byte; integers are little-endian, strings are a u32 length
// and the bytes.
//
// Handshake, before any data request:
//   client: hello   magic u32, version u16, client_nonce str (kAuthNonceBytes; empty: no secret)
//   server: ok      version u16, Auth u8, and with Auth::required server_nonce str
//   with Auth::required only:
//   client: auth    client_proof str (auth_proof by the client, challenged by server_nonce)
//   server: ok      server_proof str (auth_proof by the server, challenged by client_nonce)
//           or error with the reason, and closes the connection
// The client proves itself first, so a client with the wrong secret hears why from the real store
// rather than doubting the store. A server with a secret reads nothing but `auth` after hello, and
// drops a connection that has not finished the handshake within its auth timeout.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace dptrain::store_protocol {

constexpr uint32_t kMagic = 0x53545044;  // "DPTS" on the wire
constexpr uint16_t kVersion = 3;         // 2: nonces and the auth step; 3: peek
// Caps what one frame may make the peer buffer, so garbage on a socket cannot allocate gigabytes.
constexpr uint32_t kMaxFrameBytes = 64u << 20;
constexpr size_t kLengthBytes = 4;

// peek: keys strs; its reply: for each key, present u8 and value str (empty where absent).
enum class Op : uint8_t {
  hello = 1,
  set = 2,
  get = 3,
  wait = 4,
  add = 5,
  check = 6,
  auth = 7,
  peek = 8
};
enum class Auth : uint8_t { none = 0, required = 1 };
enum class Status : uint8_t {
  ok = 0,
  timeout = 1,  // payload: the keys still missing
  error = 2,    // payload: a message
};
// Why a server with a secret drops a client whose proof is wrong or absent; the client shows it.
constexpr const char* kWrongSecretReason = "wrong or missing job secret";

// Builds one frame.
class FrameWriter {
 public:
  FrameWriter() : bytes_(kLengthBytes, '\0') {}
  FrameWriter& u8(uint8_t value);
  FrameWriter& u16(uint16_t value) { return unsigned_le(value, 2); }
  FrameWriter& u32(uint32_t value) { return unsigned_le(value, 4); }
  FrameWriter& u64(uint64_t value) { return unsigned_le(value, 8); }
  FrameWriter& i64(int64_t value) { return u64(static_cast<uint64_t>(value)); }
  FrameWriter& str(std::string_view value);
  FrameWriter& strs(const std::vector<std::string>& values);
  // The frame with its length prefix filled in; the writer is spent afterwards.
  std::string finish();

 private:
  FrameWriter& unsigned_le(uint64_t value, int bytes);
  std::string bytes_;
};

// Reads the fields of one frame's payload; throws Error(comm) "malformed store message" when the
// payload is shorter than its fields claim.
class FrameReader {
 public:
  explicit FrameReader(std::string_view payload) : rest_(payload) {}
  // The reader only views its payload, which must outlive it.
  explicit FrameReader(std::string&&) = delete;
  uint8_t u8() { return static_cast<uint8_t>(unsigned_le(1)); }
  uint16_t u16() { return static_cast<uint16_t>(unsigned_le(2)); }
  uint32_t u32() { return static_cast<uint32_t>(unsigned_le(4)); }
  uint64_t u64() { return unsigned_le(8); }
  int64_t i64() { return static_cast<int64_t>(u64()); }
  std::string str();
  std::vector<std::string> strs();
  // Throws unless every byte was consumed.
  void expect_end() const;

 private:
  uint64_t unsigned_le(int bytes);
  std::string_view take(size_t size);
  std::string_view rest_;
};

// The payload length announced by a frame header (the first kLengthBytes bytes).
uint32_t frame_length(std::string_view header);

}  // namespace dptrain::store_protocol
