// A key-value store over TCP for rendezvous, as PyTorch's TCPStore serves torchrun: the
// server (tcp_store_server.hpp), its client `tcp_store` (tcp_store_client.hpp), their wire
// protocol (detail/wire.hpp) and sockets (detail/socket.hpp).
#pragma once

#include <strata/comm/rendezvous/tcp_store_client.hpp>
#include <strata/comm/rendezvous/tcp_store_server.hpp>
