#include "parallel/rendezvous/net_address.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>

#include "core/common/error.h"

namespace trainrun {

namespace {

std::string to_text(const in_addr& a) {
  char buf[INET_ADDRSTRLEN] = {};
  ::inet_ntop(AF_INET, &a, buf, sizeof buf);
  return buf;
}

in_addr resolve(const std::string& host) {
  in_addr a{};
  if (::inet_pton(AF_INET, host.c_str(), &a) == 1) return a;
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* res = nullptr;
  const int rc = ::getaddrinfo(host.c_str(), nullptr, &hints, &res);
  if (rc != 0 || !res) {
    if (res) ::freeaddrinfo(res);
    TR_FAIL("cannot resolve the master address '", host, "': ", rc ? ::gai_strerror(rc) : "no IPv4 address");
  }
  a = reinterpret_cast<sockaddr_in*>(res->ai_addr)->sin_addr;
  ::freeaddrinfo(res);
  return a;
}

}  // namespace

bool is_loopback_address(const std::string& addr) {
  in_addr a{};
  if (::inet_pton(AF_INET, addr.c_str(), &a) != 1) return addr == "localhost";
  return (ntohl(a.s_addr) >> 24) == 127;
}

std::string local_address_toward(const std::string& host) {
  const in_addr target = resolve(host);
  if ((ntohl(target.s_addr) >> 24) == 127) return "127.0.0.1";
  const int fd = ::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  TR_CHECK_ERRNO(fd >= 0, "socket() to find the local address toward '", host, "'");
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_addr = target;
  to.sin_port = htons(9);  // any port: connect() on UDP only picks the route
  if (::connect(fd, reinterpret_cast<sockaddr*>(&to), sizeof to) != 0) {
    const int e = errno;
    ::close(fd);
    errno = e;
    TR_CHECK_ERRNO(false, "no route from this host to the master address '", host, "' (", to_text(target), ")");
  }
  sockaddr_in me{};
  socklen_t len = sizeof me;
  const int rc = ::getsockname(fd, reinterpret_cast<sockaddr*>(&me), &len);
  ::close(fd);
  TR_CHECK_ERRNO(rc == 0, "getsockname() to find the local address toward '", host, "'");
  return to_text(me.sin_addr);
}

std::string first_routable_address() {
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return "";
  std::string found;
  for (ifaddrs* i = list; i && found.empty(); i = i->ifa_next) {
    if (!i->ifa_addr || i->ifa_addr->sa_family != AF_INET) continue;
    if (!(i->ifa_flags & IFF_UP) || (i->ifa_flags & IFF_LOOPBACK)) continue;
    found = to_text(reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr);
  }
  ::freeifaddrs(list);
  return found;
}

std::string worker_bind_address(const std::string& master_addr, std::string* note) {
  const std::string toward = local_address_toward(master_addr);
  if (!is_loopback_address(toward) || is_loopback_address(master_addr)) return toward;
  const std::string routable = first_routable_address();
  if (routable.empty()) return toward;
  if (note)
    *note = "the master address '" + master_addr + "' resolves to loopback on this host (" + toward +
            "); workers bind " + routable + " instead (set TRAINRUN_GLOO_HOST to choose)";
  return routable;
}

}  // namespace trainrun
