// AddressSanitizer's defaults for test_asan (tests/CMakeLists.txt), also when CTest runs it to list its
// tests: LibTorch's own allocations are not this program's to report (what it keeps until exit, its
// new/free pairs), and the first error ends the program.
extern "C" const char* __asan_default_options() { return "detect_leaks=0:alloc_dealloc_mismatch=0:halt_on_error=1"; }
