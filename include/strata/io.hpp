// Saved training state (checkpoints): the safetensors reader and writer, the store of atomic
// checkpoints, CRC-32C, resharding's arithmetic (needs nlohmann_json: link strata::checkpoint).
#pragma once

#include <strata/io/crc32c.hpp>
#include <strata/io/reshard.hpp>
#include <strata/io/safetensors.hpp>
#include <strata/io/store.hpp>
