// Structure checks of torch.save files before LibTorch reads them (torch_file_check.h). No LibTorch.
#include "triaccel/core/torch_file_check.h"

#include "triaccel/core/errors.h"

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <set>
#include <utility>
#include <vector>

namespace triaccel {
namespace {

// Zip layout (APPNOTE.TXT): signatures and fixed header sizes.
constexpr uint64_t kZipLocalSig = 0x04034b50;
constexpr uint64_t kZipCentralSig = 0x02014b50;
constexpr uint64_t kZipEndSig = 0x06054b50;
constexpr uint64_t kZip64EndSig = 0x06064b50;
constexpr uint64_t kZip64LocatorSig = 0x07064b50;
constexpr uint64_t kZipLocalHeader = 30;
constexpr uint64_t kZipCentralHeader = 46;
constexpr uint64_t kZipEndRecord = 22;
constexpr uint64_t kZip64Locator = 20;
constexpr uint64_t kZip64EndRecord = 56;
constexpr uint64_t kZipMaxComment = 0xFFFF;
constexpr uint64_t kZip64ExtraId = 0x0001;
constexpr uint64_t kSaturated16 = 0xFFFF;
constexpr uint64_t kSaturated32 = 0xFFFFFFFF;

// Little-endian unsigned of `width` bytes at `off`; a read past the end is an error.
uint64_t le_read(const std::string& b, uint64_t off, uint64_t width, const char* what) {
  TRIACCEL_CHECK_INPUT(off <= b.size() && width <= b.size() - off, what, " runs past the end (offset ", off, " of ",
                       b.size(), " bytes)");
  uint64_t v = 0;
  for (uint64_t i = width; i-- > 0;) v = (v << 8) | static_cast<uint8_t>(b[off + i]);
  return v;
}

// The end of central directory record, found as miniz finds it: the last signature within the last 64 KiB + 22
// bytes of the file.
uint64_t zip_end_record(const std::string& b) {
  TRIACCEL_CHECK_INPUT(b.size() >= kZipEndRecord, "not a zip file (", b.size(), " bytes)");
  const uint64_t lowest = b.size() > kZipEndRecord + kZipMaxComment ? b.size() - kZipEndRecord - kZipMaxComment : 0;
  for (uint64_t at = b.size() - kZipEndRecord;; --at) {
    if (le_read(b, at, 4, "zip end record") == kZipEndSig) return at;
    TRIACCEL_CHECK_INPUT(at > lowest, "not a zip file (no end of central directory record)");
  }
}

// An entry's sizes and local header offset: saturated 32-bit fields are replaced from its zip64 extra field, as
// miniz does (the first field with id 1; values in the order uncompressed, compressed, offset).
void zip64_extra(const std::string& b, uint64_t extra, uint64_t extra_len, uint64_t* size, uint64_t* packed,
                 uint64_t* local) {
  const uint64_t end = extra + extra_len;
  for (uint64_t p = extra; p < end;) {
    TRIACCEL_CHECK_INPUT(end - p >= 4, "zip extra field runs past its entry");
    const uint64_t id = le_read(b, p, 2, "zip extra field");
    const uint64_t len = le_read(b, p + 2, 2, "zip extra field");
    TRIACCEL_CHECK_INPUT(len <= end - p - 4, "zip extra field runs past its entry");
    if (id == kZip64ExtraId) {
      uint64_t q = p + 4;
      for (uint64_t* field : {size, packed, local}) {
        if (*field != kSaturated32) continue;
        TRIACCEL_CHECK_INPUT(q + 8 <= p + 4 + len, "zip64 extra field is too short");
        *field = le_read(b, q, 8, "zip64 extra field");
        q += 8;
      }
      return;
    }
    p += 4 + len;
  }
}

// The names miniz would treat as one (its lookups ignore case).
std::string zip_name_key(std::string name) {
  for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return name;
}

}  // namespace

void torch_zip_check(const std::string& b) {
  const uint64_t n = b.size();
  const uint64_t end = zip_end_record(b);
  // torch.save writes no archive comment and nothing after the end record. Bytes after it would make miniz search
  // for the record further back: in a file of 4 to 8 KiB whose record is more than 4 KiB from the end, its search
  // computes a negative offset and reads before the buffer (fuzz_checkpoint, docs/reliability.md).
  TRIACCEL_CHECK_INPUT(end == n - kZipEndRecord, "the zip end record is followed by ", n - kZipEndRecord - end,
                       " bytes; torch.save writes nothing after it");
  uint64_t entries = le_read(b, end + 10, 2, "zip end record");
  uint64_t dir_size = le_read(b, end + 12, 4, "zip end record");
  uint64_t dir_offset = le_read(b, end + 16, 4, "zip end record");
  uint64_t dir_must_end = end;  // the directory ends where the end records begin
  // With a zip64 locator before the end record (torch.save always writes one), miniz reads the zip64 end record
  // just before the locator and takes all its values. Here it must be there, the locator must point to it, and
  // its values must agree with the end record's (a 32-bit field may be saturated), so that this check and miniz
  // read the same directory.
  if (end >= kZip64Locator && le_read(b, end - kZip64Locator, 4, "zip64 locator") == kZip64LocatorSig) {
    TRIACCEL_CHECK_INPUT(end >= kZip64Locator + kZip64EndRecord, "zip64 locator without room for its end record");
    const uint64_t at = end - kZip64Locator - kZip64EndRecord;
    TRIACCEL_CHECK_INPUT(le_read(b, at, 4, "zip64 end record") == kZip64EndSig &&
                             le_read(b, end - kZip64Locator + 8, 8, "zip64 locator") == at,
                         "the zip64 end record is not where its locator points, just before it");
    const uint64_t entries64 = le_read(b, at + 32, 8, "zip64 end record");
    const uint64_t size64 = le_read(b, at + 40, 8, "zip64 end record");
    const uint64_t offset64 = le_read(b, at + 48, 8, "zip64 end record");
    TRIACCEL_CHECK_INPUT((entries == kSaturated16 || entries == entries64) &&
                             (dir_size == kSaturated32 || dir_size == size64) &&
                             (dir_offset == kSaturated32 || dir_offset == offset64),
                         "the zip64 end record disagrees with the end record");
    entries = entries64;
    dir_size = size64;
    dir_offset = offset64;
    dir_must_end = at;
  }
  TRIACCEL_CHECK_INPUT(dir_offset <= n && dir_size <= n - dir_offset && dir_offset + dir_size == dir_must_end,
                       "zip central directory (offset ", dir_offset, ", ", dir_size,
                       " bytes) does not end where the end records begin (offset ", dir_must_end, ")");
  TRIACCEL_CHECK_INPUT(entries <= dir_size / kZipCentralHeader, "zip central directory of ", dir_size,
                       " bytes cannot hold ", entries, " entries");
  const uint64_t dir_end = dir_offset + dir_size;
  std::vector<std::pair<uint64_t, uint64_t>> spans;  // [local header, end of data) of every record
  std::set<std::string> names;
  uint64_t p = dir_offset;
  for (uint64_t i = 0; i < entries; ++i) {
    TRIACCEL_CHECK_INPUT(kZipCentralHeader <= dir_end - p && le_read(b, p, 4, "zip entry") == kZipCentralSig,
                         "zip central directory entry ", i, " is damaged");
    const uint64_t method = le_read(b, p + 10, 2, "zip entry");
    uint64_t packed = le_read(b, p + 20, 4, "zip entry");
    uint64_t size = le_read(b, p + 24, 4, "zip entry");
    const uint64_t name_len = le_read(b, p + 28, 2, "zip entry");
    const uint64_t extra_len = le_read(b, p + 30, 2, "zip entry");
    const uint64_t comment_len = le_read(b, p + 32, 2, "zip entry");
    uint64_t local = le_read(b, p + 42, 4, "zip entry");
    const uint64_t next = p + kZipCentralHeader + name_len + extra_len + comment_len;
    TRIACCEL_CHECK_INPUT(next <= dir_end, "zip central directory entry ", i, " runs past the directory");
    const std::string name = b.substr(p + kZipCentralHeader, name_len);
    if (packed == kSaturated32 || size == kSaturated32 || local == kSaturated32) {
      zip64_extra(b, p + kZipCentralHeader + name_len, extra_len, &size, &packed, &local);
    }
    TRIACCEL_CHECK_INPUT(names.insert(zip_name_key(name)).second, "zip record '", name, "' appears twice");
    TRIACCEL_CHECK_INPUT(method == 0, "zip record '", name, "' is compressed (method ", method,
                         "); torch.save stores every record uncompressed");
    TRIACCEL_CHECK_INPUT(packed == size, "zip record '", name, "' is stored with ", packed, " bytes but declares ",
                         size);
    TRIACCEL_CHECK_INPUT(local <= n && kZipLocalHeader <= n - local &&
                             le_read(b, local, 4, "zip local header") == kZipLocalSig,
                         "zip record '", name, "' has no local header at offset ", local);
    const uint64_t data = local + kZipLocalHeader + le_read(b, local + 26, 2, "zip local header") +
                          le_read(b, local + 28, 2, "zip local header");
    TRIACCEL_CHECK_INPUT(data <= n && size <= n - data, "zip record '", name, "' (", size, " bytes at offset ", data,
                         ") runs past the end of the file (", n, " bytes)");
    spans.emplace_back(local, data + size);
    p = next;
  }
  std::sort(spans.begin(), spans.end());
  for (size_t i = 1; i < spans.size(); ++i) {
    TRIACCEL_CHECK_INPUT(spans[i - 1].second <= spans[i].first, "zip records at offsets ", spans[i - 1].first,
                         " and ", spans[i].first, " overlap");
  }
}

namespace {

// One pass over a pickle. Arguments are checked against the bytes left; the stack is simulated with a node per
// container (scalars are kNoNode) and an edge for every value put into one, so the nesting depth of what the
// unpickler builds is bounded by the longest path of this graph.
class PickleScan {
 public:
  explicit PickleScan(const std::string& pickle) : b_(pickle) {}

