"""The host emulation of the CuPy backend's CUDA kernels: test infrastructure, not part of the
product (the wheel does not ship it and no module of `varlen` imports it).

* `emulation.cupy`: the stand-in `cupy` module whose RawKernels run the kernel sources compiled
  with g++ (`cuda/host_emulation*.cuh`: warp-collective PTX primitives, wgmma, TMA, mbarriers
  emulated from the PTX ISA), the emulated cases' runner and `python -m emulation`;
* `emulation.sm90`: the runtime of the sm_90a launches (`EmulatedRuntime`);
* `emulation.sm90_primitives`: the Hopper primitives one at a time, the same harness and
  expectations on the emulation and on a GPU (`EmulationRunner`, `CupyRunner`);
* `emulation.cases`: the batches the emulation runs;
* `emulation.mutations`: the mutation sweep of the kernels' synchronisation sites;
* `cuda/`: the emulation's headers, its entry points and the primitive harness.

Import it from the repository root (the tests put the root on `sys.path`); it replaces
`sys.modules["cupy"]` in the process that installs it, so run it in a process of its own.
"""
