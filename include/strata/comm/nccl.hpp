// The NCCL backend: its communicator, the environment's world, the unique id's exchange and the
// error checks (needs the CUDA toolkit and NCCL).
#pragma once

#include <strata/comm/nccl/communicator.hpp>
#include <strata/comm/nccl/error.hpp>
#include <strata/comm/nccl/types.hpp>
#include <strata/comm/nccl/unique_id.hpp>
#include <strata/comm/nccl/world.hpp>
