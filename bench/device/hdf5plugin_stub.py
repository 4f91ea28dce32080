"""Stand-in for hdf5plugin in the benchmark bundle (bench/device/bundle copies this file to
stub/hdf5plugin/__init__.py; run.sh puts stub/ on the path only where no real hdf5plugin imports).

h5ngff imports hdf5plugin for one side effect: registering the HDF5 filters HDF5 lacks (blosc,
zstd, lz4, bitshuffle, ...) so that h5py can *read* datasets compressed with them. Nothing else of
it is used. The benchmark's f32 input is contiguous (no filter at all; u16-4d uses gzip, which HDF5
has), and every output is written with numcodecs' or tensorstore's blosc, not through HDF5, so the
measured work is the same. The real wheel is ~46 MB and costs each worker ~50 ms and ~6.5 MiB at
import. A dataset that does need one of those filters fails loudly in h5py ("required filter ...
is not available"): carry the real one then (bundle --real-hdf5plugin)."""

__version__ = "0+stub"
