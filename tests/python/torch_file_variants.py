"""torch.save files that dtrain's reader once refused or misread (tests/checkpoint/torch_archive_test.cpp).

usage: torch_file_variants.py VARIANT PATH [NUMEL RECORD_NUMEL OFFSET SIZE STRIDE]

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
    else:
        sys.exit("unknown variant " + variant)


if __name__ == "__main__":
    main()
