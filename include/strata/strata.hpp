// The umbrella header: every host-only public header of strata.
#pragma once

#include <strata/core/buffer.hpp>
#include <strata/core/cpu.hpp>
#include <strata/core/device.hpp>
#include <strata/core/dtype.hpp>
#include <strata/core/element.hpp>
#include <strata/core/error.hpp>
#include <strata/core/float16.hpp>
#include <strata/core/memory.hpp>
#include <strata/core/philox.hpp>
#include <strata/core/random.hpp>
#include <strata/core/tensor.hpp>
#include <strata/core/thread_pool.hpp>

#include <strata/comm/communicator.hpp>
#include <strata/comm/counters.hpp>
#include <strata/comm/local.hpp>
#include <strata/comm/mesh.hpp>
#include <strata/comm/options.hpp>
#include <strata/comm/p2p.hpp>
#include <strata/comm/reduce_op.hpp>
#include <strata/comm/rendezvous/env.hpp>
#include <strata/comm/rendezvous/tcp_store.hpp>

#include <strata/optim/adamw.hpp>
#include <strata/optim/clipping.hpp>
#include <strata/optim/loss_scaler.hpp>
#include <strata/optim/optimizer.hpp>
#include <strata/optim/scaling.hpp>
#include <strata/optim/schedule.hpp>
#include <strata/optim/sgd.hpp>
#include <strata/optim/state.hpp>

#include <strata/nn/activation.hpp>
#include <strata/nn/attention.hpp>
#include <strata/nn/context.hpp>
#include <strata/nn/cross_entropy.hpp>
#include <strata/nn/dropout.hpp>
#include <strata/nn/embedding.hpp>
#include <strata/nn/grad_check.hpp>
#include <strata/nn/layer.hpp>
#include <strata/nn/layer_norm.hpp>
#include <strata/nn/linear.hpp>
#include <strata/nn/mlp.hpp>
#include <strata/nn/parallel_attention.hpp>
#include <strata/nn/parallel_transformer_block.hpp>
#include <strata/nn/parameter.hpp>
#include <strata/nn/scratch.hpp>
#include <strata/nn/sequence.hpp>
#include <strata/nn/tensor_parallel.hpp>
#include <strata/nn/transformer_block.hpp>
#include <strata/nn/vocab_parallel.hpp>

#include <strata/data/batch.hpp>
#include <strata/data/dataset.hpp>
#include <strata/data/loader.hpp>
#include <strata/data/sampler.hpp>
#include <strata/data/text_dataset.hpp>

#include <strata/engine/batch.hpp>
#include <strata/engine/executor.hpp>
#include <strata/engine/node.hpp>
#include <strata/engine/op.hpp>
#include <strata/engine/optimizer.hpp>
#include <strata/engine/pass.hpp>
#include <strata/engine/program.hpp>
#include <strata/engine/state.hpp>
#include <strata/engine/trace.hpp>

#include <strata/parallel/plan.hpp>
#include <strata/parallel/sharded.hpp>
#include <strata/parallel/tensor_parallel.hpp>
#include <strata/parallel/tp_check.hpp>
#include <strata/policy/recompute.hpp>

#include <strata/train/trainer.hpp>

// Installs the NCCL error hook that lists this host's likely causes (docs/troubleshooting.md).
#include <strata/profile/troubleshoot.hpp>

#include <strata/models/gpt.hpp>
#include <strata/models/mlp.hpp>
#include <strata/models/static_gpt.hpp>