  void run() {
    while (true) {
      TRIACCEL_CHECK_INPUT(pos_ < b_.size(), "pickle ends at byte ", pos_, " without its STOP opcode");
      op_at_ = pos_;
      const auto op = static_cast<uint8_t>(b_[pos_++]);
      if (op == '.') break;  // STOP
      step(op);
    }
    check_depth();
  }

 private:
  static constexpr int64_t kNoNode = -1;

  [[noreturn]] void fail(const std::string& why) const {
    throw UserError(str_cat("pickle opcode 0x", hex(static_cast<uint8_t>(b_[op_at_])), " at byte ", op_at_, ": ",
                            why));
  }
  static std::string hex(uint8_t v) {
    const char* digits = "0123456789abcdef";
    return {digits[v >> 4], digits[v & 15]};
  }

  uint64_t fixed(uint64_t width) {  // a little-endian argument
    if (width > b_.size() - pos_) fail("its argument runs past the end of the pickle");
    uint64_t v = 0;
    for (uint64_t i = width; i-- > 0;) v = (v << 8) | static_cast<uint8_t>(b_[pos_ + i]);
    pos_ += width;
    return v;
  }
  void counted(uint64_t width, bool is_signed) {  // a length, then that many bytes
    uint64_t len = fixed(width);
    if (is_signed && (len >> (8 * width - 1)) != 0) fail("negative length");
    if (len > b_.size() - pos_) {
      fail(str_cat("declares ", len, " bytes, ", b_.size() - pos_, " are left"));
    }
    pos_ += len;
  }
  std::string line() {  // a newline-terminated argument
    const size_t nl = b_.find('\n', pos_);
    if (nl == std::string::npos) fail("its line argument has no newline");
    std::string text = b_.substr(pos_, nl - pos_);
    pos_ = nl + 1;
    return text;
  }
  uint64_t decimal_line() {
    const std::string text = line();
    if (text.empty() || text.size() > 18 || text.find_first_not_of("0123456789") != std::string::npos) {
      fail("'" + text + "' is not a memo index");
    }
    return std::stoull(text);
  }

