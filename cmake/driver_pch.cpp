// The translation unit that builds the one precompiled LibTorch header every tool and benchmark reuses
// (megaslide_driver_pch in the top-level CMakeLists.txt). Nothing of its own.
