// Entry points by name for the host emulation's kernels (host_emulation_entry.cu, the
// primitives' harness sm90_harness.cu): a table of `Kernel`s, each a name, the sizes of its
// parameters and a launch. Arguments travel as a GPU launch passes them (cuLaunchKernel's
// kernelParams): an array of pointers, one per kernel parameter, each to that parameter's
// bytes; the kernel then gets every parameter by value. `param_sizes` states each parameter's
// size, so the caller can refuse an argument of the wrong size. After host_emulation.cuh.
#pragma once

#include <cstddef>
#include <cstring>
#include <type_traits>
#include <utility>

namespace hostemu {

template <typename F, F KERNEL>
struct Entry;

template <typename... P, void (*KERNEL)(P...)>
struct Entry<void (*)(P...), KERNEL> {
    static int param_sizes(size_t* sizes) {
        const size_t s[] = {sizeof(P)..., 0};
        std::memcpy(sizes, s, sizeof...(P) * sizeof(size_t));
        return static_cast<int>(sizeof...(P));
    }

    template <size_t... I>
    static void call(void** args, std::index_sequence<I...>) {
        KERNEL(*static_cast<std::remove_cv_t<P>*>(args[I])...);
    }

    // False when a thread trapped (the launch failed, as on a GPU).
    static bool run(const char* key, unsigned gx, unsigned gy, unsigned threads, size_t smem,
                    void** args) {
        return ::launch(key, gx, gy, threads, smem,
                        [&] { call(args, std::index_sequence_for<P...>{}); });
    }
};

struct Kernel {
    const char* key;
    int (*param_sizes)(size_t*);
    bool (*run)(const char*, unsigned, unsigned, unsigned, size_t, void**);
};

// The kernel of `key` in `table`, or nullptr.
template <size_t N>
const Kernel* find_kernel(const Kernel (&table)[N], const char* key) {
    for (const Kernel& k : table) {
        if (std::strcmp(k.key, key) == 0) return &k;
    }
    return nullptr;
}

}  // namespace hostemu

// A `hostemu::Kernel` of name `key` for the kernel (a function, template arguments included)
#define VARLEN_EMU_KERNEL(key, ...) \
    hostemu::Kernel{key, &hostemu::Entry<decltype(&__VA_ARGS__), &__VA_ARGS__>::param_sizes, \
                    &hostemu::Entry<decltype(&__VA_ARGS__), &__VA_ARGS__>::run}
