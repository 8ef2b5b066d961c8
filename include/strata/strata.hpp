// The umbrella header: every host-only public header of strata.
#pragma once

#include <strata/core/dtype.hpp>
#include <strata/core/error.hpp>
#include <strata/core/float16.hpp>

#include <strata/comm/communicator.hpp>
#include <strata/comm/counters.hpp>
#include <strata/comm/local.hpp>
#include <strata/comm/mesh.hpp>
#include <strata/comm/options.hpp>
#include <strata/comm/p2p.hpp>
#include <strata/comm/reduce_op.hpp>
#include <strata/comm/rendezvous/env.hpp>
#include <strata/comm/rendezvous/tcp_store.hpp>