  void push(int64_t node) { stack_.push_back(node); }
  int64_t pop() {
    if (stack_.size() <= (marks_.empty() ? 0 : marks_.back())) fail("pops an empty stack");
    const int64_t v = stack_.back();
    stack_.pop_back();
    return v;
  }
  int64_t top() {
    if (stack_.empty()) fail("needs a value on the stack");
    return stack_.back();
  }
  std::vector<int64_t> pop_mark() {
    if (marks_.empty()) fail("needs a MARK");
    std::vector<int64_t> items(stack_.begin() + static_cast<std::ptrdiff_t>(marks_.back()), stack_.end());
    stack_.resize(marks_.back());
    marks_.pop_back();
    return items;
  }
  int64_t container(const std::vector<int64_t>& items = {}) {
    children_.emplace_back();
    const auto node = static_cast<int64_t>(children_.size() - 1);
    add(node, items);
    return node;
  }
  void add(int64_t into, const std::vector<int64_t>& items) {
    if (into == kNoNode) return;  // into a scalar: the unpickler refuses; nothing nests
    for (const int64_t item : items) {
      if (item != kNoNode) children_[static_cast<size_t>(into)].push_back(item);
    }
  }
  void memo_put(uint64_t index) {
    if (index > memo_.size()) fail(str_cat("memo index ", index, " skips ahead of the ", memo_.size(), " stored"));
    if (index == memo_.size()) memo_.push_back(top()); else memo_[index] = top();
  }
  void memo_get(uint64_t index) {
    if (index >= memo_.size()) fail(str_cat("memo index ", index, " was never stored"));
    push(memo_[index]);
  }

