// The device-local backend: N ranks as threads of one process, each with its own device context,
// over device memory (device_local::run, device_local::communicator<Ctx>).
#pragma once

#include <strata/comm/device_local/communicator.hpp>
#include <strata/comm/device_local/request.hpp>
#include <strata/comm/device_local/run.hpp>
