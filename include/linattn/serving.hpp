/// \file linattn/serving.hpp
/// \brief The serving module: Serving sequences: the state as a sum (combine(), summarize()),
/// states saved and loaded, and weights read from and written to safetensors files.
///
/// Includes only this module and the modules below it (docs/ARCHITECTURE.md).
#pragma once

#include "serving/safetensors.hpp"
#include "serving/state_algebra.hpp"
#include "serving/state_io.hpp"
#include "serving/state_io_decoders.hpp"
#include "serving/state_io_layers.hpp"