  void step(uint8_t op) {
    switch (op) {
      // Scalars and names: push a leaf.
      case 'N': case 0x88: case 0x89: case 0x97: push(kNoNode); break;           // NONE NEWTRUE NEWFALSE NEXT_BUFFER
      case 'K': case 0x82: fixed(1); push(kNoNode); break;                        // BININT1 EXT1
      case 'M': case 0x83: fixed(2); push(kNoNode); break;                        // BININT2 EXT2
      case 'J': case 0x84: fixed(4); push(kNoNode); break;                        // BININT EXT4
      case 'G': fixed(8); push(kNoNode); break;                                   // BINFLOAT
      case 'I': case 'L': case 'F': case 'S': case 'V': case 'P': line(); push(kNoNode); break;  // text forms
      case 'c': line(); line(); push(kNoNode); break;                             // GLOBAL
      case 'U': case 'C': case 0x8c: case 0x8a: counted(1, false); push(kNoNode); break;  // short strings, LONG1
      case 'X': case 'B': counted(4, false); push(kNoNode); break;               // BINUNICODE BINBYTES
      case 'T': case 0x8b: counted(4, true); push(kNoNode); break;               // BINSTRING LONG4
      case 0x8d: case 0x8e: case 0x96: counted(8, false); push(kNoNode); break;  // BINUNICODE8 BINBYTES8 BYTEARRAY8
      case 0x93: pop(); pop(); push(kNoNode); break;                              // STACK_GLOBAL
      // Containers and objects.
      case ']': case '}': case ')': case 0x8f: push(container()); break;          // EMPTY_LIST _DICT _TUPLE _SET
      case '(': marks_.push_back(stack_.size()); break;                           // MARK
      case 'l': case 't': case 'd': case 0x91: case 'o': push(container(pop_mark())); break;  // LIST TUPLE DICT
      case 'i': line(); line(); push(container(pop_mark())); break;               // INST
      case 0x85: case 0x86: case 0x87: {                                          // TUPLE1 TUPLE2 TUPLE3
        std::vector<int64_t> items(static_cast<size_t>(op - 0x84));
        for (auto it = items.rbegin(); it != items.rend(); ++it) *it = pop();
        push(container(items));
        break;
      }
      case 'a': case 'b': { const int64_t v = pop(); add(top(), {v}); break; }   // APPEND BUILD
      case 's': { const int64_t v = pop(); const int64_t k = pop(); add(top(), {k, v}); break; }  // SETITEM
      case 'e': case 'u': case 0x90: {                                            // APPENDS SETITEMS ADDITEMS
        const auto items = pop_mark();
        add(top(), items);
        break;
      }
      case 'R': case 0x81: {                                                      // REDUCE NEWOBJ
        const int64_t a = pop();
        const int64_t f = pop();
        push(container({f, a}));
        break;
      }
      case 0x92: {                                                                // NEWOBJ_EX
        const int64_t kw = pop(); const int64_t a = pop(); const int64_t c = pop();
        push(container({c, a, kw}));
        break;
      }
      case 'Q': { const int64_t id = pop(); push(container({id})); break; }      // BINPERSID
      // Stack and memo.
      case '0': pop(); break;                                                     // POP
      case '1': pop_mark(); break;                                                // POP_MARK
      case '2': push(top()); break;                                               // DUP
      case 'q': memo_put(fixed(1)); break;                                        // BINPUT
      case 'r': memo_put(fixed(4)); break;                                        // LONG_BINPUT
      case 'p': memo_put(decimal_line()); break;                                  // PUT
      case 0x94: memo_put(memo_.size()); break;                                   // MEMOIZE
      case 'h': memo_get(fixed(1)); break;                                        // BINGET
      case 'j': memo_get(fixed(4)); break;                                        // LONG_BINGET
      case 'g': memo_get(decimal_line()); break;                                  // GET
      // Framing.
      case 0x80: fixed(1); break;                                                 // PROTO
      case 0x95: {                                                                // FRAME: a size hint
        const uint64_t len = fixed(8);
        if (len > b_.size() - pos_) fail(str_cat("frame of ", len, " bytes, ", b_.size() - pos_, " are left"));
        break;
      }
      case 0x98: break;                                                           // READONLY_BUFFER
      default: fail("is not a pickle opcode");
    }
  }

