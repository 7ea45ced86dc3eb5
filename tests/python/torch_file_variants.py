"""torch.save files that dtrain's reader once refused or misread (tests/checkpoint/torch_archive_test.cpp).

usage: torch_file_variants.py VARIANT PATH [NUMEL RECORD_NUMEL OFFSET SIZE STRIDE]
       torch_file_variants.py check-dtypes PATH

  no-crc32    {"step": 7, "tensors": {"w": arange(4.)}} saved after set_crc32_options(False): every
              record's CRC-32 is 0
  big-ints    {"step": 3_000_000_000, "ints": [...]}: ints outside int32, which pickle writes as LONG1
              of 5 to 8 bytes
  huge-int    {"step": 2**64}: a LONG1 of 9 bytes
  big-endian  {"step": 7, "tensors": {"w": arange(4.)}} with byteorder "big"
  bad-rng     {"step": 7, "sampler": {...}, "rng": 3 zero bytes}: no CPU generator's state
  tensor      {"step": 7, "tensors": {"w": T}}, T a float tensor of one dimension (SIZE elements,
              STRIDE apart, from OFFSET) of a storage said to hold NUMEL elements, whose record
              "data/0" holds RECORD_NUMEL: written by hand, as torch.save would, without its checks
  dtypes      {"step": 7, "tensors": dtype_tensors()}: every dtype of DTYPES, torch.save writing the
              float8, float4, uint16/32/64 and complex32 ones with _rebuild_tensor_v3 over an untyped
              storage
  dtype-value {"step": 7, "tensors": {"w": a float8_e4m3fn tensor}, "values": {"dtype":
              torch.float8_e4m3fn}}: a dtype as a value, which LibTorch cannot hold
  odd-bytes   {"step": 7, "tensors": {"w": T}}, T a uint16 tensor of 3 elements over an untyped storage
              (_rebuild_tensor_v3) of 7 bytes: written by hand, as torch.save would, without its checks
  check-dtypes  opens dtrain's PATH with torch.load(weights_only=True) and compares its "tensors"
              with dtype_tensors() exactly (dtype, shape, strides, offset, bytes); prints "dtypes ok N"
              or exits non-zero naming each tensor that differs
"""

import collections
import io
import pickle
import struct
import sys

import torch


def save_tensor_by_hand(path, numel, record_numel, offset, size, stride):
    class Storage:
        pass

    class Tensor:
        def __reduce__(self):
            return (torch._utils._rebuild_tensor_v2,
                    (Storage(), offset, (size,), (stride,), False, collections.OrderedDict()))

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj):
            return ("storage", torch.FloatStorage, "0", "cpu", numel) if isinstance(obj, Storage) else None

    data = io.BytesIO()
    Pickler(data, protocol=2).dump({"step": 7, "tensors": {"w": Tensor()}})
    record = struct.pack("<%df" % record_numel, *range(record_numel))
    writer = torch._C.PyTorchFileWriter(path)
    writer.write_record("data.pkl", data.getvalue(), len(data.getvalue()))
    writer.write_record("byteorder", "little", 6)
    writer.write_record("data/0", record, len(record))
    writer.write_record("version", "3\n", 2)
    writer.write_end_of_file()


def save_odd_untyped_storage_by_hand(path):
    class Storage:
        pass

    class Tensor:
        def __reduce__(self):
            return (torch._utils._rebuild_tensor_v3,
                    (Storage(), 0, (3,), (1,), False, collections.OrderedDict(), torch.uint16))

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj):
            return ("storage", torch.UntypedStorage, "0", "cpu", 7) if isinstance(obj, Storage) else None

    data = io.BytesIO()
    Pickler(data, protocol=2).dump({"step": 7, "tensors": {"w": Tensor()}})
    writer = torch._C.PyTorchFileWriter(path)
    writer.write_record("data.pkl", data.getvalue(), len(data.getvalue()))
    writer.write_record("byteorder", "little", 6)
    writer.write_record("data/0", bytes(7), 7)
    writer.write_record("version", "3\n", 2)
    writer.write_end_of_file()


