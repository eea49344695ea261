# ccache in front of every compiler when it is installed: a no-change rebuild after a fresh configure
# (or in a second clone, such as CI's) costs seconds instead of minutes of LibTorch header parsing.
# ccache reads its settings from the environment of each compile, so they travel in the launcher:
# it only caches compiles that use a precompiled header when told to trust the PCH's defines and
# timestamps, and CCACHE_BASEDIR makes cache keys relative to the checkout, so clones share entries.
find_program(MEGASLIDE_CCACHE ccache)
if(MEGASLIDE_CCACHE)
  set(_megaslide_launcher ${CMAKE_COMMAND} -E env
      CCACHE_SLOPPINESS=pch_defines,time_macros,include_file_mtime,include_file_ctime
      CCACHE_BASEDIR=${PROJECT_SOURCE_DIR}
      ${MEGASLIDE_CCACHE})
  set(CMAKE_CXX_COMPILER_LAUNCHER ${_megaslide_launcher})
  set(CMAKE_CUDA_COMPILER_LAUNCHER ${_megaslide_launcher})
endif()
