#include "wire.h"

#include <arpa/inet.h>
#include <errno.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <random>

namespace jaxgin::transport {

namespace {

std::string os_error(const char* what) { return std::string(what) + ": " + std::strerror(errno); }

void set_nodelay(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

// The IPv4 address peers on other hosts reach this one at: JAXGIN_TRANSPORT_ADDR, else the first
// up, non-loopback interface's, else loopback (then only this host can connect).
uint32_t local_ipv4() {
  if (const char* forced = std::getenv("JAXGIN_TRANSPORT_ADDR")) {
    in_addr a{};
    if (inet_pton(AF_INET, forced, &a) == 1) return a.s_addr;
  }
  uint32_t found = htonl(INADDR_LOOPBACK);
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return found;
  for (ifaddrs* i = list; i; i = i->ifa_next) {
    if (!i->ifa_addr || i->ifa_addr->sa_family != AF_INET) continue;
    if (!(i->ifa_flags & IFF_UP) || (i->ifa_flags & IFF_LOOPBACK)) continue;
    found = reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr.s_addr;
    break;
  }
  freeifaddrs(list);
  return found;
}

socklen_t unix_address(const char* name, sockaddr_un& addr) {
  std::memset(&addr, 0, sizeof(addr));
  addr.sun_family = AF_UNIX;
  // Abstract namespace: name[0] is NUL, nothing appears in the file system, nothing to clean up.
  size_t len = 1 + std::strlen(name + 1);
  std::memcpy(addr.sun_path, name, len);
  return static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + len);
}

// A message header with room for one passed file descriptor (SCM_RIGHTS).
struct WithDescriptor {
  iovec iov;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {0};
  msghdr msg{};
  explicit WithDescriptor(Message* message) : iov{message, sizeof(Message)} {
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
  }
};

}  // namespace

uint64_t host_id() {
  std::string identity;
  if (const char* forced = std::getenv("JAXGIN_TRANSPORT_HOST_ID")) {
    identity = std::string("forced:") + forced;
  } else {
    char name[256] = {0};
    gethostname(name, sizeof(name) - 1);
    std::ifstream boot("/proc/sys/kernel/random/boot_id");
    std::string boot_id;
    std::getline(boot, boot_id);
    identity = std::string(name) + "/" + boot_id;
  }
  return std::hash<std::string>{}(identity) | 1;  // never 0
}

bool tcp_only() {
  const char* v = std::getenv("JAXGIN_TRANSPORT_TCP");
  return v && (std::strcmp(v, "1") == 0 || std::strcmp(v, "true") == 0 || std::strcmp(v, "yes") == 0);
}

int connect_timeout_ms() {
  const char* v = std::getenv("JAXGIN_TRANSPORT_CONNECT_TIMEOUT");
  double seconds = v ? std::atof(v) : 300.0;
  return seconds > 0 ? static_cast<int>(seconds * 1000) : 300000;
}

bool listen_on(Address& address, int& tcp_fd, int& unix_fd, std::string& error) {
  static std::atomic<uint32_t> counter{0};
  std::memset(&address, 0, sizeof(address));
  address.magic = kAddressMagic;
  address.pid = static_cast<uint32_t>(getpid());
  address.host_id = host_id();

  tcp_fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (tcp_fd < 0) return error = os_error("socket(AF_INET)"), false;
  sockaddr_in in{};
  in.sin_family = AF_INET;
  in.sin_addr.s_addr = local_ipv4();
  in.sin_port = 0;
  socklen_t len = sizeof(in);
  if (bind(tcp_fd, reinterpret_cast<sockaddr*>(&in), sizeof(in)) != 0 || listen(tcp_fd, 1024) != 0 ||
      getsockname(tcp_fd, reinterpret_cast<sockaddr*>(&in), &len) != 0)
    return error = os_error("binding the TCP listening socket"), false;
  address.ipv4 = in.sin_addr.s_addr;
  address.tcp_port = in.sin_port;

  std::random_device entropy;
  std::snprintf(address.unix_name + 1, sizeof(address.unix_name) - 1, "jaxgin-transport-%u-%u-%08x", address.pid,
                counter.fetch_add(1), static_cast<unsigned>(entropy()));
  unix_fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (unix_fd < 0) return error = os_error("socket(AF_UNIX)"), false;
  sockaddr_un un{};
  socklen_t un_len = unix_address(address.unix_name, un);
  if (bind(unix_fd, reinterpret_cast<sockaddr*>(&un), un_len) != 0 || listen(unix_fd, 1024) != 0)
    return error = os_error("binding the Unix listening socket"), false;
  return true;
}

int connect_to(const Address& peer, bool same_host, std::string& error) {
  int fd;
  if (same_host) {
    fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un un{};
    socklen_t len = unix_address(peer.unix_name, un);
    if (fd < 0 || connect(fd, reinterpret_cast<sockaddr*>(&un), len) != 0) {
      error = os_error("connecting to a peer's Unix socket");
      if (fd >= 0) close(fd);
      return -1;
    }
    return fd;
  }
  fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in in{};
  in.sin_family = AF_INET;
  in.sin_addr.s_addr = peer.ipv4;
  in.sin_port = peer.tcp_port;
  if (fd < 0 || connect(fd, reinterpret_cast<sockaddr*>(&in), sizeof(in)) != 0) {
    char ip[INET_ADDRSTRLEN] = "?";
    inet_ntop(AF_INET, &in.sin_addr, ip, sizeof(ip));
    error = os_error(("connecting to " + std::string(ip) + ":" + std::to_string(ntohs(peer.tcp_port))).c_str());
    if (fd >= 0) close(fd);
    return -1;
  }
  set_nodelay(fd);
  return fd;
}

int accept_one(int tcp_fd, int unix_fd, int timeout_ms, std::string& error) {
  pollfd fds[2] = {{tcp_fd, POLLIN, 0}, {unix_fd, POLLIN, 0}};
  int ready = poll(fds, 2, timeout_ms);
  if (ready == 0) {
    error = "no peer connected within " + std::to_string(timeout_ms / 1000) +
            " s (JAXGIN_TRANSPORT_CONNECT_TIMEOUT); a peer process may have failed before connecting";
    return -1;
  }
  if (ready < 0) return error = os_error("poll"), -1;
  bool tcp = fds[0].revents & POLLIN;
  int fd = accept4(tcp ? tcp_fd : unix_fd, nullptr, nullptr, SOCK_CLOEXEC);
  if (fd < 0) return error = os_error("accept"), -1;
  if (tcp) set_nodelay(fd);
  return fd;
}

bool send_all(int fd, const void* data, size_t bytes) {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    ssize_t n = send(fd, p, bytes, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    p += n;
    bytes -= static_cast<size_t>(n);
  }
  return true;
}

bool recv_all(int fd, void* data, size_t bytes) {
  char* p = static_cast<char*>(data);
  while (bytes > 0) {
    ssize_t n = recv(fd, p, bytes, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    p += n;
    bytes -= static_cast<size_t>(n);
  }
  return true;
}

bool send_message(int fd, const Message& message, int pass_fd) {
  if (pass_fd < 0) return send_all(fd, &message, sizeof(message));
  // The descriptor travels with the message's first byte; the rest follows normally.
  WithDescriptor w(const_cast<Message*>(&message));
  msghdr& msg = w.msg;
  cmsghdr* c = CMSG_FIRSTHDR(&msg);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int));
  std::memcpy(CMSG_DATA(c), &pass_fd, sizeof(int));
  ssize_t n;
  do n = sendmsg(fd, &msg, MSG_NOSIGNAL); while (n < 0 && errno == EINTR);
  if (n <= 0) return false;
  return send_all(fd, reinterpret_cast<const char*>(&message) + n, sizeof(message) - static_cast<size_t>(n));
}

bool recv_message(int fd, Message& message, int& received_fd) {
  received_fd = -1;
  WithDescriptor w(&message);
  msghdr& msg = w.msg;
  ssize_t n;
  do n = recvmsg(fd, &msg, MSG_CMSG_CLOEXEC); while (n < 0 && errno == EINTR);
  if (n <= 0) return false;
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c))
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) std::memcpy(&received_fd, CMSG_DATA(c), sizeof(int));
  if (!recv_all(fd, reinterpret_cast<char*>(&message) + n, sizeof(message) - static_cast<size_t>(n))) return false;
  return message.magic == kMessageMagic;
}

}  // namespace jaxgin::transport