  // Longest chain of containers (iterative depth-first search); a container reachable from itself is refused.
  void check_depth() const {
    enum : uint8_t { kNew, kOpen, kDone };
    std::vector<uint8_t> state(children_.size(), kNew);
    std::vector<size_t> depth(children_.size(), 0);
    std::vector<std::pair<size_t, size_t>> path;  // (node, next child)
    for (size_t root = 0; root < children_.size(); ++root) {
      if (state[root] != kNew) continue;
      state[root] = kOpen;
      path.emplace_back(root, 0);
      while (!path.empty()) {
        auto& [node, next] = path.back();
        if (next < children_[node].size()) {
          const auto child = static_cast<size_t>(children_[node][next++]);
          TRIACCEL_CHECK_INPUT(state[child] != kOpen, "pickle holds a container inside itself");
          if (state[child] == kNew) {
            state[child] = kOpen;
            path.emplace_back(child, 0);
          }
          continue;
        }
        size_t d = 1;
        for (const int64_t child : children_[node]) d = std::max(d, depth[static_cast<size_t>(child)] + 1);
        TRIACCEL_CHECK_INPUT(d <= kPickleMaxDepth, "pickle nests containers more than ", kPickleMaxDepth, " deep");
        depth[node] = d;
        state[node] = kDone;
        path.pop_back();
      }
    }
  }

  const std::string& b_;
  size_t pos_ = 0;
  size_t op_at_ = 0;
  std::vector<int64_t> stack_;
  std::vector<size_t> marks_;
  std::vector<int64_t> memo_;
  std::vector<std::vector<int64_t>> children_;
};

}  // namespace

void torch_pickle_check(const std::string& pickle) { PickleScan(pickle).run(); }

}  // namespace triaccel
