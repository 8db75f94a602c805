// File helpers with the error rules of the house: every failure names the path and what to do.
#pragma once

#include <string>

namespace triaccel {

// Writes bytes to path atomically: a temporary file in the same folder, fsync, rename, fsync of the folder.
// A reader sees either the old file or the new one, never a partial one. Throws UserError naming the path
// when the folder is not writable or the disk is full (the temporary file is removed).
void file_write_atomic(const std::string& path, const std::string& bytes);

// Reads a whole file; throws UserError naming the path when it is missing or unreadable.
// Removes temporary files that file_write_atomic(path) left behind when its process was killed mid-write
// (path + ".tmp." + pid). Call before the first write of a run; the target file itself is never touched.
void file_remove_stale_temps(const std::string& path);

std::string file_read_all(const std::string& path);

bool file_exists(const std::string& path);

// Creates the folder (and parents) and checks that a file can be written in it; key is the option
// the user set (for the error message).
void directory_prepare_writable(const std::string& dir, const std::string& key);

// Seconds since the first call in this process (steady clock).
double time_since_start_s();

}  // namespace triaccel
