// Umbrella header: the whole public API of libmegaslide.
#pragma once

#include "megaslide/attention/deformable_slide_attention.h"
#include "megaslide/attention/dsa3d.h"
#include "megaslide/config/run_config.h"
#include "megaslide/data/structured_motion.h"
#include "megaslide/diffusion/ddpm.h"
#include "megaslide/io/files.h"
#include "megaslide/model/attention.h"
#include "megaslide/model/dit.h"
#include "megaslide/model/layers.h"
#include "megaslide/model/text_encoder.h"
#include "megaslide/offload/cpu_adamw.h"
#include "megaslide/offload/host_param_store.h"
#include "megaslide/train/resident_trainer.h"
#include "megaslide/train/run_outputs.h"
#include "megaslide/util/build_info.h"
