// Checkpoints of the device trainer: io::save, io::load, io::load_latest and
// io::async_saver::save for a trainer<Model, Plan, cuda> or <..., cuda_emulated>, in the host
// trainer's files (io/trainer_checkpoint.hpp, which holds them; this header brings the device
// trainer with it). A checkpoint saved on a device loads on the host under any layout, and the
// other way round; docs/checkpoint.md.
#pragma once

#include <strata/io/trainer_checkpoint.hpp>
#include <strata/train/device_trainer.hpp>
