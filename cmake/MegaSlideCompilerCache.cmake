# ccache in front of every compiler when it is installed: a no-change rebuild after a fresh configure
# (or a second clone) costs seconds instead of minutes of LibTorch header parsing.
find_program(MEGASLIDE_CCACHE ccache)
if(MEGASLIDE_CCACHE)
  set(CMAKE_CXX_COMPILER_LAUNCHER ${MEGASLIDE_CCACHE})
  set(CMAKE_CUDA_COMPILER_LAUNCHER ${MEGASLIDE_CCACHE})
  # Precompiled headers and ccache only agree when ccache is told to trust the PCH's timestamps.
  set(ENV{CCACHE_SLOPPINESS} "pch_defines,time_macros,include_file_mtime,include_file_ctime")
endif()
