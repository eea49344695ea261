# Decides whether kernels/ is compiled. With MEGASLIDE_CUDA=AUTO (the default) the CUDA language is
# enabled whenever nvcc is found, even on machines without a GPU: the kernels must always compile and
# link, and tests that need a device skip themselves at run time.
set(MEGASLIDE_WITH_CUDA OFF)
if(NOT MEGASLIDE_CUDA STREQUAL "OFF")
  if(NOT CMAKE_CUDA_COMPILER)
    find_program(_megaslide_nvcc nvcc PATHS /usr/local/cuda/bin ENV CUDA_HOME PATH_SUFFIXES bin)
    if(_megaslide_nvcc)
      set(CMAKE_CUDA_COMPILER ${_megaslide_nvcc})
    endif()
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    # sm_90 machine code for Hopper (H100/H200) plus compute_90 PTX that newer GPUs JIT-compile.
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      set(CMAKE_CUDA_ARCHITECTURES 90)
    endif()
    # The shared CUDA runtime, the one LibTorch loads: a static one linked into libmegaslide would be a
    # second runtime in the process (its own error state and module registry beside LibTorch's), working
    # only as long as link order happened to put LibTorch's first.
    set(CMAKE_CUDA_RUNTIME_LIBRARY Shared)
    set(CMAKE_CUDA_STANDARD 17)
    set(CMAKE_CUDA_STANDARD_REQUIRED ON)
    enable_language(CUDA)
    set(MEGASLIDE_WITH_CUDA ON)
  elseif(MEGASLIDE_CUDA STREQUAL "ON")
    message(FATAL_ERROR "MEGASLIDE_CUDA=ON but no CUDA compiler (nvcc) was found")
  endif()
endif()
message(STATUS "MegaSlide: CUDA kernels ${MEGASLIDE_WITH_CUDA}")
