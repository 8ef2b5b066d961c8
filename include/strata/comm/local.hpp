// The local backend: N ranks as threads of one process (local::run, local::communicator).
#pragma once

#include <strata/comm/local/communicator.hpp>
#include <strata/comm/local/request.hpp>
#include <strata/comm/local/run.hpp>
