// Structure checks of a torch.save file (zip container + pickle) that torch_load_bytes (torch_file.cpp) runs before
// LibTorch reads the file. No LibTorch here.
//
// Why they exist: LibTorch's reader (2.11: PyTorchStreamReader over miniz, torch::jit::Unpickler) sizes
// allocations from fields of the file before it compares them with what the file holds, and frees nested values
// recursively. Found with fuzz_checkpoint and crafted files (docs/reliability.md, "fuzz_checkpoint"):
//   - a compressed zip record is allocated at its declared uncompressed size before it is inflated (4 GiB from a
//     2 KB file);
//   - a pickle string or bytes opcode carries a 4- or 8-byte length that the unpickler reserves and zero-fills
//     before it finds the pickle shorter (4 GiB resident; a 2^48-byte request aborts under ASan);
//   - a memo index (BINPUT, LONG_BINPUT) resizes the memo table to it (16 bytes an entry, up to 2^32 entries);
//   - lists nested 200,000 deep (a 400 KB pickle; 100,000 did not) overflow the stack when LibTorch frees them;
//   - bytes after the zip end record: in a file of 4 to 8 KiB, miniz's search for the record then reads before
//     the file's buffer.
//
// Invariants once both checks pass: the file ends with its zip end record; every zip record is stored
// uncompressed, lies inside the file, and overlaps no other record, so LibTorch reads at most the file's size of
// records in total; every length in the pickle fits in the bytes after it; every memo index is at most the number
// of memo writes before it (memo table ≤ pickle size); no container is nested deeper than kPickleMaxDepth and none
// contains itself. Errors are UserError naming the offending record, opcode or offset.
#pragma once

#include <cstddef>
#include <string>

namespace triaccel {

// Deeper than any state dict or checkpoint (a tensor in a dict of dicts is a handful of levels), and far below
// the nesting that overflows the stack when LibTorch frees it.
constexpr size_t kPickleMaxDepth = 1000;

// The zip container: the end record must end the file, a zip64 end record must stand just before its locator and
// agree with the end record, and the central directory must end where they begin (so that this check and miniz,
// LibTorch's zip reader, read the same directory); then every entry, its local header and its data.
void torch_zip_check(const std::string& file);

// The pickle (the container's data.pkl), opcode by opcode up to STOP; protocols 0 to 5.
void torch_pickle_check(const std::string& pickle);

}  // namespace triaccel
