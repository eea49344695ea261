// CPUID (and OS register-state) checks for the instruction sets the CPU AdamW kernels need, and the two
// that say the CPU does bf16 arithmetic natively (cpu_resources.h's cpu_bf16_support asks these).
// Defined in cpu_resources.cpp.
#pragma once

namespace megaslide {

bool cpu_has_avx512();       // avx512f + avx512bw + avx512vl
bool cpu_has_avx2();         // avx2 + fma + f16c
bool cpu_has_avx512_bf16();  // cpu_has_avx512() + avx512_bf16 (VCVTNE2PS2BF16, VDPBF16PS)
bool cpu_has_amx_bf16();     // amx-bf16 + amx-tile, tile state enabled by the OS

}  // namespace megaslide
