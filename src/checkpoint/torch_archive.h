// The file format of Python's torch.save, written and read from C++ (Note [torch.save's format] in
// torch_archive.cpp): a zip of a pickle ("data.pkl") and one record per tensor storage.
#pragma once

#include <ATen/core/ivalue.h>

#include <string>
#include <vector>

namespace dtrain::detail {

// The bytes of a file that Python's torch.load(path, weights_only=True) opens as `value`: dicts,
// lists, tuples, strings, numbers, booleans, None and CPU tensors. (torch::pickle_save tags its
// dicts and lists with a TorchScript global that weights_only refuses, hence this; and it names
// the storages of float8, uint16/32/64 and complex32 tensors with classes Python lacks.) The bytes
// come sealed: the zip's comment holds a CRC-32 of every byte before it. Throws c10::Error for a
// value outside that set, or for two tensors that view one storage as two dtypes.
std::vector<char> save_torch_archive(const c10::IValue& value);

// Whether bytes are an intact torch.save file: sealed by save_torch_archive and the seal holds, or
// (a file Python wrote) a zip whose directory is whole and whose every record matches its CRC-32,
// where it has one (0: saved after torch.serialization.set_crc32_options(False); LibTorch's reader
// checks neither). Returns false and sets *why ("checksum mismatch", "record
// 'archive/data/3': checksum mismatch", "truncated: no zip directory at its end ...") otherwise.
bool torch_archive_intact(const std::vector<char>& bytes, std::string* why);

// The value of a torch.save file (from Python or save_torch_archive), tensors on the CPU. Reads
// what Python writes for a state dict (an OrderedDict with its _metadata attribute) and for a
// float8, uint16/32/64 or complex32 tensor (_rebuild_tensor_v3), which LibTorch's own unpickler
// cannot take: Note [torch.save's format]. Throws c10::Error for bytes that are not such a file,
// a tensor that reaches past the bytes of its record, an int beyond int64, a dtype stored as a
// value, or a file whose byteorder record is not "little".
c10::IValue load_torch_archive(const std::vector<char>& bytes);

}  // namespace dtrain::detail
