// The trainer's declaration: trainer<Model, Plan, Device> is the host trainer
// (train/trainer.hpp) for Device = host and the device trainer (train/device_trainer.hpp) for a
// device with an execution context (cuda, cuda_emulated).
#pragma once

#include <strata/core/device.hpp>
#include <strata/engine/node.hpp>
#include <strata/parallel/plan.hpp>

namespace strata {

template <engine::model Model, class Plan = plan<>, class Device = host>
class trainer;

} // namespace strata
