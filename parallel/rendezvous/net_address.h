// Which local address a process should bind so that peers on other nodes can
// reach it. Workers bind their Gloo transport to it (TRAINRUN_GLOO_HOST,
// else derived from MASTER_ADDR); binding MASTER_ADDR itself only works on
// the node that owns that address.
#pragma once
#include <string>

namespace trainrun {

// The IPv4 source address the kernel picks for a route to `host` (a UDP
// socket is connected, no packet is sent): the address of the interface
// that reaches the master. 127.0.0.1 for a loopback host. Throws
// trainrun::Error when the host does not resolve or has no route.
std::string local_address_toward(const std::string& host);

// The first IPv4 address of an interface that is up and not loopback, or ""
// when there is none.
std::string first_routable_address();

// 127.0.0.0/8 (a literal address; host names are not resolved).
bool is_loopback_address(const std::string& addr);

// The address a worker on a node of a multi-node job binds: the one toward
// the master, unless that is loopback while the master is not (a Debian
// /etc/hosts maps the host's own name to 127.0.1.1), then the first routable
// one. `note` gets a sentence for the log when the fallback was taken.
std::string worker_bind_address(const std::string& master_addr, std::string* note);

}  // namespace trainrun
