// Files in torch.save's format, written from C++. Invariant: what torch_save_bytes returns is exactly what
// Python's torch.save would write for the same value (zip container, plain pickle, one record per tensor storage),
// so torch.load(path, weights_only=True) reads it, and so does torch_load_bytes / torch::pickle_load.
// torch::pickle_save is not used: it wraps containers in torch.jit._pickle.restore_type_tag, a global that
// weights_only loading rejects; the same pickler with type tags off writes what torch.save writes.
#pragma once

#include <ATen/core/ivalue.h>

#include <string>

namespace triaccel {

// value: tensors (any device; saved as they are), dicts with string keys, lists, strings, ints, doubles, bools.
std::string torch_save_bytes(const c10::IValue& value);

// The inverse; throws (UserError from the structure checks of torch_file_check.h, c10::Error from LibTorch) for
// bytes that are not such a file. What it allocates grows with the file's size, never with a size written in the
// file, and every tensor it returns views a record of the file.
c10::IValue torch_load_bytes(const std::string& bytes);

}  // namespace triaccel