# The dtypes of tests/checkpoint/torch_archive_test.cpp's kDtypes, in its order: those torch.save
# writes with _rebuild_tensor_v3 (torch.storage._new_dtypes()) between ones with a storage class of
# their own, so that each kind of tensor follows the other.
DTYPES = ["float8_e4m3fn", "bfloat16", "float8_e5m2", "bool", "float8_e4m3fnuz", "complex64",
          "float8_e5m2fnuz", "int8", "float8_e8m0fnu", "float32", "float4_e2m1fn_x2", "uint16",
          "uint32", "uint64", "complex32"]


def dtype_tensors():
    """For the k-th dtype D of DTYPES, "kk.D": a (3, 4) tensor whose storage's byte i is
    (31 i + 7 k) % 256 (bool: i % 2), and "kk.D.view": its rows 1: transposed, the same storage."""
    tensors = {}
    for k, name in enumerate(DTYPES):
        dtype = getattr(torch, name)
        size = 12 * dtype.itemsize
        data = [i % 2 if dtype == torch.bool else (31 * i + 7 * k) % 256 for i in range(size)]
        base = torch.tensor(data, dtype=torch.uint8).view(dtype).view(3, 4)
        tensors["%02d.%s" % (k, name)] = base
        tensors["%02d.%s.view" % (k, name)] = base[1:].t()
    return tensors


def check_dtypes(path):
    loaded = torch.load(path, weights_only=True)["tensors"]
    expected = dtype_tensors()
    wrong = []
    for name, want in expected.items():
        got = loaded.get(name)
        if got is None:
            wrong.append(f"{name}: missing")
            continue
        have, expect = ((t.dtype, tuple(t.shape), t.stride(), t.storage_offset(),
                         bytes(t.untyped_storage())) for t in (got, want))
        if have != expect:
            wrong.append(f"{name}: {have[:4]}{' (other bytes)' if have[:4] == expect[:4] else ''}, "
                         f"expected {expect[:4]}")
    if wrong:
        sys.exit("; ".join(wrong))
    print("dtypes ok", len(expected))


def main():
    variant, path = sys.argv[1], sys.argv[2]
    if variant == "no-crc32":
        torch.serialization.set_crc32_options(False)
        torch.save({"step": 7, "tensors": {"w": torch.arange(4.0)}}, path)
    elif variant == "big-ints":
        ints = [3_000_000_000, -3_000_000_000, 2**31, -(2**31) - 1, 2**40, 2**63 - 1, -(2**63)]
        torch.save({"step": 3_000_000_000, "ints": ints}, path)
    elif variant == "huge-int":
        torch.save({"step": 2**64}, path)
    elif variant == "big-endian":
        sys.byteorder = "big"  # what torch.save writes in its byteorder record
        torch.save({"step": 7, "tensors": {"w": torch.arange(4.0)}}, path)
    elif variant == "bad-rng":
        sampler = {"epoch": 1, "samples_consumed": 10}
        torch.save({"step": 7, "sampler": sampler, "rng": torch.zeros(3, dtype=torch.uint8)}, path)
    elif variant == "tensor":
        save_tensor_by_hand(path, *map(int, sys.argv[3:8]))
    elif variant == "dtypes":
        torch.save({"step": 7, "tensors": dtype_tensors()}, path)
    elif variant == "dtype-value":
        w = torch.arange(4.0).to(torch.float8_e4m3fn)
        torch.save({"step": 7, "tensors": {"w": w}, "values": {"dtype": torch.float8_e4m3fn}}, path)
    elif variant == "odd-bytes":
        save_odd_untyped_storage_by_hand(path)
    elif variant == "check-dtypes":
        check_dtypes(path)
    else:
        sys.exit("unknown variant " + variant)


if __name__ == "__main__":
    main()
