// Connections of jaxgin's host transport: a Unix socket to each peer on the same host (it can
// carry file descriptors, which CUDA IPC needs) and TCP to peers on other hosts. One connection
// per direction and peer: a rank writes requests on its own, and reads its peers' on theirs.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace jaxgin::transport {

// What a rank publishes in listen(): everything a peer needs to reach it. Fits NCCL's 128-byte
// connection handle.
struct Address {
  uint32_t magic;
  uint32_t pid;
  uint64_t host_id;   // equal on the same host (unless JAXGIN_TRANSPORT_HOST_ID says otherwise)
  uint32_t ipv4;      // network byte order
  uint16_t tcp_port;  // network byte order
  uint16_t unused;
  char unix_name[64];  // abstract-namespace Unix socket, NUL-led
};
static_assert(sizeof(Address) <= 128, "a transport Address must fit NCCL's connection handle");

constexpr uint32_t kAddressMagic = 0x4a475441;  // "JGTA"
constexpr uint32_t kMessageMagic = 0x4a47544d;  // "JGTM"

enum class MessageType : uint32_t {
  kHello = 1,     // first message on a connection: who is writing
  kRegister = 2,  // a symmetric registration's shape; may carry the allocation's file descriptor
  kPut = 3,       // `size` payload bytes follow, for region `region` at `offset`; may carry a signal
  kSignal = 4,    // add `signal_delta` to the 64-bit word at `signal_offset` of `signal_region`
  kBye = 5,       // the writer closes on purpose (anything else ending the stream is a failure)
};

constexpr uint64_t kNoRegion = ~0ull;

struct Message {
  uint32_t magic;
  MessageType type;
  uint64_t region;  // registration sequence number, the same on every rank of the communicator
  uint64_t offset;
  uint64_t size;
  uint64_t signal_region;  // kNoRegion when the message carries no signal
  uint64_t signal_offset;
  uint64_t signal_delta;
  uint32_t rank;   // kHello: the writer's rank
  uint32_t flags;  // kRegister: RegisterFlags
  uint64_t allocation_bytes;   // kRegister: the exported allocation's size
  uint64_t allocation_offset;  // kRegister: where the region starts in it
};

enum RegisterFlags : uint32_t { kRegionOnDevice = 1, kRegionExported = 2 };

// This host's identity, and whether every peer must be treated as remote (JAXGIN_TRANSPORT_TCP=1).
uint64_t host_id();
bool tcp_only();

// Opens both listening sockets; fills `address`. Returns false with `error` set.
bool listen_on(Address& address, int& tcp_fd, int& unix_fd, std::string& error);
// Connects to a peer's Address, by Unix socket when `same_host`, else TCP.
int connect_to(const Address& peer, bool same_host, std::string& error);
// Waits up to `timeout_ms` for a connection on either listening socket.
int accept_one(int tcp_fd, int unix_fd, int timeout_ms, std::string& error);

// Whole-buffer I/O; false when the peer is gone or the socket failed (errno says why).
bool send_all(int fd, const void* data, size_t bytes);
bool recv_all(int fd, void* data, size_t bytes);
// A message, optionally passing a file descriptor along (Unix sockets only).
bool send_message(int fd, const Message& message, int pass_fd = -1);
// Reads one message; `received_fd` gets a passed descriptor or -1. Returns false on EOF or error.
bool recv_message(int fd, Message& message, int& received_fd);

int connect_timeout_ms();

}  // namespace jaxgin::transport
