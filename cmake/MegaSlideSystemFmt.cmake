# LibTorch's include folder carries its own fmt (v12) headers, and it is searched before /usr/include,
# so `#include <fmt/format.h>` would compile against fmt 12 while linking Debian's libfmt 9 (which
# spdlog is built against too). A build-tree folder holding only a link to the system fmt headers,
# put first on the include path, makes every MegaSlide target see the fmt it links.
get_target_property(_megaslide_fmt_include fmt::fmt INTERFACE_INCLUDE_DIRECTORIES)
list(GET _megaslide_fmt_include 0 _megaslide_fmt_include)
set(MEGASLIDE_FMT_SHIM ${PROJECT_BINARY_DIR}/fmt-shim)
file(MAKE_DIRECTORY ${MEGASLIDE_FMT_SHIM})
file(CREATE_LINK ${_megaslide_fmt_include}/fmt ${MEGASLIDE_FMT_SHIM}/fmt SYMBOLIC)

function(megaslide_use_system_fmt target)
  target_include_directories(${target} BEFORE PRIVATE ${MEGASLIDE_FMT_SHIM})
endfunction()
