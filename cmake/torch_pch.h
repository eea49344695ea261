// The LibTorch headers every precompiled header of the project holds (the library's, the tests' and the
// tools' and benchmarks'): what libmegaslide's public headers include, the tensor API (<torch/types.h>:
// ATen's operators, autograd's factories) and the few C++-frontend pieces the models build on (nn::Module and
// the modules they hold). The optimizer and custom autograd functions are left to the few files that use them
// (each costs every file that loads the header about a second more, docs/building.md).
// Not <torch/torch.h>: its whole C++ frontend (datasets, serialization, every nn module, JIT) costs a
// translation unit that uses none of it about 9 s more at -O3 on the Zen 1 VM of docs/building.md
// (src/config/run_config.cpp: 38.7 s with <torch/torch.h> precompiled, 29.7 s with these).
#pragma once
#include <torch/types.h>

#include <torch/nn/cloneable.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/linear.h>
